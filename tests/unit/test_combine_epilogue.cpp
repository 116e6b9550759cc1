// The epilogue's host side (no GPU): fp8 e4m3 conversions against an independent reference, and
// the quantization's division against the host's; every combination of the epilogue with the
// layouts, dtype pairs, strides, scale and accumulate plans an epilogue module whose geometry the
// kernels accept, with the fields in its parameters; the decode split and its cluster launch; the
// vector width the residual and weight allow; the text form of the epilogue's specs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "../../kernel_templates/fp8_e4m3.h"
#include "combine_epilogue.h"
#include "combine_plan.h"
#include "error.h"

namespace moejit {
namespace {

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every finite e4m3 magnitude by code (0..126), from its definition: code = e << 3 | m, value
// m * 2^-9 for e = 0, (8 + m) * 2^(e - 10) otherwise.
double e4m3_magnitude(int code) {
  const int e = code >> 3, m = code & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// The e4m3 nearest to x by search over the codes, ties to the even code, saturating at 448.
unsigned reference_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xffu : 0x7fu;
  const unsigned sign = std::signbit(x) ? 0x80u : 0u;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7eu;
  int best = 0;
  for (int code = 1; code <= 126; ++code) {
    const double d = std::fabs(e4m3_magnitude(code) - a), b = std::fabs(e4m3_magnitude(best) - a);
    if (d < b || (d == b && (code & 1) == 0)) best = code;
  }
  return sign | static_cast<unsigned>(best);
}

TEST(Fp8E4m3, DecodesEveryCode) {
  for (int b = 0; b < 256; ++b) {
    const float f = bits_float(e4m3_to_float_bits(static_cast<unsigned char>(b)));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
      continue;
    }
    const double want = (b & 0x80 ? -1.0 : 1.0) * e4m3_magnitude(b & 0x7f);
    EXPECT_EQ(static_cast<double>(f), want) << b;
    EXPECT_EQ(std::signbit(f), (b & 0x80) != 0) << b;
    // And back: every finite value is its own nearest.
    EXPECT_EQ(e4m3_from_float_bits(float_bits(f)), b) << b;
  }
}

// The encoder against the search: every code's neighbourhood (the midpoints to its neighbours,
// one fp32 ulp either side, the ties), every power of two's, subnormal fp32 inputs, saturation
// and NaN; then fp32 values spread over the whole range.
TEST(Fp8E4m3, RoundsToNearestEvenAndSaturates) {
  std::vector<float> xs = {0.0f,   -0.0f,     448.0f,   449.0f,        463.99f,     464.0f,
                           480.0f, 1e30f,     INFINITY, -INFINITY,     NAN,         -NAN,
                           1e-45f, 1.17e-38f, 1e-3f,    0.0009765625f, 0.001953125f};
  for (int code = 0; code <= 126; ++code) {
    const float v = static_cast<float>(e4m3_magnitude(code));
    const float mid = static_cast<float>((e4m3_magnitude(code) + e4m3_magnitude(code + 1)) / 2);
    for (float x : {v, mid}) {
      xs.push_back(x);
      xs.push_back(std::nextafter(x, 0.0f));
      xs.push_back(std::nextafter(x, INFINITY));
    }
  }
  for (int e = -140; e <= 20; ++e) xs.push_back(std::ldexp(1.0f, e));
  for (uint32_t u = 0; u < 0x7f800000u; u += 0x00012345u) xs.push_back(bits_float(u));
  for (float x : std::vector<float>(xs))
    if (!std::isnan(x)) xs.push_back(-x);
  for (float x : xs)
    EXPECT_EQ(static_cast<unsigned>(e4m3_from_float_bits(float_bits(x))), reference_e4m3(x))
        << x << " (bits " << std::hex << float_bits(x) << ")";
}

// The quantization's division: divide_by_scale(a, s, 1 / s) is the correctly rounded a / s (the
// host's division) for |a| >= 2^-102, and its e4m3 code is the same for every a; scales as the
// kernel makes them (a group's amax, at least 1e-10, over 448; also rounded up to powers of two).
TEST(Fp8E4m3, DividingByAScaleIsTheRoundedQuotient) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {  // xorshift64
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  long exact = 0;
  for (int i = 0; i < 4000000; ++i) {
    const uint64_t x = next();
    // amax: any positive normal float; a: its magnitude or up to 63 binades below, either sign.
    const float amax =
        bits_float(static_cast<uint32_t>((x & 0x7fffffu) | ((1u + (x >> 23) % 253u) << 23)));
    float s = std::max(amax, 1e-10f) / 448.0f;
    if (i % 4 == 3) s = bits_float((float_bits(s) + 0x7fffffu) & 0x7f800000u);  // a power of two
    const int biased = static_cast<int>(float_bits(amax) >> 23) - static_cast<int>((x >> 32) % 64);
    float a = i % 1000 == 0 ? 0.0f
                            : bits_float(static_cast<uint32_t>(((x >> 40) & 0x7fffffu) |
                                                               (std::max(biased, 0) << 23)));
    a = std::min(a, amax);
    if (x >> 63) a = -a;
    const float q = divide_by_scale(a, s, 1.0f / s), want = a / s;
    if (std::fabs(a) >= 0x1p-102f) {
      EXPECT_EQ(float_bits(q), float_bits(want)) << a << " / " << s;
      ++exact;
    }
    EXPECT_EQ(e4m3_from_float_bits(float_bits(q)), e4m3_from_float_bits(float_bits(want)))
        << a << " / " << s;
  }
  EXPECT_GT(exact, 3000000);
}

// ---- plans -----------------------------------------------------------------------------------

constexpr uintptr_t kRegion = uintptr_t{1} << 44;
void* at(int region, uintptr_t offset = 0) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(region) * kRegion + offset);
}

