// Host-only checks of the dispatcher's choices: vector width from alignment, thread geometry,
// name expressions, and the generated source.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "aligned_call.h"
#include "combine_plan.h"
#include "error.h"
#include "kernel_spec.h"

namespace moejit {
namespace {

// What a spec's kind says, in the words the tests use.
// A single launch with one token per block in whole warps: the geometry that has a small-call form.
bool ordered_scan(const KernelSpec& s) {
  return (s.kind == KernelKind::kTokenIndexScan || s.kind == KernelKind::kTokenIndexSmallScan) &&
         s.tpb == 1 && s.tpt % 32 == 0;
}
bool small_scan(const KernelSpec& s) {
  return s.kind == KernelKind::kTokenIndexSmallScan;
}
bool needs_list_helpers(const KernelSpec& s) {
  return companion_module(s).has_value();
}
bool one_dim_grid(const KernelSpec& s) {
  return s.grid != Grid::kTokensByChunks;
}

// expert and out are fake addresses whose low bits set the alignment a test wants; each is moved
// into a region of its own (far apart), since the library refuses buffers that overlap.
moejit_combine_args gather_args(void* expert, void* out, int64_t hidden) {
  constexpr uintptr_t kRegion = uintptr_t{1} << 46;  // past the largest span a test plans
  expert = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(expert) + 1 * kRegion);
  out = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(out) + 2 * kRegion);
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = MOEJIT_LAYOUT_GATHER_MAP;
  a.num_tokens = 3;
  a.top_k = 2;
  a.num_rows = 6;
  a.hidden_dim = hidden;
  a.expert_hidden = expert;
  a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.indices = reinterpret_cast<void*>(0x10000);
  a.out = out;
  a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  return a;
}

TEST(KernelSpec, AlignedBf16UsesSixteenByteVectors) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  a.num_tokens = 3333;
  a.num_rows = 6666;
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.vec, 8);
  EXPECT_EQ(plan.spec.tpt, 128);
  EXPECT_EQ(plan.spec.tpb, 1);
  EXPECT_EQ(plan.spec.chunks(), 7);
  EXPECT_FALSE(plan.list_helpers());  // fixed layouts: one launch
  EXPECT_FALSE(plan.token_scan());
  // Past mid-size calls one 1-D grid, a token's 7 chunks adjacent (as for token-major).
  EXPECT_EQ(plan.combine_grid_x, 3333u * 7u);
  EXPECT_EQ(plan.combine_grid_y, 1u);
}

TEST(KernelSpec, FixedLayoutsUseOneDimensionWithATokensChunksAdjacent) {
  for (moejit_layout layout : {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP}) {
    SCOPED_TRACE(layout);
    auto a =
        gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
    a.layout = layout;
    a.num_tokens = 3333;  // past mid-size calls, where the gather map takes the 2-D grid
    if (layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
      a.indices = nullptr;
      a.num_rows = 0;
    } else {
      a.num_rows = 6666;
    }
    const CombinePlan plan = plan_combine(&a);
    EXPECT_EQ(plan.spec.chunks(), 7);
    EXPECT_EQ(plan.combine_grid_x, 3333u * 7u);
    EXPECT_EQ(plan.combine_grid_y, 1u);
    // Past what one 1-D launch holds: a clear error, not a wrapped grid.
    a.num_tokens = int64_t{1} << 30;
    try {
      plan_combine(&a);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), MOEJIT_ERROR_UNSUPPORTED);
      EXPECT_NE(std::string(e.what()).find("split the batch"), std::string::npos) << e.what();
    }
  }
}

TEST(KernelSpec, DecodeSizedCallsKeepTheBandwidthBlocksAndMidSizeCallsSpreadATokenOut) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  // Decode sizes: the 128-thread blocks whatever the rows per token (faster than 16x2 at K > 2),
  // one slot per thread (two at K=1, four at K=2, only past them).
  for (int k : {1, 2, 4, 8}) {
    a.top_k = k;
    a.num_rows = 3 * k;
    const CombinePlan few = plan_combine(&a);  // 3 tokens
    EXPECT_EQ(few.spec.tpt, 128) << k;
    EXPECT_EQ(few.spec.tpb, 1) << k;
    EXPECT_EQ(few.spec.upt, 1) << k;
    // 896 vectors in 7 chunks per token. The gather map on the 2-D grid at decode sizes (x the
    // tokens, y the chunks), token-major on the 1-D grid (a token's chunks adjacent).
    EXPECT_EQ(few.combine_grid_x, 3u) << k;
    EXPECT_EQ(few.combine_grid_y, 7u) << k;
    a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
    const CombinePlan few_tm = plan_combine(&a);
    EXPECT_EQ(few_tm.spec.tpt, 128) << k;
    EXPECT_EQ(few_tm.combine_grid_x, 3u * 7u) << k;
    EXPECT_EQ(few_tm.combine_grid_y, 1u) << k;
    a.layout = MOEJIT_LAYOUT_GATHER_MAP;
  }
  // The gather map on the 2-D grid up to mid-size calls (T * vectors per row <= 2^21: T = 2340
  // at 896 vectors), on the 1-D grid past them.
  a.top_k = 8;
  a.num_tokens = 2340;
  a.num_rows = 8 * 2340;
  const CombinePlan mid = plan_combine(&a);
  const unsigned mid_tpb = static_cast<unsigned>(mid.spec.tpb);
  EXPECT_EQ(mid_tpb, 8u);                                          // eight token groups per block
  EXPECT_EQ(mid.combine_grid_x, (2340u + mid_tpb - 1) / mid_tpb);  // the last block partial
  EXPECT_EQ(mid.combine_grid_y, static_cast<unsigned>(mid.spec.chunks()));
  a.num_tokens = 2341;
  a.num_rows = 8 * 2341;
  const CombinePlan large = plan_combine(&a);
  EXPECT_EQ(large.combine_grid_x, 2341u * static_cast<unsigned>(large.spec.chunks()));
  EXPECT_EQ(large.combine_grid_y, 1u);
  a.num_tokens = 3;
  // Mid-size calls with eight rows per token: 16-slot token groups, eight per 128-thread block for
  // the gather map, two per 32-thread block for token-major.
  a.top_k = 8;
  a.num_tokens = 100;
  a.num_rows = 800;
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.tpt, 16);
  EXPECT_EQ(plan.spec.tpb, 8);
  EXPECT_EQ(plan.spec.chunks(), 56);
  EXPECT_EQ(plan.combine_grid_x, 13u);  // 100 tokens in blocks of eight (the 2-D grid)
  EXPECT_EQ(plan.combine_grid_y, 56u);  // 56 chunks
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  const CombinePlan plan_tm = plan_combine(&a);
  EXPECT_EQ(plan_tm.spec.tpt, 16);
  EXPECT_EQ(plan_tm.spec.tpb, 2);
  EXPECT_EQ(plan_tm.combine_grid_x, 50u * 56u);  // two tokens per block, chunks adjacent (1-D)
  a.layout = MOEJIT_LAYOUT_GATHER_MAP;
  a.num_tokens = 64;  // the last decode size
  a.num_rows = 512;
  EXPECT_EQ(plan_combine(&a).spec.tpt, 128);
  // The token index: one 64-thread group per block for the list path and the one-token kernel;
  // its single-launch kernel scans token_idx once per block, in 128-thread blocks.
  const KernelSpec ti = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                       MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256, 3);
  EXPECT_EQ(ti.tpt, 64);
  EXPECT_EQ(ti.tpb, 1);
  const KernelSpec ti_fp32 =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                     MOEJIT_INDEX_INT32, 7168, 4, 256, 3);
  EXPECT_EQ(one_token_index_spec(ti_fp32).tpt, 64);  // in 16-byte vectors, the decode geometry
  EXPECT_EQ(single_launch_spec(ti, 3).name_expressions(),
            std::vector<std::string>{
                "&moejit::combine_scan<2, 2, int, 7168, 8, 8, 128, 1, 1, 32, false>"});
  // Rows narrower than 128 threads: the decode geometry as before.
  const KernelSpec ti_narrow =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                     MOEJIT_INDEX_INT32, 512, 8, 256, 3);
  EXPECT_EQ(single_launch_spec(ti_narrow, 3).tpt, 64);
  EXPECT_EQ(single_launch_spec(ti_narrow, 3).tpb, 1);
  // Past the mid-size limit (2^21 token slots): the bandwidth geometry.
  a.num_tokens = 2341;
  a.num_rows = 2341 * 8;
  EXPECT_EQ(plan_combine(&a).spec.tpt, 128);
}

