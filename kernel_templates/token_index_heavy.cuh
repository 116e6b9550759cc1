// The token index's list path for tokens past their list (a skewed routing: "heavy" tokens, with
// more rows than list_capacity, four times the average or more): their rows are spread over the
// whole GPU instead of one block walking token_idx. The kernel token_index_heavy
// (combine_token_index.cuh) runs these steps between token_index_assign and combine_lists; the
// combine leaves heavy tokens alone. Template parameters: see combine_common.cuh; the workspace's
// parts: token_index_workspace.h.
//
// token_index_assign registers each heavy token as its count passes the list (register_heavy).
// Then every warp of token_index_heavy takes work items in ticket order, five steps of them, each
// waiting for the steps before it:
//   count   one item per chunk of the row range: each heavy token's rows in the chunk;
//   plan    one item: where each heavy token's rows go (row_base) and its pieces (piece_base);
//   rank    one item per heavy token and chunk: the token's rows of the chunk, in ascending order,
//           written to their ranks in heavy_rows (ballots; the earlier chunks' counts give the
//           offset), and which pieces start there (piece_token);
//   sum     one item per piece of the tokens of more than kPieceRows rows and warp-wide part of a
//           row: the piece's rows summed in fp32 from zero in ascending order, to its partial;
//   finish  one item per heavy token and part: its rows in order (kPieceRows or fewer) or its
//           pieces' sums in piece order (add_heavy_token), stored to out. It waits for its own
//           token's sum items only (token_summed), so that the first tokens finish while the last
//           pieces are still summed.
// The summation moejit.h defines, whatever the geometry: bitwise the same on every path (the
// single launch sums such a token in the same pieces by itself, add_rows_by_ordered_walk).
//
// Why no deadlock without a grid barrier: a warp waits only for steps whose items all have smaller
// tickets than its own, and every ticket handed out belongs to a warp that is running and works on
// it without waiting for a larger one. The counters are zeroed by token_index_clear on every call.
//
// A kernel that needs a heavy token's fp32 sum instead of its stored row (the token index's
// epilogue, combine_epilogue.cuh) follows token_index_heavy without the finish (FINISH = false)
// and adds the token itself with add_heavy_token, in any geometry.
#ifndef MOEJIT_TOKEN_INDEX_HEAVY_CUH_
#define MOEJIT_TOKEN_INDEX_HEAVY_CUH_

#include "combine_common.cuh"
#include "token_index_rows.cuh"
#include "token_index_workspace.h"

