// The token-index layout's workspace: what the host asks the caller for
// (moejit_combine_workspace_size) and where the kernels find each part of it, one definition for
// both; and the summation rule for a token with many rows, which its partial sums serve.
// Plain C++ that includes only host_device.h: the host compiles it, and NVRTC without any toolkit
// header.
#ifndef MOEJIT_TOKEN_INDEX_WORKSPACE_H_
#define MOEJIT_TOKEN_INDEX_WORKSPACE_H_

#include "host_device.h"

namespace moejit {

// A token of the token index with more rows than kPieceRows is summed in pieces (moejit.h): its
// rows in ascending order, cut into consecutive pieces of kPieceRows rows, each piece summed in
// fp32 from zero in row order, the pieces' sums then added in piece order. Several blocks can then
// share one token's rows while the result stays fixed by the input alone. A constant, not a
// choice per call: results depend on neither the batch nor the launch geometry. No smaller than
// the longest list (list_capacity, src/combine_dispatch.cpp), so that a token that fits a list is
// one piece, summed as it always was; so is every token of the single launch's small-call form
// and of the one-token kernel (at most 128 and 64 rows per call).
enum { kPieceRows = 128 };

// Every workspace list holds at least this many rows (list_capacity): a token past its list (a
// "heavy" token) has more, so a call has at most num_rows / (kMinListCapacity + 1) of them.
enum { kMinListCapacity = 16 };

// Heavy tokens' rows are ranked in chunks of the row range, each ranked by its own warp: a power of
// two of them (the kernels divide by it), at most kMaxRowChunks (the per-token count table stays
// within 4 ints per row), of at least kMinChunkRows rows where there are enough.
enum { kMaxRowChunks = 64, kMinChunkRows = 512 };

// Threads per block of token_index_heavy, the list path's kernel for tokens past their lists.
enum { kHeavyThreads = 256 };

// The 64-bit counters at the header: token_index_clear zeroes them on every call,
// token_index_assign counts the heavy tokens, token_index_heavy hands out and counts the work of
// ranking and summing their rows (token_index_heavy.cuh).
enum HeavyCounter {
  kHeavyTokens = 0,  // heavy tokens registered (token_index_assign)
  kHeavyTicket,      // next work item to hand out
  kHeavyCounted,     // items done of each step, in order: rows counted per chunk, the plan,
  kHeavyPlanned,     //   the rows ranked (the pieces summed are counted per token: token_summed;
  kHeavyRanked,      //   the finish items, last, by no one)
  kHeavyPieces,      // pieces of the call (the plan's total)
  kHeavyRows,        // rows of the heavy tokens (the plan's total: the written part of heavy_rows)
  kHeavyCounters
};

// Byte offsets of the workspace's parts from its start, each aligned to 256 bytes. The per-token
// counts (int [T]) come first, at 0.
struct TokenIndexWorkspace {
  long long header;        // kHeavyCounters unsigned 64-bit counters
  long long heavy_of;      // int [T]: a heavy token's index among them (written for those only)
  long long heavy_tokens;  // long long [max_heavy]: each heavy token, in registration order
  long long row_base;      // int [max_heavy]: where its rows start in heavy_rows
  long long piece_base;    // int [max_heavy]: its first piece, if it has more than kPieceRows rows
  long long token_summed;  // unsigned 64-bit [max_heavy]: its sum items done (the plan zeroes them)
  long long piece_token;   // int [max_pieces]: the heavy token (index) each piece belongs to
  long long chunk_counts;  // int [max_heavy][chunks]: its rows in each chunk of the row range
  long long heavy_rows;    // int [num_rows]: heavy tokens' rows, each token's in ascending order
  long long partials;      // float [max_pieces][partial_stride]: each piece's fp32 sum
  long long lists;         // int [T][list_capacity]: each token's first rows (the list path)
  long long bytes;         // the whole workspace
  long long max_heavy;     // heavy tokens a call can have
  long long max_pieces;    // pieces a call can have: at most 2R / (kPieceRows + 1)
  long long partial_stride;  // floats per partial sum: hidden rounded up to 8 (32-byte rows)
  long long chunk_rows;      // rows per chunk (the last one may have fewer)
  int chunks;                // chunks of the row range: a power of two,
  int chunk_shift;           //   1 << chunk_shift
};

MOEJIT_HOST_DEVICE inline long long workspace_align(long long bytes) {
  return (bytes + 255) / 256 * 256;
}

// Where the header starts: right after the counts (the list helpers find it from T alone).
MOEJIT_HOST_DEVICE inline long long token_index_header_offset(long long num_tokens) {
  return workspace_align(num_tokens * 4);
}

// The workspace of a call of T tokens, R rows of `hidden` elements and lists of list_capacity rows
// (0 where only the parts before the lists are wanted). Every part grows with T and R, so a
// workspace sized for a call serves every call with no more tokens and rows (and no more rows per
// token: list_capacity).
MOEJIT_HOST_DEVICE inline TokenIndexWorkspace token_index_workspace(long long num_tokens,
                                                                    long long num_rows,
                                                                    long long hidden,
                                                                    long long list_capacity) {
  TokenIndexWorkspace w;
  const long long t = num_tokens, r = num_rows > 0 ? num_rows : 0;
  const long long by_rows = r / (kMinListCapacity + 1);
  w.max_heavy = t < by_rows ? t : by_rows;
  w.max_pieces = 2 * r / (kPieceRows + 1);
  w.partial_stride = (hidden + 7) / 8 * 8;
  w.chunk_shift = 0;
  while ((1 << w.chunk_shift) < kMaxRowChunks &&
         (static_cast<long long>(kMinChunkRows) << w.chunk_shift) < r)
    ++w.chunk_shift;
  w.chunks = 1 << w.chunk_shift;
  w.chunk_rows = (r + w.chunks - 1) >> w.chunk_shift;
  long long at = token_index_header_offset(t);
  w.header = at;
  at += workspace_align(kHeavyCounters * 8);
  w.heavy_of = at;
  at += workspace_align(t * 4);
  w.heavy_tokens = at;
  at += workspace_align(w.max_heavy * 8);
  w.row_base = at;
  at += workspace_align(w.max_heavy * 4);
  w.piece_base = at;
  at += workspace_align(w.max_heavy * 4);
  w.token_summed = at;
  at += workspace_align(w.max_heavy * 8);
  w.piece_token = at;
  at += workspace_align(w.max_pieces * 4);
  w.chunk_counts = at;
  at += workspace_align(w.max_heavy * w.chunks * 4);
  w.heavy_rows = at;
  at += workspace_align(r * 4);
  w.partials = at;
  at += workspace_align(w.max_pieces * w.partial_stride * 4);
  w.lists = at;
  at += workspace_align(t * list_capacity * 4);
  w.bytes = at;
  return w;
}

}  // namespace moejit

#endif  // MOEJIT_TOKEN_INDEX_WORKSPACE_H_