TEST(KernelSpec, MisalignedPointerNarrowsTheVector) {
  // Two bytes past a 16-byte boundary: only single bf16 elements are aligned.
  auto a = gather_args(reinterpret_cast<void*>(0x100002), reinterpret_cast<void*>(0x200000), 4096);
  EXPECT_EQ(plan_combine(&a).spec.vec, 1);
  // Four bytes past: pairs.
  a.expert_hidden = reinterpret_cast<void*>(0x100004);
  EXPECT_EQ(plan_combine(&a).spec.vec, 2);
  // An odd row stride breaks every row after the first.
  a.expert_hidden = reinterpret_cast<void*>(0x100000);
  a.expert_row_stride = 4097;
  EXPECT_EQ(plan_combine(&a).spec.vec, 1);
  // Padding that keeps alignment keeps the vector.
  a.expert_row_stride = 4096 + 64;
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
}

// Token-major reads no indices and does not check index_type: any int a C caller left there must
// plan without the field being loaded as the enum (UB, which tools/sanitize.sh aborts on).
TEST(KernelSpec, TokenMajorPlansWhateverIndexTypeTheCallerLeft) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 4096);
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.indices = nullptr;
  const int not_an_index_type = 7;
  std::memcpy(&a.index_type, &not_an_index_type, sizeof(a.index_type));
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.index_bytes, 4);
  EXPECT_EQ(plan.spec.top_k, 2);
}

TEST(KernelSpec, ShortRowsShareBlocks) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 128);
  a.expert_dtype = a.out_dtype = MOEJIT_DTYPE_FLOAT32;
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.vec, 4);
  EXPECT_EQ(plan.spec.tpt, 32);
  EXPECT_EQ(plan.spec.tpb, 4);
  EXPECT_EQ(plan.spec.block_threads(), 128);
  EXPECT_EQ(plan.combine_grid_x, 1u);  // 3 tokens fit in one block of 4 token groups
  EXPECT_EQ(plan.combine_grid_y, 1u);
}

TEST(KernelSpec, TinyHiddenKeepsAtLeastFourThreadsPerToken) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 1);
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.vec, 1);
  EXPECT_EQ(plan.spec.tpt, 4);
  EXPECT_EQ(plan.spec.tpb, 32);
}

TEST(KernelSpec, PlanMatchesSpecForShapeOnAlignedBuffers) {
  // The precompile tool warms spec_for_shape(); the runtime must ask for the same spec.
  for (int hidden : {1, 7, 128, 2880, 4096, 7168}) {
    for (int64_t tokens : {1, 3, 16, 17, 4096}) {
      auto a =
          gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), hidden);
      a.num_tokens = tokens;
      a.num_rows = 2 * tokens;
      const KernelSpec planned = plan_combine(&a).spec;
      // One token with at most top_k rows: the one-token kernel in its own geometry.
      const KernelSpec shape =
          spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                         MOEJIT_INDEX_INT32, hidden, 2, 256, tokens);
      EXPECT_EQ(planned, tokens == 1 ? one_token_map_spec(shape) : shape)
          << "hidden " << hidden << " tokens " << tokens;
      // As a programmatic dependent, the fixed kernel (the one-token kernel's shared-memory
      // staging made a dependent launch start late), which precompile warms as well.
      a.dependent_launch = 1;
      EXPECT_EQ(plan_combine(&a).spec, shape) << "hidden " << hidden << " tokens " << tokens;
      a.dependent_launch = 0;
      const auto all = specs_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                       MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, hidden, 2, 256);
      EXPECT_NE(std::find(all.begin(), all.end(), planned), all.end());
    }
  }
}

// A module's spec: its describe() line and its one kernel's name expression.
void expect_module(const KernelSpec& spec, const std::string& description,
                   const std::string& name_expression) {
  EXPECT_EQ(spec.describe(), description);
  EXPECT_EQ(spec.name_expressions(), std::vector<std::string>{name_expression});
}

