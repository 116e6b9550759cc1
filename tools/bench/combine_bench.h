// The combine figures: one case = one shape, run in every requested layout on the same inputs,
// checked against the float64 reference, then timed with the L2 flushed and with it warm.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bench_data.h"
#include "json_writer.h"
#include "moejit/moejit.h"

namespace moejit_bench {

struct BenchSettings {
  int warmup = 10;
  int reps = 0;                      // 0: by size (200 below 64 MB of minimal bytes, else 100)
  bool l2_warm = true;               // also time with a warm L2
  int64_t check_tokens = INT64_MAX;  // float64 reference on at most this many tokens (>= 2)
  uint64_t seed = 20261130;
  // Percent of each case's T*K routing slots dropped (make_inputs); then `layouts` must not hold
  // token-major, which has no way to mark a slot dropped.
  double drop_percent = 0.0;
};

// The machine's floors, measured once per run and shared by every case.
struct Floors {
  double copy_ceiling_gbps = 0.0;  // device-to-device copy, bytes read + written
  double empty_kernel_us = 0.0;    // L2 flushed between runs, like the combine
  double empty_kernel_warm_us = 0.0;
  // The empty kernel's flushed runs: median of the odd ones minus the even ones (Timer).
  double empty_kernel_parity_split_us = 0.0;
};

struct CaseResult {
  Shape shape;
  moejit_layout layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  double drop_percent = 0.0;  // the inputs' (HostInputs)
  int64_t dropped_slots = 0;
  double median_us = 0.0;  // L2 flushed between runs
  // Of the flushed runs: median of the odd runs minus median of the even ones (Timer).
  double parity_split_us = 0.0;
  double l2_warm_us = 0.0;  // 0 when not measured
  double gbps = 0.0;        // minimal bytes / median
  double pct_ceiling = 0.0;
  // The launch-adjusted floor (the minimal bytes at the copy ceiling plus one empty kernel) over
  // the median, in %. BENCHMARKS.md reads the 95% target this way for prefill shapes whose
  // bytes-only floor is under about 60 us: no kernel timed with events hides its own launch.
  double pct_floor_with_launch = 0.0;
  double ratio_empty = 0.0;
  // A device-to-device copy of as many bytes (half read, half written) as the case's minimal
  // traffic, timed the same way: what the fixed costs of a launch of this size leave of the
  // ceiling. 0 when not measured.
  double same_size_copy_us = 0.0;
  double same_size_copy_pct_ceiling = 0.0;
  double same_size_copy_pct_floor_with_launch = 0.0;
  CheckResult check;          // the checked run's output against the float64 reference
  bool deterministic = true;  // output after the timed runs == output of the checked run
  bool correct = false;       // check.passed() and deterministic
  int reps = 0;
  std::string error;  // non-empty: the case did not run (message of the failure)
};

// A decode step in a CUDA graph (--pipeline): a producer kernel that writes the combine's input
// rows and lets its dependents start at once (as PDL-aware kernels do), then the combine. Figures
// are microseconds per step added to the producer's own, over a graph of 100 steps (median of 15
// replays, L2 as the steps leave it): with plain launches, and with programmatic dependent
// launches (args.dependent_launch = 1, the producer launched as a dependent too); the same for an
// empty kernel in the combine's place.
struct PipelineResult {
  Shape shape;
  moejit_layout layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  double drop_percent = 0.0;  // the inputs' (HostInputs)
  int64_t dropped_slots = 0;
  double producer_plain_us = 0.0, producer_dependent_us = 0.0;  // the producer alone, per step
  double combine_plain_us = 0.0, combine_dependent_us = 0.0;
  double empty_plain_us = 0.0, empty_dependent_us = 0.0;
  // The same with the routing evicted from L2 before each step (a sweep kernel before the
  // producer, not counted): the combine reads its routing from DRAM, its rows from L2.
  double combine_plain_evicted_us = 0.0, combine_dependent_evicted_us = 0.0;
  bool correct = false;  // the dependent step's output == a plain call's, bitwise (rows poisoned)
  std::string error;
  std::string skipped;  // why this case was not timed (not a failure); empty: it ran
};

class HelperKernels;
std::vector<PipelineResult> run_pipeline(const Shape& shape,
                                         const std::vector<moejit_layout>& layouts,
                                         const BenchSettings& settings,
                                         const HelperKernels& helpers, cudaStream_t stream);

const char* layout_text(moejit_layout layout);  // "token_major" | "gather_map" | "token_index"
bool parse_layout(const std::string& text, moejit_layout* layout);

// Runs one shape in each of `layouts`. Environment failures (CUDA) throw; a failed moe_combine
// call is recorded in that layout's CaseResult::error and the other layouts still run.
std::vector<CaseResult> run_case(const Shape& shape, const std::vector<moejit_layout>& layouts,
                                 const BenchSettings& settings, const Floors& floors, Timer& timer);

// Token-index inputs with any rows per token (make_token_index_inputs: moejit-bench --skew) in the
// token-index layout, checked and timed like run_case's layouts (no same-size copy).
CaseResult run_token_index_case(const HostInputs& in, const BenchSettings& settings,
                                const Floors& floors, Timer& timer);

// A timed case's figures and its check, as every JSON record of one (moejit-bench's cases and
// --skew's) writes them: median_us .. pct_floor_with_launch, and rel_err .. reps.
void write_case_timing(JsonWriter& j, const CaseResult& r);
void write_case_check(JsonWriter& j, const CaseResult& r);

}  // namespace moejit_bench