namespace moejit {
namespace detail {

// The header's counters: right after the per-token counts.
__device__ __forceinline__ unsigned long long* heavy_counters(const CombineParams& p) {
  return reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(p.token_counts) +
                                               token_index_header_offset(p.num_tokens));
}

// token_index_assign, for the row that finds token t's list full (exactly one per heavy token):
// the token gets the next index among the heavy ones. Its list is never read.
__device__ __forceinline__ void register_heavy(const CombineParams& p, long long t) {
  const TokenIndexWorkspace w = token_index_workspace(p.num_tokens, p.num_rows, 0, 0);
  char* base = reinterpret_cast<char*>(p.token_counts);
  const unsigned long long h = atomicAdd(heavy_counters(p) + kHeavyTokens, 1ull);
  reinterpret_cast<long long*>(base + w.heavy_tokens)[h] = t;
  reinterpret_cast<int*>(base + w.heavy_of)[t] = static_cast<int>(h);
}

// The heavy-token parts of the workspace, and the tickets of this call: [0, count_end) count,
// [count_end, plan_end) the plan (one), [plan_end, rank_end) rank, then pieces * parts sums and
// heavy * parts finishes (their number known once the plan is over).
struct HeavyWork {
  unsigned long long* counter;
  const int* heavy_of;
  const long long* heavy_tokens;
  int* row_base;
  int* piece_base;
  unsigned long long* token_summed;
  int* piece_token;
  int* chunk_counts;
  int* heavy_rows;
  float* partials;
  long long partial_stride, chunk_rows;
  long long heavy;          // heavy tokens in this call
  int chunks, chunk_shift;  // chunks of the row range: 1 << chunk_shift
  unsigned long long count_end, plan_end, rank_end;
};

template <int HIDDEN>
__device__ __forceinline__ HeavyWork heavy_work(const CombineParams& p, long long heavy) {
  const TokenIndexWorkspace w = token_index_workspace(p.num_tokens, p.num_rows, HIDDEN, 0);
  char* base = reinterpret_cast<char*>(p.token_counts);
  HeavyWork s;
  s.counter = reinterpret_cast<unsigned long long*>(base + w.header);
  s.heavy_of = reinterpret_cast<const int*>(base + w.heavy_of);
  s.heavy_tokens = reinterpret_cast<const long long*>(base + w.heavy_tokens);
  s.row_base = reinterpret_cast<int*>(base + w.row_base);
  s.piece_base = reinterpret_cast<int*>(base + w.piece_base);
  s.token_summed = reinterpret_cast<unsigned long long*>(base + w.token_summed);
  s.piece_token = reinterpret_cast<int*>(base + w.piece_token);
  s.chunk_counts = reinterpret_cast<int*>(base + w.chunk_counts);
  s.heavy_rows = reinterpret_cast<int*>(base + w.heavy_rows);
  s.partials = reinterpret_cast<float*>(base + w.partials);
  s.partial_stride = w.partial_stride;
  s.chunk_rows = w.chunk_rows;
  s.heavy = heavy;
  s.chunks = w.chunks;
  s.chunk_shift = w.chunk_shift;
  s.count_end = static_cast<unsigned long long>(w.chunks);
  s.plan_end = s.count_end + 1;
  s.rank_end = s.plan_end + static_cast<unsigned long long>(heavy) * w.chunks;
  return s;
}

// Warp-wide parts of a row (32 lanes of UPT slots): the sum and finish items' unit.
template <int HIDDEN, int VEC, int UPT>
struct RowParts {
  enum { value = ((HIDDEN + VEC - 1) / VEC + 32 * UPT - 1) / (32 * UPT) };
};

// ---- ordering between warps --------------------------------------------------------------------
// A step's items publish their writes (each lane fences its own, then one release increment); a
// warp that waits for the step reads its count with acquire semantics, then the data with loads
// that bypass L1 (ld.global.cg: L1 is not coherent between SMs). Data the previous kernels wrote
// (counts, heavy_of, heavy_tokens, token_idx) is read through the read-only path as usual.

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* at) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(at) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* at) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(at) : "memory");
  return v;
}

// Every lane of the warp: until *counter reaches n.
__device__ __forceinline__ void wait_for_count(const unsigned long long* counter,
                                               unsigned long long n) {
  while (__shfl_sync(0xffffffffu, load_acquire(counter), 0) < n) __nanosleep(256);
}

// Every lane of the warp, after its item's writes: one more item of the step done.
__device__ __forceinline__ void publish_item(unsigned long long* counter) {
  __threadfence();
  __syncwarp();
  if (threadIdx.x % 32 == 0)
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// Entries of token_idx a lane reads per round trip in the count and rank steps (eight spilled in
// some modules: the kernel's register promise covers every step).
enum { kHeavyScan = 4 };

// ---- the steps ---------------------------------------------------------------------------------

// count: each heavy token's rows in chunk `chunk` of the row range (this warp owns that column of
// chunk_counts: it clears it first).
template <typename IdxT>
__device__ __forceinline__ void count_chunk_rows(const CombineParams& p, const HeavyWork& s,
                                                 int chunk) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int* column = s.chunk_counts + chunk;
  for (long long h = lane; h < s.heavy; h += 32) column[h * s.chunks] = 0;
  __syncwarp();
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const long long first = chunk * s.chunk_rows;
  const long long end = first + s.chunk_rows < p.num_rows ? first + s.chunk_rows : p.num_rows;
  // Each trip's entries are loaded during the trip before: a trip waits for the counts and the
  // heavy indices only (two dependent loads, not three).
  long long next[kHeavyScan];
#pragma unroll
  for (int u = 0; u < kHeavyScan; ++u) {
    const long long r = first + u * 32 + lane;
    next[u] = r < end ? static_cast<long long>(__ldg(token_idx + r)) : -1;
  }
#pragma unroll 1
  for (long long base = first; base < end; base += kHeavyScan * 32) {
    long long t[kHeavyScan];
    int h[kHeavyScan];
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u) {
      t[u] = next[u];
      const long long r = base + (kHeavyScan + u) * 32 + lane;
      next[u] = r < end ? static_cast<long long>(__ldg(token_idx + r)) : -1;
    }
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u)  // -2: a heavy token, whose index is read next
      h[u] = t[u] >= 0 && t[u] < p.num_tokens && __ldg(p.token_counts + t[u]) > p.list_capacity
                 ? -2
                 : -1;
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u)
      if (h[u] == -2) h[u] = __ldg(s.heavy_of + t[u]);
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u) {
      const unsigned same = __match_any_sync(0xffffffffu, h[u]);
      if (h[u] >= 0 && lane == __ffs(static_cast<int>(same)) - 1)
        atomicAdd(column + static_cast<long long>(h[u]) * s.chunks, __popc(same));
    }
  }
}

