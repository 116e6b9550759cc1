// The token index's ways to find a token's rows: the single launch's scans of token_idx (shared
// lists, ordered warp slabs, the small-call form), and the paths for a token with more rows than
// it holds in registers (a skewed routing): its list added in order, and walks of token_idx past
// its list. Used by combine_token_index.cuh; template parameters: see combine_common.cuh.
#ifndef MOEJIT_TOKEN_INDEX_ROWS_CUH_
#define MOEJIT_TOKEN_INDEX_ROWS_CUH_

#include "combine_common.cuh"

namespace moejit {
namespace detail {

// More rows for one token than its list holds (a skewed routing): walk token_idx in row order
// and add this token's rows, in the same ascending order as the listed path. Slow but bounded,
// and bitwise identical to what a longer list would give. Token groups narrower than a warp (short
// rows); whole warps walk 32 entries per step (add_rows_by_warp_walk), and the ordered scan lists
// later windows instead (relist_slab_window).
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, typename IdxT>
__device__ __forceinline__ void add_rows_by_walk(const CombineParams& p, long long tok,
                                                 int first_slot, float (&sum)[UPT][VEC]) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
#pragma unroll 1  // rare and long: unrolling would only multiply its code (and compile time)
  for (long long r = 0; r < p.num_rows; ++r) {
    if (static_cast<long long>(__ldg(token_idx + r)) != tok) continue;
    add_row<IN_DT, VEC, HIDDEN, UPT, TPT>(p, r, p.gates != nullptr ? __ldg(p.gates + r) : 1.0f,
                                          first_slot, sum);
  }
}

// The same walk by whole warps (TPT a multiple of 32: every lane of a warp adds the same token's
// rows, each to its own slots): a step loads 32 entries with one instruction, and the warp's
// ballot names the token's rows among them; those rows are then added one at a time in ascending
// order. 32 entries per round trip instead of one.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, typename IdxT>
__device__ __forceinline__ void add_rows_by_warp_walk(const CombineParams& p, long long tok,
                                                      int first_slot, float (&sum)[UPT][VEC]) {
  static_assert(TPT % 32 == 0, "whole warps of one token");
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const IdxT want = static_cast<IdxT>(tok);  // the token has rows: nameable
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll 1
  for (long long base = 0; base < p.num_rows; base += 32) {
    const long long r = base + lane;
    unsigned bits = __ballot_sync(0xffffffffu, r < p.num_rows && __ldg(token_idx + r) == want);
#pragma unroll 1  // one copy of the row's adds
    for (; bits != 0; bits &= bits - 1) {
      const long long row = base + (__ffs(static_cast<int>(bits)) - 1);
      add_row<IN_DT, VEC, HIDDEN, UPT, TPT>(
          p, row, p.gates != nullptr ? __ldg(p.gates + row) : 1.0f, first_slot, sum);
    }
  }
}

// A token-index list longer than the rows held in registers (a skewed routing) but within
// LIST_CAP: add its rows in ascending row order, two at a time. Each pass over the list (short and
// cached) keeps the two smallest ids above the last one added, inserting each entry into a sorted
// pair in registers; both rows are then loaded together (a pass per row was much slower for
// uneven routings: docs/performance.md#kernel-variants). Quadratic in the list length, but bitwise
// identical to the held path and to add_rows_by_walk (the same rows in the same order). `list` is
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
// token_idx). Blocks of one token take scan_token_rows_ordered below (no atomics, no sort).
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

// One step of a warp's ordered list (scan_token_rows_ordered, relist_slab_window): the lanes
// where `match` holds append their row r, in lane order, to a shared-memory list at shared
// address `list`: the warp's earlier matches number `listed`, and the list starts at its match
// number `skip` (both warp-uniform). Matches before or past the list are counted, not stored.
// Returns how many lanes matched.
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

// The OR of v over the warp (every lane active).
__device__ __forceinline__ unsigned warp_or(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned r;
  asm("redux.sync.or.b32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
#else
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) v |= __shfl_xor_sync(0xffffffffu, v, lanes);
  return v;
#endif
}

// The slab form's count of the block's token's rows in each warp's slab, from its first scan
// (scan_token_rows_ordered), kept for later windows (relist_slab_window): one array per kernel.
template <int WARPS>
__device__ __forceinline__ int* slab_counts() {
  __shared__ int s_found[WARPS];
  return s_found;
}

// The slab form past its list (a token with more than LIST_CAP rows: four times the average):
// lists the token's rows at positions [from, from + LIST_CAP) of its ascending list into `list`,
// the block's merged list, which the held rounds then add like the first window. Each warp scans
// its slab again; its rows follow those of the warps before it (slab_counts), so every match is
// written straight to its position: no per-warp list, no merge. One load per 32 entries per step,
// a warp's scan ending once past the window (a walk of token_idx costs one dependent load per
// entry in every thread). Not inlined: inlined, it changed how ptxas scheduled the first scan's
// batch (one load of eight after the compares: a second round trip per batch in every call).
// Every thread of the block calls it (barriers).
template <typename IdxT, int BLOCK, int LIST_CAP>
__device__ __noinline__ void relist_slab_window(const IdxT* __restrict__ token_idx, int rows,
                                                long long tok, int from, int count, int* list) {
  enum { kWarps = BLOCK / 32 };
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned below = lanes_below();
  const unsigned list_at = static_cast<unsigned>(__cvta_generic_to_shared(list));
  const IdxT want = static_cast<IdxT>(tok);  // nameable: the token has rows
  int at = -from;    // the window position of this warp's next row (negative: before the window)
  int mine = count;  // this warp's rows
  if constexpr (kWarps > 1) {
    const int* found = slab_counts<kWarps>();
#pragma unroll 1
    for (int w = 0; w < warp; ++w) at += found[w];
    mine = found[warp];
  }
  // The first scan's slabs (scan_token_rows_ordered).
  const int slab = (rows + 32 * kWarps - 1) / (32 * kWarps) * 32;
  const int begin = warp * slab, end = min(begin + slab, rows);
  __syncthreads();      // every thread has read the previous window
  if (at + mine > 0) {  // warp-uniform: some of this warp's rows are in or past the window
#pragma unroll 1
    for (int base = begin; base < end && at < LIST_CAP; base += 32) {
      const int r = base + lane;
      const bool match = r < end && __ldg(token_idx + r) == want;
      at += list_matches<LIST_CAP>(match, r, at, 0, below, list_at);
    }
  }
  __syncthreads();
}

// Token index, single launch, one token per block (whole warps: every decode-sized and wide-row
// call): the same scan without atomics or a sort. A warp reads 32 entries of token_idx per load
// instruction; each match learns its rank among the warp's matches from a ballot and writes its
// row id there, so a warp's list is in ascending row order: the order the combine sums in. At
// decode the kernel is bound by one warp's instruction chain, which this keeps short.
// Two forms, each its own module (kTokenIndexSmallScan / kTokenIndexOrderedScan; the host picks by
// the call's rows):
//  - SMALL (calls with at most BLOCK rows): every warp reads all of token_idx, one load per 32
//    entries, and keeps its own list: no block barrier, no merge, no unused loads of a full batch,
//    and no walk of token_idx for long lists. The list is a window of LIST_CAP entries starting at
//    list position `from`; a token with more rows (a skewed routing) has the combine scan again
//    for each later window. A window, not a list for every row of the call: a block's larger
//    shared memory made a dependent launch after a producer that uses none start late.
//  - Otherwise warp w reads its own contiguous slab (kScanBatch loads in flight) and the warps'
//    lists, one after another, are the token's rows in ascending order (merged in shared memory).
// Returns the token's row count; `list` then holds its rows (in the slab form the first LIST_CAP
// of them; more are counted, and the combine lists them a window at a time, relist_slab_window).
// The host scans only calls with R <= 24 * BLOCK entries, so row ids fit an int.
template <typename IdxT, int BLOCK, int LIST_CAP, bool SMALL>
__device__ __forceinline__ int scan_token_rows_ordered(const CombineParams& p, long long tok,
                                                       int*& list, int from = 0) {
  static_assert(BLOCK % 32 == 0, "whole warps");
  enum { kWarps = BLOCK / 32 };
  __shared__ __align__(16) int s_rows[kWarps][LIST_CAP];
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const unsigned below = lanes_below();
  // A token id no IdxT can hold (past 2^31 with int32 indices) has no rows.
  const IdxT want = static_cast<IdxT>(tok);
  const bool nameable = static_cast<long long>(want) == tok;
  const int rows = static_cast<int>(p.num_rows);  // SMALL: <= BLOCK (the host)
  // The list's shared-memory address, once: a generic pointer here made the compiler rebuild the
  // address (CTA id included) for every store.
  const unsigned warp_rows = static_cast<unsigned>(__cvta_generic_to_shared(s_rows[warp]));
  int found = 0;  // warp-uniform
  // Appends row r to the warp's list where `match` holds (this lane's entry names the token;
  // dropped ids, negative, never do).
  auto append = [&](bool match, int r) {
    found += list_matches<LIST_CAP>(match, r, found, from, below, warp_rows);
  };
  if constexpr (SMALL) {
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
  } else {
    // This warp's slab: whole 32-entry groups of token_idx (coalesced, aligned loads).
    const int slab = (rows + 32 * kWarps - 1) / (32 * kWarps) * 32;
    const int begin = warp * slab, end = min(begin + slab, rows);
#pragma unroll 1
    for (int base = begin; base < end; base += 32 * kScanBatch) {
      IdxT t[kScanBatch];
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) {
        const int r = base + i * 32 + lane;
        t[i] = r < end ? __ldg(token_idx + r) : IdxT(-1);
      }
      // Bit i: this lane's entry i names the token. Only the batch's entries that some lane
      // matched are appended, in ascending order: most batches of a mid-size call hold none of
      // the token's rows, and one unrolled append per entry was most of the slab loop's code.
      unsigned mine = 0;
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i)
        mine |= static_cast<unsigned>(nameable && t[i] == want) << i;
#pragma unroll 1  // usually no iteration, or one: one copy of the append
      for (unsigned any = warp_or(mine); any != 0; any &= any - 1) {
        const int i = __ffs(static_cast<int>(any)) - 1;
        append(((mine >> i) & 1u) != 0, base + i * 32 + lane);
      }
    }
    if constexpr (kWarps == 1) {
      __syncwarp();
      list = s_rows[0];
      return found;
    } else {
      int* s_found = slab_counts<kWarps>();
      __shared__ __align__(16) int s_list[LIST_CAP];
      if (lane == 0) s_found[warp] = found;
      __syncthreads();
      int start[kWarps], total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        start[w] = total;
        total += s_found[w];
      }
      // One list for the combine (the held rows are read from it as vectors): the token's first
      // LIST_CAP rows, all of which some warp listed. A list longer than the block (LIST_CAP 128
      // in 64-thread blocks: more than 16 rows per token on average, rows of 33-64 vectors) takes
      // a thread two entries.
#pragma unroll
      for (int i = 0; i < (LIST_CAP + BLOCK - 1) / BLOCK; ++i) {
        const int k = static_cast<int>(threadIdx.x) + i * BLOCK;
        if (k < total && k < LIST_CAP) {
          int in_warp = 0, at = k;  // entry `at` of warp `in_warp`'s list
#pragma unroll
          for (int w = 1; w < kWarps; ++w)
            if (k >= start[w]) {
              in_warp = w;
              at = k - start[w];
            }
          s_list[k] = s_rows[in_warp][at];
        }
      }
      __syncthreads();
      list = s_list;
      return total;
    }
  }
}

