// moejit-bench --skew (issue 58): the token-index layout on skewed routings of a shape's R = T*K
// rows (skew_routing.h), each checked against the float64 reference and timed like every case,
// and divided by the time of the uniform routing (exactly K rows per token) of the same shape and
// drop rate, measured in the same run.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bench_data.h"
#include "combine_bench.h"
#include "json_writer.h"
#include "skew_routing.h"

namespace moejit_bench {

struct SkewResult {
  CaseResult run;  // layout token_index; run.shape carries the label
  RoutingSpec spec;
  std::string routing;  // spec.name(R)
  int64_t max_rows_per_token = 0;
  int64_t tokens_with_rows = 0;
  double uniform_us = 0.0;  // the uniform routing's median, same shape and drop; 0: not measured
  double ratio_to_uniform = 0.0;  // run.median_us / uniform_us; 0 when either is missing
};

// The shapes --skew runs without --skew-case: DeepSeek-V3 prefill (issue 58's table) and
// Mixtral-8x7B prefill (K = 2: few rows per token to start from); --quick: the first.
std::vector<Shape> default_skew_shapes(bool quick);

// Every distribution of skew_specs(R, drop_percent) on `shape`, in that order; on_result sees each
// result as it comes. Environment failures (CUDA) throw; a failed moe_combine call is recorded in
// that result's run.error.
std::vector<SkewResult> run_skew(const Shape& shape, double drop_percent,
                                 const BenchSettings& settings, const Floors& floors, Timer& timer,
                                 const std::function<void(const SkewResult&)>& on_result);

void print_skew_header();
void print_skew_result(const SkewResult& r);

// The "skew_cases" array of the JSON (apart from "cases": merge_results.py matches cases by shape
// and layout, and these share both with the uniform record).
void write_skew_json(JsonWriter& j, const std::vector<SkewResult>& results);

}  // namespace moejit_bench