// plan: exclusive sums over the heavy tokens of their rows (row_base) and of their pieces where
// they have more than kPieceRows rows (piece_base), their sum-item counters zeroed (token_summed);
// the total of pieces to the header. One warp, 32 tokens per round.
__device__ __forceinline__ void plan_heavy_tokens(const CombineParams& p, const HeavyWork& s) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int rows_before = 0, pieces_before = 0;  // the rounds before
#pragma unroll 1
  for (long long first = 0; first < s.heavy; first += 32) {
    const long long h = first + lane;
    const int rows = h < s.heavy ? __ldg(p.token_counts + __ldg(s.heavy_tokens + h)) : 0;
    const int pieces = rows > kPieceRows ? (rows + kPieceRows - 1) / kPieceRows : 0;
    int rows_in = rows, pieces_in = pieces;  // inclusive sums over the lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int r = __shfl_up_sync(0xffffffffu, rows_in, d);
      const int q = __shfl_up_sync(0xffffffffu, pieces_in, d);
      if (lane >= d) {
        rows_in += r;
        pieces_in += q;
      }
    }
    if (h < s.heavy) {
      s.row_base[h] = rows_before + rows_in - rows;
      s.piece_base[h] = pieces_before + pieces_in - pieces;
      s.token_summed[h] = 0;
    }
    rows_before += __shfl_sync(0xffffffffu, rows_in, 31);
    pieces_before += __shfl_sync(0xffffffffu, pieces_in, 31);
  }
  if (lane == 0) {
    s.counter[kHeavyPieces] = static_cast<unsigned long long>(pieces_before);
    s.counter[kHeavyRows] = static_cast<unsigned long long>(rows_before);
  }
}

// rank: heavy token h's rows in chunk `chunk`, in ascending order, to heavy_rows at their ranks
// among all its rows; and the pieces whose first row is among them, to piece_token.
template <typename IdxT>
__device__ __forceinline__ void rank_chunk_rows(const CombineParams& p, const HeavyWork& s,
                                                long long h, int chunk) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int* counts = s.chunk_counts + h * s.chunks;
  int before = 0, here = 0;
  for (int c = lane; c < s.chunks; c += 32) {
    const int n = __ldcg(counts + c);
    if (c < chunk) before += n;
    if (c == chunk) here = n;
  }
  before = warp_sum(before);
  here = warp_sum(here);
  if (here == 0) return;  // uniform
  const long long token = __ldg(s.heavy_tokens + h);
  int* out = s.heavy_rows + __ldcg(s.row_base + h) + before;
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const long long first = chunk * s.chunk_rows;
  const long long end = first + s.chunk_rows < p.num_rows ? first + s.chunk_rows : p.num_rows;
  const unsigned below = lanes_below();
  int found = 0;  // uniform