// N consecutive entries of an ordered scan's list (shared memory, 16-byte aligned) from `at`, a
// multiple of N entries: as whole vectors. The compiler issued them so by itself only while the
// list's start was fixed; the slab form's later windows (relist_slab_window) move it.
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
// the fixed layouts), from the first block only (every block reads the same entries): the ordered
// scans (one token per block) all of token_idx, one line per thread (24 * BLOCK entries at most,
// so every line of an int32 index); the shared-list scan the block's first batch. The gates are
// read by row, known only after the scan.
template <typename IdxT, int TPT, int TPB, bool ORDERED>
__device__ __forceinline__ void prefetch_scan_routing(const CombineParams& p) {
  const IdxT* routing = static_cast<const IdxT*>(p.indices);
  const long long rows = p.num_rows;
  if (blockIdx.x != 0 || blockIdx.y != 0 || rows <= 0) return;
  const long long batch = static_cast<long long>(kScanBatch) * TPT * TPB;
  const long long entries = ORDERED || rows < batch ? rows : batch;
  prefetch_l2_line(routing, entries * static_cast<long long>(sizeof(IdxT)),
                   static_cast<int>(threadIdx.x));
}

}  // namespace detail
}  // namespace moejit

#endif  // MOEJIT_TOKEN_INDEX_ROWS_CUH_
