// The C boundary: every argument error has its own status and a message naming the argument, its
// value and what is allowed; status names and descriptions; per-thread messages; versions;
// runtime options; and what happens with no driver. Runs without a GPU (the cases that would
// launch are skipped where a driver is present, since their pointers are fake).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace {

constexpr auto fake = &moejit_test::fake_address;
using moejit_test::driver_present;
using moejit_test::set_c_enum;

// Turns a into a token-index call whose (1 MB) workspace starts at the fake address `at`.
void token_index_workspace_at(moejit_combine_args& a, uintptr_t at) {
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.workspace = fake(at);
  a.workspace_bytes = 1 << 20;
}

// A valid gather-map combine on (fake, well aligned) device pointers, with gates.
moejit_combine_args valid_args() {
  moejit_combine_args a = moejit_test::fake_gather_map_args(33, 2, 4096);
  a.gates = static_cast<const float*>(fake(moejit_test::kFakeGates));
  return a;
}

struct BadCase {
  const char* name;
  std::function<void(moejit_combine_args&)> mutate;
  moejit_status expected;
  std::string message_part;  // the argument named, or the allowed values
};

// gtest prints a parameter without a printer as its bytes (pointers included), and
// gtest_discover_tests puts that into every ctest name: 340-character names that change with
// each build. The case name instead.
void PrintTo(const BadCase& c, std::ostream* os) {
  *os << c.name;
}

class ArgumentErrors : public ::testing::TestWithParam<BadCase> {};

TEST_P(ArgumentErrors, HaveTheirOwnStatusAndMessage) {
  const BadCase& c = GetParam();
  moejit_combine_args a = valid_args();
  c.mutate(a);
  EXPECT_EQ(moe_combine(&a, nullptr), c.expected) << moejit_last_error_message();
  const std::string message = moejit_last_error_message();
  EXPECT_NE(message.find(c.message_part), std::string::npos) << message;
}

