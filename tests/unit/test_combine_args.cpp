// What plan_combine accepts right at each documented limit (moejit.h): the limits are inclusive,
// adjacent buffers do not overlap, and what a layout does not read is not checked. The rejections
// themselves, with their messages, are in tests/api/test_api.cpp (ArgumentErrors); here the values
// on the accepted side of each bound, so that a check made stricter by one is caught too.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "../kernel_templates/token_index_workspace.h"
#include "combine_plan.h"
#include "error.h"
#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace moejit {
namespace {

// Regions 2^44 bytes apart: past the largest span a test plans (2^31 rows of 128 bf16 elements).
constexpr uintptr_t kExpert = uintptr_t{1} << 44;
constexpr uintptr_t kGates = uintptr_t{2} << 44;
constexpr uintptr_t kIndices = uintptr_t{3} << 44;
constexpr uintptr_t kOut = uintptr_t{4} << 44;
constexpr uintptr_t kWorkspace = uintptr_t{5} << 44;

void* at(uintptr_t address) {
  return reinterpret_cast<void*>(address);
}

// A valid gather-map call (bf16 rows and output, int32 map, gates) on fake addresses, each buffer
// in a region of its own, far enough apart for the largest spans planned here.
moejit_combine_args gather_map(int64_t tokens, int64_t top_k, int64_t hidden) {
  moejit_combine_args a = moejit_test::fake_gather_map_args(tokens, top_k, hidden);
  a.expert_hidden = at(kExpert);
  a.gates = static_cast<const float*>(at(kGates));
  a.indices = at(kIndices);
  a.out = at(kOut);
  return a;
}

// The same rows through token_idx, with a workspace of exactly the size asked for.
moejit_combine_args token_index(int64_t tokens, int64_t rows, int64_t hidden) {
  moejit_combine_args a = gather_map(tokens, 2, hidden);
  a.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  a.num_rows = rows;
  a.workspace = at(kWorkspace);
  a.workspace_bytes = combine_workspace_bytes(&a);
  return a;
}

// Plans a (accepted) call; a rejection fails the test with its message.
::testing::AssertionResult plans(const moejit_combine_args& a) {
  try {
    plan_combine(&a);
    return ::testing::AssertionSuccess();
  } catch (const Error& e) {
    return ::testing::AssertionFailure() << moejit_status_name(e.status()) << ": " << e.what();
  }
}

// The message of a rejected call ("" if it was planned).
std::string refusal(const moejit_combine_args& a, moejit_status expected) {
  try {
    plan_combine(&a);
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), expected) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "planned, expected " << moejit_status_name(expected);
  return "";
}

// moejit.h: hidden_dim 1..65536, top_k 1..64, num_rows up to 2^31 - 1 (gather map, token index),
// num_tokens up to 2^40: every bound itself is a valid value. (At 2^40 tokens no single launch
// takes the call, but its shape is valid: the workspace size of it is answered.)
TEST(CombineArgs, EveryShapeLimitIsInclusive) {
  EXPECT_TRUE(plans(gather_map(3, 2, MOEJIT_MAX_HIDDEN_DIM)));
  EXPECT_TRUE(plans(gather_map(3, MOEJIT_MAX_TOP_K, 4096)));
  moejit_combine_args a = gather_map(3, 2, 128);
  a.num_rows = INT32_MAX;
  EXPECT_TRUE(plans(a));
  EXPECT_TRUE(plans(token_index(3, INT32_MAX, 128)));
  a = gather_map(MOEJIT_MAX_NUM_TOKENS, 2, 64);
  a.num_rows = 6;
  EXPECT_NO_THROW(combine_workspace_bytes(&a));
  a = token_index(3, 6, 64);
  a.num_tokens = MOEJIT_MAX_NUM_TOKENS;
  EXPECT_GT(combine_workspace_bytes(&a), 0u);
  // One past each is refused (the messages: ArgumentErrors in tests/api).
  EXPECT_NE(refusal(gather_map(3, 2, MOEJIT_MAX_HIDDEN_DIM + 1), MOEJIT_ERROR_INVALID_ARGUMENT)
                .find("args->hidden_dim = 65537"),
            std::string::npos);
  EXPECT_NE(refusal(gather_map(3, MOEJIT_MAX_TOP_K + 1, 4096), MOEJIT_ERROR_INVALID_ARGUMENT)
                .find("args->top_k = 65"),
            std::string::npos);
  a = gather_map(3, 2, 64);
  a.num_tokens = MOEJIT_MAX_NUM_TOKENS + 1;
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("args->num_tokens = 1099511627777"),
            std::string::npos);
}