TEST(KernelSpec, TokenIndexNeedsHelpersAndAList) {
  const KernelSpec s = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT16,
                                      MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 2048, 8, 256);
  EXPECT_EQ(s.held, 8);  // rows held in registers: 8 expected per token
  EXPECT_EQ(s.top_k, 0);
  EXPECT_EQ(s.list_cap, 32);
  // Held rows: the expected count rounded up to 1, 2, 4, 8 or 16; the list holds at least 16 and
  // four times the expected count, up to 128 (random counts per token then stay within it). The
  // single launch's small-call form, which scans again past its window, keeps twice the expected
  // count, at least 8.
  const struct {
    int rows_per_token, held, cap, small_cap;
  } sizes[] = {{0, 1, 16, 8},    {1, 1, 16, 8},     {2, 2, 16, 8},    {3, 4, 32, 8},
               {4, 4, 32, 8},    {5, 8, 32, 16},    {8, 8, 32, 16},   {9, 12, 64, 32},
               {16, 16, 64, 32}, {17, 16, 128, 64}, {40, 16, 128, 64}};
  for (const auto& z : sizes) {
    const KernelSpec t =
        spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                       MOEJIT_INDEX_INT32, 4096, z.rows_per_token, 256);
    EXPECT_EQ(t.held, z.held) << z.rows_per_token;
    EXPECT_EQ(t.list_cap, z.cap) << z.rows_per_token;
    const KernelSpec single = single_launch_spec(t, 3);
    EXPECT_EQ(single.list_cap, z.cap) << z.rows_per_token;
    ASSERT_TRUE(ordered_scan(single)) << z.rows_per_token;
    const KernelSpec small = single_launch_for_rows(single, 1);
    EXPECT_EQ(small.list_cap, z.small_cap) << z.rows_per_token;
    EXPECT_EQ(single_launch_for_rows(small, 1), small) << z.rows_per_token;
  }
  EXPECT_EQ(s.vec, 4);  // fp32 output limits the vector to 16 bytes of output
  // Prefill: 512 slots in whole 128-thread chunks, the bandwidth blocks (rows through L1).
  // Its module's second kernel sums the tokens past their lists, before the combine.
  EXPECT_EQ(s.name_expressions(),
            (std::vector<std::string>{
                "&moejit::combine_lists<1, 0, long long, 2048, 4, 8, 128, 1, 1, 32, 1, true>",
                "&moejit::token_index_heavy<1, 0, long long, 2048, 4>"}));
  // The list helpers: one module per index type, whatever the shape.
  const KernelSpec h = list_helpers_spec(s.index_bytes);
  ASSERT_TRUE(companion_module(s).has_value());
  EXPECT_EQ(*companion_module(s), h);
  const auto names = h.name_expressions();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[kClearKernel], "&moejit::token_index_clear<>");
  EXPECT_EQ(names[kAssignKernel], "&moejit::token_index_assign<long long>");
  EXPECT_EQ(h.describe(), "kind=token_index_list_helpers idx=int64");
  EXPECT_NE(h, s);
  EXPECT_NE(h, single_launch_spec(s, kAnyTokens));
  EXPECT_EQ(
      h, *companion_module(spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32,
                                          MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 7168, 1, 256)));
  EXPECT_FALSE(companion_module(h).has_value());
  EXPECT_NE(h.hash(), s.hash());
  // Only a list-path combine launches the helpers (ModuleCache loads them with it).
  EXPECT_TRUE(needs_list_helpers(s));
  EXPECT_FALSE(needs_list_helpers(single_launch_spec(s, kAnyTokens)));
  EXPECT_FALSE(needs_list_helpers(h));
  EXPECT_EQ(h.chunks(), 0);  // no geometry: no division by zero
  // The single-launch kernel is a module of its own, a spec of its own (and a cache entry), in
  // 128-thread blocks: each of them scans all of token_idx.
  const KernelSpec scan = single_launch_spec(s, kAnyTokens);
  EXPECT_NE(scan, s);
  EXPECT_NE(scan.hash(), s.hash());
  expect_module(scan,
                "kind=token_index_scan in=fp16 out=fp32 idx=int64 H=2048 vec=4 held=8 tpt=128 "
                "tpb=1 upt=1 cap=32",
                "&moejit::combine_scan<1, 0, long long, 2048, 4, 8, 128, 1, 1, 32, false>");
  // Its small-call form (every warp reads all of token_idx; calls with at most 128 rows): a
  // module, spec and cache entry of its own, with half the list (it scans again past a window).
  ASSERT_TRUE(ordered_scan(scan));
  const KernelSpec small = single_launch_for_rows(scan, 1);
  EXPECT_NE(small, scan);
  EXPECT_NE(small.hash(), scan.hash());
  expect_module(small,
                "kind=token_index_small_scan in=fp16 out=fp32 idx=int64 H=2048 vec=4 held=8 "
                "tpt=128 tpb=1 upt=1 cap=16",
                "&moejit::combine_scan<1, 0, long long, 2048, 4, 8, 128, 1, 1, 16, true>");
  EXPECT_EQ(single_launch_for_rows(scan, 1), small);
  EXPECT_EQ(single_launch_for_rows(scan, 128), small);
  EXPECT_EQ(single_launch_for_rows(scan, 129), scan);
  // At decode and mid sizes the list path takes 64-thread blocks (streaming row loads); the single
  // launch keeps 128 (each warp then reads all of a call's token_idx up to 128 rows): with eight
  // rows per token it is the prefill geometry's module, one module for both.
  const KernelSpec s_decode =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32,
                     MOEJIT_INDEX_INT64, 2048, 8, 256, 64);
  EXPECT_EQ(s_decode.tpt, 64);
  EXPECT_EQ(single_launch_spec(s_decode, 64), scan);
  // Mid-size: up to 2^21 token slots (T = 4096 at 512 slots).
  const auto s_at = [](int64_t tokens) {
    return spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32,
                          MOEJIT_INDEX_INT64, 2048, 8, 256, tokens);
  };
  EXPECT_EQ(s_at(65), s_decode);
  EXPECT_EQ(s_at(4096), s_decode);
  EXPECT_EQ(s_at(4097), s);
  EXPECT_EQ(single_launch_spec(s_at(4096), 4096), scan);
  // With short lists the prefill geometry holds two slots per thread, decode one.
  const KernelSpec k2_decode =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                     MOEJIT_INDEX_INT32, 4096, 2, 256, 64);
  const KernelSpec k2_scan = single_launch_spec(k2_decode, 64);
  EXPECT_EQ(k2_scan.tpt, 128);
  EXPECT_EQ(k2_scan.tpb, 1);
  EXPECT_EQ(k2_scan.upt, 1);
  EXPECT_EQ(single_launch_spec(k2_decode, kAnyTokens).upt, 2);
  // Rows shorter than a warp (several tokens per block) have one too: beyond decode sizes in
  // 512-thread blocks (128 tokens of 4 threads), at decode in 128 (32 tokens), as the list path.
  const KernelSpec tiny = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32,
                                         MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32, 8, 2, 256);
  EXPECT_EQ(tiny.tpt, 4);
  EXPECT_EQ(tiny.tpb, 32);
  EXPECT_EQ(tiny.name_expressions().size(), 2u);  // combine_lists, token_index_heavy
  EXPECT_EQ(
      single_launch_spec(tiny, kAnyTokens).name_expressions(),
      std::vector<std::string>{"&moejit::combine_scan<0, 0, int, 8, 4, 2, 4, 128, 1, 16, false>"});
  // Several tokens per block: not an ordered scan, so no small-call form.
  EXPECT_FALSE(ordered_scan(single_launch_spec(tiny, 64)));
  EXPECT_EQ(single_launch_for_rows(single_launch_spec(tiny, 64), 2), single_launch_spec(tiny, 64));
  EXPECT_EQ(single_launch_spec(tiny, 64).tpb, 32);
  EXPECT_EQ(single_launch_spec(tiny, 65).tpb, 128);
  // With 9-16 rows per token the list path holds 12 or 16; a single launch with several tokens per
  // block holds eight (more spilled), one token per block all of them.
  for (int rows : {10, 16}) {
    const KernelSpec wide = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32,
                                           MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32, 8, rows, 256);
    EXPECT_EQ(wide.held, rows <= 12 ? 12 : 16);
    EXPECT_GT(single_launch_spec(wide, 65).tpb, 1);
    EXPECT_EQ(single_launch_spec(wide, 65).held, 8);
    const KernelSpec long_rows =
        spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                       MOEJIT_INDEX_INT32, 4096, rows, 256);
    EXPECT_EQ(single_launch_spec(long_rows, 65).tpb, 1);
    EXPECT_EQ(single_launch_spec(long_rows, 65).held, long_rows.held);
  }
  // The one-token kernel: a module of its own too, without a list, in the decode geometry.
  const KernelSpec one = one_token_index_spec(s_decode);  // 8-byte vectors: not narrowed
  EXPECT_NE(one, s_decode);
  EXPECT_NE(one, s);
  EXPECT_NE(one, scan);
  EXPECT_NE(one.hash(), s.hash());
  EXPECT_EQ(one.list_cap, 0);
  EXPECT_FALSE(needs_list_helpers(one));
  expect_module(one,
                "kind=token_index_one_token in=fp16 out=fp32 idx=int64 H=2048 vec=4 held=8 tpt=64 "
                "tpb=1 upt=1",
                "&moejit::combine_one_token<1, 0, long long, 2048, 4, 8, 64, 1, 1>");
  // Each module's source includes its kernel family's template.
  EXPECT_NE(s.source().find("#include \"combine_token_index.cuh\""), std::string::npos);
  EXPECT_NE(one.source().find("#include \"combine_one_token.cuh\""), std::string::npos);
}