#pragma unroll 1
  for (long long base = first; base < end && found < here; base += kHeavyScan * 32) {
    bool match[kHeavyScan];
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u) {
      const long long r = base + u * 32 + lane;
      match[u] = r < end && static_cast<long long>(__ldg(token_idx + r)) == token;
    }
#pragma unroll
    for (int u = 0; u < kHeavyScan; ++u) {
      const unsigned m = __ballot_sync(0xffffffffu, match[u]);
      if (match[u]) out[found + __popc(m & below)] = static_cast<int>(base + u * 32 + lane);
      found += __popc(m);
    }
  }
  if (__ldg(p.token_counts + token) > kPieceRows) {
    const int first_piece = (before + kPieceRows - 1) / kPieceRows;
    const int last_piece = (before + here - 1) / kPieceRows;
    int* pieces = s.piece_token + __ldcg(s.piece_base + h);
    for (int k = first_piece + lane; k <= last_piece; k += 32) pieces[k] = static_cast<int>(h);
  }
}

// BATCH rows (row ids, -1: none) added from their gates into sum; this thread's UPT slots
// first_slot + u * TPT. One round trip.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, int BATCH>
__device__ __forceinline__ void add_row_batch(const CombineParams& p, const int (&row)[BATCH],
                                              int first_slot, float (&sum)[UPT][VEC]) {
  typedef typename Elem<IN_DT>::storage S;
  bool mapped[BATCH];
  float gate[BATCH];
  Pack<S, VEC> v[BATCH][UPT];
  bool present[BATCH];
#pragma unroll
  for (int k = 0; k < BATCH; ++k)
    gate[k] = p.gates != nullptr && row[k] >= 0 ? __ldg(p.gates + row[k]) : 1.0f;
  add_held_rows<kLayoutTokenIndex, IN_DT, HIDDEN, VEC, BATCH, TPT, UPT, BATCH, BATCH, false>(
      p, static_cast<const S*>(p.expert), 0, first_slot, row, mapped, gate, v, present, sum);
}

// rows[0..n) (ascending row ids, written by this kernel) added from their gates into sum, BATCH
// per round trip; this thread's UPT slots first_slot + u * TPT.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, int BATCH>
__device__ __forceinline__ void add_ranked_rows(const CombineParams& p, const int* rows, int n,
                                                int first_slot, float (&sum)[UPT][VEC]) {
#pragma unroll 1
  for (int from = 0; from < n; from += BATCH) {
    int row[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) row[k] = from + k < n ? __ldcg(rows + from + k) : -1;
    add_row_batch<IN_DT, VEC, HIDDEN, UPT, TPT, BATCH>(p, row, first_slot, sum);
  }
}

// ---- a piece's rows, warp-wide ------------------------------------------------------------------
// A sum item's rows are the same for every lane of its warp (each adds its own slots), so the warp
// loads the piece's row ids once, together with the token's count, and keeps them in shared
// memory (registers are what the rows in flight need); a round trip then waits for its rows and
// their gates alone, not for a row-id load before them. The adds are the same fp32 fma chain in
// ascending row order.
enum { kPieceIds = kPieceRows / 32 };  // entries of a piece per lane

// Rows per round trip of a sum item at VEC_BYTES per row and lane, within the kernel's register
// promise (the steps' other state is live beside them): four vectors of 8 or 16 bytes, eight of
// 4 bytes or less (more spilled in some modules).
template <int VEC_BYTES>
struct PieceBatch {
  enum { value = VEC_BYTES >= 8 ? 4 : 8 };
};

// This warp's row ids of its piece (token_index_heavy's blocks: kHeavyThreads / 32 warps).
__device__ __forceinline__ int* warp_piece_ids() {
  __shared__ __align__(16) int ids[kHeavyThreads / 32][kPieceRows];
  return ids[threadIdx.x / 32];
}

// Entries [0, kPieceRows) of `rows` (a piece's ranked rows) into this lane's id[]: entry
// l + 32 * j at lane l, where it is one of the `readable` entries from `rows` on (-1 elsewhere):
// ranked rows only, never an unwritten one. Not bounded by the piece's count, so that the load
// need not wait for it: add_piece_rows drops the entries past the count.
__device__ __forceinline__ void load_piece_ids(const int* rows, long long readable,
                                               int (&id)[kPieceIds]) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < kPieceIds; ++j)
    id[j] = j * 32 + lane < readable ? __ldcg(rows + j * 32 + lane) : -1;
}