// top_k is unused by the token-index layout (moejit.h): any value there, 0 included.
TEST(CombineArgs, TokenIndexIgnoresTopK) {
  for (int64_t k : {int64_t{0}, int64_t{-1}, int64_t{65}}) {
    moejit_combine_args a = token_index(33, 66, 4096);
    a.top_k = k;
    EXPECT_TRUE(plans(a)) << "top_k = " << k;
  }
}

// A buffer extent (rows x row stride x element size) may reach 2^62 bytes, not more; the element
// size counts.
TEST(CombineArgs, RowStridesMaySpanUpToTwoToTheSixtyTwoBytes) {
  moejit_combine_args a = gather_map(3, 2, 64);
  a.num_rows = 1;
  a.expert_dtype = MOEJIT_DTYPE_FLOAT32;
  a.expert_row_stride = int64_t{1} << 60;  // 1 row x 2^60 x 4 bytes = 2^62
  EXPECT_TRUE(plans(a));
  a.expert_row_stride += 1;
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT)
                .find("args->expert_row_stride = 1152921504606846977: is too large"),
            std::string::npos);
  a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;  // 2 bytes per element: well within
  EXPECT_TRUE(plans(a));

  a = gather_map(1, 2, 64);
  a.out_dtype = MOEJIT_DTYPE_FLOAT32;
  a.out_row_stride = int64_t{1} << 60;
  EXPECT_TRUE(plans(a));
  a.out_row_stride += 1;
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("args->out_row_stride = "),
            std::string::npos);
}

// Pointers need their element's alignment and no more: fp32 gates at 4 bytes, int32 indices at
// 4, int64 at 8, bf16 rows and output at 2; the workspace at 16 (moejit.h).
TEST(CombineArgs, PointersNeedOnlyTheirElementsAlignment) {
  moejit_combine_args a = gather_map(33, 2, 4096);
  a.gates = static_cast<const float*>(at(kGates + 4));
  a.indices = at(kIndices + 4);
  a.expert_hidden = at(kExpert + 2);
  a.out = at(kOut + 2);
  EXPECT_TRUE(plans(a));
  a.index_type = MOEJIT_INDEX_INT64;
  a.indices = at(kIndices + 8);
  EXPECT_TRUE(plans(a));

  a = token_index(33, 66, 4096);
  a.workspace = at(kWorkspace + 16);
  EXPECT_TRUE(plans(a));
  a.workspace = at(kWorkspace + 48);
  EXPECT_TRUE(plans(a));
}

// Token-major reads no indices: whatever the field holds is not checked (alignment included).
TEST(CombineArgs, TokenMajorDoesNotCheckTheIndices) {
  moejit_combine_args a = gather_map(33, 2, 4096);
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.indices = at(kIndices + 1);
  EXPECT_TRUE(plans(a));
  a.index_type = MOEJIT_INDEX_INT64;
  a.indices = at(kIndices + 4);
  EXPECT_TRUE(plans(a));
}

// With no rows the token-index layout reads no token_idx, rows or gates: NULL is fine for them.
TEST(CombineArgs, TokenIndexWithoutRowsNeedsNoRowPointers) {
  moejit_combine_args a = token_index(33, 0, 4096);
  a.indices = nullptr;
  a.expert_hidden = nullptr;
  a.gates = nullptr;
  EXPECT_TRUE(plans(a));
}

// Token-major with num_rows = 0 means num_tokens * top_k rows: the rows are read, so they must be
// there.
TEST(CombineArgs, TokenMajorNumRowsZeroMeansEveryRow) {
  moejit_combine_args a = gather_map(33, 2, 4096);
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.num_rows = 0;
  EXPECT_EQ(plan_combine(&a).params.num_rows, 66);
  a.expert_hidden = nullptr;
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("args->expert_hidden = NULL"),
            std::string::npos);
  // Their bytes count for the overlap checks: out placed on the last row is refused.
  a.expert_hidden = at(kExpert);
  a.out = at(kExpert + 65 * 4096 * 2);
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("overlaps args->expert_hidden"),
            std::string::npos);
}