// The plan of a token-index call on 16-byte-aligned bf16 rows (VEC 8) with a workspace.
CombinePlan plan_token_index(int64_t hidden, int64_t tokens, int64_t rows, moejit_index_type idx) {
  auto a =
      gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), hidden);
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = reinterpret_cast<void*>(0x300000);
  a.workspace_bytes = size_t{1} << 30;
  a.num_tokens = tokens;
  a.num_rows = rows;
  a.index_type = idx;
  return plan_combine(&a);
}

// The shapes of the GPU test CombineGpu.SlabScanListsAHotTokensRows take the single launch with
// one token per block and more rows than the block has threads (its shared list, not the
// small-call form), with the list capacities that test puts its hot token's row counts around.
TEST(KernelSpec, SlabListTestShapesTakeTheOneTokenBlockScan) {
  struct Shape {
    int64_t hidden, tokens, top_k;
    int tpt, list_cap;
  };
  for (const Shape& sh :
       {Shape{7168, 17, 8, 128, 32}, Shape{7168, 64, 8, 128, 32}, Shape{4096, 256, 2, 128, 16},
        Shape{2880, 64, 4, 128, 32}, Shape{512, 4, 40, 64, 128}}) {
    for (const moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64}) {
      const std::string at = std::to_string(sh.hidden) + " " + std::to_string(sh.tokens) + " " +
                             std::to_string(sh.top_k) + " " + std::to_string(idx);
      const CombinePlan plan = plan_token_index(sh.hidden, sh.tokens, sh.tokens * sh.top_k, idx);
      EXPECT_TRUE(plan.token_scan()) << at;
      EXPECT_TRUE(ordered_scan(plan.spec)) << at;
      EXPECT_FALSE(small_scan(plan.spec)) << at;
      EXPECT_GT(sh.tokens * sh.top_k, plan.spec.block_threads()) << at;
      EXPECT_EQ(plan.spec.tpt, sh.tpt) << at;
      EXPECT_EQ(plan.spec.list_cap, sh.list_cap) << at;
    }
  }
}

// The shapes of CombineGpu.WalksPastAHotTokensList: the list path in 128- and 64-thread token
// groups, the single launch (several tokens per block, not the ordered scan) in 32-, 8- and
// 4-thread groups, with the list capacities that test's row counts sit around. The last one has
// 128-entry lists in shared memory: 64 tokens per block, not 128
// (ShortRowScanListsFitSharedMemory).
TEST(KernelSpec, WalkTestShapesTakeTheirGroups) {
  struct Shape {
    int64_t hidden, tokens, top_k;
    bool scan;
    int tpt, tpb, list_cap;
  };
  for (const Shape& sh :
       {Shape{2048, 8200, 1, false, 128, 1, 16}, Shape{2880, 1000, 8, false, 64, 1, 32},
        Shape{256, 1536, 2, true, 32, 16, 16}, Shape{64, 1536, 2, true, 8, 64, 16},
        Shape{32, 100, 20, true, 4, 64, 128}}) {
    for (const moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64}) {
      const std::string at =
          std::to_string(sh.hidden) + " " + std::to_string(sh.tokens) + " " + std::to_string(idx);
      const CombinePlan plan = plan_token_index(sh.hidden, sh.tokens, sh.tokens * sh.top_k, idx);
      EXPECT_EQ(plan.token_scan(), sh.scan) << at;
      EXPECT_FALSE(ordered_scan(plan.spec)) << at;
      EXPECT_EQ(needs_list_helpers(plan.spec), !sh.scan) << at;
      EXPECT_EQ(plan.spec.tpt, sh.tpt) << at;
      EXPECT_EQ(plan.spec.tpb, sh.tpb) << at;
      EXPECT_EQ(plan.spec.list_cap, sh.list_cap) << at;
    }
  }
}

// The single launch with several tokens per block keeps a row list per token in shared memory
// (token_index_rows.cuh, scan_token_rows): at most 32 KB of lists per block, whatever the row
// length and the rows per token (lists of 16 to 128 entries), at decode and larger sizes. 4-thread
// groups of 128-entry lists in 512-thread blocks took 64 KB, over the 48 KB of static shared
// memory.
TEST(KernelSpec, ShortRowScanListsFitSharedMemory) {
  int scans = 0;
  for (int64_t hidden : {1, 8, 16, 32, 64, 128, 256})
    for (int64_t rows_per_token : {1, 2, 8, 12, 16, 17, 40, 200})
      for (int64_t tokens : {4, 64, 65, 100, 400}) {
        const CombinePlan plan =
            plan_token_index(hidden, tokens, tokens * rows_per_token, MOEJIT_INDEX_INT32);
        if (!plan.token_scan() || plan.spec.tpb == 1) continue;
        ++scans;
        EXPECT_LE(plan.spec.tpb * plan.spec.list_cap * 4, 32 * 1024)
            << plan.spec.describe() << " T=" << tokens;
      }
  EXPECT_GT(scans, 50);  // the loop reaches the several-tokens-per-block single launch
}

// One token (single-sequence decode) with few rows: combine_one_token, which loads rows and
// token_idx together instead of scanning first. More rows, or more tokens: the scan.
TEST(KernelSpec, OneTokenCallsPlanTheOneTokenModule) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = reinterpret_cast<void*>(0x300000);
  a.workspace_bytes = size_t{1} << 30;
  a.num_tokens = 1;
  for (int64_t rows :
       {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{64}}) {
    a.num_rows = rows;
    const CombinePlan plan = plan_combine(&a);
    EXPECT_TRUE(plan.one_token()) << rows;
    EXPECT_FALSE(plan.token_scan()) << rows;
    EXPECT_FALSE(plan.list_helpers()) << rows;
    EXPECT_EQ(plan.spec.list_cap, 0) << rows;
    EXPECT_EQ(plan.params.list_capacity, 0) << rows;
    EXPECT_NE(plan.spec.name_expressions()[kCombineKernel].find("combine_one_token<"),
              std::string::npos);
    // Its own geometry (one_token_index_spec): up to two rows 1792 8-byte vectors in 14 chunks of
    // 128 threads; three or four rows the decode geometry's 896 16-byte vectors in 14 chunks of
    // 64; five or more 3584 4-byte vectors in 28 chunks of 128.
    const bool few = rows <= 2, four = rows > 2 && rows <= 4;
    EXPECT_EQ(plan.spec.tpt, four ? 64 : 128) << rows;
    EXPECT_EQ(plan.spec.vec, few ? 4 : four ? 8 : 2) << rows;
    EXPECT_EQ(plan.spec.tpb, 1) << rows;
    EXPECT_EQ(plan.combine_grid_x, 1u);
    EXPECT_EQ(plan.combine_grid_y, few || four ? 14u : 28u) << rows;
    // What the precompile tool warms for the shape (rows per token = rows at T = 1).
    const auto warmed =
        specs_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                        MOEJIT_INDEX_INT32, 7168, static_cast<int>(rows), 256);
    EXPECT_NE(std::find(warmed.begin(), warmed.end(), plan.spec), warmed.end()) << rows;
  }
  a.num_rows = 65;  // past kOneTokenMaxRows: the scan
  EXPECT_FALSE(plan_combine(&a).one_token());
  EXPECT_TRUE(plan_combine(&a).token_scan());
  a.num_tokens = 2;
  a.num_rows = 8;
  EXPECT_FALSE(plan_combine(&a).one_token());
  EXPECT_TRUE(plan_combine(&a).token_scan());
  // Token-major never takes it.
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.num_tokens = 1;
  a.top_k = 8;
  a.num_rows = 8;
  EXPECT_FALSE(plan_combine(&a).one_token());
}

