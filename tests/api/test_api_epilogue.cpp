// The epilogue's fields at the C boundary (moejit.h, since 0.3): every bad value has its status and
// a message naming the argument, its value and what is allowed, before anything is launched; the
// 0.1 and 0.2 struct sizes still work and never read the new fields; the defaults. Runs without a
// GPU: the calls that would launch stop at the driver (skipped where one is present, since their
// pointers are fake).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>

#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace {

constexpr auto fake = &moejit_test::fake_address;
// Regions of the epilogue's buffers, apart from fake_combine_args.h's.
constexpr uintptr_t kFakeResidual = 0x7f0050000000;
constexpr uintptr_t kFakeWeight = 0x7f0060000000;
constexpr uintptr_t kFakeScales = 0x7f0070000000;
constexpr uintptr_t kFakeWorkspace = 0x7f0080000000;
constexpr size_t kArgsSizeV02 = offsetof(moejit_combine_args, residual);
constexpr size_t kArgsSizeV01 = offsetof(moejit_combine_args, dependent_launch);
using moejit_test::driver_present;
using moejit_test::set_c_enum;

// A valid gather-map combine (T 33, K 2, H 4096, bf16, gates) with a bf16 residual and norm
// weight: the rows of out (and of the residual) span 0x42000 bytes.
moejit_combine_args normed_args() {
  moejit_combine_args a = moejit_test::fake_gather_map_args(33, 2, 4096);
  a.gates = static_cast<const float*>(fake(moejit_test::kFakeGates));
  a.residual = fake(kFakeResidual);
  a.residual_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.norm_weight = fake(kFakeWeight);
  a.norm_weight_dtype = MOEJIT_DTYPE_BFLOAT16;
  return a;
}

// The same with an fp8 out and its row-major scales.
moejit_combine_args fp8_args() {
  moejit_combine_args a = normed_args();
  a.out_dtype = MOEJIT_DTYPE_FLOAT8_E4M3;
  a.out_scales = static_cast<float*>(fake(kFakeScales));
  return a;
}

struct BadCase {
  const char* name;
  std::function<moejit_combine_args()> make;
  std::string message_part;  // the argument named, its value, what is allowed
};

void PrintTo(const BadCase& c, std::ostream* os) {
  *os << c.name;
}

class EpilogueArgumentErrors : public ::testing::TestWithParam<BadCase> {};

TEST_P(EpilogueArgumentErrors, AreRefusedWithTheirMessage) {
  const BadCase& c = GetParam();
  const moejit_combine_args a = c.make();
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT) << moejit_last_error_message();
  const std::string message = moejit_last_error_message();
  EXPECT_NE(message.find(c.message_part), std::string::npos) << message;
}

// Each case: a valid call changed in one field.
template <typename Change>
std::function<moejit_combine_args()> with(moejit_combine_args (*base)(), Change change) {
  return [base, change] {
    moejit_combine_args a = base();
    change(a);
    return a;
  };
}