// Buffers that only touch do not overlap: one allocation split into consecutive buffers is fine.
// One element more and they do.
TEST(CombineArgs, AdjacentBuffersDoNotOverlap) {
  moejit_combine_args a = gather_map(33, 2, 4096);
  const uintptr_t rows_end = kExpert + 66 * 4096 * 2;
  a.out = at(rows_end);
  EXPECT_TRUE(plans(a));
  a.out = at(rows_end - 2);
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("overlaps args->expert_hidden"),
            std::string::npos);
  // out ending where the map begins.
  a.out = at(kIndices - 33 * 4096 * 2);
  EXPECT_TRUE(plans(a));
  a.out = at(kIndices - 33 * 4096 * 2 + 2);
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("overlaps args->indices"),
            std::string::npos);

  // The workspace right after the token_idx, and right before out.
  a = token_index(33, 66, 4096);
  a.workspace = at((kIndices + 66 * 4 + 15) / 16 * 16);
  EXPECT_TRUE(plans(a));
  a.workspace = at(kOut - a.workspace_bytes);
  EXPECT_TRUE(plans(a));
  a.workspace = at(kOut - a.workspace_bytes + 16);
  EXPECT_NE(refusal(a, MOEJIT_ERROR_INVALID_ARGUMENT).find("overlaps args->out"),
            std::string::npos);
}

// The workspace size moejit_combine_workspace_size() answers is enough: exactly that many bytes
// are accepted, one fewer is not.
TEST(CombineArgs, TheWorkspaceSizeAskedForIsEnough) {
  for (int64_t tokens : {1, 33, 65, 4096}) {
    for (int64_t rows : {tokens, tokens * 2, tokens * 8 + 1}) {
      moejit_combine_args a = token_index(tokens, rows, 2048);
      ASSERT_GT(a.workspace_bytes, 0u);
      EXPECT_TRUE(plans(a)) << tokens << " tokens, " << rows << " rows";
      a.workspace_bytes -= 1;
      EXPECT_NE(refusal(a, MOEJIT_ERROR_WORKSPACE_TOO_SMALL).find("args->workspace = "),
                std::string::npos);
    }
  }
}

// The lists the plan points into lie inside the workspace it asked for: the counts first (one int
// per token), then num_tokens lists of list_capacity row ids, neither overlapping the other. The
// kernels write them, so a size that is short by one list writes past the caller's buffer.
TEST(CombineArgs, TheListsFitTheWorkspace) {
  for (int64_t tokens : {2, 3, 63, 64, 65, 100, 1000, 4096}) {
    for (int64_t rows_per_token : {1, 2, 3, 5, 8, 9, 16, 17, 64}) {
      for (int64_t extra : {0, 1}) {
        const int64_t rows = tokens * rows_per_token + extra;
        const moejit_combine_args a = token_index(tokens, rows, 2048);
        const CombinePlan plan = plan_combine(&a);
        if (plan.params.list_capacity == 0) continue;  // a kernel that keeps no lists
        SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::to_string(rows) + " rows");
        const char* ws = static_cast<const char*>(a.workspace);
        const char* counts = reinterpret_cast<const char*>(plan.params.token_counts);
        const char* lists = reinterpret_cast<const char*>(plan.params.token_rows);
        EXPECT_EQ(counts, ws);
        EXPECT_GE(lists, counts + tokens * 4);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(lists) % 16, 0u);
        EXPECT_LE(lists + tokens * int64_t{plan.params.list_capacity} * 4, ws + a.workspace_bytes);
      }
    }
  }
}