// Gather map, one token whose buffer holds at most top_k rows (an engine's decode step):
// combine_one_token_map, which loads every row with the map and the gates, on the fixed layouts'
// 1-D grid in their decode geometry. More rows, more tokens, or more slots than it holds at once
// (top_k > 8): the fixed layouts' kernel.
TEST(KernelSpec, OneTokenGatherMapCallsPlanTheirModule) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  a.num_tokens = 1;
  for (int64_t k : {1, 2, 3, 8}) {
    for (int64_t rows : {int64_t{0}, k - 1, k}) {
      if (rows < 0) continue;
      const std::string at = "K=" + std::to_string(k) + " rows=" + std::to_string(rows);
      a.top_k = k;
      a.num_rows = rows;
      const CombinePlan plan = plan_combine(&a);
      EXPECT_TRUE(plan.one_token()) << at;
      EXPECT_FALSE(plan.token_scan()) << at;
      EXPECT_FALSE(plan.list_helpers()) << at;
      EXPECT_EQ(plan.spec.top_k, k) << at;
      EXPECT_EQ(plan.spec.kind, KernelKind::kGatherMapOneToken) << at;
      EXPECT_EQ(plan.params.list_capacity, 0) << at;
      // Its own geometry (one_token_map_spec) on the fixed layouts' grid: at K <= 2 8-byte vectors
      // (1792 of them in 14 chunks of 128), at K > 2 16-byte ones (896 in 56 chunks of 16, two
      // token groups per block), one after the other on x.
      EXPECT_EQ(plan.spec.name_expressions(),
                std::vector<std::string>{"&moejit::combine_one_token_map<2, 2, int, 7168, " +
                                         std::string(k <= 2 ? "4, " : "8, ") + std::to_string(k) +
                                         (k <= 2 ? ", 128, 1, 1>" : ", 16, 2, 1>")})
          << at;
      EXPECT_TRUE(one_dim_grid(plan.spec)) << at;
      EXPECT_EQ(plan.combine_grid_x, k <= 2 ? 14u : 56u) << at;
      EXPECT_EQ(plan.combine_grid_y, 1u) << at;
      const auto warmed =
          specs_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                          MOEJIT_INDEX_INT32, 7168, static_cast<int>(k), 256);
      EXPECT_NE(std::find(warmed.begin(), warmed.end(), plan.spec), warmed.end()) << at;
    }
  }
  a.top_k = 8;
  a.num_rows = 9;  // a row the map may not name: the fixed layouts' kernel, in 128-thread blocks
  EXPECT_FALSE(plan_combine(&a).one_token());
  EXPECT_EQ(plan_combine(&a).spec.tpt, 128);
  a.num_rows = 8;
  a.num_tokens = 2;
  EXPECT_FALSE(plan_combine(&a).one_token());
  a.num_tokens = 1;
  a.top_k = 9;  // more slots than it holds in flight
  a.num_rows = 9;
  EXPECT_FALSE(plan_combine(&a).one_token());
  const auto warmed = specs_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                      MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 9, 256);
  EXPECT_TRUE(std::none_of(warmed.begin(), warmed.end(), [](const KernelSpec& s) {
    return s.kind == KernelKind::kGatherMapOneToken;
  }));
}

// The single launch with one token per block has a small-call form (every warp reads all of
// token_idx and lists a window of rows: no shared lists, no walk) for calls with at most one
// block's threads in rows; the precompile tool warms it wherever a decode or mid-size call of the
// shape takes it.
TEST(KernelSpec, CallsWithAtMostABlockOfRowsTakeTheSmallScanForm) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = reinterpret_cast<void*>(0x300000);
  a.workspace_bytes = size_t{1} << 30;
  // Rows of 896 vectors: 128-thread blocks; rows of 64 vectors (H = 512): 64-thread blocks at
  // decode sizes (past them several tokens per 512-thread block: no ordered scan).
  for (const int hidden : {7168, 512}) {
    a.hidden_dim = hidden;
    const int block = hidden == 7168 ? 128 : 64;
    for (const int64_t tokens : {1, 2, 16, 17, 64, 65, 100}) {
      for (const int64_t rows : {int64_t{block}, int64_t{block} + 1}) {
        a.num_tokens = tokens;
        a.num_rows = rows;
        const CombinePlan plan = plan_combine(&a);
        if (!plan.token_scan()) continue;  // T = 1 with few rows: the one-token kernel
        const std::string at =
            std::to_string(hidden) + " " + std::to_string(tokens) + " " + std::to_string(rows);
        if (tokens <= 64 || hidden == 7168) {
          EXPECT_EQ(plan.spec.block_threads(), block) << at;
          EXPECT_TRUE(ordered_scan(plan.spec)) << at;
        }
        EXPECT_EQ(small_scan(plan.spec), ordered_scan(plan.spec) && rows <= block) << at;
      }
    }
    // Every decode and mid-size call with K rows per token: its module is among those warmed. K is
    // the average rounded up, as the plan takes it (R / T): a call with dropped rows too, down to
    // (K - 1) * T + 1 rows (T = 65 with 66 rows: at most a block's rows, the small-call form).
    for (const int k : {1, 2, 4, 8}) {
      const auto warmed =
          specs_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                          MOEJIT_INDEX_INT32, hidden, k, 256);
      for (int64_t tokens = 1; tokens <= 300; ++tokens) {
        for (const int64_t rows : {tokens * (k - 1) + 1, tokens * k}) {
          a.num_tokens = tokens;
          a.num_rows = rows;
          const KernelSpec planned = plan_combine(&a).spec;
          EXPECT_NE(std::find(warmed.begin(), warmed.end(), planned), warmed.end())
              << planned.describe() << " for T = " << tokens << ", R = " << rows;
        }
      }
    }
  }
  // Several tokens per block (rows shorter than a warp) have no small-call form.
  a.hidden_dim = 8;
  a.expert_dtype = a.out_dtype = MOEJIT_DTYPE_FLOAT32;
  a.num_tokens = 4;
  a.num_rows = 8;
  const CombinePlan tiny = plan_combine(&a);
  EXPECT_TRUE(tiny.token_scan());
  EXPECT_FALSE(ordered_scan(tiny.spec));
  EXPECT_FALSE(small_scan(tiny.spec));
}

