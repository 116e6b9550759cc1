// The token index's kernels: an arbitrary token_idx[R] names each row's token. Either two small
// helpers list every token's rows first (token_index_clear, token_index_assign: the list path,
// combine_lists), or one launch finds them itself (combine_scan: every block scans all of
// token_idx for its own tokens). Either way a token's rows are summed in ascending row order
// (in pieces of kPieceRows past that many, token_index_workspace.h), whatever order the lists
// arrived in: the result is bitwise the same on every path. Template parameters: see
// combine_common.cuh; the host's choice among them: src/combine_dispatch.cpp.
#ifndef MOEJIT_COMBINE_TOKEN_INDEX_CUH_
#define MOEJIT_COMBINE_TOKEN_INDEX_CUH_

#include "combine_common.cuh"
#include "token_index_heavy.cuh"
#include "token_index_rows.cuh"

namespace moejit {
namespace detail {

// Rows per batch of the held path: kBatch 16-byte vectors in flight per thread, whatever UPT is
// (BatchRows, VEC_BYTES the rows' vector); with 12 or 16 rows held at one slot per thread, all of
// them (one round trip).
template <int HELD, int UPT, int VEC_BYTES>
struct HeldBatch {
  enum {
    rows_per_batch = WideBatch<HELD, UPT>::value ? HELD : BatchRows<VEC_BYTES, UPT>::value,
    value = rows_per_batch < HELD ? rows_per_batch : HELD
  };
};

// Rows per round trip of the single launch's walk past a token's list: a whole batch (BatchRows)
// where the held path keeps at most two rows of one slot, else half the held batch, at least two
// (the walk keeps a piece's sum and the step's matches in registers besides the rows: a whole
// batch beside eight held rows, or of several slots, spilled).
template <int HELD, int UPT, int VEC_BYTES>
struct WalkBatch {
  enum {
    held = HeldBatch<HELD, UPT, VEC_BYTES>::value,
    value = HELD <= 2 && UPT == 1 ? BatchRows<VEC_BYTES, UPT>::value
            : held / 2 > 2        ? held / 2
                                  : 2
  };
};

// The bytes of one vector of S.
template <typename S, int VEC>
struct VecBytes {
  enum { value = static_cast<int>(sizeof(S)) * VEC };
};

// From list position held_from on: -1 past the token's count (no row), and each row's gate.
template <int HELD>
__device__ __forceinline__ void held_gates(const CombineParams& p, int count, int held_from,
                                           int (&row)[HELD], float (&gate)[HELD]) {
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    if (held_from + k >= count) row[k] = -1;
    gate[k] = p.gates != nullptr && row[k] >= 0 ? __ldg(p.gates + row[k]) : 1.0f;
  }
}

// Combines token tok from a list of its rows in arrival order (the workspace's from the list path,
// IN_SHARED a block's from the shared-list scan): its first HELD entries, sorted, are added as a
// batch where the token has at most HELD rows; otherwise (a skewed routing) the slower paths add
// them, in the same ascending order. The entries are read together with the count, not after it
// (entries past the count are stale but inside the list): one round trip before the rows, as for
// a gather map. Past LIST_CAP rows the single launch walks token_idx; the list path adds nothing
// for such a token (token_index_heavy sums it).
template <int IN_DT, typename IdxT, int HIDDEN, int VEC, int HELD, int TPT, int UPT, int LIST_CAP,
          bool CACHED, bool IN_SHARED, typename S>
__device__ __forceinline__ void add_listed_token_rows(const CombineParams& p,
                                                      const S* __restrict__ expert, long long tok,
                                                      int first_slot, const int* list, int count,
                                                      float (&sum)[UPT][VEC]) {
  constexpr int kBatchRows = HeldBatch<HELD, UPT, VecBytes<S, VEC>::value>::value;
  Pack<S, VEC> v[kBatchRows][UPT];  // the batch's rows in flight
  bool present[kBatchRows];
  const bool held_all = count <= HELD;
  int row[HELD];
  bool mapped[HELD];
  float gate[HELD];
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    if constexpr (IN_SHARED)
      row[k] = list[k];
    else
      row[k] = __ldg(list + k);
  }
#pragma unroll
  for (int k = 0; k < HELD; ++k)
    if (k >= count) row[k] = 0x7fffffff;
  sort_rows(row);
  held_gates(p, count, 0, row, gate);
  if (held_all)
    add_held_rows<kLayoutTokenIndex, IN_DT, HIDDEN, VEC, HELD, TPT, UPT, HELD, kBatchRows, CACHED>(
        p, expert, tok, first_slot, row, mapped, gate, v, present, sum);
  if (!held_all) {
    if (count <= LIST_CAP)
      add_listed_rows_in_order<IN_DT, VEC, HIDDEN, UPT, TPT>(p, list, count, first_slot, sum);
    else if constexpr (IN_SHARED)
      add_rows_by_ordered_walk<IN_DT, VEC, HIDDEN, UPT, TPT,
                               WalkBatch<HELD, UPT, VecBytes<S, VEC>::value>::value, IdxT>(
          p, tok, first_slot, sum);
  }
}

