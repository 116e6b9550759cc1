// The token index's ways to find a token's rows: the single launch's scans of token_idx (lists in
// shared memory, the small-call form's ordered warp lists), and the paths for a token with more
// rows than it holds in registers (a skewed routing): its list added in order, and the single
// launch's walk of token_idx past its list. Used by combine_token_index.cuh and
// token_index_heavy.cuh (the list path past a list); template parameters: see combine_common.cuh.
#ifndef MOEJIT_TOKEN_INDEX_ROWS_CUH_
#define MOEJIT_TOKEN_INDEX_ROWS_CUH_

#include "combine_common.cuh"
#include "token_index_workspace.h"

namespace moejit {
namespace detail {

// The rows first_row + i for the set bits i of `bits`, in ascending order, added BATCH per round
// trip to `piece`, which joins `sum` whenever it completes kPieceRows rows (in_piece counts them).
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, int BATCH>
__device__ __forceinline__ void add_rows_in_pieces(const CombineParams& p, unsigned bits,
                                                   long long first_row, int first_slot,
                                                   int& in_piece, float (&piece)[UPT][VEC],
                                                   float (&sum)[UPT][VEC]) {
  typedef typename Elem<IN_DT>::storage S;
#pragma unroll 1
  while (bits != 0) {
    const int room = kPieceRows - in_piece;
    int row[BATCH];
    bool mapped[BATCH];
    float gate[BATCH];
    Pack<S, VEC> v[BATCH][UPT];
    bool present[BATCH];
    int taken = 0;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      row[k] = -1;
      if (bits != 0 && k < room) {
        row[k] = static_cast<int>(first_row + __ffs(static_cast<int>(bits)) - 1);
        bits &= bits - 1;
        ++taken;
      }
      gate[k] = p.gates != nullptr && row[k] >= 0 ? __ldg(p.gates + row[k]) : 1.0f;
    }
    add_held_rows<kLayoutTokenIndex, IN_DT, HIDDEN, VEC, BATCH, TPT, UPT, BATCH, BATCH, false>(
        p, static_cast<const S*>(p.expert), 0, first_slot, row, mapped, gate, v, present, piece);
    in_piece += taken;
    if (in_piece == kPieceRows) {  // a piece is complete: its sum joins the total
#pragma unroll
      for (int u = 0; u < UPT; ++u)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          sum[u][e] += piece[u][e];
          piece[u][e] = 0.0f;
        }
      in_piece = 0;
    }
  }
}

// More rows for one token than the single launch's list holds (a skewed routing): walk token_idx in
// row order and add this token's rows in ascending order, in pieces of kPieceRows (moejit.h): each
// piece summed from zero, then added to the total as it completes. The list path's heavy tokens
// are summed the same way by many blocks (token_index_heavy.cuh): bitwise the same result, and
// the one a longer list would give (a token of at most kPieceRows rows is one piece). Whole warps
// (TPT a multiple of 32: every lane adds the same rows, each to its own slots) read 8 x 32 entries
// per round trip and name the token's rows with ballots; narrower groups read 8 entries per thread.
// The rows found are added BATCH per round trip, a batch never crossing the end of a piece.
// Slow next to the list path, which spreads a heavy token over the GPU, but bounded: the single
// launch takes only calls of a few rows per thread.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, int BATCH, typename IdxT>
__device__ __forceinline__ void add_rows_by_ordered_walk(const CombineParams& p, long long tok,
                                                         int first_slot, float (&sum)[UPT][VEC]) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const IdxT want = static_cast<IdxT>(tok);  // the token has rows: nameable
  float piece[UPT][VEC];
  clear_sums(piece);
  int in_piece = 0;  // rows of the current piece added so far (uniform across the group)
  if constexpr (TPT % 32 == 0) {
#pragma unroll 1
    for (long long base = 0; base < p.num_rows; base += 8 * 32) {
      // Read again each round (one instruction), not kept across the loop: in the short-row
      // blocks ptxas spilled it.
      unsigned lane;
      asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
      unsigned bits[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const long long r = base + u * 32 + lane;
        bits[u] = __ballot_sync(0xffffffffu, r < p.num_rows && __ldg(token_idx + r) == want);
      }
      // One copy of the adds: the ballots move down a register queue (an index into bits that
      // the loop does not unroll would put the array in local memory).
#pragma unroll 1
      for (int u = 0; u < 8; ++u) {
        add_rows_in_pieces<IN_DT, VEC, HIDDEN, UPT, TPT, BATCH>(p, bits[0], base + u * 32,
                                                                first_slot, in_piece, piece, sum);
#pragma unroll
        for (int q = 0; q < 7; ++q) bits[q] = bits[q + 1];
      }
    }
  } else {
#pragma unroll 1
    for (long long base = 0; base < p.num_rows; base += 8) {
      unsigned bits = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (base + i < p.num_rows && __ldg(token_idx + base + i) == want) bits |= 1u << i;
      add_rows_in_pieces<IN_DT, VEC, HIDDEN, UPT, TPT, BATCH>(p, bits, base, first_slot, in_piece,
                                                              piece, sum);
    }
  }
  // The last piece (a sum that starts at +0.0 never becomes -0.0: adding a +0.0 piece changes no
  // bit).
