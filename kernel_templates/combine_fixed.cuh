// The fixed layouts' combine (token-major, gather map): every token has exactly TOP_K slots, so a
// token's routing is where the token is. Each thread reads its token's routing, issues the loads
// of a whole batch of rows (up to kBatch 16-byte vectors; kWideBatch rows with 9-16 slots) before
// the first add, sums in fp32 in slot order and stores once. Template parameters: see
// combine_common.cuh.
#ifndef MOEJIT_COMBINE_FIXED_CUH_
#define MOEJIT_COMBINE_FIXED_CUH_

#include "combine_common.cuh"

namespace moejit {
namespace detail {

// A token's routing for its first HELD slots, into registers. Gather map: `mapped` says whether
// the entry names a row, and row[] is 0 where it does not, so the row's address needs no select.
// Token-major: the row is tok * TOP_K + k (row[] unused). At decode sizes the kernel is bound by
// one warp's instruction chain: every instruction between the map load and the row loads counts.
template <int LAYOUT, typename IdxT, int TOP_K, int HELD>
__device__ __forceinline__ void read_slot_routing(const CombineParams& p,
                                                  const IdxT* __restrict__ indices, long long tok,
                                                  int (&row)[HELD], bool (&mapped)[HELD],
                                                  float (&gate)[HELD]) {
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    if constexpr (LAYOUT == kLayoutTokenMajor) {
      row[k] = 0;  // unused: the row is tok * TOP_K + k
    } else {
      const IdxT m = __ldg(indices + tok * TOP_K + k);
      mapped[k] = names_row(m, p.num_rows);  // out of range: dropped
      row[k] = mapped[k] ? static_cast<int>(m) : 0;
    }
  }
  // Gates from one base address under one (uniform) branch: a null check per gate made the
  // compiler build each gate's address separately.
  if (p.gates != nullptr) {
    const float* __restrict__ g = p.gates + tok * TOP_K;
#pragma unroll
    for (int k = 0; k < HELD; ++k) gate[k] = __ldg(g + k);
  } else {
#pragma unroll
    for (int k = 0; k < HELD; ++k) gate[k] = 1.0f;
  }
}

// Rows loaded together: kBatch 16-byte vectors in flight per thread, whatever UPT is (BatchRows,
// VEC_BYTES the rows' vector); with 9-16 slots per token at one slot per thread all of them in one
// batch, one round trip.
template <int TOP_K, int UPT, int VEC_BYTES>
struct FixedBatch {
  enum {
    rows = WideBatch<TOP_K, UPT>::value ? TOP_K : BatchRows<VEC_BYTES, UPT>::value,
    // The first batch's routing is held in registers; later slots are read as they come. A batch
    // is never larger than the held slots: absent ones would cost their adds (zeros times weight
    // 0, which the compiler must keep).
    held = TOP_K < rows ? TOP_K : rows
  };
};

// Adds token tok's TOP_K rows, in slot order, to this thread's UPT slots (first_slot + u * TPT).
// indices and expert are p's, as the kernel holds them.
template <int LAYOUT, int IN_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT, int UPT,
          bool CACHED, typename S>
__device__ __forceinline__ void add_fixed_token_rows(const CombineParams& p,
                                                     const IdxT* __restrict__ indices,
                                                     const S* __restrict__ expert, long long tok,
                                                     int first_slot, float (&sum)[UPT][VEC]) {
  typedef FixedBatch<TOP_K, UPT, static_cast<int>(sizeof(S)) * VEC> Batch;
  constexpr int kRowsPerBatch = Batch::rows;
  constexpr int kHeld = Batch::held;
  int row[kHeld];
  bool mapped[kHeld];
  float gate[kHeld];
  read_slot_routing<LAYOUT, IdxT, TOP_K, kHeld>(p, indices, tok, row, mapped, gate);
  Pack<S, VEC> v[kHeld][UPT];
  bool present[kHeld];
  add_held_rows<LAYOUT, IN_DT, HIDDEN, VEC, TOP_K, TPT, UPT, kHeld, kHeld, CACHED>(
      p, expert, tok, first_slot, row, mapped, gate, v, present, sum);
  // Slots past the first batch (9-16 slots at two or more slots per thread, or more than 16): two
  // at a time, routing from memory. A loop that is not unrolled, so the rare large top_k costs no
  // registers on the common path.
#pragma unroll 1
  for (int base = kRowsPerBatch; base < TOP_K; base += 2) {
    Pack<S, VEC> v2[2][UPT];
    float w[2];
    bool present2[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int k = base + j;
      long long r = -1;
      if (k < TOP_K) {
        if constexpr (LAYOUT == kLayoutTokenMajor) {
          r = tok * TOP_K + k;
        } else {
          const IdxT m = __ldg(indices + tok * TOP_K + k);
          r = names_row(m, p.num_rows) ? static_cast<long long>(m) : -1;
        }
      }
      present2[j] = r >= 0;
      w[j] = present2[j] && p.gates != nullptr ? __ldg(p.gates + tok * TOP_K + k) : 1.0f;
      load_row_slots<S, VEC, HIDDEN, UPT, TPT, CACHED>(
          present2[j], expert + (present2[j] ? r : 0) * p.expert_stride, first_slot, v2[j]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (present2[j]) add_row_slots<IN_DT, VEC, UPT>(w[j], v2[j], sum);
  }
}

}  // namespace detail

// Blocks per SM the launch bounds promise (0: none, ptxas's own choice). Whole 128-thread blocks
// with one slot per thread promise eight, which lets ptxas use up to 64 registers: without it ptxas
// fitted them into 32 registers by issuing a batch's row loads one or two at a time instead of all
// back to back. With 9-16 slots in one batch (kWideBatch) the routing and the rows take up to
// about 110 registers: four blocks, the same bytes in flight per SM. The gather map with four slots
// per thread in 16-byte vectors promises ten (it keeps 48 registers, no spill, loads back to
// back). Two slots per thread already had their loads back to back; token-major with four slots
// spilled under a promise; smaller blocks keep ptxas's choice. Vectors of 4 bytes or less
// (eight rows of UPT slots, a register each) promise eight: left to itself ptxas gave some 40
// registers and spilled. Measured: docs/performance.md#geometry-within-a-variant.
template <int LAYOUT, int TOP_K, int TPT, int TPB, int UPT, int VEC_BYTES>
struct FixedMinBlocks {
  enum {
    value = TPT * TPB < 128  ? 0
            : UPT == 1       ? (detail::WideBatch<TOP_K, UPT>::value ? 512 : 1024) / (TPT * TPB)
            : VEC_BYTES <= 4 ? 1024 / (TPT * TPB)
            : UPT == 4 && LAYOUT == kLayoutGatherMap && VEC_BYTES == 16 ? 1280 / (TPT * TPB)
                                                                        : 0
  };
};

// The combine of the fixed layouts: one block per work item (detail::work_item).
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT,
          int TPB, int UPT, int GRID, bool CACHED>
__global__ void __launch_bounds__(
    TPT* TPB,
    (FixedMinBlocks<LAYOUT, TOP_K, TPT, TPB, UPT,
                    static_cast<int>(sizeof(typename detail::Elem<IN_DT>::storage)) * VEC>::value))
    combine_fixed(const CombineParams p) {
  static_assert(LAYOUT == kLayoutTokenMajor || LAYOUT == kLayoutGatherMap, "a fixed layout");
  static_assert(TOP_K > 0, "fixed top_k");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  const IdxT* __restrict__ indices = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const detail::WorkItem item = detail::work_item<GRID, HIDDEN, VEC, TPT, TPB, UPT>();
  const long long tok = item.tok;
  const int first_slot = item.first_slot;
  // A dependent launch waits before any memory access (only hints before it): the routing, the
  // rows and (accumulating) out may be the previous kernel's output, and out may be its input.
  if (p.dependent_launch != 0) {
    detail::prefetch_slot_routing<LAYOUT, IdxT, TOP_K>(p, tok, item.chunk, item.lane);
    detail::wait_for_predecessor();
  }
  if (tok >= p.num_tokens) return;  // no barrier below: idle token groups may leave

  float sum[UPT][VEC];
  detail::clear_sums(sum);
  detail::add_fixed_token_rows<LAYOUT, IN_DT, IdxT, HIDDEN, VEC, TOP_K, TPT, UPT, CACHED>(
      p, indices, expert, tok, first_slot, sum);
  detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(
      static_cast<OutS*>(p.out) + tok * p.out_stride, first_slot, sum, p);
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_FIXED_CUH_