// The small-call form's combine of token tok (one token per block): its ascending list in shared
// memory, held in rounds of HELD entries, each round the held batch path, until the token's count;
// then the store. The list is a window of LIST_CAP entries, scanned for again past its end (the
// scan sits in the rounds: one copy of it in the module).
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int HELD, int TPT, int UPT,
          int LIST_CAP, typename S>
__device__ __forceinline__ void combine_small_call_token(const CombineParams& p,
                                                         const S* __restrict__ expert,
                                                         long long tok, int first_slot) {
  constexpr int kScanWindow = LIST_CAP / HELD * HELD;
  constexpr int kBatchRows = HeldBatch<HELD, UPT, VecBytes<S, VEC>::value>::value;
  int count = HELD;
  int* list = nullptr;
  float sum[UPT][VEC];
  clear_sums(sum);
  int held_from = 0;    // list position of this round's first held row
  int window_from = 0;  // list position of `list`'s first entry
  do {
    int row[HELD];
    bool mapped[HELD];
    float gate[HELD];
    Pack<S, VEC> v[kBatchRows][UPT];  // the batch's rows in flight
    bool present[kBatchRows];
    if (held_from == 0 || held_from - window_from == kScanWindow) {  // uniform
      window_from = held_from;
      __syncwarp();  // every lane has read the last window
      count = scan_token_rows_small<IdxT, TPT, LIST_CAP>(p, tok, list, window_from);
    }
    load_list_entries(list + (held_from - window_from), row);  // shared memory
    held_gates(p, count, held_from, row, gate);
    add_held_rows<kLayoutTokenIndex, IN_DT, HIDDEN, VEC, HELD, TPT, UPT, HELD, kBatchRows, false>(
        p, expert, tok, first_slot, row, mapped, gate, v, present, sum);
    held_from += HELD;
  } while (held_from < count);
  store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(
      static_cast<typename Elem<OUT_DT>::storage*>(p.out) + tok * p.out_stride, first_slot, sum, p);
}

}  // namespace detail

// The list path's combine, after token_index_assign built the lists and token_index_heavy summed
// the tokens past their lists (it waits for both). The grid: flat with two or more rows held, x by
// y with one (GRID).
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int HELD, int TPT, int TPB,
          int UPT, int LIST_CAP, int GRID, bool CACHED>
__global__ void __launch_bounds__(TPT* TPB, 0) combine_lists(const CombineParams p) {
  static_assert(LIST_CAP >= HELD && HELD >= 1, "a list, at least HELD long");
  static_assert(LIST_CAP <= kPieceRows, "a token that fits its list is one piece");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const detail::WorkItem item = detail::work_item<GRID, HIDDEN, VEC, TPT, TPB, UPT>();
  const long long tok = item.tok;
  const int first_slot = item.first_slot;
  detail::wait_for_predecessor();   // token_index_heavy (after token_index_assign's lists)
  if (tok >= p.num_tokens) return;  // no barrier below: idle token groups may leave
  const int count = __ldg(p.token_counts + tok);
  const int* list = p.token_rows + tok * LIST_CAP;
  float sum[UPT][VEC];
  detail::clear_sums(sum);
  detail::add_listed_token_rows<IN_DT, IdxT, HIDDEN, VEC, HELD, TPT, UPT, LIST_CAP, CACHED, false>(
      p, expert, tok, first_slot, list, count, sum);
  if (count <= LIST_CAP)  // a token past its list: token_index_heavy stored it
    detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(
        static_cast<OutS*>(p.out) + tok * p.out_stride, first_slot, sum, p);
}