// The token index's workspace (kernel_templates/token_index_workspace.h, which the kernels read
// too): its parts in order, 256-byte aligned, none overlapping the next, each as large as the
// most a call can write there; the plan points the counts and lists at the same places; the whole
// grows with T and R. The bounds: a heavy token (past its list) has more than kMinListCapacity
// rows, so there are at most R / (kMinListCapacity + 1) of them; a token of c > kPieceRows rows has
// ceil(c / kPieceRows) <= 2c / (kPieceRows + 1) pieces (equality at c = kPieceRows + 1).
TEST(CombineArgs, TokenIndexWorkspaceHoldsEveryPart) {
  for (int64_t c = kPieceRows + 1; c < 20 * kPieceRows; ++c)
    ASSERT_LE((c + kPieceRows - 1) / kPieceRows * (kPieceRows + 1), 2 * c) << c;
  for (const int64_t tokens : {1, 2, 17, 64, 1000, 4096, 37500})
    for (const int64_t rows : {0, 1, 16, 17, 128, 129, 511, 512, 513, 4096, 32768, 300000})
      for (const int64_t hidden : {1, 7, 128, 1001, 7168}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::to_string(rows) +
                     " rows, H = " + std::to_string(hidden));
        const int64_t cap = 32;
        const TokenIndexWorkspace w = token_index_workspace(tokens, rows, hidden, cap);
        EXPECT_EQ(w.max_heavy, std::min(tokens, rows / (kMinListCapacity + 1)));
        EXPECT_EQ(w.max_pieces, 2 * rows / (kPieceRows + 1));
        EXPECT_EQ(w.partial_stride % 8, 0);
        EXPECT_GE(w.partial_stride, hidden);
        EXPECT_EQ(w.chunks, 1 << w.chunk_shift);
        EXPECT_LE(w.chunks, kMaxRowChunks);
        EXPECT_GE(static_cast<int64_t>(w.chunks) * w.chunk_rows, rows);  // every row in a chunk
        EXPECT_TRUE(w.chunks == kMaxRowChunks || w.chunks == 1 ||
                    static_cast<int64_t>(w.chunks) * kMinChunkRows >= rows);
        const int64_t parts[][2] = {{0, tokens * 4},
                                    {w.header, kHeavyCounters * 8},
                                    {w.heavy_of, tokens * 4},
                                    {w.heavy_tokens, w.max_heavy * 8},
                                    {w.row_base, w.max_heavy * 4},
                                    {w.piece_base, w.max_heavy * 4},
                                    {w.token_summed, w.max_heavy * 8},
                                    {w.piece_token, w.max_pieces * 4},
                                    {w.chunk_counts, w.max_heavy * w.chunks * 4},
                                    {w.heavy_rows, rows * 4},
                                    {w.partials, w.max_pieces * w.partial_stride * 4},
                                    {w.lists, tokens * cap * 4}};
        for (size_t i = 0; i < std::size(parts); ++i) {
          EXPECT_EQ(parts[i][0] % 256, 0) << "part " << i;
          const int64_t next = i + 1 < std::size(parts) ? parts[i + 1][0] : w.bytes;
          EXPECT_LE(parts[i][0] + parts[i][1], next) << "part " << i;
        }
        EXPECT_EQ(token_index_header_offset(tokens), w.header);
        // The parts before the lists do not depend on the list's length (the kernels compute
        // them without it).
        EXPECT_EQ(token_index_workspace(tokens, rows, hidden, 0).partials, w.partials);
        EXPECT_EQ(token_index_workspace(tokens, rows, hidden, 0).lists, w.lists);
        // ... nor the helpers' parts (before the partial sums) on hidden_dim.
        EXPECT_EQ(token_index_workspace(tokens, rows, 0, 0).heavy_rows, w.heavy_rows);
        // Growing with T and R.
        EXPECT_LE(w.bytes, token_index_workspace(tokens + 1, rows, hidden, cap).bytes);
        EXPECT_LE(w.bytes, token_index_workspace(tokens, rows + 1, hidden, cap).bytes);
      }
  // The plan's pointers and the size it asks for are this layout's, with the call's list length.
  const moejit_combine_args a = token_index(4096, 32768, 7168);
  const CombinePlan plan = plan_combine(&a);
  const TokenIndexWorkspace w = token_index_workspace(4096, 32768, 7168, 32);
  EXPECT_EQ(static_cast<int64_t>(a.workspace_bytes), w.bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(plan.params.token_counts), kWorkspace);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(plan.params.token_rows), kWorkspace + w.lists);
  EXPECT_EQ(plan.params.list_capacity, 32);
  // DeepSeek-V3 prefill: 15.5 MB, nearly all of it the pieces' partial sums (508 rows of 7168
  // floats).
  EXPECT_EQ(w.max_pieces, 508);
  EXPECT_LT(w.bytes, 16 << 20);
}