struct Epilogue {
  int res = -1, weight = -1;  // dtypes, -1: none
  bool fp8 = false;
  const char* name;
};
const Epilogue kEpilogues[] = {
    {MOEJIT_DTYPE_BFLOAT16, -1, false, "residual"},
    {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, false, "residual+norm"},
    {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, true, "residual+norm+fp8"},
    {-1, MOEJIT_DTYPE_FLOAT32, false, "norm"},
    {-1, -1, true, "fp8"},
};

// A valid call of the layout with the epilogue, each buffer in a region of its own.
moejit_combine_args call(moejit_layout layout, moejit_dtype in, moejit_dtype out, int64_t tokens,
                         int64_t top_k, int64_t hidden, const Epilogue& e) {
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = layout;
  a.num_tokens = tokens;
  a.top_k = top_k;
  a.num_rows = tokens * top_k;
  a.hidden_dim = hidden;
  a.expert_hidden = at(1);
  a.expert_dtype = in;
  a.gates = static_cast<const float*>(at(2));
  a.indices = layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : at(3);
  a.out = at(4);
  a.out_dtype = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : out;
  if (e.res >= 0) {
    a.residual = at(5);
    a.residual_dtype = static_cast<moejit_dtype>(e.res);
  }
  if (e.weight >= 0) {
    a.norm_weight = at(6);
    a.norm_weight_dtype = static_cast<moejit_dtype>(e.weight);
  }
  if (e.fp8) a.out_scales = static_cast<float*>(at(7));
  if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
    a.workspace = at(8);
    a.workspace_bytes = combine_workspace_bytes(&a);
  }
  return a;
}