const BadCase kBadCases[] = {
    {"expert_dtype_fp8", with(normed_args, [](auto& a) { set_c_enum(a.expert_dtype, 3); }),
     "args->expert_dtype = 3: must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or "
     "MOEJIT_DTYPE_BFLOAT16 (2) (MOEJIT_DTYPE_FLOAT8_E4M3 is an out_dtype only)"},
    {"fp8_out_without_scales", with(fp8_args, [](auto& a) { a.out_scales = nullptr; }),
     "args->out_scales = NULL: must be a device pointer (fp32, one scale per token per 128 "
     "channels) for an fp8 out"},
    {"scales_without_fp8_out",
     with(normed_args, [](auto& a) { a.out_scales = static_cast<float*>(fake(kFakeScales)); }),
     "args->out_scales = 0x7f0070000000: must be NULL: out_dtype is bf16; only an fp8 out"},
    {"scales_layout_past_last", with(fp8_args, [](auto& a) { set_c_enum(a.out_scales_layout, 2); }),
     "args->out_scales_layout = 2: must be MOEJIT_SCALES_ROW_MAJOR (0) or "
     "MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 (1)"},
    {"scales_layout_negative", with(fp8_args, [](auto& a) { set_c_enum(a.out_scales_layout, -1); }),
     "args->out_scales_layout = -1"},
    {"column_major_scales_need_whole_groups",
     with(fp8_args,
          [](auto& a) {
            a.out_scales_layout = MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4;
            a.hidden_dim = 4000;
          }),
     "args->out_scales_layout = MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 (1) with hidden_dim = 4000: "
     "needs hidden_dim % 128 == 0"},
    {"scales_pow2", with(fp8_args, [](auto& a) { a.out_scales_pow2 = 2; }),
     "args->out_scales_pow2 = 2: must be 0 (scale = amax / 448) or 1"},
    {"residual_dtype_fp8", with(normed_args, [](auto& a) { set_c_enum(a.residual_dtype, 3); }),
     "args->residual_dtype = 3: must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or "
     "MOEJIT_DTYPE_BFLOAT16 (2)"},
    {"residual_dtype_negative",
     with(normed_args, [](auto& a) { set_c_enum(a.residual_dtype, -1); }),
     "args->residual_dtype = -1"},
    {"residual_stride", with(normed_args, [](auto& a) { a.residual_row_stride = 100; }),
     "args->residual_row_stride = 100: must be 0 (= hidden_dim) or >= hidden_dim = 4096"},
    {"residual_stride_negative", with(normed_args, [](auto& a) { a.residual_row_stride = -1; }),
     "args->residual_row_stride = -1"},
    {"residual_stride_huge",
     with(normed_args, [](auto& a) { a.residual_row_stride = int64_t{1} << 60; }),
     "args->residual_row_stride = 1152921504606846976: is too large: num_tokens = 33 rows"},
    {"norm_weight_dtype_fp8",
     with(normed_args, [](auto& a) { set_c_enum(a.norm_weight_dtype, 3); }),
     "args->norm_weight_dtype = 3: must be MOEJIT_DTYPE_FLOAT32 (0)"},
    {"norm_eps_nan", with(normed_args, [](auto& a) { a.norm_eps = std::nanf(""); }),
     "args->norm_eps = nan: must be a finite number >= 0"},
    {"norm_eps_negative", with(normed_args, [](auto& a) { a.norm_eps = -1e-6f; }),
     "args->norm_eps = -0.000001: must be a finite number >= 0"},
    {"norm_eps_infinite", with(normed_args, [](auto& a) { a.norm_eps = INFINITY; }),
     "args->norm_eps = inf"},
    {"residual_misaligned",
     with(normed_args, [](auto& a) { a.residual = fake(kFakeResidual + 1); }),
     "args->residual = 0x7f0050000001: must be aligned to its element size (2 bytes for bf16)"},
    {"norm_weight_misaligned",
     with(normed_args,
          [](auto& a) {
            a.norm_weight_dtype = MOEJIT_DTYPE_FLOAT32;
            a.norm_weight = fake(kFakeWeight + 2);
          }),
     "args->norm_weight = 0x7f0060000002: must be aligned to its element size (4 bytes for fp32)"},
    {"out_scales_misaligned",
     with(fp8_args, [](auto& a) { a.out_scales = static_cast<float*>(fake(kFakeScales + 2)); }),
     "args->out_scales = 0x7f0070000002: must be aligned to its element size (4 bytes for fp32 "
     "scales)"},
    // Written buffers against every other: the residual is read and written in place.
    {"residual_aliases_out", with(normed_args, [](auto& a) { a.residual = a.out; }),
     "args->out = [0x7f0030000000, 0x7f0030042000): overlaps args->residual [0x7f0030000000, "
     "0x7f0030042000)"},
    {"residual_overlaps_last_out_row",
     with(normed_args, [](auto& a) { a.residual = fake(moejit_test::kFakeOut + 0x41ffe); }),
     "args->out = [0x7f0030000000, 0x7f0030042000): overlaps args->residual"},
    {"residual_overlaps_expert",
     with(normed_args, [](auto& a) { a.residual = fake(moejit_test::kFakeExpert + 4096); }),
     "args->residual = [0x7f0000001000, 0x7f0000043000): overlaps args->expert_hidden"},
    {"residual_overlaps_gates",
     with(normed_args, [](auto& a) { a.residual = fake(moejit_test::kFakeGates - 0x41000); }),
     "overlaps args->gates"},
    {"residual_overlaps_map",
     with(normed_args, [](auto& a) { a.residual = fake(moejit_test::kFakeIndices + 0x100); }),
     "args->residual = [0x7f0020000100, 0x7f0020042100): overlaps args->indices"},
    {"residual_overlaps_norm_weight",
     with(normed_args, [](auto& a) { a.norm_weight = fake(kFakeResidual + 0x1000); }),
     "args->residual = [0x7f0050000000, 0x7f0050042000): overlaps args->norm_weight"},
    // A padded residual row stride counts its padding.
    {"residual_padding_overlaps_out",
     with(normed_args,
          [](auto& a) {
            a.residual_row_stride = 8192;
            a.residual = fake(moejit_test::kFakeOut - 32 * 8192 * 2 - 100);
          }),
     "overlaps args->residual"},
    {"out_overlaps_norm_weight",
     with(normed_args, [](auto& a) { a.norm_weight = fake(moejit_test::kFakeOut + 0x2000); }),
     "args->out = [0x7f0030000000, 0x7f0030042000): overlaps args->norm_weight"},
    // fp8 out: 33 rows of 4096 bytes; row-major scales: 33 * 32 floats.
    {"scales_overlap_out",
     with(fp8_args,
          [](auto& a) {
            a.out_scales = static_cast<float*>(fake(moejit_test::kFakeOut + 0x20ffc));
          }),
     "args->out = [0x7f0030000000, 0x7f0030021000): overlaps args->out_scales [0x7f0030020ffc, "
     "0x7f003002207c)"},
    {"scales_overlap_residual",
     with(fp8_args,
          [](auto& a) { a.out_scales = static_cast<float*>(fake(kFakeResidual + 0x41000)); }),
     "args->residual = [0x7f0050000000, 0x7f0050042000): overlaps args->out_scales"},
    {"scales_overlap_norm_weight",
     with(fp8_args, [](auto& a) { a.norm_weight = fake(kFakeScales + 0x1000); }),
     "args->out_scales = [0x7f0070000000, 0x7f0070001080): overlaps args->norm_weight"},
    {"scales_overlap_expert",
     with(fp8_args,
          [](auto& a) {
            a.out_scales = static_cast<float*>(fake(moejit_test::kFakeExpert + 0x83ffc));
          }),
     "args->out_scales = [0x7f0000083ffc, 0x7f000008507c): overlaps args->expert_hidden"},
    // Column-major: G = 32 columns of T4 = 36 floats, the last one's to token 32: the scales end
    // at (31 * 36 + 33) * 4 = 0x11f4 bytes.
    {"column_major_scales_overlap_out",
     with(fp8_args,
          [](auto& a) {
            a.out_scales_layout = MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4;
            a.out_scales = static_cast<float*>(fake(moejit_test::kFakeOut - 0x11f0));
          }),
     "args->out = [0x7f0030000000, 0x7f0030021000): overlaps args->out_scales [0x7f002fffee10, "
     "0x7f0030000004)"},
    {"workspace_overlaps_residual",
     with(normed_args,
          [](auto& a) {
            a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
            a.workspace = fake(kFakeResidual + 0x40000);
            a.workspace_bytes = 1 << 20;
          }),
     "args->workspace = [0x7f0050040000, 0x7f0050045400): overlaps args->residual"},
    {"workspace_overlaps_scales",
     with(fp8_args,
          [](auto& a) {
            a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
            a.workspace = fake(kFakeScales - 0x100);
            a.workspace_bytes = 1 << 20;
          }),
     "overlaps args->out_scales"},
};