// The piece's first n rows (load_piece_ids' id[], n <= kPieceRows) added from their gates into
// sum, BATCH rows per round trip (a multiple of 4 that divides kPieceRows: the ids are read from
// shared memory four at a time); this thread's UPT slots first_slot + u * 32. Every lane of the
// warp, with the same rows.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int BATCH>
__device__ __forceinline__ void add_piece_rows(const CombineParams& p, const int (&id)[kPieceIds],
                                               int n, int first_slot, float (&sum)[UPT][VEC]) {
  static_assert(BATCH % 4 == 0 && kPieceRows % BATCH == 0, "whole int4s of ids per trip");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int* ids = warp_piece_ids();
#pragma unroll
  for (int j = 0; j < kPieceIds; ++j) ids[j * 32 + lane] = j * 32 + lane < n ? id[j] : -1;
  __syncwarp();
#pragma unroll 1
  for (int from = 0; from < n; from += BATCH) {
    int row[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; k += 4) {
      const int4 q = *reinterpret_cast<const int4*>(ids + from + k);
      row[k] = q.x;
      row[k + 1] = q.y;
      row[k + 2] = q.z;
      row[k + 3] = q.w;
    }
    add_row_batch<IN_DT, VEC, HIDDEN, UPT, 32, BATCH>(p, row, first_slot, sum);
  }
  __syncwarp();  // every lane has read the ids before the warp's next item writes its own
}

// VEC floats of a partial sum, past L1.
template <int VEC>
__device__ __forceinline__ void load_partial(const float* at, float (&x)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 q = __ldcg(reinterpret_cast<const float4*>(at + i));
      x[i] = q.x;
      x[i + 1] = q.y;
      x[i + 2] = q.z;
      x[i + 3] = q.w;
    }
  } else if constexpr (VEC == 2) {
    const float2 q = __ldcg(reinterpret_cast<const float2*>(at));
    x[0] = q.x;
    x[1] = q.y;
  } else {
    x[0] = __ldcg(at);
  }
}

// n partial sums from `partials` on, a stride apart, added in order into this thread's UPT slots
// (first_slot + u * TPT). 32 floats in flight: more spilled in token_index_heavy's finish.
template <int VEC, int HIDDEN, int UPT, int TPT>
__device__ __forceinline__ void add_partials(const float* partials, long long stride, int n,
                                             int first_slot, float (&sum)[UPT][VEC]) {
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
  constexpr int kInFlight = 32 / (UPT * VEC) > 0 ? 32 / (UPT * VEC) : 1;  // partials per trip
#pragma unroll 1
  for (int k = 0; k < n; k += kInFlight) {
    float x[kInFlight][UPT][VEC];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
        const int slot = first_slot + u * TPT;
        if (k + i < n && slot < kSlots)
          load_partial<VEC>(partials + (k + i) * stride + static_cast<long long>(slot) * VEC,
                            x[i][u]);
      }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (k + i < n)
#pragma unroll
        for (int u = 0; u < UPT; ++u)
#pragma unroll
          for (int e = 0; e < VEC; ++e) sum[u][e] += x[i][u][e];
  }
}

// A heavy token's sum into this thread's UPT slots (first_slot + u * TPT, in any geometry), once
// the rank step is over (count <= kPieceRows: its rows in ascending order) or the sum step is
// (more: its pieces' partial sums in piece order). sum starts at zero. For a kernel after
// token_index_heavy that needs the fp32 sum (FINISH = false there).
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT, int BATCH>
__device__ __forceinline__ void add_heavy_token(const CombineParams& p, const HeavyWork& s,
                                                long long tok, int count, int first_slot,
                                                float (&sum)[UPT][VEC]) {
  const int h = __ldg(s.heavy_of + tok);
  if (count <= kPieceRows)
    add_ranked_rows<IN_DT, VEC, HIDDEN, UPT, TPT, BATCH>(p, s.heavy_rows + __ldcg(s.row_base + h),
                                                         count, first_slot, sum);
  else
    add_partials<VEC, HIDDEN, UPT, TPT>(s.partials + __ldcg(s.piece_base + h) * s.partial_stride,
                                        s.partial_stride, (count + kPieceRows - 1) / kPieceRows,
                                        first_slot, sum);
}