// Every combination the issue names is valid (layouts x dtype pairs x epilogues x batch sizes x
// strides, scale, accumulate), takes an epilogue kind the kernels accept, and carries the
// epilogue's fields to the kernel; the grid covers the batch.
TEST(CombineEpilogue, EveryCombinationPlansAnEpilogueModule) {
  const moejit_dtype dtypes[] = {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16};
  int plans = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (moejit_dtype in : dtypes)
      for (moejit_dtype out : dtypes)
        for (const Epilogue& e : kEpilogues)
          for (int64_t hidden : {1, 7, 128, 2880, 4096, 7168, 65536})
            for (int64_t tokens : {1, 33, 64, 65, 4096})
              for (int variant = 0; variant < 3; ++variant) {
                moejit_combine_args a = call(static_cast<moejit_layout>(layout), in, out, tokens,
                                             variant == 2 ? 8 : 2, hidden, e);
                a.accumulate = variant == 1;
                a.scale = variant == 2 ? 0.5f : 1.0f;
                if (variant == 1) {  // padded, element-aligned rows: narrower vectors
                  a.out_row_stride = hidden + 3;
                  if (e.res >= 0) a.residual_row_stride = hidden + 5;
                  a.expert_row_stride = hidden + 1;
                }
                if (variant == 2 && e.fp8 && hidden % 128 == 0) {
                  a.out_scales_layout = MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4;
                  a.out_scales_pow2 = 1;
                }
                if (layout == MOEJIT_LAYOUT_TOKEN_INDEX)
                  a.workspace_bytes = combine_workspace_bytes(&a);
                const std::string what =
                    std::string(layout_name(layout)) + " " + dtype_name(in) + "->" +
                    dtype_name(a.out_dtype) + " " + e.name + " H=" + std::to_string(hidden) +
                    " T=" + std::to_string(tokens) + " variant=" + std::to_string(variant);
                CombinePlan plan;
                try {
                  plan = plan_combine(&a);
                } catch (const Error& err) {
                  ADD_FAILURE() << what << ": " << err.what();
                  continue;
                }
                ++plans;
                const KernelSpec& s = plan.spec;
                ASSERT_TRUE(is_epilogue(s.kind)) << what << ": " << s.describe();
                EXPECT_EQ(s.layout(), layout) << what;
                EXPECT_EQ(check_spec(s), "") << what << ": " << s.describe();
                EXPECT_EQ(s.res_dtype, e.res) << what;
                EXPECT_EQ(s.weight_dtype, e.weight) << what;
                EXPECT_EQ(plan.list_helpers(), layout == MOEJIT_LAYOUT_TOKEN_INDEX) << what;
                EXPECT_EQ(plan.params.residual, a.residual);
                EXPECT_EQ(plan.params.norm_weight, a.norm_weight);
                EXPECT_EQ(plan.params.out_scales, a.out_scales);
                EXPECT_EQ(
                    plan.params.residual_stride,
                    e.res >= 0 ? (a.residual_row_stride ? a.residual_row_stride : hidden) : 0);
                EXPECT_EQ(plan.params.norm_eps, 1e-6f);
                EXPECT_EQ(plan.params.scales_layout, static_cast<int>(a.out_scales_layout));
                EXPECT_EQ(plan.params.scales_pow2, a.out_scales_pow2);
                EXPECT_EQ(plan.params.accumulate, a.accumulate);
                const int64_t groups = (tokens + s.tpb - 1) / s.tpb;
                EXPECT_EQ(plan.combine_grid_y, 1u);
                if (is_cluster_epilogue(s.kind)) {
                  EXPECT_LE(tokens, kDecodeMaxTokens) << what;
                  EXPECT_EQ(plan.combine_grid_x, static_cast<unsigned>(tokens * s.split)) << what;
                  EXPECT_EQ(plan.one_block_grid_x, static_cast<unsigned>(tokens)) << what;
                  EXPECT_EQ(plan.cluster_blocks,
                            e.weight >= 0 ? static_cast<unsigned>(s.split) : 0u)
                      << what;
                } else {
                  EXPECT_EQ(plan.combine_grid_x, static_cast<unsigned>(groups)) << what;
                  EXPECT_EQ(plan.cluster_blocks, 0u) << what;
                }
                if (HasFailure()) return;
              }
  EXPECT_EQ(plans, 3 * 9 * 5 * 7 * 5 * 3);
}