const BadCase kBadCases[] = {
    {"struct_size", [](auto& a) { a.struct_size = 8; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->struct_size = 8"},
    {"layout", [](auto& a) { set_c_enum(a.layout, 7); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->layout = 7: must be MOEJIT_LAYOUT_TOKEN_MAJOR"},
    {"expert_dtype", [](auto& a) { set_c_enum(a.expert_dtype, 3); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->expert_dtype = 3"},
    {"out_dtype", [](auto& a) { set_c_enum(a.out_dtype, -1); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->out_dtype = -1"},
    {"index_type", [](auto& a) { set_c_enum(a.index_type, 2); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "MOEJIT_INDEX_INT32 (0) or MOEJIT_INDEX_INT64 (1)"},
    {"num_tokens", [](auto& a) { a.num_tokens = -1; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->num_tokens = -1: must be in 0..1099511627776 (2^40)"},
    {"hidden_zero", [](auto& a) { a.hidden_dim = 0; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->hidden_dim = 0: must be in 1..65536"},
    {"hidden_huge", [](auto& a) { a.hidden_dim = 65537; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->hidden_dim = 65537"},
    {"top_k_zero", [](auto& a) { a.top_k = 0; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->top_k = 0: must be in 1..64"},
    {"top_k_huge", [](auto& a) { a.top_k = 65; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->top_k = 65"},
    {"num_rows_negative", [](auto& a) { a.num_rows = -5; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->num_rows = -5"},
    {"num_rows_token_major",
     [](auto& a) {
       a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
       a.num_rows = 5;
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "must be 0 or num_tokens * top_k = 66"},
    {"num_rows_too_many", [](auto& a) { a.num_rows = 1ll << 31; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->num_rows = 2147483648"},
    // Past 2^40 tokens every size derived from T (slots, lists, workspace bytes) could overflow.
    {"num_tokens_huge", [](auto& a) { a.num_tokens = 1ll << 62; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->num_tokens = 4611686018427387904: must be in 0..1099511627776 (2^40)"},
    {"expert_stride_huge", [](auto& a) { a.expert_row_stride = 1ll << 60; },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->expert_row_stride = 1152921504606846976: is too large: num_rows = 66 rows"},
    {"out_stride_huge", [](auto& a) { a.out_row_stride = INT64_MAX; },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->out_row_stride = 9223372036854775807: is too large"},
    {"expert_stride", [](auto& a) { a.expert_row_stride = 100; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->expert_row_stride = 100: must be 0 (= hidden_dim) or >= hidden_dim = 4096"},
    {"out_stride", [](auto& a) { a.out_row_stride = -3; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->out_row_stride = -3"},
    {"out_null", [](auto& a) { a.out = nullptr; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->out = NULL"},
    {"expert_null", [](auto& a) { a.expert_hidden = nullptr; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->expert_hidden = NULL"},
    {"indices_null", [](auto& a) { a.indices = nullptr; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->indices = NULL: must be a device pointer (the gather map, num_tokens * top_k"},
    // With no rows every map entry is dropped, but the kernels still read the T * K entries.
    {"indices_null_no_rows",
     [](auto& a) {
       a.num_rows = 0;
       a.expert_hidden = nullptr;
       a.indices = nullptr;
     },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->indices = NULL: must be a device pointer (the gather map"},
    {"token_idx_null",
     [](auto& a) {
       a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
       a.indices = nullptr;
     },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->indices = NULL: must be a device pointer (the token_idx)"},
    // Buffers the kernels read while they write out (or the workspace): a race, refused.
    {"out_overlaps_expert", [](auto& a) { a.out = fake(0x7f0000000000 + 65 * 4096 * 2); },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "overlaps args->expert_hidden [0x7f0000000000, 0x7f0000084000)"},
    {"out_overlaps_gates", [](auto& a) { a.out = fake(0x7f0010000000 - 4096 * 2 * 33 + 8); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->gates"},
    {"out_overlaps_map", [](auto& a) { a.out = fake(0x7f0020000000); },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->out = [0x7f0020000000, 0x7f0020042000): overlaps "
     "args->indices"},
    {"out_wraps_past_the_address_space",
     [](auto& a) {
       a.out = fake(0xfffffffffffff000);
       a.expert_hidden = fake(0x1000);
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "past the end of the 64-bit address space"},
    {"workspace_overlaps_out", [](auto& a) { token_index_workspace_at(a, 0x7f0030000000 + 4096); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->workspace = [0x7f0030001000"},
    {"expert_misaligned", [](auto& a) { a.expert_hidden = fake(0x7f0000000001); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->expert_hidden = 0x7f0000000001: must be aligned"},
    {"out_misaligned",
     [](auto& a) {
       a.out_dtype = MOEJIT_DTYPE_FLOAT32;
       a.out = fake(0x7f0030000002);
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "4 bytes for fp32"},
    {"gates_misaligned", [](auto& a) { a.gates = static_cast<const float*>(fake(0x7f0010000002)); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->gates"},
    {"indices_misaligned",
     [](auto& a) {
       a.index_type = MOEJIT_INDEX_INT64;
       a.indices = fake(0x7f0020000004);
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "8 bytes for int64 indices"},
    {"accumulate", [](auto& a) { a.accumulate = 2; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->accumulate = 2: must be 0 (overwrite out) or 1 (add into out)"},
    {"scale_nan", [](auto& a) { a.scale = std::nanf(""); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->scale"},
    {"dependent_launch", [](auto& a) { a.dependent_launch = 2; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->dependent_launch = 2: must be 0 (plain launch) or 1 (programmatic dependent launch)"},
    {"struct_size_between",
     [](auto& a) { a.struct_size = offsetof(moejit_combine_args, dependent_launch) + 4; },
     MOEJIT_ERROR_INVALID_ARGUMENT, "from a 0.1 header"},
    {"workspace_missing",
     [](auto& a) {
       a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
       a.workspace = nullptr;
     },
     MOEJIT_ERROR_WORKSPACE_TOO_SMALL, "moejit_combine_workspace_size"},
    {"workspace_small",
     [](auto& a) {
       a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
       a.workspace = fake(0x7f0040000000);
       a.workspace_bytes = 16;
     },
     MOEJIT_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes = 16"},
    // One past each bound, and the other side of each range (the limits themselves are accepted:
    // tests/unit/test_combine_args.cpp).
    {"struct_size_larger", [](auto& a) { a.struct_size = sizeof(moejit_combine_args) + 8; },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->struct_size = " + std::to_string(sizeof(moejit_combine_args) + 8) +
         ": must be sizeof(moejit_combine_args)"},
    {"layout_past_last", [](auto& a) { set_c_enum(a.layout, 3); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->layout = 3: must be MOEJIT_LAYOUT_TOKEN_MAJOR"},
    {"layout_negative", [](auto& a) { set_c_enum(a.layout, -1); }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->layout = -1"},
    {"expert_dtype_negative", [](auto& a) { set_c_enum(a.expert_dtype, -1); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->expert_dtype = -1: must be MOEJIT_DTYPE_FLOAT32 (0)"},
    {"out_dtype_past_last", [](auto& a) { set_c_enum(a.out_dtype, 4); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->out_dtype = 4: must be MOEJIT_DTYPE_FLOAT32 (0)"},
    {"index_type_negative", [](auto& a) { set_c_enum(a.index_type, -1); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->index_type = -1"},
    {"num_tokens_past_max", [](auto& a) { a.num_tokens = MOEJIT_MAX_NUM_TOKENS + 1; },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->num_tokens = 1099511627777: must be in 0..1099511627776"},
    {"dependent_launch_negative", [](auto& a) { a.dependent_launch = -1; },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->dependent_launch = -1"},
    {"accumulate_negative", [](auto& a) { a.accumulate = -1; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->accumulate = -1: must be 0 (overwrite out) or 1 (add into out)"},
    {"scale_infinite", [](auto& a) { a.scale = INFINITY; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->scale = inf: must be a finite number"},
    {"scale_minus_infinite", [](auto& a) { a.scale = -INFINITY; }, MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->scale = -inf: must be a finite number"},
    // One row of 2^61 + 1 bf16 elements: 2^62 + 2 bytes (the element size counts).
    {"expert_stride_past_extent",
     [](auto& a) {
       a.num_rows = 1;
       a.expert_row_stride = (int64_t{1} << 61) + 1;
     },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->expert_row_stride = 2305843009213693953: is too large: num_rows = 1 rows of that many "
     "bf16 elements span more than 2^62 bytes"},
    // The token-major rows (num_rows 0: num_tokens * top_k of them) are read: there must be some.
    {"expert_null_token_major",
     [](auto& a) {
       a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
       a.num_rows = 0;
       a.expert_hidden = nullptr;
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "args->expert_hidden = NULL"},
    // The gather map has num_tokens * top_k entries whatever num_rows is: out placed on its last
    // entries overlaps it.
    {"out_overlaps_map_past_num_rows",
     [](auto& a) {
       a.num_rows = 1;
       a.out = fake(moejit_test::kFakeIndices + 65 * 4);
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->indices"},
    {"out_overlaps_last_gate", [](auto& a) { a.out = fake(moejit_test::kFakeGates + 65 * 4); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->gates"},
    {"out_overlaps_last_int64_index",
     [](auto& a) {
       a.index_type = MOEJIT_INDEX_INT64;
       a.out = fake(moejit_test::kFakeIndices + 65 * 8);
     },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->indices"},
    // The workspace is written too: it may share bytes with none of the buffers read.
    {"workspace_overlaps_expert",
     [](auto& a) { token_index_workspace_at(a, moejit_test::kFakeExpert + 4096); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->expert_hidden"},
    // token_idx: 66 entries, 264 bytes.
    {"workspace_overlaps_token_idx",
     [](auto& a) { token_index_workspace_at(a, moejit_test::kFakeIndices + 256); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->indices"},
    {"workspace_overlaps_gates",
     [](auto& a) { token_index_workspace_at(a, moejit_test::kFakeGates + 256); },
     MOEJIT_ERROR_INVALID_ARGUMENT, "overlaps args->gates"},
    {"workspace_misaligned", [](auto& a) { token_index_workspace_at(a, 0x7f0040000008); },
     MOEJIT_ERROR_INVALID_ARGUMENT,
     "args->workspace = 0x7f0040000008: must be aligned to 16 bytes"},
};

std::string case_name(const ::testing::TestParamInfo<BadCase>& param_info) {
  return param_info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Api, ArgumentErrors, ::testing::ValuesIn(kBadCases), case_name);

TEST(Api, NullArgs) {
  EXPECT_EQ(moe_combine(nullptr, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("args = NULL"), std::string::npos);
  EXPECT_EQ(moejit_combine_args_init(nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  size_t bytes = 0;
  EXPECT_EQ(moejit_combine_workspace_size(nullptr, &bytes), MOEJIT_ERROR_INVALID_ARGUMENT);
  moejit_combine_args a = valid_args();
  EXPECT_EQ(moejit_combine_workspace_size(&a, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(moejit_runtime_get_stats(nullptr, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(moejit_runtime_create(nullptr, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(moejit_runtime_destroy(nullptr), MOEJIT_SUCCESS);  // accepts NULL
}

// moejit_runtime_create: "runtime receives the handle (NULL on failure)", whatever it held.
TEST(Api, AFailedCreateLeavesANullHandle) {
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  set_c_enum(o.cache_mode, 9);
  int not_a_runtime = 0;
  moejit_runtime_t rt = reinterpret_cast<moejit_runtime_t>(&not_a_runtime);
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(rt, nullptr);
}

TEST(Api, StatusNamesAndDescriptions) {
#define CHECK_STATUS(name, value, description)                \
  EXPECT_STREQ(moejit_status_name(name), #name);              \
  EXPECT_STREQ(moejit_status_description(name), description); \
  EXPECT_EQ(static_cast<int>(name), value);
  MOEJIT_STATUS_TABLE(CHECK_STATUS)
#undef CHECK_STATUS
  // Fixed values: appended only, never renumbered.
  EXPECT_EQ(MOEJIT_ERROR_INVALID_ARGUMENT, 1);
  EXPECT_EQ(MOEJIT_ERROR_DRIVER_NOT_FOUND, 4);
  EXPECT_EQ(MOEJIT_ERROR_NOT_CACHED, 8);
  // 15: within the enum's range in C++ but no status. Values past it (999, -1), which only C can
  // pass, are checked by the C99 test (header_c.c).
  EXPECT_STREQ(moejit_status_name(static_cast<moejit_status>(15)), "MOEJIT_STATUS_UNKNOWN");
  EXPECT_STREQ(moejit_status_description(static_cast<moejit_status>(15)), "unknown status code");
}

// The logger is shared by every runtime: a create that fails must not change its level. Seen from
// outside through what it prints: a failing call logs its message at debug level.
TEST(Api, AFailedCreateLeavesTheLogLevelAsItWas) {
  auto debug_line_printed = [] {
    moejit_combine_args a = valid_args();
    a.hidden_dim = 0;
    testing::internal::CaptureStderr();
    EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
    return testing::internal::GetCapturedStderr().find("args->hidden_dim = 0") != std::string::npos;
  };
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.log_level = MOEJIT_LOG_WARN;
  moejit_runtime_t rt = nullptr;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  ASSERT_FALSE(debug_line_printed());

  o.log_level = MOEJIT_LOG_DEBUG;
  o.template_dir = "/nonexistent/moejit/templates";
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_FALSE(debug_line_printed()) << "a failed create changed the log level";

  o.template_dir = nullptr;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  EXPECT_TRUE(debug_line_printed()) << "a created runtime's log level did not apply";

  o.log_level = MOEJIT_LOG_WARN;  // back to the default for the other tests
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS);
  moejit_runtime_destroy(rt);
}

TEST(Api, LastErrorIsPerThread) {
  moejit_combine_args a = valid_args();
  a.hidden_dim = 0;
  ASSERT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_INVALID_ARGUMENT);
  std::string other;
  std::thread([&] {
    moejit_combine_args b = valid_args();
    b.top_k = 99;
    moe_combine(&b, nullptr);
    other = moejit_last_error_message();
  }).join();
  EXPECT_NE(other.find("top_k"), std::string::npos);
  EXPECT_NE(std::string(moejit_last_error_message()).find("hidden_dim"), std::string::npos);
}

TEST(Api, Versions) {
  EXPECT_EQ(moejit_version(), MOEJIT_VERSION_NUMBER);
  EXPECT_STREQ(moejit_version_string(), MOEJIT_PROJECT_VERSION);  // CMake's project version
}

TEST(Api, WorkspaceSize) {
  moejit_combine_args a = valid_args();
  size_t bytes = 123;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS);
  EXPECT_EQ(bytes, 0u);  // gather map needs none
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS);
  EXPECT_GE(bytes, 33u * 4u + 33u * 2u * 4u);  // counts + at least K row ids per token
  a.num_tokens = 0;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS);
  EXPECT_EQ(bytes, 0u);
  a.hidden_dim = -1;
  EXPECT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_ERROR_INVALID_ARGUMENT);
}

// moejit.h and docs/usage.md promise an engine with batches of varying size one buffer: the
// workspace of (T tokens, T * K rows) serves every call with at most T tokens and at most K rows
// per token on average (num_rows <= num_tokens * K). Calls with more rows per token than that can
// need more, which is why the rule is stated per K.
TEST(Api, WorkspaceOfTheLargestBatchServesSmallerOnes) {
  auto workspace = [](int64_t tokens, int64_t rows) {
    moejit_combine_args a = valid_args();
    a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
    a.num_tokens = tokens;
    a.num_rows = rows;
    size_t bytes = 0;
    EXPECT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    return bytes;
  };
  for (int64_t k : {1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 20, 32, 64}) {
    for (int64_t max_tokens : {1, 7, 64, 65, 300, 4096}) {
      const size_t largest = workspace(max_tokens, max_tokens * k);
      for (int64_t t = 1; t <= max_tokens; t += 1 + t / 8) {
        for (int64_t r = 0; r <= t * k; r += 1 + r / 16)
          ASSERT_LE(workspace(t, r), largest)
              << "T=" << t << " R=" << r << " against T=" << max_tokens << " K=" << k;
        ASSERT_LE(workspace(t, t * k), largest) << "T=" << t << " K=" << k;
      }
    }
  }
  // More rows per token than the largest batch had can need more: why the rule bounds them.
  EXPECT_GT(workspace(99, 800), workspace(100, 800));
}

// A caller built against the 0.1 header passes the shorter struct: accepted, and nothing past its
// end is read (the fields added since take their defaults).
TEST(Api, ArgsFromAnOlderHeaderAreAccepted) {
  moejit_combine_args a = valid_args();
  EXPECT_EQ(a.dependent_launch, 0);  // the default
  a.struct_size = offsetof(moejit_combine_args, dependent_launch);
  a.dependent_launch = 7;  // not the caller's memory: must not be looked at
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  size_t old_bytes = 0, bytes = 0;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &old_bytes), MOEJIT_SUCCESS)
      << moejit_last_error_message();
  a.struct_size = sizeof(a);
  a.dependent_launch = 1;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS)
      << moejit_last_error_message();
  EXPECT_EQ(old_bytes, bytes);
  a.dependent_launch = 7;
  EXPECT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("args->dependent_launch = 7"),
            std::string::npos);
}

// Initializing never writes past the caller's struct: a binary built against the 0.1 header
// calls the function moejit_combine_args_init with a struct that ends before dependent_launch
// (the 0.2 header's moejit_combine_args_init is a macro over the sized form).
TEST(Api, InitWritesNoMoreThanTheCallersStruct) {
  constexpr size_t kV01 = offsetof(moejit_combine_args, dependent_launch);
  struct Padded {
    moejit_combine_args args;
    unsigned char after[16];
  };
  for (int form = 0; form < 3; ++form) {
    SCOPED_TRACE(form);
    Padded p;
    std::memset(&p, 0xAB, sizeof(p));
    unsigned char* bytes = reinterpret_cast<unsigned char*>(&p);
    size_t expect_size = kV01;
    if (form == 0) {
      ASSERT_EQ((moejit_combine_args_init)(&p.args), MOEJIT_SUCCESS);  // the 0.1 entry point
    } else if (form == 1) {
      ASSERT_EQ(moejit_combine_args_init_sized(&p.args, kV01), MOEJIT_SUCCESS);
    } else {
      ASSERT_EQ(moejit_combine_args_init(&p.args), MOEJIT_SUCCESS);  // the macro: this header's
      expect_size = sizeof(moejit_combine_args);
    }
    EXPECT_EQ(p.args.struct_size, expect_size);
    for (size_t i = expect_size; i < sizeof(p); ++i)
      ASSERT_EQ(bytes[i], 0xAB) << "byte " << i << " past the struct was written";
    EXPECT_EQ(p.args.scale, 1.0f);
    EXPECT_EQ(p.args.layout, MOEJIT_LAYOUT_TOKEN_MAJOR);
    EXPECT_EQ(p.args.workspace_bytes, 0u);  // the last 0.1 field
  }
  moejit_combine_args a;
  for (size_t size : {size_t{0}, size_t{8}, kV01 + 4, sizeof(moejit_combine_args) + 8}) {
    EXPECT_EQ(moejit_combine_args_init_sized(&a, size), MOEJIT_ERROR_INVALID_ARGUMENT) << size;
    EXPECT_NE(std::string(moejit_last_error_message())
                  .find("invalid argument struct_size = " + std::to_string(size) +
                        ": must be sizeof(moejit_combine_args)"),
              std::string::npos)
        << moejit_last_error_message();
  }
  EXPECT_EQ(moejit_combine_args_init_sized(nullptr, sizeof(a)), MOEJIT_ERROR_INVALID_ARGUMENT);
}

// The token-major layout reads no indices, so index_type is not checked there, and a C caller
// may leave any int in it: the library must not load it as the enum either (undefined behaviour
// that the sanitizer build aborts on) when it plans the call.
TEST(Api, TokenMajorIgnoresTheIndexType) {
  if (driver_present()) GTEST_SKIP() << "libcuda.so.1 is present: the fake pointers would launch";
  moejit_combine_args a = valid_args();
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.num_rows = 0;
  a.indices = nullptr;
  set_c_enum(a.index_type, 7);
  size_t bytes = 1;
  ASSERT_EQ(moejit_combine_workspace_size(&a, &bytes), MOEJIT_SUCCESS)
      << moejit_last_error_message();
  EXPECT_EQ(bytes, 0u);
  // Every argument accepted: the call gets as far as loading the driver.
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_DRIVER_NOT_FOUND) << moejit_last_error_message();
}

TEST(Api, ZeroTokensIsANoOpEvenWithoutADriver) {
  moejit_combine_args a = valid_args();
  a.num_tokens = 0;
  a.out = nullptr;
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
}

TEST(Api, WithoutADriverAValidCallSaysSo) {
  if (driver_present()) GTEST_SKIP() << "libcuda.so.1 is present: this case checks its absence";
  moejit_combine_args a = valid_args();
  EXPECT_EQ(moe_combine(&a, nullptr), MOEJIT_ERROR_DRIVER_NOT_FOUND);
  EXPECT_NE(std::string(moejit_last_error_message()).find("libcuda.so.1"), std::string::npos);
}

TEST(Api, RuntimeOptions) {
  moejit_runtime_options o;
  ASSERT_EQ(moejit_runtime_options_init(&o), MOEJIT_SUCCESS);
  EXPECT_EQ(o.struct_size, sizeof(o));
  // The 0.1 entry point fills the fields of the 0.1 and 0.2 headers only (up to template_dir):
  // a binary built against them has a struct that ends there.
  const size_t v02 = offsetof(moejit_runtime_options, cache_key_file);
  std::memset(&o, 0xAB, sizeof(o));
  ASSERT_EQ((moejit_runtime_options_init)(&o), MOEJIT_SUCCESS);
  EXPECT_EQ(o.struct_size, v02);
  EXPECT_EQ(o.log_level, MOEJIT_LOG_DEFAULT);
  EXPECT_EQ(o.template_dir, nullptr);
  unsigned char past[sizeof(o) - v02];
  std::memcpy(past, reinterpret_cast<const char*>(&o) + v02, sizeof(past));
  for (unsigned char c : past) EXPECT_EQ(c, 0xAB) << "wrote past the 0.2 struct";
  moejit_runtime_t old_caller = nullptr;  // such a struct is accepted as it is
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  ASSERT_EQ(moejit_runtime_create(&o, &old_caller), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(old_caller);
  std::memset(&o, 0xAB, sizeof(o));
  ASSERT_EQ(moejit_runtime_options_init_sized(&o, v02), MOEJIT_SUCCESS);
  EXPECT_EQ(o.struct_size, v02);
  std::memcpy(past, reinterpret_cast<const char*>(&o) + v02, sizeof(past));
  for (unsigned char c : past) EXPECT_EQ(c, 0xAB) << "wrote past the 0.2 struct";
  ASSERT_EQ(moejit_runtime_options_init(&o), MOEJIT_SUCCESS);
  EXPECT_EQ(o.struct_size, sizeof(o));
  EXPECT_EQ(o.cache_key_file, nullptr);
  EXPECT_EQ(moejit_runtime_options_init_sized(&o, sizeof(o) + 8), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message())
                .find("invalid argument struct_size = " + std::to_string(sizeof(o) + 8)),
            std::string::npos)
      << moejit_last_error_message();
  set_c_enum(o.cache_mode, 9);
  moejit_runtime_t rt = nullptr;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->cache_mode = 9"),
            std::string::npos);
  EXPECT_EQ(rt, nullptr);

  set_c_enum(o.cache_mode, -1);
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->cache_mode = -1"),
            std::string::npos);
  EXPECT_EQ(rt, nullptr);
  // Every mode itself is accepted, the last one included.
  for (moejit_cache_mode mode : {MOEJIT_CACHE_MODE_DISABLED, MOEJIT_CACHE_MODE_NO_COMPILE}) {
    o.cache_mode = mode;
    o.cache_dir = "/nonexistent/moejit-cache";  // no-compile only reads: nothing is created
    ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
    moejit_runtime_destroy(rt);
  }

  moejit_runtime_options_init(&o);
  set_c_enum(o.log_level, 42);
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->log_level = 42"),
            std::string::npos);
  set_c_enum(o.log_level, -2);  // below MOEJIT_LOG_DEFAULT
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->log_level = -2"),
            std::string::npos);
  set_c_enum(o.log_level, 5);  // between ERROR (4) and OFF (6): no level
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->log_level = 5"),
            std::string::npos);
  EXPECT_EQ(rt, nullptr);

  // A size that ends inside a field (here inside cache_dir) is refused, not half copied.
  for (size_t size : {size_t{0}, size_t{12}, sizeof(o) - 4, sizeof(o) + 8}) {
    moejit_runtime_options_init(&o);
    o.cache_dir = "/tmp/moejit-never-created";
    o.struct_size = size;
    EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT) << size;
    EXPECT_NE(std::string(moejit_last_error_message())
                  .find("options->struct_size = " + std::to_string(size) +
                        ": must be sizeof(moejit_runtime_options) = " + std::to_string(sizeof(o))),
              std::string::npos)
        << moejit_last_error_message();
    EXPECT_EQ(rt, nullptr);
  }

  moejit_runtime_options_init(&o);
  o.template_dir = "/nonexistent/moejit/templates";
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("options->template_dir = "),
            std::string::npos)
      << moejit_last_error_message();

  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_stats s;
  s.struct_size = sizeof(s);
  ASSERT_EQ(moejit_runtime_get_stats(rt, &s), MOEJIT_SUCCESS);
  EXPECT_EQ(s.compiles, 0u);
  EXPECT_EQ(s.launches, 0u);
  EXPECT_EQ(moejit_runtime_destroy(rt), MOEJIT_SUCCESS);
}

TEST(Api, BadEnvironmentIsReportedByName) {
  setenv("MOEJIT_CACHE_MODE", "sometimes", 1);
  moejit_runtime_t rt = nullptr;
  EXPECT_EQ(moejit_runtime_create(nullptr, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("MOEJIT_CACHE_MODE = \"sometimes\""),
            std::string::npos)
      << moejit_last_error_message();
  unsetenv("MOEJIT_CACHE_MODE");
  // Not a count of bytes; "-1" and an overflow included (strtoull would wrap or clamp them).
  for (const char* bad : {"lots", "-1", "99999999999999999999999", " 5", "0"}) {
    setenv("MOEJIT_CACHE_MAX_BYTES", bad, 1);
    EXPECT_EQ(moejit_runtime_create(nullptr, &rt), MOEJIT_ERROR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(moejit_last_error_message())
                  .find(std::string("MOEJIT_CACHE_MAX_BYTES = \"") + bad + "\""),
              std::string::npos)
        << moejit_last_error_message();
  }
  setenv("MOEJIT_CACHE_MAX_BYTES", "18446744073709551615", 1);  // 2^64 - 1: a valid count
  ASSERT_EQ(moejit_runtime_create(nullptr, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  unsetenv("MOEJIT_CACHE_MAX_BYTES");
  // A template directory is named by the setting that gave it.
  setenv("MOEJIT_TEMPLATE_DIR", "/nonexistent/moejit/templates", 1);
  EXPECT_EQ(moejit_runtime_create(nullptr, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message())
                .find("MOEJIT_TEMPLATE_DIR = \"/nonexistent/moejit/templates\": must be a readable "
                      "directory"),
            std::string::npos)
      << moejit_last_error_message();
  unsetenv("MOEJIT_TEMPLATE_DIR");
}

// A field of moejit_runtime_options that is set wins over its environment variable, which is then
// not even read: a malformed one does not fail the create. An empty variable counts as unset.
TEST(Api, OptionsThatAreSetOverrideTheEnvironment) {
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  moejit_runtime_t rt = nullptr;
  setenv("MOEJIT_CACHE_MODE", "sometimes", 1);
  setenv("MOEJIT_CACHE_MAX_BYTES", "lots", 1);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  o.cache_max_bytes = 1 << 20;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  // Each variable is read where its field is left at the default.
  o.cache_max_bytes = 0;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("MOEJIT_CACHE_MAX_BYTES = \"lots\""),
            std::string::npos)
      << moejit_last_error_message();
  o.cache_max_bytes = 1 << 20;
  o.cache_mode = MOEJIT_CACHE_MODE_DEFAULT;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("MOEJIT_CACHE_MODE = \"sometimes\""),
            std::string::npos)
      << moejit_last_error_message();
  // Empty: as if unset (read-write, here in a directory of the test's own).
  setenv("MOEJIT_CACHE_MODE", "", 1);
  setenv("MOEJIT_CACHE_MAX_BYTES", "", 1);
  char dir[] = "/tmp/moejit-api-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  o.cache_max_bytes = 0;
  o.cache_dir = dir;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  unsetenv("MOEJIT_CACHE_MODE");
  unsetenv("MOEJIT_CACHE_MAX_BYTES");
  std::filesystem::remove_all(dir);
}

// A malformed MOEJIT_LOG_LEVEL is reported when a runtime is created, not at the library's first
// message: at the default level that may never come, and whoever asked for "verbose" would see
// nothing at all. The logger reads the variable once per process, so the check runs in a fresh
// one (the threadsafe death-test style re-executes this binary).
TEST(Api, AMalformedLogLevelIsReportedWhenARuntimeIsCreated) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* expected =
      "MOEJIT_LOG_LEVEL=verbose is not one of trace, debug, info, warn, error, off";
  auto create_and_exit = [](bool default_runtime) {
    setenv("MOEJIT_LOG_LEVEL", "verbose", 1);
    moejit_runtime_t rt = nullptr;
    if (default_runtime) {
      moejit_stats s;
      s.struct_size = sizeof(s);
      std::exit(moejit_runtime_get_stats(nullptr, &s) == MOEJIT_SUCCESS ? 0 : 1);
    }
    std::exit(moejit_runtime_create(nullptr, &rt) == MOEJIT_SUCCESS ? 0 : 1);
  };
  EXPECT_EXIT(create_and_exit(false), testing::ExitedWithCode(0), expected);
  EXPECT_EXIT(create_and_exit(true), testing::ExitedWithCode(0), expected);
}

// The default runtime (NULL handle) is made on first use from the environment. A bad setting fails
// that call, and every call until the setting is fixed; then the next call makes it. Needs a
// process whose default runtime does not exist yet (the threadsafe death-test style re-executes
// this binary).
TEST(Api, TheDefaultRuntimeIsMadeByTheFirstCallThatCan) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto fail_then_succeed = [] {
    moejit_stats s;
    s.struct_size = sizeof(s);
    setenv("MOEJIT_CACHE_MODE", "sometimes", 1);
    for (int i = 0; i < 2; ++i) {
      if (moejit_runtime_get_stats(nullptr, &s) != MOEJIT_ERROR_INVALID_ARGUMENT) std::exit(1);
      if (std::string(moejit_last_error_message()).find("MOEJIT_CACHE_MODE") == std::string::npos)
        std::exit(2);
    }
    unsetenv("MOEJIT_CACHE_MODE");
    if (moejit_runtime_get_stats(nullptr, &s) != MOEJIT_SUCCESS) std::exit(3);
    // Made once: a bad setting now changes nothing.
    setenv("MOEJIT_CACHE_MODE", "sometimes", 1);
    std::exit(moejit_runtime_get_stats(nullptr, &s) == MOEJIT_SUCCESS ? 0 : 4);
  };
  EXPECT_EXIT(fail_then_succeed(), testing::ExitedWithCode(0), "");
}

// The cache key file (options->cache_key_file, MOEJIT_CACHE_KEY_FILE): a runtime is created only
// with a file that keeps the key to its owner. Each broken rule is named, with the path, by the
// option or variable that gave it.
TEST(Api, ACacheKeyFileMustBePrivateToItsOwner) {
  std::string base = (std::filesystem::temp_directory_path() / "moejit-key-XXXXXX").string();
  ASSERT_NE(mkdtemp(base.data()), nullptr);
  auto write_key = [&](const std::string& name, const std::string& bytes, mode_t mode) {
    const std::string path = base + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    chmod(path.c_str(), mode);
    return path;
  };
  const std::string good = write_key("good", std::string(32, 's'), 0600);
  const std::string read_only = write_key("read-only", std::string(16, 's'), 0400);
  std::filesystem::create_symlink(good, base + "/link");
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  moejit_runtime_t rt = nullptr;
  for (const std::string& path : {good, read_only, base + "/link"}) {
    o.cache_key_file = path.c_str();
    EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS)
        << path << ": " << moejit_last_error_message();
    moejit_runtime_destroy(rt);
  }
  const struct {
    std::string path, reason;
  } bad[] = {
      {write_key("group", std::string(32, 's'), 0640),
       "is accessible to group or others (mode 0640)"},
      {write_key("others", std::string(32, 's'), 0604),
       "is accessible to group or others (mode 0604)"},
      {write_key("short", std::string(15, 's'), 0600), "holds 15 bytes"},
      {write_key("empty", "", 0600), "holds 0 bytes"},
      {base, "is not a regular file"},
      {base + "/missing", "cannot be opened: No such file or directory"},
  };
  for (const auto& b : bad) {
    o.cache_key_file = b.path.c_str();
    EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT) << b.path;
    EXPECT_EQ(rt, nullptr);
    const std::string message = moejit_last_error_message();
    EXPECT_NE(message.find("options->cache_key_file = \"" + b.path + "\": " + b.reason),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("owned by this user, with no permission for group or others"),
              std::string::npos)
        << message;
  }
  if (geteuid() == 0) {
    const std::string theirs = write_key("theirs", std::string(32, 's'), 0600);
    ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
    o.cache_key_file = theirs.c_str();
    EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(moejit_last_error_message()).find("is owned by uid 65534"),
              std::string::npos)
        << moejit_last_error_message();
  }
  // From the environment, when the option is unset.
  o.cache_key_file = nullptr;
  setenv("MOEJIT_CACHE_KEY_FILE", bad[0].path.c_str(), 1);
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(moejit_last_error_message()).find("MOEJIT_CACHE_KEY_FILE = \""),
            std::string::npos)
      << moejit_last_error_message();
  setenv("MOEJIT_CACHE_KEY_FILE", good.c_str(), 1);
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  moejit_runtime_destroy(rt);
  unsetenv("MOEJIT_CACHE_KEY_FILE");
  std::filesystem::remove_all(base);
}

TEST(Api, StatsStructSizeIsChecked) {
  moejit_stats s;
  s.struct_size = 4;
  EXPECT_EQ(moejit_runtime_get_stats(nullptr, &s), MOEJIT_ERROR_INVALID_ARGUMENT);
  // The message says which sizes are accepted: any that holds struct_size and one counter.
  EXPECT_NE(std::string(moejit_last_error_message())
                .find("stats->struct_size = 4: must be at least 16 (struct_size and one counter; "
                      "sizeof(moejit_stats) = " +
                      std::to_string(sizeof(moejit_stats)) + " for this library version)"),
            std::string::npos)
      << moejit_last_error_message();
  // The smallest accepted size: struct_size and the first counter, and nothing past it written.
  std::memset(&s, 0xAB, sizeof(s));
  s.struct_size = sizeof(size_t) + sizeof(uint64_t);
  ASSERT_EQ(moejit_runtime_get_stats(nullptr, &s), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_NE(s.memory_hits, 0xABABABABABABABABull);
  EXPECT_EQ(s.disk_hits, 0xABABABABABABABABull);
  s.struct_size = sizeof(size_t) + sizeof(uint64_t) - 1;
  EXPECT_EQ(moejit_runtime_get_stats(nullptr, &s), MOEJIT_ERROR_INVALID_ARGUMENT);
  // A size that ends inside a field: the fields before it are written, that one not at all.
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  moejit_runtime_t rt = nullptr;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  std::memset(&s, 0xAB, sizeof(s));
  s.struct_size = offsetof(moejit_stats, disk_hits) + 4;
  ASSERT_EQ(moejit_runtime_get_stats(rt, &s), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(s.memory_hits, 0u);
  EXPECT_EQ(s.disk_hits, 0xABABABABABABABABull);
  moejit_runtime_destroy(rt);
}

}  // namespace