// The list path's tokens past their lists (token_index_heavy.cuh), between token_index_assign and
// combine_lists: blocks of kHeavyThreads (token_index_workspace.h), each warp taking work items
// until none is left. A call without such tokens only reads their count. The combine may be
// scheduled at once (it waits for this kernel before touching memory). FINISH: the heavy tokens
// stored to out; without it (the token index's epilogue, combine_epilogue.cuh) their pieces are
// left for the next kernel, which adds each such token itself (add_heavy_token; OUT_DT unused).
// Three blocks per SM (up to 80 registers; left to itself ptxas took 116-128 and kept two), one
// vector per lane and row, PieceBatch rows per round trip.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, bool FINISH = true>
__global__ void __launch_bounds__(kHeavyThreads, 3) token_index_heavy(const CombineParams p) {
  typedef typename detail::Elem<IN_DT>::storage S;
  constexpr int kUpt = 1;
  constexpr int kRows = detail::PieceBatch<detail::VecBytes<S, VEC>::value>::value;
  detail::allow_dependents();
  detail::wait_for_predecessor();  // token_index_assign's counts and heavy tokens
  const long long heavy = static_cast<long long>(__ldg(detail::heavy_counters(p) + kHeavyTokens));
  if (heavy == 0) return;
  const detail::HeavyWork s = detail::heavy_work<HIDDEN>(p, heavy);
  detail::do_heavy_work<IN_DT, OUT_DT, IdxT, HIDDEN, VEC, kUpt, kRows, FINISH>(p, s);
}

// ---- small calls: one launch ------------------------------------------------------------------
// For calls with few rows, the list path's three extra launches (clear, assign, heavy) cost more
// than the work: here every block scans all of token_idx for its own tokens' rows, then combines
// them in the list path's order (ascending rows, in pieces past kPieceRows: bitwise the same
// result).
// SMALL: the small-call form (one token per block in whole warps, calls of at most TPT rows),
// whose warps each read all of token_idx and list the rows in order. The grid is x by y.
// The small-call form promises four blocks per SM (up to 128 registers): without it ptxas gave its
// windowed scan loop too few registers and loaded a row's second slot only after adding its first
// (two round trips per row). With it the loads are back to back at every small-form geometry and
// nothing spills; its grids are small anyway. The other forms promise 1024 threads per SM (up to
// 64 registers): left to itself, ptxas gave some of them (narrow vectors, with the walk past a
// list) 40 registers and spilled around the scan.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int HELD, int TPT, int TPB,
          int UPT, int LIST_CAP, bool SMALL>
__global__ void __launch_bounds__(TPT* TPB, SMALL ? 4 : 1024 / (TPT * TPB))
    combine_scan(const CombineParams p) {
  static_assert(LIST_CAP >= HELD && HELD >= 1, "a list, at least HELD long");
  static_assert(!SMALL || (TPB == 1 && TPT % 32 == 0),
                "the small-call form is one token per block, in whole warps");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const detail::WorkItem item =
      detail::work_item<kGridTokensByChunks, HIDDEN, VEC, TPT, TPB, UPT>();
  const long long tok = item.tok;
  const int first_slot = item.first_slot;
  // A dependent launch waits before any memory access (only hints before it).
  if (p.dependent_launch != 0) {
    detail::prefetch_scan_routing<IdxT, TPT, TPB, SMALL>(p);
    detail::wait_for_predecessor();
  }
  if constexpr (SMALL) {
    if (tok >= p.num_tokens) return;  // the whole block (one token); no barrier below
    detail::combine_small_call_token<IN_DT, OUT_DT, IdxT, HIDDEN, VEC, HELD, TPT, UPT, LIST_CAP>(
        p, expert, tok, first_slot);
  } else {
    __shared__ int s_count[TPB];
    __shared__ int s_rows[TPB][LIST_CAP];
    const long long first_tok = tok - sub;  // the block's first token
    detail::scan_token_rows<IdxT, TPT * TPB, TPB, LIST_CAP>(p, first_tok, s_count, s_rows);
    if (tok >= p.num_tokens) return;  // after the scan's barriers; none below
    float sum[UPT][VEC];
    detail::clear_sums(sum);
    detail::add_listed_token_rows<IN_DT, IdxT, HIDDEN, VEC, HELD, TPT, UPT, LIST_CAP, false, true>(
        p, expert, tok, first_slot, s_rows[sub], s_count[sub], sum);
    detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(
        static_cast<OutS*>(p.out) + tok * p.out_stride, first_slot, sum, p);
  }
}