// The geometry over every hidden size and vector width: whole slices of whole warps and whole
// 128-channel groups, up to 32 slot values per thread and 512 threads per token group, blocks of
// at most 1024 threads; at decode a split of at most 8 blocks over a row long enough for two.
TEST(CombineEpilogue, GeometryKeepsTheKernelsRules) {
  for (int hidden = 1; hidden <= MOEJIT_MAX_HIDDEN_DIM; hidden += hidden < 300 ? 1 : 97)
    for (int vec : {1, 2, 4, 8})
      for (int64_t tokens : {int64_t{1}, int64_t{17}, int64_t{33}, int64_t{64}, kAnyTokens}) {
        if (vec > hidden) continue;
        CallShape c;
        c.layout = MOEJIT_LAYOUT_GATHER_MAP;
        c.in_dtype = c.out_dtype = MOEJIT_DTYPE_BFLOAT16;
        c.weight_dtype = MOEJIT_DTYPE_BFLOAT16;
        c.hidden = hidden;
        c.vec = vec;
        c.top_k = 8;
        c.num_tokens = tokens;
        c.num_rows = tokens * 8;
        const KernelSpec s = choose_kernel(c);
        const std::string what = s.describe() + " T=" + std::to_string(tokens);
        ASSERT_EQ(check_spec(s), "") << what;
        ASSERT_LE(s.tpt * s.tpb, 1024) << what;
        ASSERT_EQ(s.tpt * s.tpb % 32, 0) << what;
        ASSERT_LE(s.upt, s.tpt > 256 ? 4 : 8) << what;
        ASSERT_LE(s.upt * s.vec, s.tpt > 256 ? std::max(16, s.vec) : std::max(32, s.vec)) << what;
        ASSERT_LE(s.tpt, 512) << what;
        ASSERT_GE(int64_t{s.split} * s.tpt * s.upt, s.slots()) << what;
        // No slice wholly past the row.
        ASSERT_LT(int64_t{s.split - 1} * s.tpt * s.upt, s.slots()) << what;
        if (is_cluster_epilogue(s.kind)) {
          ASSERT_GE(tokens, 1) << what;
          ASSERT_LE(tokens, kDecodeMaxTokens) << what;
          ASSERT_GE(s.split, 2) << what;
          ASSERT_LE(s.split, 8) << what;
          ASSERT_LE(tokens * s.split, 128) << what;
        }
        if (s.tpt >= 128 / s.vec) {
          ASSERT_EQ(s.tpt % (128 / s.vec), 0) << what;  // whole fp8 groups per slot column
        } else {
          ASSERT_EQ(s.upt, 1) << what;  // a row within one group
          ASSERT_EQ(s.split, 1) << what;
        }
      }
}

// Past decode a row takes 32 fp32 values per thread, 16 (twice the warps) with fp8 output, but
// for a token-index row that would then take a second pass.
TEST(CombineEpilogue, Fp8RowsTakeSixteenValuesPerThreadPastDecode) {
  struct Case {
    moejit_layout layout;
    int hidden;
    moejit_dtype dtype;
    int vec;
    moejit_dtype out;
    int tpt, upt, split;
  };
  const moejit_dtype bf16 = MOEJIT_DTYPE_BFLOAT16, fp32 = MOEJIT_DTYPE_FLOAT32,
                     fp8 = MOEJIT_DTYPE_FLOAT8_E4M3;
  const moejit_layout gm = MOEJIT_LAYOUT_GATHER_MAP, ti = MOEJIT_LAYOUT_TOKEN_INDEX;
  for (const Case& k :
       {Case{gm, 7168, bf16, 8, bf16, 224, 4, 1}, Case{gm, 7168, bf16, 8, fp8, 448, 1, 2},
        Case{ti, 7168, bf16, 8, fp8, 224, 4, 1},  // 16 would take two passes
        Case{gm, 4096, bf16, 8, bf16, 128, 4, 1}, Case{gm, 4096, bf16, 8, fp8, 256, 2, 1},
        Case{ti, 4096, bf16, 8, fp8, 256, 2, 1}, Case{gm, 4096, fp32, 4, fp32, 128, 8, 1},
        Case{gm, 4096, fp32, 4, fp8, 256, 4, 1}}) {
    CallShape c;
    c.layout = k.layout;
    c.in_dtype = k.dtype;
    c.out_dtype = k.out;
    c.res_dtype = c.weight_dtype = k.dtype;
    c.hidden = k.hidden;
    c.vec = k.vec;
    c.top_k = 8;
    c.num_tokens = 4096;
    c.num_rows = 4096 * 8;
    const KernelSpec s = choose_kernel(c);
    EXPECT_FALSE(is_cluster_epilogue(s.kind)) << s.describe();
    EXPECT_EQ(std::vector<int>({s.tpt, s.upt, s.split}), std::vector<int>({k.tpt, k.upt, k.split}))
        << s.describe();
    EXPECT_EQ(check_spec(s), "") << s.describe();
  }
}

