#include "skew_bench.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace moejit_bench {
namespace {

Shape named(int64_t t, int64_t k, int64_t h, const char* label) {
  Shape s;
  s.tokens = t;
  s.top_k = k;
  s.hidden = h;
  s.in_dtype = s.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  s.label = label;
  return s;
}

std::string drop_text(double percent) {
  char text[32];
  std::snprintf(text, sizeof text, "%g%%", percent);
  return text;
}

}  // namespace

std::vector<Shape> default_skew_shapes(bool quick) {
  std::vector<Shape> shapes = {named(4096, 8, 7168, "DeepSeek-V3 prefill"),
                               named(8192, 2, 4096, "Mixtral-8x7B prefill")};
  if (quick) shapes.resize(1);
  return shapes;
}

std::vector<SkewResult> run_skew(const Shape& shape, double drop_percent,
                                 const BenchSettings& settings, const Floors& floors, Timer& timer,
                                 const std::function<void(const SkewResult&)>& on_result) {
  std::vector<SkewResult> results;
  std::map<double, double> uniform_us;  // by drop rate: the uniform routing comes first in each
  for (const RoutingSpec& spec : skew_specs(shape.rows(), drop_percent)) {
    SkewResult r;
    r.spec = spec;
    r.routing = spec.name(shape.rows());
    {
      Routing routing = make_routing(shape.tokens, shape.top_k, spec, settings.seed);
      const std::vector<int64_t> count = rows_per_token(routing.token_idx, shape.tokens);
      r.max_rows_per_token = *std::max_element(count.begin(), count.end());
      r.tokens_with_rows =
          std::count_if(count.begin(), count.end(), [](int64_t n) { return n > 0; });
      const HostInputs in =
          make_token_index_inputs(shape, std::move(routing.token_idx), std::move(routing.gates),
                                  routing.dropped, spec.drop_percent, r.routing, settings.seed);
      r.run = run_token_index_case(in, settings, floors, timer);
    }
    const bool measured = r.run.error.empty() && r.run.median_us > 0;
    if (spec.spread == Spread::kUniform && measured)
      uniform_us[spec.drop_percent] = r.run.median_us;
    const auto base = uniform_us.find(spec.drop_percent);
    if (base != uniform_us.end() && measured) {
      r.uniform_us = base->second;
      r.ratio_to_uniform = r.run.median_us / base->second;
    }
    on_result(r);
    results.push_back(r);
  }
  return results;
}

void print_skew_header() {
  std::printf(
      "\nSkewed token_index routing (--skew): the same R = T*K rows over T tokens, rows "
      "expert-sorted; x_unif = median / the uniform routing's (exactly K rows per token) of the "
      "same shape and drop, this run\n");
  std::printf("%-22s %-22s %5s %8s %10s %10s %8s %7s %7s %9s  %s\n", "shape", "routing", "drop",
              "max_rows", "median_us", "l2warm_us", "GB/s", "%ceil", "x_unif", "rel_err", "check");
}

void print_skew_result(const SkewResult& r) {
  const CaseResult& c = r.run;
  const std::string shape = c.shape.describe();
  const std::string drop = drop_text(r.spec.drop_percent);
  if (!c.error.empty()) {
    std::printf("%-22s %-22s %5s %8lld FAILED: %s\n", shape.c_str(), r.routing.c_str(),
                drop.c_str(), static_cast<long long>(r.max_rows_per_token), c.error.c_str());
    return;
  }
  std::string check = c.correct ? "ok" : "FAIL";
  if (c.check.nonfinite > 0) check += " (" + std::to_string(c.check.nonfinite) + " NaN or Inf)";
  if (c.check.bad_tokens > 0)
    check += " (" + std::to_string(c.check.bad_tokens) + " tokens over their bound, the first " +
             std::to_string(c.check.first_bad_token) + ")";
  if (!(c.check.rel_err <= c.check.bound)) check += " (rel_err over its bound)";
  if (!c.deterministic) check += " (output changed between runs)";
  char ratio[16] = "-";
  if (r.ratio_to_uniform > 0) std::snprintf(ratio, sizeof ratio, "%.2f", r.ratio_to_uniform);
  std::printf("%-22s %-22s %5s %8lld %10.2f %10.2f %8.0f %6.1f%% %7s %9.2e  %s\n", shape.c_str(),
              r.routing.c_str(), drop.c_str(), static_cast<long long>(r.max_rows_per_token),
              c.median_us, c.l2_warm_us, c.gbps, c.pct_ceiling, ratio, c.check.rel_err,
              check.c_str());
}

void write_skew_json(JsonWriter& j, const std::vector<SkewResult>& results) {
  j.key("skew_cases").begin_array();
  for (const SkewResult& r : results) {
    const CaseResult& c = r.run;
    j.begin_object();
    j.member("label", c.shape.label);
    j.member("layout", layout_text(c.layout));
    j.member("T", c.shape.tokens);
    j.member("K", c.shape.top_k);
    j.member("H", c.shape.hidden);
    j.member("in_dtype", dtype_text(c.shape.in_dtype));
    j.member("out_dtype", dtype_text(c.shape.out_dtype));
    j.member("routing", r.routing);
    j.member("hot_rows", r.spec.spread == Spread::kHot ? r.spec.hot_rows : int64_t{0});
    j.member("drop_percent", r.spec.drop_percent);
    j.member("dropped_slots", c.dropped_slots);
    j.member("max_rows_per_token", r.max_rows_per_token);
    j.member("tokens_with_rows", r.tokens_with_rows);
    j.member("minimal_bytes", static_cast<int64_t>(c.shape.minimal_bytes(c.dropped_slots)));
    if (!c.error.empty()) {
      j.member("error", c.error);
    } else {
      write_case_timing(j, c);
      if (r.ratio_to_uniform > 0) {
        j.member("uniform_us", r.uniform_us);
        j.member("ratio_to_uniform", r.ratio_to_uniform);
      } else {
        j.key("uniform_us").null();
        j.key("ratio_to_uniform").null();
      }
      write_case_check(j, c);
    }
    j.end_object();
  }
  j.end_array();
}

}  // namespace moejit_bench
