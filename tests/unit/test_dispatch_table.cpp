// The kernel-choice table against the precompile set it generates: across every boundary of the
// table (decode, mid-size and prefill batch sizes, one token, the single launch's block sizes, the
// rows per token, hidden sizes from 1 to the largest, every dtype pair and index type), every
// module a call loads is in specs_for_shape() for the call's shape, and specs_for_shape() holds no
// module that no such call loads. Host only: plan_combine reads no device memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "aligned_call.h"
#include "combine_epilogue.h"
#include "combine_plan.h"

namespace moejit {
namespace {

// Token counts at the table's boundaries for calls with k rows per token and rows of `slots`
// vectors: no tokens, one, the decode range's ends, the first calls with more rows than each block
// size the single launch takes (64, 128 and 512 threads), the mid-size line (T * slots = 2^21)
// on both sides, and a prefill call too large for the single launch.
std::vector<int64_t> token_counts(int64_t k, int64_t slots) {
  std::set<int64_t> t{0, 1, 2, 3, 16, 17, 63, 64, 65, 66, 129, 130, 257, 513};
  for (const int64_t block : {64, 128, 512}) {
    t.insert(block / k + 1);
    t.insert(block / k + 2);
  }
  const int64_t mid_last = (int64_t{1} << 21) / slots;
  t.insert(mid_last);
  t.insert(mid_last + 1);
  t.insert(std::max<int64_t>(mid_last + 1, 24 * 512 + 1));
  return {t.begin(), t.end()};
}

TEST(DispatchTable, ThePrecompileSetIsExactlyWhatTheRuntimeLoads) {
  const moejit_dtype dtypes[] = {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16};
  std::vector<int> ks;
  for (int k = 1; k <= 16; ++k) ks.push_back(k);
  ks.push_back(64);
  size_t plans = 0, shapes = 0;
  std::set<KernelKind> kinds_seen;
  for (const moejit_layout layout :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX})
    for (const moejit_index_type index_type : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64}) {
      if (layout == MOEJIT_LAYOUT_TOKEN_MAJOR && index_type == MOEJIT_INDEX_INT64) continue;
      for (const moejit_dtype in : dtypes)
        for (const moejit_dtype out : dtypes)
          for (const int hidden : {1, 7, 128, 2880, 7168, 65536})
            for (const int k : ks) {
              const std::vector<KernelSpec> warmed =
                  specs_for_shape(layout, in, out, index_type, hidden, k, 256);
              const int64_t slots =
                  spec_for_shape(layout, in, out, index_type, hidden, k, 256).slots();
              std::set<size_t> loaded;  // indices into warmed
              auto expect_warmed = [&](const KernelSpec& spec, const std::string& at) {
                const auto it = std::find(warmed.begin(), warmed.end(), spec);
                if (it == warmed.end()) {
                  ADD_FAILURE() << spec.describe() << " is not warmed, for " << at;
                  return;
                }
                loaded.insert(static_cast<size_t>(it - warmed.begin()));
              };
              for (const int64_t tokens : token_counts(k, slots)) {
                // Rows: token-major exactly T * K; the gather map as many as the map names, or
                // fewer; the token index from the fewest to the most its rows per token round
                // up to K from.
                std::vector<int64_t> rows_choices{tokens * k};
                if (layout != MOEJIT_LAYOUT_TOKEN_MAJOR && tokens > 0)
                  rows_choices.push_back(tokens * (k - 1) + 1);
                for (const int64_t rows : rows_choices)
                  for (const int dependent : {0, 1}) {
                    if (dependent == 1 && tokens != 1) continue;  // it changes T = 1 calls only
                    const moejit_combine_args a = test::aligned_call(
                        layout, in, out, index_type, hidden, k, tokens, rows, dependent);
                    const CombinePlan plan = plan_combine(&a);
                    ++plans;
                    if (plan.nothing_to_do) continue;
                    const std::string at =
                        std::string(layout_name(layout)) + " " + dtype_name(in) + "->" +
                        dtype_name(out) + " idx" + std::to_string(index_type) +
                        " H=" + std::to_string(hidden) + " K=" + std::to_string(k) +
                        " T=" + std::to_string(tokens) + " R=" + std::to_string(rows) +
                        " dependent=" + std::to_string(dependent);
                    kinds_seen.insert(plan.spec.kind);
                    expect_warmed(plan.spec, at);
                    if (const auto before = companion_module(plan.spec)) {
                      kinds_seen.insert(before->kind);
                      expect_warmed(*before, at + " (its companion)");
                    }
                  }
              }
              ++shapes;
              for (size_t i = 0; i < warmed.size(); ++i)
                if (loaded.count(i) == 0)
                  ADD_FAILURE() << warmed[i].describe() << " is warmed for " << layout_name(layout)
                                << " " << dtype_name(in) << "->" << dtype_name(out) << " idx"
                                << index_type << " H=" << hidden << " K=" << k
                                << " but no call of the grid loads it";
              if (HasFailure()) return;  // one shape's report is enough to read
            }
    }
  // Every variant without an epilogue was reached (the epilogue's: the test below).
  size_t plain_kinds = 0;
  for (int k = 0; k < kKernelKinds; ++k) plain_kinds += !is_epilogue(static_cast<KernelKind>(k));
  EXPECT_EQ(kinds_seen.size(), plain_kinds);
  EXPECT_GT(shapes, 2000u);
  EXPECT_GT(plans, 100000u);
}