// Decode splits a long row over a cluster (about 128 blocks over the batch, 8 at most); past
// kDecodeMaxTokens tokens, or with a row too short to split, a token's row is one block's.
TEST(CombineEpilogue, DecodeSplitsLongRowsAcrossACluster) {
  auto plan_for = [](int64_t tokens, int64_t hidden, const Epilogue& e) {
    const moejit_combine_args a = call(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                       MOEJIT_DTYPE_BFLOAT16, tokens, 8, hidden, e);
    return plan_combine(&a);
  };
  const Epilogue& normed = kEpilogues[1];
  struct Expect {
    int64_t tokens, hidden;
    int split, tpt;
  } cases[] = {{1, 7168, 7, 128},  {16, 7168, 7, 128}, {17, 7168, 4, 224}, {32, 7168, 4, 224},
               {33, 7168, 2, 448}, {64, 4096, 2, 256}, {1, 2880, 6, 64},   {1, 65536, 8, 512}};
  for (const Expect& x : cases) {
    const CombinePlan p = plan_for(x.tokens, x.hidden, normed);
    SCOPED_TRACE(p.spec.describe());
    EXPECT_EQ(p.spec.kind, KernelKind::kEpilogueClusterGatherMap);
    EXPECT_EQ(p.spec.split, x.split);
    EXPECT_EQ(p.spec.tpt, x.tpt);
    EXPECT_EQ(p.cluster_blocks, static_cast<unsigned>(x.split));
    EXPECT_TRUE(needs_cluster(p.spec));
  }
  // Without a norm the split's blocks never meet: no cluster.
  const CombinePlan fp8 = plan_for(1, 7168, kEpilogues[4]);
  EXPECT_EQ(fp8.spec.kind, KernelKind::kEpilogueClusterGatherMap);
  EXPECT_EQ(fp8.cluster_blocks, 0u);
  EXPECT_FALSE(needs_cluster(fp8.spec));
  // One block per token past decode and for short rows.
  EXPECT_EQ(plan_for(65, 7168, normed).spec.kind, KernelKind::kEpilogueGatherMap);
  EXPECT_EQ(plan_for(1, 128, normed).spec.kind, KernelKind::kEpilogueGatherMap);
  EXPECT_EQ(plan_for(4096, 7168, normed).spec.describe(),
            "kind=gather_map_epilogue in=bf16 out=bf16 idx=int32 H=7168 vec=8 K=8 tpt=224 tpb=1 "
            "upt=4 split=1 res=bf16 weight=bf16");
  // Rows too long for one block's registers take passes.
  const KernelSpec long_rows = plan_for(4096, 65536, normed).spec;
  EXPECT_EQ(long_rows.split, 8);  // 8192 slots: 512 threads x 2 slots (16 values) per pass
  EXPECT_EQ(long_rows.tpt, 512);
  EXPECT_EQ(long_rows.upt, 2);
}