// Every token is in some block: token groups of spec.tpb tokens, the last one partial.
TEST(CombineArgs, TheGridCoversEveryToken) {
  for (moejit_layout layout :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX}) {
    for (int64_t tokens : {1, 2, 33, 65, 1000, 4097, 100001}) {
      for (int64_t hidden : {8, 96, 4096}) {
        moejit_combine_args a = layout == MOEJIT_LAYOUT_TOKEN_INDEX
                                    ? token_index(tokens, tokens * 2, hidden)
                                    : gather_map(tokens, 2, hidden);
        a.layout = layout;
        const CombinePlan plan = plan_combine(&a);
        SCOPED_TRACE(std::to_string(layout) + ": " + std::to_string(tokens) +
                     " tokens, H = " + std::to_string(hidden));
        const int64_t blocks = int64_t{plan.combine_grid_x} * plan.combine_grid_y;
        ASSERT_EQ(blocks % plan.spec.chunks(), 0);
        const int64_t groups = blocks / plan.spec.chunks();
        EXPECT_GE(groups * plan.spec.tpb, tokens);        // every token in a group
        EXPECT_LT((groups - 1) * plan.spec.tpb, tokens);  // and no group without one
      }
    }
  }
}

// The vector width suits every row start of both buffers: a padded output row stride narrows it as
// a padded expert row stride does (a wider vector would store to misaligned addresses), and a
// row of exactly one widest vector keeps it.
TEST(CombineArgs, TheVectorSuitsEveryRowOfBothBuffers) {
  moejit_combine_args a = gather_map(33, 2, 4096);
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
  a.out_row_stride = 4097;
  EXPECT_EQ(plan_combine(&a).spec.vec, 1);
  a.out_row_stride = 4098;
  EXPECT_EQ(plan_combine(&a).spec.vec, 2);
  a.out_row_stride = 4096 + 8;
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
  a = gather_map(33, 2, 8);  // eight bf16 elements: one 16-byte vector
  EXPECT_EQ(plan_combine(&a).spec.vec, 8);
  a.expert_dtype = a.out_dtype = MOEJIT_DTYPE_FLOAT32;
  a.hidden_dim = 4;
  EXPECT_EQ(plan_combine(&a).spec.vec, 4);
}

// The gather map runs on the 2-D grid up to mid-size calls, T * vectors per row <= 2^21 included
// (combine_dispatch.cpp, Grid::kFlatOrTokensByChunks), on the 1-D grid past that.
TEST(CombineArgs, GatherMapTwoDimensionalGridUpToTwoToTheTwentyOneSlots) {
  moejit_combine_args a = gather_map(4096, 3, 4096);  // 512 slots of 8 bf16 per row: 2^21
  a.gates = nullptr;
  CombinePlan plan = plan_combine(&a);
  ASSERT_EQ(plan.spec.slots(), 512);
  EXPECT_EQ(plan.combine_grid_y, static_cast<unsigned>(plan.spec.chunks()));
  EXPECT_GT(plan.combine_grid_y, 1u);
  a.num_tokens = 4097;
  a.num_rows = 4097 * 3;
  plan = plan_combine(&a);
  EXPECT_EQ(plan.combine_grid_y, 1u);
}

// "One launch takes up to 2^31 - 1 token groups: past that a call returns
// MOEJIT_ERROR_UNSUPPORTED" (README): exactly that many groups still plan.
TEST(CombineArgs, OneLaunchTakesUpToTwoToTheThirtyOneMinusOneTokenGroups) {
  // 8-element rows: one vector slot, several tokens per block, one chunk.
  moejit_combine_args a = gather_map(1 << 20, 2, 8);
  a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  a.num_rows = 0;
  a.indices = nullptr;
  a.gates = nullptr;
  const int tpb = plan_combine(&a).spec.tpb;
  ASSERT_GT(tpb, 1);
  a.num_tokens = int64_t{tpb} * INT32_MAX;
  const CombinePlan plan = plan_combine(&a);
  EXPECT_EQ(plan.spec.tpb, tpb);
  EXPECT_EQ(plan.combine_grid_x, static_cast<unsigned>(INT32_MAX));
  a.num_tokens += 1;
  EXPECT_NE(refusal(a, MOEJIT_ERROR_UNSUPPORTED).find("split the batch"), std::string::npos);
}

}  // namespace
}  // namespace moejit