// The same for the epilogue (residual, norm weight, fp8 out): every batch size at decode (where
// the split depends on T) and past it, the layouts, the dtype pairs (fp8 out among them), hidden
// sizes from 1 to the largest and the rows per token; every epilogue variant is reached.
TEST(DispatchTable, TheEpiloguesPrecompileSetIsExactlyWhatTheRuntimeLoads) {
  const moejit_dtype dtypes[] = {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16};
  const moejit_dtype outs[] = {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_BFLOAT16,
                               MOEJIT_DTYPE_FLOAT8_E4M3};
  struct Epilogue {
    int res, weight;
  };
  const Epilogue epilogues[] = {{MOEJIT_DTYPE_BFLOAT16, -1},
                                {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16},
                                {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16},
                                {-1, MOEJIT_DTYPE_FLOAT32},
                                {-1, -1}};
  constexpr uintptr_t kRegion = uintptr_t{1} << 46;  // aligned_call's regions are 1..4
  std::set<KernelKind> kinds_seen;
  size_t plans = 0;
  for (const moejit_layout layout :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX})
    for (const moejit_dtype in : dtypes)
      for (const moejit_dtype out : outs)
        for (const Epilogue& e : epilogues)
          for (const int hidden : {1, 7, 128, 2880, 7168, 65536})
            for (const int k : {1, 2, 8, 64}) {
              if (e.res < 0 && e.weight < 0 && out != MOEJIT_DTYPE_FLOAT8_E4M3) continue;
              const std::vector<KernelSpec> warmed = specs_for_shape(
                  layout, in, out, MOEJIT_INDEX_INT32, hidden, k, 256, e.res, e.weight);
              std::set<size_t> loaded;
              const std::string shape = std::string(layout_name(layout)) + " " + dtype_name(in) +
                                        "->" + dtype_name(out) + " res" + std::to_string(e.res) +
                                        " weight" + std::to_string(e.weight) +
                                        " H=" + std::to_string(hidden) + " K=" + std::to_string(k);
              std::vector<int64_t> tokens(epilogue_token_counts());
              tokens.push_back(4096);
              tokens.push_back(100000);
              for (const int64_t t : tokens) {
                moejit_combine_args a =
                    test::aligned_call(layout, in, out, MOEJIT_INDEX_INT32, hidden, k, t, t * k, 0);
                if (e.res >= 0) {
                  a.residual = reinterpret_cast<void*>(5 * kRegion);
                  a.residual_dtype = static_cast<moejit_dtype>(e.res);
                }
                if (e.weight >= 0) {
                  a.norm_weight = reinterpret_cast<void*>(6 * kRegion);
                  a.norm_weight_dtype = static_cast<moejit_dtype>(e.weight);
                }
                if (out == MOEJIT_DTYPE_FLOAT8_E4M3)
                  a.out_scales = reinterpret_cast<float*>(7 * kRegion);
                const CombinePlan plan = plan_combine(&a);
                ++plans;
                kinds_seen.insert(plan.spec.kind);
                std::vector<KernelSpec> modules{plan.spec};
                if (const auto before = companion_module(plan.spec)) modules.push_back(*before);
                for (const KernelSpec& m : modules) {
                  const auto it = std::find(warmed.begin(), warmed.end(), m);
                  if (it == warmed.end())
                    ADD_FAILURE() << m.describe() << " is not warmed, for " << shape << " T=" << t;
                  else
                    loaded.insert(static_cast<size_t>(it - warmed.begin()));
                }
              }
              for (size_t i = 0; i < warmed.size(); ++i)
                if (loaded.count(i) == 0)
                  ADD_FAILURE() << warmed[i].describe() << " is warmed for " << shape
                                << " but no call loads it";
              if (HasFailure()) return;
            }
  size_t epilogue_kinds = 0;
  for (KernelKind k : kinds_seen) epilogue_kinds += is_epilogue(k);
  EXPECT_EQ(epilogue_kinds, 6u);  // both variants of every layout
  EXPECT_GT(plans, 50000u);
}

}  // namespace
}  // namespace moejit