std::string case_name(const ::testing::TestParamInfo<BadCase>& param_info) {
  return param_info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Api, EpilogueArgumentErrors, ::testing::ValuesIn(kBadCases), case_name);

// Accepted calls reach the driver: without one, MOEJIT_ERROR_DRIVER_NOT_FOUND says the arguments
// passed. (Where a driver is present the fake pointers must not be launched on.)
void expect_accepted(const moejit_combine_args& a, const char* what) {
  if (driver_present()) GTEST_SKIP() << "a driver is present: these fake pointers must not launch";
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_DRIVER_NOT_FOUND)
      << what << ": " << moejit_last_error_message();
}

// The norm weight is only read: it may share bytes with the inputs (the rows, routing, gates).
TEST(ApiEpilogue, TheNormWeightMayShareTheInputs) {
  moejit_combine_args a = normed_args();
  a.norm_weight = fake(moejit_test::kFakeExpert + 4096);
  expect_accepted(a, "weight inside the expert rows");
  a.norm_weight = fake(moejit_test::kFakeGates);
  expect_accepted(a, "weight on the gates");
}

// What is not set is not checked: a residual_dtype, stride or weight dtype without their buffer,
// scales' fields without an fp8 out.
TEST(ApiEpilogue, FieldsOfWhatIsNotSetAreNotChecked) {
  moejit_combine_args a = moejit_test::fake_gather_map_args(33, 2, 4096);
  set_c_enum(a.residual_dtype, 77);
  a.residual_row_stride = -5;
  set_c_enum(a.norm_weight_dtype, -3);
  a.norm_eps = std::nanf("");
  set_c_enum(a.out_scales_layout, 9);
  a.out_scales_pow2 = 4;
  size_t bytes = 1;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS)
      << moejit_last_error_message();
  EXPECT_EQ(bytes, 0u);
  expect_accepted(a, "no epilogue");
}