// A sum item (piece i / parts: its rows to its partial sum) or, FINISHING, a finish item (heavy
// token i / parts: add_heavy_token's sum stored to out); part i % parts of the row. One copy of
// the row adds for both. Returns the item's heavy token (its index among them).
template <int IN_DT, int OUT_DT, int VEC, int HIDDEN, int UPT, int BATCH>
__device__ __forceinline__ int sum_part(const CombineParams& p, const HeavyWork& s,
                                        unsigned long long i, bool finishing) {
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
  constexpr int kParts = RowParts<HIDDEN, VEC, UPT>::value;
  const long long item = static_cast<long long>(i / kParts);
  const int first_slot =
      static_cast<int>(i % kParts) * (32 * UPT) + static_cast<int>(threadIdx.x) % 32;
  const int h = finishing ? static_cast<int>(item) : __ldcg(s.piece_token + item);
  const long long token = __ldg(s.heavy_tokens + h);
  const int first_piece = __ldcg(s.piece_base + h);
  // The rows of the piece, or of the whole token where it is one piece; else its partial sums.
  // The piece's row ids are loaded together with the token's count, not after it.
  const int first = finishing ? 0 : (static_cast<int>(item) - first_piece) * kPieceRows;
  const long long rows_from = __ldcg(s.row_base + h) + static_cast<long long>(first);
  int id[kPieceIds];
  const long long ranked = static_cast<long long>(__ldcg(s.counter + kHeavyRows));
  load_piece_ids(s.heavy_rows + rows_from, ranked - rows_from, id);
  const int count = __ldg(p.token_counts + token);
  const bool by_rows = !finishing || count <= kPieceRows;
  float sum[UPT][VEC];
  clear_sums(sum);
  if (by_rows)
    add_piece_rows<IN_DT, VEC, HIDDEN, UPT, BATCH>(
        p, id, count - first < kPieceRows ? count - first : kPieceRows, first_slot, sum);
  else
    add_partials<VEC, HIDDEN, UPT, 32>(s.partials + first_piece * s.partial_stride,
                                       s.partial_stride, (count + kPieceRows - 1) / kPieceRows,
                                       first_slot, sum);
  if (finishing) {
    store_row_slots<OUT_DT, VEC, HIDDEN, UPT, 32>(
        static_cast<typename Elem<OUT_DT>::storage*>(p.out) + token * p.out_stride, first_slot, sum,
        p);
    return h;
  }
  float* partial = s.partials + item * s.partial_stride;
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    const int slot = first_slot + u * 32;
    if (slot < kSlots) {
      Pack<float, VEC> q;
#pragma unroll
      for (int e = 0; e < VEC; ++e) q.e[e] = sum[u][e];
      *reinterpret_cast<Pack<float, VEC>*>(partial + static_cast<long long>(slot) * VEC) = q;
    }
  }
  return h;
}

// Every lane of the warp, before heavy token h's finish items: until its pieces are summed (none
// to wait for with kPieceRows rows or fewer: the finish adds the rows themselves).
template <int HIDDEN, int VEC, int UPT>
__device__ __forceinline__ void wait_for_token_pieces(const CombineParams& p, const HeavyWork& s,
                                                      long long h) {
  const int count = __ldg(p.token_counts + __ldg(s.heavy_tokens + h));
  if (count > kPieceRows)
    wait_for_count(s.token_summed + h,
                   static_cast<unsigned long long>((count + kPieceRows - 1) / kPieceRows) *
                       RowParts<HIDDEN, VEC, UPT>::value);
}

// ---- handing out the work ----------------------------------------------------------------------

enum : unsigned long long { kNoTicket = ~0ull };

