// The one-token kernels: a call with one token (single-sequence decode) and few rows, where
// loading every row together with the routing (one round trip to memory) beats finding the
// token's rows first (two). Template parameters: see combine_common.cuh.
#ifndef MOEJIT_COMBINE_ONE_TOKEN_CUH_
#define MOEJIT_COMBINE_ONE_TOKEN_CUH_

#include "combine_common.cuh"

namespace moejit {

// ---- token index, one token: one launch, no scan ---------------------------------------------
// A call with one token (single-sequence decode) needs no search: every row whose token_idx entry
// is 0 belongs to it, and every other row is dropped. So the row, its gate and its token_idx entry
// are loaded together, a batch of rows at a time, and the entry only decides whether the row is
// added: one round trip to memory before the adds, where the single launch's scan needs two (the
// entries, then the rows they name). Rows are added in ascending order with the same fp32 fma
// chain as every other path: bitwise the same result. The host takes it for calls with few rows
// (src/combine_dispatch.cpp): a dropped row is still read, so many of them would cost bandwidth the
// scan does not spend.
// HELD: rows per batch (the rows the call has, rounded up to 1, 2, 4, 8, 12 or 16); the grid is
// x the token groups (one, whose other tokens leave at once), y the chunks.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int HELD, int TPT, int TPB,
          int UPT>
__global__ void __launch_bounds__(TPT* TPB) combine_one_token(const CombineParams p) {
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  // Up to kBatch rows per batch; with 12 or 16 rows per token held, all of them.
  constexpr int kMostPerBatch = detail::WideBatch<HELD, UPT>::value ? detail::kWideBatch
                                : detail::kBatch / UPT > 0          ? detail::kBatch / UPT
                                                                    : 1;
  constexpr int kRowsPerBatch = HELD < kMostPerBatch ? HELD : kMostPerBatch;
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  if (p.dependent_launch != 0) {  // token_idx and the gates first (as the other kernels do)
    if (blockIdx.x == 0 && blockIdx.y == 0 && p.num_rows > 0) {  // <= 64 rows: a few lines
      const int line = static_cast<int>(threadIdx.x);
      detail::prefetch_l2_line(p.indices, p.num_rows * static_cast<long long>(sizeof(IdxT)), line);
      if (p.gates != nullptr)
        detail::prefetch_l2_line(p.gates, p.num_rows * static_cast<long long>(sizeof(float)), line);
    }
    detail::wait_for_predecessor();  // before any memory access
  }
  if (blockIdx.x * TPB + sub != 0) return;  // token 0 is the only one; no barrier below
  const int first_slot = static_cast<int>(blockIdx.y) * (TPT * UPT) + lane;
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const char* slot0 = reinterpret_cast<const char*>(expert + first_slot * VEC);
  const unsigned long long row_bytes = static_cast<unsigned long long>(p.expert_stride) * sizeof(S);
  const int rows = static_cast<int>(p.num_rows);  // a few (the host)

  float sum[UPT][VEC];
  detail::clear_sums(sum);
#pragma unroll 1
  for (int base = 0; base < rows; base += kRowsPerBatch) {
    IdxT t[kRowsPerBatch];
    float w[kRowsPerBatch];
    detail::Pack<S, VEC> v[kRowsPerBatch][UPT];
#pragma unroll
    for (int i = 0; i < kRowsPerBatch; ++i) {
      const int r = base + i;
      const bool exists = r < rows;
      t[i] = exists ? __ldg(token_idx + r) : IdxT(-1);
      // Row r's address from this thread's first slot (row 0 past the end: never loaded).
      const unsigned rid = exists ? static_cast<unsigned>(r) : 0u;
      detail::load_slots_at<S, VEC, HIDDEN, UPT, TPT>(
          exists, reinterpret_cast<const S*>(slot0 + rid * row_bytes), first_slot, v[i]);
    }
    // Gates from one base under one uniform branch (as the fixed layouts read theirs).
    if (p.gates != nullptr) {
#pragma unroll
      for (int i = 0; i < kRowsPerBatch; ++i)
        w[i] = base + i < rows ? __ldg(p.gates + base + i) : 0.0f;
    } else {
#pragma unroll
      for (int i = 0; i < kRowsPerBatch; ++i) w[i] = 1.0f;
    }
    // A dropped row (any entry but 0) is skipped, not weighted by zero: its data and its gate
    // may be anything (NaN * 0 is NaN).
#pragma unroll
    for (int i = 0; i < kRowsPerBatch; ++i)
      if (t[i] == IdxT(0)) detail::add_row_slots<IN_DT, VEC, UPT>(w[i], v[i], sum);
  }
  detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(static_cast<OutS*>(p.out), first_slot, sum,
                                                         p);  // token 0's row
}

// ---- gather map, one token: one launch, rows loaded with the map ------------------------------
// A call with one token (single-sequence decode) whose buffer holds at most top_k rows (the
// token's own expert outputs, as an engine passes them at decode): every row may be one of the
// token's, so the rows, the map entries and the gates are loaded together, one round trip to
// memory before the adds, where the fixed layouts' kernel needs two (the map, then the rows it
// names). Slot k's row is then picked from the thread's own copies, staged in shared memory
// (each thread reads back only what it wrote: no barrier), and the slots are added in order k =
// 0..K-1 with the fixed layouts' fp32 fma chain, a dropped slot as weight 0 times zeros as there:
// bitwise the fixed layouts' result. The host takes it for num_tokens == 1, num_rows <= top_k,
// top_k * UPT <= kBatch (src/combine_dispatch.cpp, fits_one_token_map); its grid is flat (the
// token's chunks; a second token group of the block leaves at once).
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT, int TPB,
          int UPT>
__global__ void __launch_bounds__(TPT* TPB) combine_one_token_map(const CombineParams p) {
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  typedef detail::Pack<S, VEC> P;
  static_assert(TOP_K >= 1 && TOP_K * UPT <= detail::kBatch, "all rows in flight at once");
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
  constexpr unsigned kChunks = (kSlots + TPT * UPT - 1) / (TPT * UPT);
  // Row r's UPT slots of thread i at stage[r][u][i] (row TOP_K: zeros): a warp's stores and loads
  // are 16-byte words side by side (no bank conflicts).
  __shared__ P stage[TOP_K + 1][UPT][TPT * TPB];
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  const long long tok = blockIdx.x / kChunks * TPB + sub;
  const int chunk = static_cast<int>(blockIdx.x % kChunks);
  const IdxT* __restrict__ map = static_cast<const IdxT*>(p.indices);
  if (p.dependent_launch != 0) {  // the map and the gates first, as the fixed layouts do
    detail::prefetch_slot_routing<kLayoutGatherMap, IdxT, TOP_K>(p, tok, chunk, lane);
    detail::wait_for_predecessor();  // before any memory access
  }
  if (tok != 0) return;  // token 0 is the only one; no barrier below
  const int first_slot = chunk * (TPT * UPT) + lane;
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const char* slot0 = reinterpret_cast<const char*>(expert + first_slot * VEC);
  const unsigned long long row_bytes = static_cast<unsigned long long>(p.expert_stride) * sizeof(S);
  const unsigned rows = static_cast<unsigned>(p.num_rows);  // <= TOP_K (host)

  // One round trip: the map entries, every row, the gates.
  unsigned m[TOP_K];  // slot k's staged row: TOP_K (zeros) where the slot is dropped
  bool mapped[TOP_K];
#pragma unroll
  for (int k = 0; k < TOP_K; ++k) {
    const IdxT e = __ldg(map + k);
    mapped[k] = detail::names_row(e, p.num_rows);
    m[k] = mapped[k] ? static_cast<unsigned>(e) : static_cast<unsigned>(TOP_K);
  }
  P v[TOP_K][UPT];
#pragma unroll
  for (int r = 0; r < TOP_K; ++r) {
    const bool exists = static_cast<unsigned>(r) < rows;
    // Row r's address from this thread's first slot (row 0 past the end: never loaded).
    const unsigned rid = exists ? static_cast<unsigned>(r) : 0u;
    detail::load_slots_at<S, VEC, HIDDEN, UPT, TPT>(
        exists, reinterpret_cast<const S*>(slot0 + rid * row_bytes), first_slot, v[r]);
  }
  float gate[TOP_K];
  if (p.gates != nullptr) {  // one base, one uniform branch (as the fixed layouts read theirs)
#pragma unroll
    for (int k = 0; k < TOP_K; ++k) gate[k] = __ldg(p.gates + k);
  } else {
#pragma unroll
    for (int k = 0; k < TOP_K; ++k) gate[k] = 1.0f;
  }
  // Stage the rows, then read each slot's row back. A dropped slot reads the zero row and adds it
  // with weight 0, as the fixed layouts' kernel adds a dropped slot: its row and gate may be
  // anything (NaN * 0 is NaN), and adds without a branch let every read go out before the first
  // add (under a branch per slot ptxas issued each read after the adds before it).
#pragma unroll
  for (int u = 0; u < UPT; ++u) stage[TOP_K][u][threadIdx.x] = detail::zero_pack<S, VEC>();
#pragma unroll
  for (int r = 0; r < TOP_K; ++r)
#pragma unroll
    for (int u = 0; u < UPT; ++u) stage[r][u][threadIdx.x] = v[r][u];
  P x[TOP_K][UPT];
#pragma unroll
  for (int k = 0; k < TOP_K; ++k)
#pragma unroll
    for (int u = 0; u < UPT; ++u) x[k][u] = stage[m[k]][u][threadIdx.x];

  float sum[UPT][VEC];
  detail::clear_sums(sum);
#pragma unroll
  for (int k = 0; k < TOP_K; ++k)
    detail::add_row_slots<IN_DT, VEC, UPT>(mapped[k] ? gate[k] : 0.0f, x[k], sum);
  detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(static_cast<OutS*>(p.out), first_slot, sum,
                                                         p);  // token 0's row
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_ONE_TOKEN_CUH_