// Every epilogue the header describes, with the token index too: a valid call.
TEST(ApiEpilogue, ValidEpiloguesAreAccepted) {
  moejit_combine_args a = normed_args();
  expect_accepted(a, "residual + norm");
  a = fp8_args();
  expect_accepted(a, "residual + norm + fp8");
  a.out_scales_layout = MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4;
  a.out_scales_pow2 = 1;
  expect_accepted(a, "column-major power-of-two scales");
  a.residual = nullptr;
  expect_accepted(a, "norm + fp8, no residual");
  a.norm_weight = nullptr;
  expect_accepted(a, "fp8 alone");
  a = normed_args();
  a.norm_weight = nullptr;
  a.accumulate = 1;
  a.residual_dtype = MOEJIT_DTYPE_FLOAT32;
  a.residual_row_stride = 4100;
  expect_accepted(a, "residual alone, fp32, padded rows, accumulating");
  a.norm_eps = 0.0f;  // unused without a norm; 0 is valid with one too
  a.norm_weight = fake(kFakeWeight);
  expect_accepted(a, "eps 0");
  // An fp8 call with no tokens writes nothing and needs no scales.
  a = fp8_args();
  a.num_tokens = 0;
  a.num_rows = 0;
  a.out_scales = nullptr;
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
}

// A caller built against the 0.2 header passes the struct that ends before residual: accepted,
// and nothing past its end is read (here: invalid epilogue values that would be refused).
TEST(ApiEpilogue, ArgsFromA02HeaderIgnoreTheEpilogueFields) {
  moejit_combine_args a = moejit_test::fake_gather_map_args(33, 2, 4096);
  a.residual = fake(kFakeResidual + 1);  // misaligned
  set_c_enum(a.residual_dtype, 9);
  a.norm_weight = fake(kFakeWeight);
  a.norm_eps = -1.0f;
  for (size_t size : {kArgsSizeV02, kArgsSizeV01}) {
    a.struct_size = size;
    size_t bytes = 1;
    EXPECT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS)
        << size << ": " << moejit_last_error_message();
  }
  a.struct_size = sizeof(a);
  size_t bytes = 1;
  EXPECT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("args->residual_dtype = 9"),
            std::string::npos)
      << moejit_last_error_message();
  a.struct_size = kArgsSizeV02;
  expect_accepted(a, "0.2 struct");
}

