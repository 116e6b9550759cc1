// plan_combine and combine_workspace_bytes on random argument structs drawn from edge values
// (negative, zero, powers of two around every limit, INT64_MAX): every call either plans a launch
// the hardware accepts or throws an Error with an argument status. Under tools/sanitize.sh the same
// run checks that no size computation overflows (UBSan found one before the 2^40 token bound).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "combine_plan.h"
#include "error.h"
#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace {

using moejit_test::set_c_enum;

void* fake(uintptr_t address) {
  return reinterpret_cast<void*>(address);
}

TEST(CombinePlanFuzz, EdgeValuesPlanALaunchOrNameTheArgument) {
  std::mt19937_64 rng(20261130);
  const int64_t k31 = int64_t{1} << 31, k36 = int64_t{1} << 36, k40 = int64_t{1} << 40,
                k47 = int64_t{1} << 47, k62 = int64_t{1} << 62;
  const int64_t edges[] = {-1,  0,   1,       2,    7,     32,        33,       64,
                           65,  128, 2880,    7168, 65536, 65537,     k31 - 1,  k31,
                           k36, k40, k40 + 1, k47,  k62,   INT64_MAX, INT64_MIN};
  auto edge = [&] { return edges[rng() % (sizeof(edges) / sizeof(edges[0]))]; };
  int planned = 0, rejected = 0, clustered = 0;
  for (int i = 0; i < 200000; ++i) {
    moejit_combine_args a;
    moejit_combine_args_init(&a);
    set_c_enum(a.layout, static_cast<int>(rng() % 4));  // 3: not a layout
    set_c_enum(a.expert_dtype, static_cast<int>(rng() % 3));
    set_c_enum(a.out_dtype, static_cast<int>(rng() % 4));  // 3: fp8, with an epilogue
    set_c_enum(a.index_type, static_cast<int>(rng() % 2));
    a.num_tokens = edge();
    a.num_rows = edge();
    a.hidden_dim = edge();
    a.top_k = static_cast<int>(rng() % 70);
    a.expert_row_stride = rng() % 2 ? 0 : edge();
    a.out_row_stride = rng() % 2 ? 0 : edge();
    a.expert_hidden = fake(0x7f0000000000);
    a.out = fake(0x7f1000000000);
    a.indices = fake(0x7f2000000000);
    a.gates = rng() % 2 ? static_cast<const float*>(fake(0x7f3000000000)) : nullptr;
    a.workspace = fake(0x7f4000000000);
    a.workspace_bytes = SIZE_MAX;
    // The epilogue (since 0.3): each buffer present or not, its dtype and stride from the edges.
    const float eps[] = {1e-6f, 0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()};
    if (rng() % 2) a.residual = fake(0x7f5000000000);
    set_c_enum(a.residual_dtype, static_cast<int>(rng() % 5) - 1);
    a.residual_row_stride = rng() % 2 ? 0 : edge();
    if (rng() % 2) a.norm_weight = fake(0x7f6000000000);
    set_c_enum(a.norm_weight_dtype, static_cast<int>(rng() % 5) - 1);
    a.norm_eps = eps[rng() % 5];
    if (rng() % 2) a.out_scales = static_cast<float*>(fake(0x7f7000000000));
    set_c_enum(a.out_scales_layout, static_cast<int>(rng() % 3));
    a.out_scales_pow2 = static_cast<int>(rng() % 3);
    try {
      const size_t bytes = moejit::combine_workspace_bytes(&a);
      const moejit::CombinePlan plan = moejit::plan_combine(&a);
      ++planned;
      if (plan.nothing_to_do) continue;
      // A launch the hardware takes: a grid within its limits, a block of 32..1024 threads.
      ASSERT_GE(plan.combine_grid_x, 1u);
      ASSERT_LE(plan.combine_grid_x, static_cast<unsigned>(INT32_MAX));
      ASSERT_GE(plan.combine_grid_y, 1u);
      ASSERT_LE(plan.combine_grid_y, 65535u);
      ASSERT_GE(plan.spec.block_threads(), 32);
      ASSERT_LE(plan.spec.block_threads(), 1024);
      ASSERT_EQ(moejit::is_epilogue(plan.spec.kind), a.residual != nullptr ||
                                                         a.norm_weight != nullptr ||
                                                         a.out_dtype == MOEJIT_DTYPE_FLOAT8_E4M3);
      if (plan.cluster_blocks > 0) {  // a cluster of 2..8 blocks per token, the grid whole ones
        ++clustered;
        ASSERT_GE(plan.cluster_blocks, 2u);
        ASSERT_LE(plan.cluster_blocks, 8u);
        ASSERT_EQ(plan.combine_grid_x, plan.one_block_grid_x * plan.cluster_blocks);
      }
      if (plan.spec.token_index()) {
        // The lists the plan writes fit in the workspace it asked for.
        ASSERT_GT(bytes, 0u);
        ASSERT_LE(static_cast<uint64_t>(a.num_tokens) * 4u, bytes);
        // The list path's token_index_heavy: a grid of at least one block, at most 512.
        if (plan.list_helpers()) {
          ASSERT_GE(plan.heavy_blocks, 1u);
          ASSERT_LE(plan.heavy_blocks, 512u);
        }
      } else {
        ASSERT_EQ(bytes, 0u);
      }
    } catch (const moejit::Error& e) {
      ++rejected;
      ASSERT_TRUE(e.status() == MOEJIT_ERROR_INVALID_ARGUMENT ||
                  e.status() == MOEJIT_ERROR_UNSUPPORTED)
          << moejit_status_name(e.status()) << ": " << e.what();
      ASSERT_NE(std::string(e.what()).find(" = "), std::string::npos) << e.what();
    }
  }
  // Both outcomes were exercised (the edge values make most structs invalid).
  EXPECT_GT(planned, 1000);
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(clustered, 10);
}

}  // namespace