// Tickets before the finishes, and in all, once the plan is over (it counts the pieces).
template <int HIDDEN, int VEC, int UPT>
__device__ __forceinline__ unsigned long long sum_end(const HeavyWork& s) {
  return s.rank_end + load_relaxed(s.counter + kHeavyPieces) * RowParts<HIDDEN, VEC, UPT>::value;
}
template <int HIDDEN, int VEC, int UPT, bool FINISH>
__device__ __forceinline__ unsigned long long tickets_end(const HeavyWork& s) {
  return sum_end<HIDDEN, VEC, UPT>(s) +
         (FINISH ? static_cast<unsigned long long>(s.heavy) * RowParts<HIDDEN, VEC, UPT>::value
                 : 0);
}

// Every lane of the warp: the next ticket, or kNoTicket once none is left. A ticket past the rank
// step waits for the plan to know whether there is such an item.
template <int HIDDEN, int VEC, int UPT, bool FINISH>
__device__ __forceinline__ unsigned long long claim_ticket(const HeavyWork& s) {
  unsigned long long t = kNoTicket;
  if (threadIdx.x % 32 == 0) {
    // Once the end is known, a warp with nothing left to take leaves without an atomic.
    const bool open =
        load_acquire(s.counter + kHeavyPlanned) == 0 ||
        load_relaxed(s.counter + kHeavyTicket) < tickets_end<HIDDEN, VEC, UPT, FINISH>(s);
    if (open) t = atomicAdd(s.counter + kHeavyTicket, 1ull);
  }
  t = __shfl_sync(0xffffffffu, t, 0);
  if (t != kNoTicket && t >= s.rank_end) {
    wait_for_count(s.counter + kHeavyPlanned, 1);
    if (t >= tickets_end<HIDDEN, VEC, UPT, FINISH>(s)) t = kNoTicket;
  }
  return t;
}

// Every lane of the warp: takes work items until none is left. FINISH: the finish step too (the
// plain combine); without it the heavy tokens are left for the next kernel (add_heavy_token),
// which waits for this one.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int UPT, int BATCH,
          bool FINISH>
__device__ __forceinline__ void do_heavy_work(const CombineParams& p, const HeavyWork& s) {
#pragma unroll 1
  for (;;) {
    const unsigned long long t = claim_ticket<HIDDEN, VEC, UPT, FINISH>(s);
    if (t == kNoTicket) return;
    if (t < s.count_end) {
      count_chunk_rows<IdxT>(p, s, static_cast<int>(t));
      publish_item(s.counter + kHeavyCounted);
    } else if (t < s.plan_end) {
      plan_heavy_tokens(p, s);
      publish_item(s.counter + kHeavyPlanned);
    } else if (t < s.rank_end) {
      wait_for_count(s.counter + kHeavyCounted, s.count_end);
      wait_for_count(s.counter + kHeavyPlanned, 1);
      const unsigned long long i = t - s.plan_end;
      rank_chunk_rows<IdxT>(p, s, static_cast<long long>(i >> s.chunk_shift),
                            static_cast<int>(i & (s.chunks - 1)));
      publish_item(s.counter + kHeavyRanked);
    } else {
      wait_for_count(s.counter + kHeavyRanked, s.rank_end - s.plan_end);
      const unsigned long long pieces_end = sum_end<HIDDEN, VEC, UPT>(s);
      const bool finishing = FINISH && t >= pieces_end;  // tickets past the end were refused
      const unsigned long long i = t - (finishing ? pieces_end : s.rank_end);
      if (finishing)
        wait_for_token_pieces<HIDDEN, VEC, UPT>(
            p, s, static_cast<long long>(i / RowParts<HIDDEN, VEC, UPT>::value));
      const int h = sum_part<IN_DT, OUT_DT, VEC, HIDDEN, UPT, BATCH>(p, s, i, finishing);
      if (!finishing) publish_item(s.token_summed + h);  // a finish item has no one waiting
    }
  }
}

}  // namespace detail
}  // namespace moejit

#endif  // MOEJIT_TOKEN_INDEX_HEAVY_CUH_