TEST(KernelSpec, SmallTokenIndexCallsPlanTheSingleLaunchModule) {
  auto a = gather_args(reinterpret_cast<void*>(0x100000), reinterpret_cast<void*>(0x200000), 7168);
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = reinterpret_cast<void*>(0x300000);
  a.workspace_bytes = size_t{1} << 30;
  // 3 tokens, 6 rows: one launch, whose module holds that kernel alone.
  const CombinePlan small = plan_combine(&a);
  EXPECT_TRUE(small.token_scan());
  EXPECT_TRUE(ordered_scan(small.spec));
  EXPECT_EQ(small.spec.name_expressions().size(), 1u);
  EXPECT_NE(small.spec.name_expressions()[kCombineKernel].find("combine_scan<"), std::string::npos);
  EXPECT_FALSE(small.list_helpers());
  EXPECT_EQ(small.params.list_capacity, small.spec.list_cap);  // the scan lists in shared memory
  EXPECT_EQ(small.params.list_capacity, 8);
  // Past the single-launch limit: the list path (clear and assign from the helpers' module, then
  // token_index_heavy and the combine from the list module).
  a.num_tokens = 40;
  a.num_rows = 8000;
  const CombinePlan large = plan_combine(&a);
  EXPECT_FALSE(large.token_scan());
  EXPECT_EQ(large.spec.kind, KernelKind::kTokenIndexLists);
  EXPECT_TRUE(large.list_helpers());
  EXPECT_EQ(large.params.list_capacity, 128);  // 200 rows per token: the workspace lists' stride
  EXPECT_EQ(large.spec.name_expressions().size(), 2u);  // and token_index_heavy
  EXPECT_EQ(large.heavy_blocks, 8000u / 128);           // a block per 128 rows
  EXPECT_EQ(companion_module(large.spec)->describe(), "kind=token_index_list_helpers idx=int32");
  EXPECT_EQ(large.spec.tpt, 64);
  EXPECT_EQ(single_launch_spec(large.spec, 40).tpt, 128);
  EXPECT_EQ(small.spec.tpt, 128);
  // The single launch: x the token groups, y the chunks (896 vectors in 128-thread blocks). The
  // list path with more than one row per token: one 1-D grid, a token's 14 chunks adjacent.
  EXPECT_EQ(small.combine_grid_x, 3u);
  EXPECT_EQ(small.combine_grid_y, 7u);
  EXPECT_TRUE(one_dim_grid(large.spec));
  EXPECT_EQ(large.combine_grid_x, 40u * 14u);
  EXPECT_EQ(large.combine_grid_y, 1u);
  // Prefill geometry: 1536 tokens of 2 rows, 128-wide fp32 (32 threads per token): the single
  // launch takes 16 tokens per 512-thread block, so each thread checks 6 entries and all blocks
  // together read 96 x 12 KB -> one launch. The list path keeps 4 tokens per 128-thread block.
  a.num_tokens = 1536;
  a.num_rows = 3072;
  a.hidden_dim = 128;
  a.expert_dtype = a.out_dtype = MOEJIT_DTYPE_FLOAT32;
  const CombinePlan mid = plan_combine(&a);
  EXPECT_TRUE(mid.token_scan());
  EXPECT_EQ(mid.spec.tpt, 32);
  EXPECT_EQ(mid.spec.tpb, 16);
  EXPECT_EQ(mid.combine_grid_x, 96u);
  EXPECT_EQ(mid.combine_grid_y, 1u);
  // Up to 24 entries per thread of those blocks: 12288 rows. Past that (12289, 25 per thread):
  // the list path, in 128-thread blocks.
  a.num_rows = 12288;
  EXPECT_TRUE(plan_combine(&a).token_scan());
  a.num_rows = 12289;
  const CombinePlan past = plan_combine(&a);
  EXPECT_FALSE(past.token_scan());
  EXPECT_EQ(past.spec.tpb, 4);
  // Within 24 per thread but too much re-reading in all (4096 tokens x 3 chunks x 12 KB).
  a.num_tokens = 4096;
  a.num_rows = 3072;
  a.hidden_dim = 5120;
  a.expert_dtype = a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  const CombinePlan one_row = plan_combine(&a);
  EXPECT_FALSE(one_row.token_scan());
  // One row per token held: the list path keeps x the token groups, y the chunks (640 vectors in
  // chunks of 64 threads x 2 slots).
  EXPECT_FALSE(one_dim_grid(one_row.spec));
  EXPECT_EQ(one_row.spec.tpt, 64);
  EXPECT_EQ(one_row.spec.upt, 2);
  EXPECT_EQ(one_row.combine_grid_x, 4096u);
  EXPECT_EQ(one_row.combine_grid_y, 5u);
  // Prefill with eight rows per token, 7168-wide bf16: the single launch keeps 128-thread blocks
  // (T = 256: 2048 entries, 16 per thread, 1792 blocks x 8 KB), the list path takes 64 (T = 512:
  // 4096 entries, 58 MB of re-reading in 128-thread blocks).
  a.hidden_dim = 7168;
  a.num_tokens = 256;
  a.num_rows = 2048;
  const CombinePlan prefill_small = plan_combine(&a);
  EXPECT_TRUE(prefill_small.token_scan());
  EXPECT_EQ(prefill_small.spec.tpt, 128);
  EXPECT_EQ(prefill_small.combine_grid_x, 256u);
  EXPECT_EQ(prefill_small.combine_grid_y, 7u);
  a.num_tokens = 512;
  a.num_rows = 4096;
  const CombinePlan prefill_large = plan_combine(&a);
  EXPECT_FALSE(prefill_large.token_scan());
  EXPECT_EQ(prefill_large.spec.tpt, 64);
  EXPECT_EQ(prefill_large.combine_grid_x, 512u * 14u);
  EXPECT_EQ(single_launch_spec(prefill_large.spec, 512), prefill_small.spec);
  // Both are among the specs the precompile tool warms for their shapes.
  const auto warmed_small =
      specs_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                      MOEJIT_INDEX_INT32, 7168, 2, 256);
  EXPECT_NE(std::find(warmed_small.begin(), warmed_small.end(), small.spec), warmed_small.end());
  const auto warmed_large =
      specs_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                      MOEJIT_INDEX_INT32, 7168, 200, 256);
  EXPECT_NE(std::find(warmed_large.begin(), warmed_large.end(), large.spec), warmed_large.end());
  const auto warmed_k8 = specs_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                         MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256);
  for (const KernelSpec& s : {prefill_small.spec, prefill_large.spec})
    EXPECT_NE(std::find(warmed_k8.begin(), warmed_k8.end(), s), warmed_k8.end()) << s.describe();
}