// ---- token-index layout: building the per-token row lists ------------------------------------
// Two small steps before the combine: per-token lists of row ids in arrival order. The combine
// sorts each list in registers, so the summation order never depends on the atomics.

// Step 1: forget the previous call's lists and heavy tokens (the workspace may hold anything).
// A template only so that NVRTC compiles it into the modules that name it: a plain __global__
// function is compiled into every module, at a cost in every compile.
template <int UNUSED = 0>
__global__ void token_index_clear(const CombineParams p) {
  // A dependent launch (the caller asked): the previous kernel on the stream may still read this
  // workspace (an earlier call's combine) or write token_idx, which token_index_assign reads
  // before its own wait; assign is not scheduled before every block of this kernel has passed the
  // wait and allowed it.
  if (p.dependent_launch != 0) detail::wait_for_predecessor();
  detail::allow_dependents();
  if (blockIdx.x == 0 && threadIdx.x < kHeavyCounters) detail::heavy_counters(p)[threadIdx.x] = 0;
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       t < p.num_tokens; t += static_cast<long long>(gridDim.x) * blockDim.x)
    p.token_counts[t] = 0;
}

// Step 2: every row announces itself to its token. Arrival order is not deterministic. The row that
// finds its token's list full registers the token as heavy (token_index_heavy.cuh). The lanes of a
// warp with the same token take their places with one atomic: a skewed routing's hot token
// otherwise serializes every row of it on one counter.
template <typename IdxT>
__global__ void token_index_assign(const CombineParams p) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  detail::allow_dependents();
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  // The first row's entry is loaded before the wait: token_idx is the caller's input, complete
  // before token_index_clear passed its own wait (and allowed this kernel only then), so its round
  // trip overlaps the clear.
  IdxT entry = first < p.num_rows ? __ldg(token_idx + first) : IdxT(-1);
  detail::wait_for_predecessor();  // the counts are token_index_clear's
  // Whole warps per round (blocks of whole warps): every lane takes part in the match, of 32-bit
  // tokens where they fit (one match instruction, not two).
  const bool narrow = p.num_tokens <= 0x7fffffffll;
  for (long long r = first; r - lane < p.num_rows; r += stride) {
    if (r != first) entry = r < p.num_rows ? __ldg(token_idx + r) : IdxT(-1);
    long long t = static_cast<long long>(entry);
    if (t < 0 || t >= p.num_tokens) t = -1;  // dropped or out of range: one key for all of them
    const unsigned peers = narrow ? __match_any_sync(0xffffffffu, static_cast<int>(t))
                                  : __match_any_sync(0xffffffffu, t);
    if (t < 0) continue;
    const int leader = __ffs(peers) - 1;
    int arrival = 0;
    if (lane == leader) arrival = atomicAdd(p.token_counts + t, __popc(peers));
    arrival = __shfl_sync(peers, arrival, leader) + __popc(peers & ((1u << lane) - 1u));
    if (arrival < p.list_capacity)
      p.token_rows[t * p.list_capacity + arrival] = static_cast<int>(r);
    else if (arrival == p.list_capacity)  // the token's list is full: a heavy token
      detail::register_heavy(p, t);
  }
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_TOKEN_INDEX_CUH_