#pragma unroll
  for (int u = 0; u < UPT; ++u)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] += piece[u][e];
}

// A token-index list longer than the rows held in registers (a skewed routing) but within
// LIST_CAP: add its rows in ascending row order, two at a time. Each pass over the list (short and
// cached) keeps the two smallest ids above the last one added, inserting each entry into a sorted
// pair in registers; both rows are then loaded together (a pass per row was much slower for
// uneven routings: docs/performance.md#kernel-variants). Quadratic in the list length, but bitwise
// identical to the held path and to a longer list's (the same rows in the same order). `list` is
// in the workspace (list path) or in shared memory (single launch): plain loads serve both.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT>
__device__ __forceinline__ void add_listed_rows_in_order(const CombineParams& p, const int* list,
                                                         int count, int first_slot,
                                                         float (&sum)[UPT][VEC]) {
  typedef typename Elem<IN_DT>::storage S;
  int prev = -1;
#pragma unroll 1  // rare: keep one copy of the code
  for (int done = 0; done < count; done += 2) {
    int next[2] = {0x7fffffff, 0x7fffffff};
#pragma unroll 1
    for (int k = 0; k < count; ++k) {
      const int r = list[k];
      if (r <= prev) continue;
      const int lo = min(next[0], r);
      next[1] = min(next[1], max(next[0], r));
      next[0] = lo;
    }
    Pack<S, VEC> v[2][UPT];
    float w[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool present = done + j < count;
      w[j] = present && p.gates != nullptr ? __ldg(p.gates + next[j]) : 1.0f;
      load_row_slots<S, VEC, HIDDEN, UPT, TPT>(
          present, static_cast<const S*>(p.expert) + (present ? next[j] : 0) * p.expert_stride,
          first_slot, v[j]);
    }
    prev = next[1];  // past the count: 0x7fffffff, and the loop ends
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (done + j < count) add_row_slots<IN_DT, VEC, UPT>(w[j], v[j], sum);
  }
}

// Token index, single launch: the whole block reads all of token_idx (at most 24 entries per
// thread, from L2 after the first block; the host checks) and appends every row of its TPB tokens
// to that token's list in shared memory. Each thread checks rows threadIdx.x, + BLOCK, ... with
// kScanBatch independent loads in flight, so the scan costs rows / (BLOCK * kScanBatch) round
// trips. Lists come out in atomic arrival order, like the workspace lists of the list path: the
// combine sorts them. Rows past LIST_CAP are not listed but counted (the combine then walks
// token_idx). Calls of at most a block's rows in one-token blocks take scan_token_rows_small.
//
// kScanBatch is an enum, not a constexpr variable: once no plain __global__ function was left in
// the module, NVRTC emitted such variables as device symbols whose names carry a per-compile hash,
// and two compiles of one program then gave different bytes (tests/cache/test_cache_store.cpp).
enum { kScanBatch = 8 };
template <typename IdxT, int BLOCK, int TPB, int LIST_CAP>
__device__ __forceinline__ void scan_token_rows(const CombineParams& p, long long first_tok,
                                                int (&count)[TPB], int (&rows)[TPB][LIST_CAP]) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < TPB) count[tid] = 0;
  __syncthreads();
  for (long long base = 0; base < p.num_rows; base += BLOCK * kScanBatch) {
    IdxT t[kScanBatch];
#pragma unroll
    for (int i = 0; i < kScanBatch; ++i) {
      const long long r = base + i * BLOCK + tid;
      t[i] = r < p.num_rows ? __ldg(token_idx + r) : IdxT(-1);
    }
#pragma unroll
    for (int i = 0; i < kScanBatch; ++i) {
      // Negative ids (dropped) and ids of other blocks' tokens fail the unsigned compare.
      const long long id = static_cast<long long>(t[i]);
      const unsigned long long d = static_cast<unsigned long long>(id - first_tok);
      if (d < static_cast<unsigned long long>(TPB) && id < p.num_tokens) {
        const int at = atomicAdd(&count[d], 1);
        if (at < LIST_CAP) rows[d][at] = static_cast<int>(base + i * BLOCK + tid);
      }
    }
  }
  __syncthreads();
}

// The lanes below this one, as a mask (for a lane's rank among a ballot's set bits).
__device__ __forceinline__ unsigned lanes_below() {
  unsigned below;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(below));
  return below;
}