TEST(KernelSpec, EqualityAndHashCoverEveryField) {
  const KernelSpec base = spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                         MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 2, 256);
  const KernelSpec lists = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                          MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 2, 256);
  // Every field a kind's text form carries: the gather map's, then the token index's own.
  const std::pair<const KernelSpec*, std::vector<int KernelSpec::*>> cases[] = {
      {&base,
       {&KernelSpec::in_dtype, &KernelSpec::out_dtype, &KernelSpec::index_bytes,
        &KernelSpec::hidden, &KernelSpec::vec, &KernelSpec::top_k, &KernelSpec::tpt,
        &KernelSpec::tpb, &KernelSpec::upt}},
      {&lists, {&KernelSpec::held, &KernelSpec::list_cap}}};
  for (const auto& [spec, fields] : cases)
    for (auto field : fields) {
      KernelSpec other = *spec;
      other.*field += field == &KernelSpec::index_bytes ? 4 : 1;  // 4 -> 8: int32 -> int64
      EXPECT_NE(other, *spec);
      EXPECT_NE(other.hash(), spec->hash());
      EXPECT_NE(other.describe(), spec->describe());
    }
  // The kind picks the module's kernel: a spec that differs in it alone (the gather map's
  // one-token module may have the fixed module's every other field) is another module.
  for (int k = 0; k < kKernelKinds; ++k) {
    KernelSpec other = base;
    other.kind = static_cast<KernelKind>(k);
    if (other.kind == base.kind) continue;
    EXPECT_NE(other, base) << k;
    EXPECT_NE(other.hash(), base.hash()) << k;
    EXPECT_NE(other.describe(), base.describe()) << k;
  }
  // The rules the kernel takes as template arguments are part of the spec (derived from the
  // fields above, so they never differ alone in practice).
  KernelSpec grid = base;
  grid.grid = Grid::kTokensByChunks;
  EXPECT_NE(grid, base);
  EXPECT_NE(grid.hash(), base.hash());
  KernelSpec cached = base;
  cached.cached_rows = !base.cached_rows;
  EXPECT_NE(cached, base);
  EXPECT_NE(cached.hash(), base.hash());
}

TEST(KernelSpec, OneRowPerTokenTakesTwoSlotsPerThreadAtPrefill) {
  auto spec = [](moejit_layout layout, int hidden, int top_k, int64_t tokens) {
    return spec_for_shape(layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32,
                          hidden, top_k, 256, tokens);
  };
  for (moejit_layout layout : {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP}) {
    EXPECT_EQ(spec(layout, 5120, 1, kAnyTokens).upt, 2);
    EXPECT_EQ(spec(layout, 5120, 1, kAnyTokens).chunks(), 3);  // 640 slots in chunks of 256
    EXPECT_EQ(spec(layout, 5120, 2, kAnyTokens).upt, 1);       // two rows: one slot
    EXPECT_EQ(spec(layout, 5120, 1, 16).upt, 1);               // decode geometry
    EXPECT_EQ(spec(layout, 1024, 1, kAnyTokens).upt, 1);       // 128 slots: one chunk already
  }
}

TEST(KernelSpec, GatherMapWithTwoRowsTakesFourSlotsPerThreadWhereWholeChunksTileTheRow) {
  auto spec = [](moejit_layout layout, moejit_dtype dtype, int hidden, int top_k, int64_t tokens) {
    return spec_for_shape(layout, dtype, dtype, MOEJIT_INDEX_INT32, hidden, top_k, 256, tokens);
  };
  const auto gm = MOEJIT_LAYOUT_GATHER_MAP;
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_BFLOAT16, 4096, 2, kAnyTokens).upt, 4);  // 512 slots
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_BFLOAT16, 4096, 2, kAnyTokens).chunks(), 1);
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_FLOAT32, 4096, 2, kAnyTokens).upt, 4);  // 1024 slots
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_FLOAT32, 4096, 2, kAnyTokens).chunks(), 2);
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_BFLOAT16, 7168, 2, kAnyTokens).upt, 1);  // 896: a partial chunk
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_BFLOAT16, 4096, 2, 16).upt, 1);          // decode geometry
  EXPECT_EQ(spec(gm, MOEJIT_DTYPE_BFLOAT16, 4096, 4, kAnyTokens).upt, 1);  // more rows
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_BFLOAT16, 4096, 2, kAnyTokens).upt, 1);
}