// moejit_combine_args_init_sized takes the 0.1, 0.2 and 0.3 sizes and writes no more than it is
// told; the 0.3 defaults turn the epilogue off.
TEST(ApiEpilogue, InitTakesEveryReleasedSizeAndSetsTheDefaults) {
  struct Padded {
    moejit_combine_args args;
    unsigned char after[16];
  };
  for (size_t size : {kArgsSizeV01, kArgsSizeV02, sizeof(moejit_combine_args)}) {
    SCOPED_TRACE(size);
    Padded p;
    std::memset(&p, 0xAB, sizeof(p));
    ASSERT_EQ(moejit_combine_args_init_sized(&p.args, size), MOEJIT_SUCCESS);
    EXPECT_EQ(p.args.struct_size, size);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&p);
    for (size_t i = size; i < sizeof(p); ++i)
      ASSERT_EQ(bytes[i], 0xAB) << "byte " << i << " past the struct was written";
  }
  moejit_combine_args a;
  ASSERT_EQ(moejit_combine_args_init(&a), MOEJIT_SUCCESS);
  EXPECT_EQ(a.residual, nullptr);
  EXPECT_EQ(a.residual_dtype, MOEJIT_DTYPE_FLOAT32);
  EXPECT_EQ(a.residual_row_stride, 0);
  EXPECT_EQ(a.norm_weight, nullptr);
  EXPECT_EQ(a.norm_weight_dtype, MOEJIT_DTYPE_FLOAT32);
  EXPECT_EQ(a.norm_eps, 1e-6f);
  EXPECT_EQ(a.out_scales, nullptr);
  EXPECT_EQ(a.out_scales_layout, MOEJIT_SCALES_ROW_MAJOR);
  EXPECT_EQ(a.out_scales_pow2, 0);
  const moejit_combine_args init = MOEJIT_COMBINE_ARGS_INIT;
  EXPECT_EQ(init.struct_size, sizeof(moejit_combine_args));
  EXPECT_EQ(init.residual, a.residual);
  EXPECT_EQ(init.norm_eps, a.norm_eps);
  EXPECT_EQ(init.out_scales_layout, a.out_scales_layout);
  EXPECT_EQ(init.out_scales_pow2, a.out_scales_pow2);
  EXPECT_EQ(init.dependent_launch, a.dependent_launch);
  // The ABI rule (abi/README.md): the first field of 0.3 is 8-byte aligned, right at 0.2's end.
  EXPECT_EQ(kArgsSizeV02 % 8, 0u);
  EXPECT_GT(sizeof(moejit_combine_args), kArgsSizeV02);
  // Sizes between the released ones are refused, naming all three.
  EXPECT_EQ(moejit_combine_args_init_sized(&a, kArgsSizeV02 + 8), MOEJIT_ERROR_INVALID_ARGUMENT);
  const std::string message = moejit_last_error_message();
  EXPECT_NE(message.find(std::to_string(kArgsSizeV02) + " for 0.2"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kArgsSizeV01) + " for 0.1"), std::string::npos) << message;
  a.struct_size = kArgsSizeV02 + 8;
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("from a 0.2 header"), std::string::npos)
      << moejit_last_error_message();
}

// The token index's workspace does not depend on the epilogue.
TEST(ApiEpilogue, TheWorkspaceIsTheCombinesAlone) {
  moejit_combine_args a = fp8_args();
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  size_t with = 0, without = 0;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &with), MOEJIT_SUCCESS);
  a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.residual = nullptr;
  a.norm_weight = nullptr;
  a.out_scales = nullptr;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &without), MOEJIT_SUCCESS);
  EXPECT_EQ(with, without);
  EXPECT_GT(with, 0u);
  a = fp8_args();
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = fake(kFakeWorkspace);
  a.workspace_bytes = with;
  expect_accepted(a, "token index with the epilogue");
}

}  // namespace