// One step of a warp's ordered list (scan_token_rows_small): the lanes where `match` holds append
// their row r, in lane order, to a shared-memory list at shared address `list`: the warp's
// earlier matches number `listed`, and the list starts at its match number `skip` (both
// warp-uniform). Matches before or past the list are counted, not stored. Returns how many lanes
// matched.
template <int LIST_CAP>
__device__ __forceinline__ int list_matches(bool match, int r, int listed, int skip, unsigned below,
                                            unsigned list) {
  const unsigned m = __ballot_sync(0xffffffffu, match);
  // Before the list: negative, so past the cap as unsigned.
  const unsigned at = static_cast<unsigned>(listed + __popc(m & below) - skip);
  if (match && at < LIST_CAP)
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(list + 4u * at), "r"(r) : "memory");
  return __popc(m);
}

// Token index, single launch, the small-call form (one token per block in whole warps, calls with
// at most BLOCK rows): the same search without atomics, a sort or a block barrier. Every warp
// reads all of token_idx, 32 entries per load instruction; each match learns its rank among the
// warp's matches from a ballot and writes its row id there, so the warp's list is in ascending
// row order: the order the combine sums in. At decode the kernel is bound by one warp's
// instruction chain, which this keeps short. The list is a window of LIST_CAP entries starting at
// list position `from`; a token with more rows (a skewed routing) has the combine scan again for
// each later window. A window, not a list for every row of the call: a block's larger shared
// memory made a dependent launch after a producer that uses none start late.
// Returns the token's row count; `list` then holds the window's rows.
template <typename IdxT, int BLOCK, int LIST_CAP>
__device__ __forceinline__ int scan_token_rows_small(const CombineParams& p, long long tok,
                                                     int*& list, int from) {
  static_assert(BLOCK % 32 == 0, "whole warps");
  enum { kWarps = BLOCK / 32 };
  __shared__ __align__(16) int s_rows[kWarps][LIST_CAP];
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned below = lanes_below();
  // A token id no IdxT can hold (past 2^31 with int32 indices) has no rows.
  const IdxT want = static_cast<IdxT>(tok);
  const bool nameable = static_cast<long long>(want) == tok;
  const int rows = static_cast<int>(p.num_rows);  // <= BLOCK (the host)
  // The list's shared-memory address, once: a generic pointer here made the compiler rebuild the
  // address (CTA id included) for every store.
  const unsigned warp_rows = static_cast<unsigned>(__cvta_generic_to_shared(s_rows[warp]));
  int found = 0;  // warp-uniform
  // Appends row r to the warp's list where `match` holds (this lane's entry names the token;
  // dropped ids, negative, never do).
  auto append = [&](bool match, int r) {
    found += list_matches<LIST_CAP>(match, r, found, from, below, warp_rows);
  };
  IdxT t[kWarps];
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    const int r = i * 32 + lane;
    t[i] = r < rows ? __ldg(token_idx + r) : IdxT(-1);
  }
#pragma unroll
  for (int i = 0; i < kWarps; ++i) append(nameable && t[i] == want, i * 32 + lane);
  __syncwarp();
  list = s_rows[warp];
  return found;
}

// N consecutive entries of the small-call scan's list (shared memory, 16-byte aligned) from `at`,
// a multiple of N entries: as whole vectors (later windows move the list's start, and the compiler
// vectorizes only a fixed one).
template <int N>
__device__ __forceinline__ void load_list_entries(const int* at, int (&row)[N]) {
  constexpr int kPerLoad = N < 4 ? N : 4;
  static_assert(N % kPerLoad == 0, "1, 2, 4, 8, 12 or 16 held rows");
  struct __align__(4 * kPerLoad) Entries {
    int v[kPerLoad];
  };
#pragma unroll
  for (int i = 0; i < N / kPerLoad; ++i) {
    const Entries e = reinterpret_cast<const Entries*>(at)[i];
#pragma unroll
    for (int j = 0; j < kPerLoad; ++j) row[i * kPerLoad + j] = e.v[j];
  }
}

// The single launch's routing prefetch before a dependent launch's wait (prefetch_slot_routing for
// the fixed layouts), from the first block only (every block reads the same entries): the
// small-call form all of token_idx (at most a block's entries, one line per thread); the
// shared-list scan the block's first batch. The gates are read by row, known only after the scan.
template <typename IdxT, int TPT, int TPB, bool SMALL>
__device__ __forceinline__ void prefetch_scan_routing(const CombineParams& p) {
  const IdxT* routing = static_cast<const IdxT*>(p.indices);
  const long long rows = p.num_rows;
  if (blockIdx.x != 0 || blockIdx.y != 0 || rows <= 0) return;
  const long long batch = static_cast<long long>(kScanBatch) * TPT * TPB;
  const long long entries = SMALL || rows < batch ? rows : batch;
  prefetch_l2_line(routing, entries * static_cast<long long>(sizeof(IdxT)),
                   static_cast<int>(threadIdx.x));
}

}  // namespace detail
}  // namespace moejit

#endif  // MOEJIT_TOKEN_INDEX_ROWS_CUH_