// The token index's epilogue runs where the list path's combine would: after the list helpers
// and token_index_heavy, which ranks and sums the tokens past their lists. Its module holds that
// kernel without the finish step (the epilogue adds such a token's sum itself), at
// heavy_kernel_slot: after the combine in the one-block kind's module, after the one-block kernel
// in the cluster kind's. The plan gives it the list path's grid, and the call needs exactly the
// plain token-index call's workspace (a byte less is refused).
TEST(CombineEpilogue, TheTokenIndexEpilogueRunsTokenIndexHeavyWithoutItsFinish) {
  int clustered = 0, one_block = 0;
  for (const Epilogue& e : kEpilogues)
    for (int64_t tokens : {1, 8, 33, 64, 65, 4096})
      for (int64_t top_k : {1, 8, 40})
        for (int64_t hidden : {7, 2880, 7168}) {
          moejit_combine_args a = call(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                       MOEJIT_DTYPE_FLOAT16, tokens, top_k, hidden, e);
          const std::string what = std::string(e.name) + " T=" + std::to_string(tokens) +
                                   " rows=" + std::to_string(a.num_rows) +
                                   " H=" + std::to_string(hidden);
          const CombinePlan plan = plan_combine(&a);
          const KernelSpec& s = plan.spec;
          ASSERT_TRUE(s.kind == KernelKind::kEpilogueTokenIndex ||
                      s.kind == KernelKind::kEpilogueClusterTokenIndex)
              << what << ": " << s.describe();
          ASSERT_TRUE(plan.list_helpers()) << what;
          ASSERT_TRUE(companion_module(s).has_value()) << what;
          EXPECT_EQ(plan.heavy_blocks, static_cast<unsigned>(std::max<int64_t>(
                                           1, std::min<int64_t>(a.num_rows / 128, 512))))
              << what;
          EXPECT_EQ(plan.params.list_capacity, s.list_cap) << what;
          const std::vector<std::string> names = s.name_expressions();
          const int slot = heavy_kernel_slot(s.kind);
          ASSERT_EQ(names.size(), static_cast<size_t>(slot) + 1) << what;
          ASSERT_LE(names.size(), static_cast<size_t>(kMaxKernels)) << what;
          EXPECT_EQ(names[slot], "&moejit::token_index_heavy<2, 2, int, " + std::to_string(hidden) +
                                     ", " + std::to_string(s.vec) + ", false>")
              << what;
          if (is_cluster_epilogue(s.kind)) {
            ++clustered;
            EXPECT_EQ(slot, static_cast<int>(kClusterHeavyKernel));
            EXPECT_EQ(names[kCombineKernel].rfind("&moejit::combine_epilogue_cluster<", 0), 0u);
            EXPECT_EQ(names[kEpilogueOneBlockKernel].rfind("&moejit::combine_epilogue<", 0), 0u);
          } else {
            ++one_block;
            EXPECT_EQ(slot, static_cast<int>(kHeavyKernel));
            EXPECT_EQ(names[kCombineKernel].rfind("&moejit::combine_epilogue<", 0), 0u);
          }
          // The workspace: the plain call's (the same counts, heavy-token parts and lists).
          moejit_combine_args plain = a;
          plain.residual = nullptr;
          plain.norm_weight = nullptr;
          plain.out_scales = nullptr;
          plain.out_dtype = MOEJIT_DTYPE_FLOAT16;
          EXPECT_EQ(combine_workspace_bytes(&a), combine_workspace_bytes(&plain)) << what;
          EXPECT_EQ(plan.params.token_rows, plan_combine(&plain).params.token_rows) << what;
          a.workspace_bytes -= 1;
          try {
            plan_combine(&a);
            ADD_FAILURE() << what << ": a workspace a byte short was taken";
          } catch (const Error& err) {
            EXPECT_EQ(err.status(), MOEJIT_ERROR_WORKSPACE_TOO_SMALL) << what;
            EXPECT_NE(std::string(err.what()).find("args->workspace"), std::string::npos);
          }
          if (HasFailure()) return;
        }
  EXPECT_GT(clustered, 0);
  EXPECT_GT(one_block, 0);
  // The other layouts' epilogue modules have no token_index_heavy.
  for (moejit_layout layout : {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP})
    for (int64_t tokens : {1, 4096}) {
      const moejit_combine_args a = call(layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                                         tokens, 8, 7168, kEpilogues[1]);
      const CombinePlan plan = plan_combine(&a);
      EXPECT_FALSE(plan.list_helpers());
      for (const std::string& name : plan.spec.name_expressions())
        EXPECT_EQ(name.find("token_index_heavy"), std::string::npos) << name;
    }
}

// The vector width also fits the residual (row starts and element size) and the weight.
TEST(CombineEpilogue, TheResidualAndWeightNarrowTheVector) {
  moejit_combine_args a = call(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                               MOEJIT_DTYPE_BFLOAT16, 4096, 8, 7168, kEpilogues[1]);
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
  a.residual = at(5, 4);  // 2 bf16 elements in: 8-byte vectors
  EXPECT_EQ(plan_combine(&a).spec.vec, 2);
  a.residual = at(5);
  a.residual_row_stride = 7168 + 4;
  EXPECT_EQ(plan_combine(&a).spec.vec, 4);
  a.residual_row_stride = 0;
  a.norm_weight = at(6, 2);
  EXPECT_EQ(plan_combine(&a).spec.vec, 1);
  a.norm_weight = at(6);
  a.residual_dtype = MOEJIT_DTYPE_FLOAT32;  // 16 bytes of fp32: 4 elements
  EXPECT_EQ(plan_combine(&a).spec.vec, 4);
  a.residual_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.out_dtype = MOEJIT_DTYPE_FLOAT8_E4M3;
  a.out_scales = static_cast<float*>(at(7));
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
  a.out = at(4, 4);  // fp8 out 4 bytes in: 4-byte vectors
  EXPECT_EQ(plan_combine(&a).spec.vec, 4);
  EXPECT_EQ(epilogue_vec(8, 7168, -1, 0, 0, -1, 0), 8);
  EXPECT_EQ(epilogue_vec(8, 3, -1, 0, 0, -1, 0), 2);
}