// Rows whose starts allow no access wider than 4 bytes (odd hidden sizes, misaligned buffers) take
// four slots per thread beyond decode sizes where a row fills them (choose_geometry); 16-byte
// vectors keep their geometry. The mid-size 16-slot groups only for rows of whole 128-byte lines.
TEST(KernelSpec, NarrowVectorsTakeFourSlotsPerThreadAndMidSizeGroupsWholeLines) {
  auto spec = [](moejit_layout layout, moejit_dtype dtype, int hidden, size_t alignment,
                 int64_t tokens) {
    return spec_for_shape(layout, dtype, dtype, MOEJIT_INDEX_INT32, hidden, 8, alignment, tokens);
  };
  for (moejit_layout layout :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX}) {
    const KernelSpec odd = spec(layout, MOEJIT_DTYPE_BFLOAT16, 1001, 2, kAnyTokens);
    EXPECT_EQ(odd.vec, 1) << layout;
    EXPECT_EQ(odd.upt, 4) << layout;
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_BFLOAT16, 7169, 2, kAnyTokens).upt, 4) << layout;
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_FLOAT32, 1001, 4, kAnyTokens).upt, 4) << layout;
    const KernelSpec pairs = spec(layout, MOEJIT_DTYPE_FLOAT16, 5002, 4, kAnyTokens);
    EXPECT_EQ(pairs.vec, 2) << layout;
    EXPECT_EQ(pairs.upt, 4) << layout;
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_BFLOAT16, 1001, 2, 16).upt, 1) << layout;         // decode
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_BFLOAT16, 201, 2, kAnyTokens).upt, 1) << layout;  // short
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_BFLOAT16, 7168, 256, kAnyTokens).upt, 1) << layout;
  }
  // H = 1000 in 2-byte elements: 125 slots of 16 bytes, rows of 2000 bytes, not whole lines.
  for (moejit_layout layout : {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP}) {
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_FLOAT16, 1024, 256, 2000).tpt, 16) << layout;
    EXPECT_NE(spec(layout, MOEJIT_DTYPE_FLOAT16, 1000, 256, 2000).tpt, 16) << layout;
    EXPECT_EQ(spec(layout, MOEJIT_DTYPE_FLOAT16, 1000, 256, 2000),
              spec(layout, MOEJIT_DTYPE_FLOAT16, 1000, 256, kAnyTokens))
        << layout;
  }
}

}  // namespace
TEST(KernelSpec, EightRowsPerTokenTakeTheMidSizeGeometryUpToTwoToTheTwentyOneTokenSlots) {
  auto spec = [](moejit_layout layout, int hidden, int top_k, int64_t tokens) {
    return spec_for_shape(layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32,
                          hidden, top_k, 256, tokens);
  };
  for (moejit_layout layout : {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP}) {
    // Decode calls take the prefill module: nothing to add for them.
    const KernelSpec prefill = spec(layout, 7168, 8, kAnyTokens);
    EXPECT_EQ(prefill.tpt, 128);
    EXPECT_EQ(prefill.tpb, 1);
    EXPECT_EQ(spec(layout, 7168, 8, 1), prefill);
    EXPECT_EQ(spec(layout, 7168, 8, 64), prefill);
    EXPECT_EQ(spec(layout, 7168, 4, 1), spec(layout, 7168, 4, kAnyTokens));
    // Mid-size calls: 16-slot token groups, one module from T = 65 to 2^21 token slots; two per
    // 32-thread block for token-major, eight per 128-thread block for the gather map (where most
    // slots dropped left a 32-thread block too little work).
    const int tpb = layout == MOEJIT_LAYOUT_GATHER_MAP ? 8 : 2;
    const KernelSpec mid = spec(layout, 7168, 8, 65);
    EXPECT_EQ(mid.tpt, 16);
    EXPECT_EQ(mid.tpb, tpb);
    EXPECT_EQ(spec(layout, 7168, 8, 1024), mid);
    EXPECT_EQ(spec(layout, 7168, 8, 2048), mid);  // 2048 x 896 slots <= 2^21
    EXPECT_EQ(spec(layout, 7168, 8, 2340), mid);
    EXPECT_EQ(spec(layout, 7168, 8, 2341).tpt, 128);  // past 2^21 token slots
    EXPECT_EQ(spec(layout, 7168, 8, 2341).tpb, 1);
    EXPECT_EQ(spec(layout, 4096, 8, 4096).tpt, 16);  // 4096 x 512 = 2^21
    EXPECT_EQ(spec(layout, 4096, 8, 4096).tpb, tpb);
    EXPECT_EQ(spec(layout, 7168, 4, 1024).tpt, 128);  // fewer rows per token: bandwidth blocks
    EXPECT_EQ(spec(layout, 7168, 16, 1024).tpt, 16);
    EXPECT_EQ(spec(layout, 7168, 16, 1024).tpb, tpb);
    EXPECT_EQ(spec(layout, 256, 8, 1024).tpb, 4);  // 32 slots: a block of 128-thread short rows
  }
  // The gather map's one-token kernel keeps 16x2 at K > 2, 128x1 at K <= 2.
  const KernelSpec one = one_token_map_spec(spec(MOEJIT_LAYOUT_GATHER_MAP, 7168, 8, 1));
  EXPECT_EQ(one.kind, KernelKind::kGatherMapOneToken);
  EXPECT_EQ(one.tpt, 16);
  EXPECT_EQ(one.tpb, 2);
  EXPECT_EQ(one_token_map_spec(spec(MOEJIT_LAYOUT_GATHER_MAP, 7168, 2, 1)).tpt, 128);
  // The token index keeps its own geometries: 64-thread blocks up to mid-size calls, 128 past
  // them (T * slots > 2^21) where whole 128 x upt chunks tile the row. With eight rows per token
  // (one slot per thread: its lists are too long for two) decode and mid-size calls then share one
  // specialization.
  const KernelSpec ti_decode = spec(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, 1);
  EXPECT_EQ(ti_decode.tpt, 64);
  EXPECT_EQ(ti_decode.tpb, 1);
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, 1024), ti_decode);
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, 2048), ti_decode);  // 896 x 2048 <= 2^21
  const KernelSpec ti_prefill = spec(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, kAnyTokens);
  EXPECT_EQ(ti_prefill.tpt, 128);
  EXPECT_EQ(ti_prefill.tpb, 1);
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 8, 4096), ti_prefill);
  // 448 slots: the last 128-slot chunk would be partial, so 64-thread blocks at every size.
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 3584, 8, kAnyTokens).tpt, 64);
  // With two rows per token prefill calls hold two slots per thread, decode calls one.
  const KernelSpec ti_k2 = spec(MOEJIT_LAYOUT_TOKEN_INDEX, 4096, 2, kAnyTokens);
  EXPECT_EQ(ti_k2.tpt, 128);
  EXPECT_EQ(ti_k2.upt, 2);
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 4096, 2, 4096).tpt, 64);  // 512 x 4096 = 2^21
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 4096, 2, 4096).upt, 2);
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 4096, 2, 64).upt, 1);
  // 640 slots, two per thread: 256-slot chunks would not tile the row.
  EXPECT_EQ(spec(MOEJIT_LAYOUT_TOKEN_INDEX, 5120, 1, kAnyTokens).tpt, 64);
  // Rows narrower than 128 vectors keep several tokens per 128-thread block.
  const KernelSpec ti_narrow = spec(MOEJIT_LAYOUT_TOKEN_INDEX, 256, 8, kAnyTokens);
  EXPECT_EQ(ti_narrow.tpt, 32);
  EXPECT_EQ(ti_narrow.tpb, 4);
}

// What moejit-precompile warms (specs_for_shape) must hold every module a call of that shape can
// plan, whatever its batch size, rows (dropped or extra ones), dtypes, index type and launch mode:
// otherwise a MOEJIT_CACHE_MODE=no-compile deployment fails on that call with NOT_CACHED. Aligned,
// unpadded buffers, as precompile assumes.
TEST(KernelSpec, EveryCallOfAWarmedShapePlansAWarmedModule) {
  std::vector<int64_t> token_counts;
  for (int64_t t = 1; t <= 140; ++t) token_counts.push_back(t);
  for (const int64_t t : {255, 256, 257, 511, 512, 513, 1000, 2048, 4096, 16384, 65536, 262145})
    token_counts.push_back(t);
  const std::pair<moejit_dtype, moejit_dtype> dtypes[] = {
      {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16},
      {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32},
      {MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32}};
  size_t plans = 0;
  for (const moejit_layout layout :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX}) {
    for (const auto& dt : dtypes) {
      for (const moejit_index_type index_type : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64}) {
        if (layout == MOEJIT_LAYOUT_TOKEN_MAJOR && index_type == MOEJIT_INDEX_INT64) continue;
        for (const int hidden : {8, 100, 512, 2880, 7168}) {
          for (const int k : {1, 2, 3, 4, 8, 9, 16}) {
            const auto warmed =
                specs_for_shape(layout, dt.first, dt.second, index_type, hidden, k, 256);
            for (const int64_t tokens : token_counts) {
              // Rows: token-major exactly T * K; the gather map as many as the map names, or a
              // few, or more; the token index anything its rows per token round up to K from.
              std::vector<int64_t> rows_choices{tokens * k};
              if (layout == MOEJIT_LAYOUT_GATHER_MAP) {
                rows_choices.push_back(1);
                rows_choices.push_back(tokens * k + 1);
              }
              if (layout == MOEJIT_LAYOUT_TOKEN_INDEX && k > 1)
                rows_choices.push_back(tokens * (k - 1) + 1);
              for (const int64_t rows : rows_choices) {
                for (const int dependent : {0, 1}) {
                  const moejit_combine_args a = test::aligned_call(
                      layout, dt.first, dt.second, index_type, hidden, k, tokens, rows, dependent);
                  const KernelSpec planned = plan_combine(&a).spec;
                  ++plans;
                  ASSERT_NE(std::find(warmed.begin(), warmed.end(), planned), warmed.end())
                      << planned.describe() << " is not warmed for T = " << tokens
                      << ", R = " << rows << ", K = " << k << ", dependent_launch = " << dependent;
                  if (needs_list_helpers(planned)) {
                    ASSERT_NE(std::find(warmed.begin(), warmed.end(), *companion_module(planned)),
                              warmed.end())
                        << "the list helpers of " << planned.describe();
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(plans, size_t{100000});
}

}  // namespace moejit