// The text form: describe() and parse_kernel_spec agree on every epilogue kind, and a line with a
// value the kernels cannot take is refused naming it.
TEST(CombineEpilogue, SpecsRoundTripThroughTheirTextForm) {
  auto fields = [](const std::string& line) {
    std::map<std::string, std::string> kv;
    size_t start = 0;
    while (start < line.size()) {
      size_t end = line.find(' ', start);
      if (end == std::string::npos) end = line.size();
      const std::string word = line.substr(start, end - start);
      kv[word.substr(0, word.find('='))] = word.substr(word.find('=') + 1);
      start = end + 1;
    }
    return kv;
  };
  int seen = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (const Epilogue& e : kEpilogues)
      for (int64_t tokens : {1, 4096}) {
        const moejit_combine_args a =
            call(static_cast<moejit_layout>(layout), MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT16,
                 tokens, 8, 7168, e);
        const KernelSpec s = plan_combine(&a).spec;
        KernelSpec parsed = parse_kernel_spec(fields(s.describe()));
        finish_spec(&parsed);
        EXPECT_EQ(parsed, s) << s.describe();
        EXPECT_EQ(check_spec(parsed), "");
        ++seen;
      }
  EXPECT_EQ(seen, 30);
  const std::string line =
      "kind=gather_map_epilogue in=bf16 out=fp8 idx=int32 H=7168 vec=8 K=8 tpt=224 tpb=1 upt=4 "
      "split=1 res=bf16 weight=none";
  EXPECT_NO_THROW(parse_kernel_spec(fields(line)));
  auto refused = [&](const std::string& key, const std::string& value) {
    auto kv = fields(line);
    kv[key] = value;
    try {
      parse_kernel_spec(kv);
    } catch (const std::invalid_argument& err) {
      return std::string(err.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused("res", "fp8").find("res = \"fp8\": expected none, fp32, fp16 or bf16"),
            std::string::npos);
  EXPECT_NE(refused("in", "fp8").find("in = \"fp8\""), std::string::npos);
  EXPECT_NE(refused("split", "0").find("split = 0"), std::string::npos);
  EXPECT_NE(refused("upt", "33").find("upt = 33"), std::string::npos);
  auto cluster = fields(line);
  cluster["kind"] = "gather_map_epilogue_cluster";
  cluster["split"] = "9";
  EXPECT_THROW(parse_kernel_spec(cluster), std::invalid_argument);
  // Without the epilogue fields, out=fp8 is no plain combine's.
  auto plain = fields(
      "kind=gather_map in=bf16 out=fp8 idx=int32 H=7168 vec=8 K=8 tpt=128 tpb=1 "
      "upt=1");
  EXPECT_THROW(parse_kernel_spec(plain), std::invalid_argument);
  // check_spec names what the kernels cannot run.
  KernelSpec nothing = parse_kernel_spec(fields(line));
  nothing.res_dtype = -1;
  nothing.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  EXPECT_NE(
      check_spec(nothing).find("an epilogue kind has a residual, a norm weight or an fp8 out"),
      std::string::npos);
  KernelSpec short_slices = parse_kernel_spec(fields(line));
  short_slices.upt = 3;
  EXPECT_NE(check_spec(short_slices).find("do not cover the row"), std::string::npos);
  KernelSpec odd_groups = parse_kernel_spec(fields(line));
  odd_groups.tpt = 200;
  EXPECT_NE(check_spec(odd_groups).find("whole warps"), std::string::npos);
}

// The epilogue's fields are part of the module: a spec that differs in one of them alone is
// another module (equality, hash, text form, and so the cache key).
TEST(CombineEpilogue, ItsFieldsAreInEqualityHashAndText) {
  const moejit_combine_args a = call(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                     MOEJIT_DTYPE_BFLOAT16, 4096, 8, 7168, kEpilogues[1]);
  const KernelSpec base = plan_combine(&a).spec;
  for (auto field : {&KernelSpec::res_dtype, &KernelSpec::weight_dtype, &KernelSpec::split}) {
    KernelSpec other = base;
    other.*field += 1;
    EXPECT_NE(other, base);
    EXPECT_NE(other.hash(), base.hash());
    EXPECT_NE(other.describe(), base.describe());
    EXPECT_NE(other.source(), base.source());
  }
  KernelSpec fp8 = base;
  fp8.out_dtype = MOEJIT_DTYPE_FLOAT8_E4M3;
  EXPECT_NE(fp8.describe(), base.describe());
  EXPECT_NE(fp8.name_expressions(), base.name_expressions());
}

}  // namespace
}  // namespace moejit
