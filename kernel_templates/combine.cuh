// MoE combine kernels (weighted gather-sum), specialized at run time by libmoejit.
//
//   out[t, :] (+)= scale * sum over rows r of token t of gate(r) * expert[r, :]
//
// Every design here gathers: the threads that own an output vector read that token's source rows,
// sum them in fp32 in a fixed order and write once. No zero-fill, no read-modify-write of out
// (except in accumulate mode, which reads its own element), no atomics on data: results are
// bitwise deterministic and do not depend on the batch. (The approach of TensorRT-LLM's finalize
// and vLLM's moe_unpermute kernels.)
//
// Template parameters of `combine` (all compile-time, chosen by src/combine_plan.cpp):
//   LAYOUT    kLayoutTokenMajor | kLayoutGatherMap | kLayoutTokenIndex (see combine_params.h)
//   IN_DT     element type code of the expert rows  (kFloat32 | kFloat16 | kBFloat16)
//   OUT_DT    element type code of the output
//   IdxT      int or long long: gather map / token_idx element type
//   HIDDEN    elements per row
//   VEC       elements per vector access; VEC * sizeof(element) <= 16 bytes, and every row start
//             is VEC-aligned (the host picks VEC from the pointers and strides). A hidden size that
//             is not a multiple of VEC gets one partial "tail" vector handled element by element.
//   TOP_K     slots per token (token-major and gather map); token index: the rows per token it
//             holds in registers (the expected count rounded up to 1, 2, 4 or 8)
//   TPT       threads per token group (one vector slot per thread)
//   TPB       token groups per block (several tokens share a block when rows are short)
//   UPT       vector slots per thread (a work item spans TPT * UPT slots of one token)
//   LIST_CAP  token-index layout: rows per token kept in its list (0 otherwise)
// `combine_scan` (token index, one launch) takes the same parameters but LAYOUT, and SMALL: its
// form for calls with at most TPT rows (one token per block), where every warp reads all of
// token_idx.
//
// Grid: one block per work item, a group of TPB tokens x a chunk of TPT * UPT vector slots (1-D,
// group-major, a token's chunks adjacent: the fixed layouts and the token index's list path with
// TOP_K >= 2, except the gather map up to mid-size calls; otherwise 2-D: x the token group, y the
// chunk).
// All addresses are computed in 64 bits: R * H passes 2^31 at realistic prefill sizes.
//
// No toolkit header is included: fp16/bf16 conversions use PTX or bit operations, so NVRTC needs
// no include path and runtime-only installs (libnvrtc without headers) still compile.
#ifndef MOEJIT_COMBINE_CUH_
#define MOEJIT_COMBINE_CUH_

#include "combine_params.h"

namespace moejit {
namespace detail {

// ---- element types ---------------------------------------------------------------------------

template <int DT>
struct Elem;

template <>
struct Elem<kFloat32> {
  typedef float storage;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Elem<kBFloat16> {
  typedef unsigned short storage;
  static __device__ __forceinline__ float to_float(unsigned short x) {
    return __uint_as_float(static_cast<unsigned>(x) << 16);
  }
  // Round to nearest even. From sm_80 the hardware conversion, as to_pack converts pairs: a NaN
  // then has the bits of the paired conversion's, whichever vector width a call got (rounding by
  // hand kept the NaN's sign and payload, where cvt.rn.bf16x2 gives the canonical NaN). Before
  // sm_80 (no bf16 conversion) by hand everywhere: a NaN stays a quiet NaN of the same sign.
  static __device__ __forceinline__ unsigned short from_float(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
#endif
  }
};

template <>
struct Elem<kFloat16> {
  typedef unsigned short storage;
  static __device__ __forceinline__ float to_float(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static __device__ __forceinline__ unsigned short from_float(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

// N elements of S, aligned to their whole size so one access moves them (up to 16 bytes).
template <typename S, int N>
struct alignas(sizeof(S) * N) Pack {
  S e[N];
};

// Reads a pack of expert data that no thread of this kernel writes, only where `pred` holds;
// elsewhere `v` keeps its value. Two flavours:
//  - streaming (the default): the non-coherent path without allocating in L1;
//  - CACHED: a plain ld.global, which allocates in L1. Chosen for the 128-thread prefill blocks
//    (see kCachedRowLoads in combine): on the H200 the fixed layouts were 1.5-4% faster at K=2
//    and at K=8 with H=7168 or 2048, level at K=1 H=5120, K=4 H=6144 and K=8 H=4096, 1-2.7%
//    slower at H=2880 and H=3584, and slower at decode sizes; the token index's list path gains
//    at its largest calls only (combine_plan.cpp, choose_geometry).
//    ld.global.nc without no_allocate measured the same as ld.global; L1::no_allocate and
//    L1::evict_first on the coherent path measured like the streaming flavour: L1 allocation is
//    what changes the figure.
// One predicated instruction and no branch: when each row load of a batch sat in its own `if`,
// the register allocator gave them one shared destination plus copies, and every load then
// waited for the one before it (seen in the SASS; a 65% slowdown at top_k 8). With the
// destination an in-out operand, each load keeps its own registers and a batch issues back to
// back.
//
// Not volatile, and no memory operand: to the compiler the asm is a pure function of its address,
// as the CUDA headers' __ldg is. Nothing pins such a load after griddepcontrol.wait
// (wait_for_predecessor) but the code's shape: the wait sits in its own branch, which a
// side-effect-free asm is not speculated above. The PTX of every kernel a dependent launch can
// start with is checked to have no load before its wait (tests/unit/test_kernel_compile.cpp,
// DependentLaunchPrefetchesRoutingAndLeavesTheNextKernelAlone).
// volatile would pin it, with the sm_80 and sm_90 cubins of 207 specializations byte-identical,
// but it changes 62 token-index modules for sm_100, where nothing was measured.
//
// The macros: one predicated load of 4, 2 or 1 32-bit words into u[] from ptr where `on` is
// nonzero (locals of load_pack_if); OP is the load instruction without its vector suffix.
#define MOEJIT_PRED_LOAD_V4(OP)                                                                 \
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p " OP ".v4.u32 {%0, %1, %2, %3}, [%4];\n}" \
      : "+r"(u[0]), "+r"(u[1]), "+r"(u[2]), "+r"(u[3])                                          \
      : "l"(ptr), "r"(on))
#define MOEJIT_PRED_LOAD_V2(OP)                                                         \
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p " OP ".v2.u32 {%0, %1}, [%2];\n}" \
      : "+r"(u[0]), "+r"(u[1])                                                          \
      : "l"(ptr), "r"(on))
#define MOEJIT_PRED_LOAD_V1(OP)                                                \
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p " OP ".u32 %0, [%1];\n}" \
      : "+r"(u[0])                                                             \
      : "l"(ptr), "r"(on))

template <bool CACHED, typename P>
__device__ __forceinline__ void load_pack_if(bool pred, const P* ptr, P& v) {
  const int on = pred;
  unsigned* u = reinterpret_cast<unsigned*>(&v);
  if constexpr (sizeof(P) == 16) {
    if constexpr (CACHED)
      MOEJIT_PRED_LOAD_V4("ld.global");
    else
      MOEJIT_PRED_LOAD_V4("ld.global.nc.L1::no_allocate");
  } else if constexpr (sizeof(P) == 8) {
    if constexpr (CACHED)
      MOEJIT_PRED_LOAD_V2("ld.global");
    else
      MOEJIT_PRED_LOAD_V2("ld.global.nc.L1::no_allocate");
  } else if constexpr (sizeof(P) == 4) {
    if constexpr (CACHED)
      MOEJIT_PRED_LOAD_V1("ld.global");
    else
      MOEJIT_PRED_LOAD_V1("ld.global.nc.L1::no_allocate");
  } else {
    if (pred) v = *ptr;
  }
}
#undef MOEJIT_PRED_LOAD_V4
#undef MOEJIT_PRED_LOAD_V2
#undef MOEJIT_PRED_LOAD_V1

// Slot `slot` of a row, at address `at`, into v where `pred` holds (v keeps its value
// elsewhere): a full vector, or the partial tail element by element.
template <typename S, int VEC, int HIDDEN, bool CACHED = false>
__device__ __forceinline__ void load_slot_if(bool pred, const S* __restrict__ at, int slot,
                                             Pack<S, VEC>& v) {
  constexpr int kFull = HIDDEN / VEC;
  if (HIDDEN % VEC == 0 || slot < kFull) {
    load_pack_if<CACHED>(pred, reinterpret_cast<const Pack<S, VEC>*>(at), v);
  } else if (pred) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.e[e] = e < HIDDEN % VEC ? at[e] : S(0);
  }
}

template <typename S, int VEC>
__device__ __forceinline__ Pack<S, VEC> zero_pack() {
  Pack<S, VEC> v;
#pragma unroll
  for (int e = 0; e < VEC; ++e) v.e[e] = S(0);
  return v;
}

// The VEC floats of a pack. bf16 pairs come from their 32-bit word: the low element is the word
// shifted up, the high one the word with its low half cleared, one instruction each. Element by
// element the compiler extracted the high half and shifted it back (PRMT, IMAD.U32, often a MOV
// as well): at K = 8 that was 50-60 of the 330-580 instructions in a decode warp's chain.
template <int DT, int VEC>
__device__ __forceinline__ void unpack(const Pack<typename Elem<DT>::storage, VEC>& v,
                                       float (&x)[VEC]) {
  if constexpr (DT == kBFloat16 && VEC % 2 == 0) {
    const unsigned* word = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      x[e] = __uint_as_float(word[e / 2] << 16);
      x[e + 1] = __uint_as_float(word[e / 2] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = Elem<DT>::to_float(v.e[e]);
  }
}

// VEC floats rounded to the storage type. 16-bit outputs on sm_80+ convert two at a time (one
// cvt.rn.{bf16x2,f16x2}.f32 each, round to nearest even), where the bit-twiddled bf16 rounding
// took several instructions per element: at decode sizes the kernel is bound by one warp's
// instruction chain, and the store was a sixth of it. A NaN stays a NaN (then the canonical one).
template <int DT, int VEC>
__device__ __forceinline__ Pack<typename Elem<DT>::storage, VEC> to_pack(const float (&v)[VEC]) {
  Pack<typename Elem<DT>::storage, VEC> r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kPairs = DT != kFloat32 && VEC % 2 == 0;
#else
  constexpr bool kPairs = false;
#endif
  // One branch or the other, never both: a loop after an early return drew NVRTC's warning
  // #128-D (loop is not reachable) in every 16-bit module.
  if constexpr (kPairs) {
    unsigned* u = reinterpret_cast<unsigned*>(&r);
#pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      // The first operand lands in the upper half: element e + 1.
      if constexpr (DT == kBFloat16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u[e / 2]) : "f"(v[e + 1]), "f"(v[e]));
      else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(u[e / 2]) : "f"(v[e + 1]), "f"(v[e]));
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.e[e] = Elem<DT>::from_float(v[e]);
  }
  return r;
}

// Writes (scale * acc [+ old]) for one slot of an output row, rounding once.
template <int OUT_DT, int VEC, int HIDDEN>
__device__ __forceinline__ void store_slot(typename Elem<OUT_DT>::storage* __restrict__ row,
                                           int slot, const float (&acc)[VEC], float scale,
                                           bool accumulate) {
  typedef Elem<OUT_DT> E;
  typedef typename E::storage S;
  constexpr int kFull = HIDDEN / VEC;
  const bool full = HIDDEN % VEC == 0 || slot < kFull;
  const int n = full ? VEC : HIDDEN % VEC;
  S* dst = row + static_cast<long long>(slot) * VEC;
  float old[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) old[e] = 0.0f;
  if (accumulate) {
    if (full) {
      const Pack<S, VEC> o = *reinterpret_cast<const Pack<S, VEC>*>(dst);  // one vector load
      unpack<OUT_DT, VEC>(o, old);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (e < n) old[e] = E::to_float(dst[e]);
    }
  }
  float val[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) val[e] = acc[e] * scale + old[e];
  Pack<S, VEC> r = to_pack<OUT_DT, VEC>(val);
  if (full) {
    *reinterpret_cast<Pack<S, VEC>*>(dst) = r;
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (e < n) dst[e] = r.e[e];
  }
}

// Stores a thread's UPT slots (first_slot + u * TPT) of one output row: the one write of every
// combine kernel.
template <int OUT_DT, int VEC, int HIDDEN, int UPT, int TPT>
__device__ __forceinline__ void store_row_slots(typename Elem<OUT_DT>::storage* __restrict__ row,
                                                int first_slot, const float (&sum)[UPT][VEC],
                                                const CombineParams& p) {
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    const int sl = first_slot + u * TPT;
    if (sl < kSlots) store_slot<OUT_DT, VEC, HIDDEN>(row, sl, sum[u], p.scale, p.accumulate != 0);
  }
}

// Programmatic dependent launch (sm_90+): the token-index chain's kernels are launched so that
// each may start while its predecessor drains, and a call's first kernel is too when the caller
// asks for it (p.dependent_launch: then it may start while the caller's previous kernel on the
// stream drains). A dependent kernel calls wait_for_predecessor() before it touches memory (it
// returns once the previous kernel finished and its writes are visible); allow_dependents() lets
// the next kernel's blocks be scheduled as this one's drain (scheduling only: a dependent still
// waits for this whole kernel before touching memory). The wait is a no-op for a plain launch and
// on older GPUs, but not free: at the start of every kernel it cost 0.1-0.27 us at decode sizes on
// the H200 (A B B A, tools/bench/NOTES.md, version 25), so a call's first kernel waits only when
// the caller asked for the dependent launch (a uniform branch on p.dependent_launch).
// Only the chain's helpers (token_index_clear, token_index_assign) allow their dependents, which
// are the chain's next kernels: without their triggers the list path was 0.2-1.8% slower at
// prefill. The combine kernels never allow the caller's next kernel early: triggered at their
// start, a decode step of a PDL-aware producer, the combine and the next producer took up to
// 0.43 us longer (token-major T64 K2 H4096 0.26, T64 K1 H5120 0.35-0.41, gather map and
// token-major T64 K2 H7168 0.38-0.43) and at most 0.21 us less elsewhere; a stand-alone probe
// (producer, combine-like consumer, producer, all dependents) lost 0.13-0.38 us per step to the
// consumer's early trigger at every grid from 64 to 448 blocks, the next producer's blocks placed
// alike (four per SM) either way. A trigger just before the stores was worse than both (NOTES,
// version 30). Without it the next dependent kernel is scheduled when the combine ends.
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// A hint that the line holding `at` is wanted soon: fetched into L2 (not L1) and nothing returned,
// so it is safe on memory the previous kernel may still be writing (L2 is where every SM's writes
// land; a load after wait_for_predecessor() sees them whatever the hint fetched). A dependent
// launch issues it for the call's routing before it waits, so that the routing's round trip
// after the wait is an L2 hit even where the kernels before it evicted the routing (see
// prefetch_routing below).
__device__ __forceinline__ void prefetch_l2(const void* at) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(at)));
}
// The i-th 128-byte line of those holding [first, first + bytes) (bytes > 0), or the last one
// past them: a block prefetches a short array with one request per line, line i from its thread
// i. A warp's requests to one line are one request, and without a branch per thread the hint
// stays in line before the wait (fewer instructions to compile and issue than a loop over
// elements, too).
__device__ __forceinline__ void prefetch_l2_line(const void* first, long long bytes, int i) {
  const unsigned long long begin = reinterpret_cast<unsigned long long>(first);
  const unsigned long long last = (begin + static_cast<unsigned long long>(bytes) - 1) & ~127ull;
  const unsigned long long line = (begin & ~127ull) + 128ull * static_cast<unsigned>(i);
  prefetch_l2(reinterpret_cast<const void*>(line < last ? line : last));
}

// Rows in flight per thread: enough independent 16-byte loads to cover memory latency without
// spilling the loaded vectors.
enum { kBatch = 8 };  // an enum, not a variable: see kScanBatch
// Fixed layouts with kBatch < top_k <= kWideBatch, and the token index holding that many rows
// (one slot per thread): every row in one batch (combine_tokens, combine_one_token); the fixed
// layouts under a launch bound of half the blocks (CombineMinBlocks).
enum { kWideBatch = 16 };
template <int TOP_K, int UPT>
struct WideBatch {  // a struct's enum, not a function or variable: see kScanBatch
  enum { value = UPT == 1 && (TOP_K > kBatch) && (TOP_K <= kWideBatch) };
};

// Slots first_slot + u * TPT (u < UPT) of one row into v[u] where `pred` holds and the slot
// exists; zero elsewhere. `at` is the address of slot first_slot, in a valid row even where pred
// is false. CACHED: see load_pack_if.
template <typename S, int VEC, int HIDDEN, int UPT, int TPT, bool CACHED = false>
__device__ __forceinline__ void load_slots_at(bool pred, const S* at, int first_slot,
                                              Pack<S, VEC> (&v)[UPT]) {
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    v[u] = zero_pack<S, VEC>();
    load_slot_if<S, VEC, HIDDEN, CACHED>(pred && first_slot + u * TPT < kSlots, at + u * TPT * VEC,
                                         first_slot + u * TPT, v[u]);
  }
}

// The same from the start of the row, `src`.
template <typename S, int VEC, int HIDDEN, int UPT, int TPT, bool CACHED = false>
__device__ __forceinline__ void load_row_slots(bool pred, const S* src, int first_slot,
                                               Pack<S, VEC> (&v)[UPT]) {
  load_slots_at<S, VEC, HIDDEN, UPT, TPT, CACHED>(
      pred, src + static_cast<long long>(first_slot) * VEC, first_slot, v);
}

// sum[u] += w * v[u] for each of a thread's UPT slots, in fp32.
template <int IN_DT, int VEC, int UPT, typename S>
__device__ __forceinline__ void add_row_slots(float w, const Pack<S, VEC> (&v)[UPT],
                                              float (&sum)[UPT][VEC]) {
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    float x[VEC];
    unpack<IN_DT, VEC>(v[u], x);
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] = fmaf(w, x[e], sum[u][e]);
  }
}

// Adds row r with weight w to this thread's UPT slots: the rare paths below, one row at a time.
template <int IN_DT, int VEC, int HIDDEN, int UPT, int TPT>
__device__ __forceinline__ void add_row(const CombineParams& p, long long r, float w,
                                        int first_slot, float (&sum)[UPT][VEC]) {
  typedef typename Elem<IN_DT>::storage S;
  Pack<S, VEC> v[UPT];
  load_row_slots<S, VEC, HIDDEN, UPT, TPT>(
      true, static_cast<const S*>(p.expert) + r * p.expert_stride, first_slot, v);
  add_row_slots<IN_DT, VEC, UPT>(w, v, sum);
}

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
// order. 32 entries per round trip instead of one (NOTES, version 35).
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
// pair in registers; both rows are then loaded together. One pass per row before: on the H200 (A
// B B A, token index with 4-12 rows per token, 8 on average, rows shuffled) T4096 H7168 193.7 ->
// 158.9 us, H4096 118.0 -> 95.9; 2-6 rows at H2880 40.5 -> 39.5; 1-3 rows at K=2 level; calls
// with K rows per token level (this code is not on their path). Quadratic in the list length, but
// bitwise identical to the held path and to add_rows_by_walk (the same rows in the same order).
// `list` is in the workspace (list path) or in shared memory (single launch): plain loads serve
// both.
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
// a warp's scan ending once past the window. Against the walk of token_idx it replaces (one
// dependent load per entry in every thread), on the H200: see NOTES, version 35.
// Not inlined: inlined, it changed how ptxas scheduled the first scan's batch (7 of its 8 loads
// before the compares, the 8th after them: a second round trip per batch in every call). As a
// call it costs the slab form's compile 4-5 ms locally (NOTES, version 35).
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

// Token index, single launch, one token per block (TPB == 1, whole warps: every decode-sized and
// wide-row call): the same scan without atomics or a sort. A warp reads 32 entries of token_idx
// per load instruction; each match learns its rank among the warp's matches from a ballot and
// writes its row id there, so a warp's list is in ascending row order: the order the combine sums
// in. At decode the kernel is bound by one warp's instruction chain (tools/bench/NOTES.md, version
// 8): 16 SASS instructions per 32 entries instead of the atomic scan's 38 (sm_90), and no sort.
// Two forms, each its own module (KernelSpec::small_scan; the host picks by the call's rows):
//  - SMALL (calls with at most BLOCK rows: T <= 16 at K = 8, T <= 64 at K <= 2): every warp reads
//    all of token_idx, one load per 32 entries, and keeps its own list: no block barrier, no
//    merge, no unused loads of a full batch, and no walk of token_idx for long lists. The list is
//    a window of LIST_CAP entries starting at list position `from`; a token with more rows (a
//    skewed routing) has the combine scan again for each later window (4 loads at BLOCK 128).
//    Against the slabs (T = 1: 562 -> 504 instructions per warp, Nsight Compute; on the H200,
//    A B B A x 3, us: T = 1 5.90 -> 5.55, T = 8 6.32 -> 6.07, T = 16 K = 4 H = 2880 5.47 ->
//    5.22). As a module of its own, without the slab code, it compiles in 99 ms locally
//    where the two forms together took 137 (the slab form alone 129), and it runs 0.09-0.23 us
//    faster than the one-module kernel at T = 2-128 on the H200 (NOTES, versions 27-28).
//    Why a window and not a list long enough for every row of the call: that list took 2 KB of
//    shared memory per block (BLOCK 128), and after a producer kernel that uses none a dependent
//    launch (p.dependent_launch) got 0.5-0.9 us slower, slower than a plain one (T = 64 K = 2
//    H = 4096: 1.43 -> 2.30 us per decode step; T = 16 K = 4 H = 2880: 1.33 -> 1.86). The old
//    kernel padded to 2 KB showed the same (1.43 -> 2.00), this form with LIST_CAP-long lists did
//    not (1.41); a carveout preference did not cure it (NOTES, version 28).
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
      // DeepSeek-V3 module (sm_90): 840 -> 664 SASS instructions, one VOTE where there were 16,
      // compile 157 -> 145 ms locally; on the H200 T = 256 and 384 at K = 8 1.5-2.0% faster,
      // T = 24-128 at K = 8 level, T = 64 K = 4 H = 2880 0.08 us slower (NOTES, version 32).
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

// Whether gather-map entry e names one of `rows` rows (negative entries do not, by the unsigned
// compare). An int32 map is checked in 32 bits (num_rows < 2^31 for this layout; the 64-bit compare
// cost 1-2%).
template <typename IdxT>
__device__ __forceinline__ bool names_row(IdxT e, long long rows) {
  if constexpr (sizeof(IdxT) == 4)
    return static_cast<unsigned>(e) < static_cast<unsigned>(rows);
  else
    return static_cast<unsigned long long>(e) < static_cast<unsigned long long>(rows);
}

// ---- the combine -----------------------------------------------------------------------------

// Sorts a few row ids ascending in registers (odd-even transposition: compile-time indices only,
// so the array never leaves registers). The token-index lists arrive in atomic arrival order;
// sorting restores the documented, deterministic summation order.
template <int N>
__device__ __forceinline__ void sort_rows(int (&r)[N]) {
#pragma unroll
  for (int round = 0; round < N; ++round)
#pragma unroll
    for (int i = round & 1; i + 1 < N; i += 2) {
      const int lo = min(r[i], r[i + 1]), hi = max(r[i], r[i + 1]);
      r[i] = lo;
      r[i + 1] = hi;
    }
}

// A dependent launch's routing prefetch (prefetch_l2), issued before the wait: what each kernel
// reads first that the previous kernel is unlikely to have written. In an engine the routing (the
// gather map or token_idx, and the gates) comes from the router, several kernels before the
// combine, and the expert GEMMs between stream enough weights through L2 to evict it; the rows
// come from the kernel just before, still in L2. One request per line is enough, and every
// block repeating them measured slower (up to 0.2 us per step at 224-320 blocks): fixed layouts,
// the token's map entries and gates from its first chunk's block; single launch, the token_idx
// entries it scans first, from the first block only (every block reads the same ones).
// The token index's gates are read by row, known only after the scan, and the list path's first
// kernel (the clear) reads no routing.
template <int LAYOUT, typename IdxT, int TOP_K, int TPT, int TPB>
__device__ __forceinline__ void prefetch_routing(const CombineParams& p, long long tok, int chunk,
                                                 int lane) {
  const IdxT* routing = static_cast<const IdxT*>(p.indices);
  if constexpr (LAYOUT != kLayoutTokenIndex) {
    if (lane != 0 || chunk != 0 || tok >= p.num_tokens) return;
    if constexpr (LAYOUT == kLayoutGatherMap) {
      prefetch_l2(routing + tok * TOP_K);
      if (TOP_K > 1) prefetch_l2(routing + tok * TOP_K + (TOP_K - 1));
    }
    if (p.gates != nullptr) {
      prefetch_l2(p.gates + tok * TOP_K);
      if (TOP_K > 1) prefetch_l2(p.gates + tok * TOP_K + (TOP_K - 1));
    }
  } else {
    const long long rows = p.num_rows;
    if (blockIdx.x != 0 || blockIdx.y != 0 || rows <= 0) return;
    // The ordered scan (one token per block, both forms): all of token_idx, one line per thread
    // (24 * BLOCK entries at most, so every line of an int32 index). Asking for each warp's first
    // slab batch instead took the slab form's compile 4 ms longer (142 -> 146 ms locally). The
    // atomic scan: the block's first batch.
    const long long batch = static_cast<long long>(kScanBatch) * TPT * TPB;
    const long long entries = (TPB == 1 && TPT % 32 == 0) || rows < batch ? rows : batch;
    prefetch_l2_line(routing, entries * static_cast<long long>(sizeof(IdxT)),
                     static_cast<int>(threadIdx.x));
  }
}

// One block per work item (a group of TPB tokens x a chunk of TPT * UPT vector slots; the grid is
// described in combine_tokens). Each thread reads its token's routing, issues the loads of a
// whole batch of rows (up to kBatch 16-byte vectors; kWideBatch rows in the fixed layouts) before
// the first use, sums in fp32 in a fixed order and stores once. Measured on the H200 against a
// persistent grid that prefetched the next item's routing: this form was 1-14% faster at every
// prefill shape (fewer registers, the hardware scheduler balancing short blocks) and equal at
// decode; see tools/bench/NOTES.md.
//
// SCAN (token index only): the single-launch form, which finds its tokens' rows itself
// (detail::scan_token_rows) instead of reading the lists token_index_assign built; SMALL_SCAN its
// form for calls with at most one block's threads in rows (scan_token_rows_ordered). The kernels
// `combine` and `combine_scan` below are this body.
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT,
          int TPB, int UPT, int LIST_CAP, bool SCAN, bool SMALL_SCAN>
__device__ __forceinline__ void combine_tokens(const CombineParams& p) {
  static_assert(!SCAN || LAYOUT == kLayoutTokenIndex, "only the token index scans");
  static_assert(!SMALL_SCAN || (SCAN && TPB == 1 && TPT % 32 == 0),
                "the small-call scan is a form of the ordered scan (one token per block)");
  static_assert(LAYOUT != kLayoutTokenIndex || (LIST_CAP >= TOP_K && TOP_K >= 1),
                "token index: a list, at least TOP_K long");
  static_assert(LAYOUT == kLayoutTokenIndex || (TOP_K > 0 && LIST_CAP == 0), "fixed top_k");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;  // vectors per row, tail included
  constexpr bool kTokenIndex = LAYOUT == kLayoutTokenIndex;
  // Rows loaded together: kBatch 16-byte vectors in flight per thread, whatever UPT is. Except
  // with 9-16 rows per token (DeepSeek-V3 with its shared expert as a ninth row, top-10 and top-16
  // routers) at one slot per thread: all of them in one batch, one round trip. The fixed layouts
  // loaded a batch of eight and then the rest two by two (each pair a round trip, after its map
  // entries at the gather map); the token index held eight rows and took the rest on its slow
  // paths (the in-order pass over the list, or a second round of the ordered scan).
  constexpr bool kWide = detail::WideBatch<TOP_K, UPT>::value;
  constexpr int kRowsPerBatch = kWide ? TOP_K : detail::kBatch / UPT > 0 ? detail::kBatch / UPT : 1;
  // Rows whose routing is held in registers. Fixed layouts: the first batch (later rows, when
  // top_k > kRowsPerBatch, are read as they come). Token index: TOP_K is the expected rows per
  // token (1, 2, 4, 8, 12 or 16, chosen by the host): that many list entries, sorted
  // here and loaded in batches of kRowsPerBatch. Holding no more than a token usually has matters:
  // 8 held rows cost 35% at K=1 and 8% at K=2 on the H200 (the sort, the predicated loads and
  // the masking, in every thread).
  constexpr int kHeldCap = kTokenIndex ? detail::kWideBatch : kRowsPerBatch;
  constexpr int kHeld = TOP_K < kHeldCap ? TOP_K : kHeldCap;
  // Rows of one batch of the held path: never more than are held. A batch of kRowsPerBatch with
  // fewer held rows (K <= 4 with one slot per thread, K = 1 with two) added its compile-time
  // absent rows too in the fixed layouts' branch-free adds: zeros times weight 0, which the
  // compiler must keep (fmaf(0, 0, -0.0f) is +0.0f), 24-56 useless FFMAs per thread between the
  // row loads and the store (nvdisasm: `FFMA R14, RZ, RZ, R14`, six per sum register at K = 2).
  constexpr int kBatchRows = kRowsPerBatch < kHeld ? kRowsPerBatch : kHeld;
  // Row loads through L1 for the bandwidth blocks (a whole 128-thread group per token) when every
  // chunk of a row is full; streaming for decode-sized groups, short rows, the single launch, and
  // rows whose last chunk is partial (H=2880 and H=3584 measured 1-2% slower through L1 in both
  // fixed layouts, in two runs; why is not known). The token index's list path has 128-thread
  // groups only where the host found L1 allocation pays (choose_geometry). See load_pack_if.
  constexpr bool kCachedRowLoads = !SCAN && TPT >= 128 && kSlots % (TPT * UPT) == 0;
  // Token index, single launch with one token per block: the scan lists rows in ascending order
  // (detail::scan_token_rows_ordered), so the combine need not sort them.
  constexpr bool kOrderedScan = SCAN && TPB == 1 && TPT % 32 == 0;
  // The ordered scan's list is a window of the token's rows, whole rounds of kHeld entries, listed
  // again past its end: the small-call form from the start of the window (it has no slab scan),
  // the slab form only past its first LIST_CAP rows.
  constexpr int kScanWindow = LIST_CAP / kHeld * kHeld;

  const IdxT* __restrict__ indices = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  // Fixed layouts: one 1-D grid, a token's chunks dispatched back to back. Token-major: the blocks
  // running together then read its K adjacent rows as one contiguous stretch (1-5% faster than
  // chunk-major at every prefill shape on the H200). Gather map, against the 2-D grid (A B B A,
  // twice): 0.5-1.2% faster at DeepSeek-V3, K=1, K=2 fp32, K=4 and K=8 H=4096, 0.1-0.16 us at
  // decode T=1 and T=32 (block medians; decode and mid-size calls: see below); 0.1-0.8% slower at
  // H=2048, H=3584 and K=2 bf16 (a row is one chunk there and both grids are the same blocks: code
  // generation). Version 8 measured the opposite, before the map's 32-bit checks and the K <= 2
  // slot counts. The token index's list path takes the 1-D grid too where it holds two or more
  // rows per token (A B B A x 2: K2 bf16 60.15 -> 59.13 us, K2 fp32 109.87 -> 109.04, K4 H2880
  // 39.04 -> 38.59, K8 H3584 75.98 -> 75.22, K8 H4096 83.90 -> 83.36, the other prefill shapes
  // level to 0.3% faster) but not with one (K1 H5120 30.63 -> 31.42). Its single launch and
  // one-token kernel keep the 2-D grid (x the token group, y the chunk). The host applies the same
  // rule (KernelSpec::one_dim_grid). Except the gather map up to mid-size calls, which the host
  // launches on the 2-D grid (gridDim.y > 1; src/combine_plan.cpp, gather_map_two_dim_grid): a
  // uniform branch here, so one module serves both grids. Only where a row has several chunks
  // (otherwise the grids are the same): at K = 2 with four slots per thread the branch cost ptxas a
  // spill and 2.7%.
  constexpr bool kOneDimGrid = !SCAN && (!kTokenIndex || TOP_K >= 2);
  long long group;
  int chunk;
  if constexpr (kOneDimGrid) {
    constexpr unsigned kChunks = (kSlots + TPT * UPT - 1) / (TPT * UPT);
    if (LAYOUT == kLayoutGatherMap && kChunks > 1 && gridDim.y > 1) {
      group = blockIdx.x;
      chunk = static_cast<int>(blockIdx.y);
    } else {
      group = blockIdx.x / kChunks;
      chunk = static_cast<int>(blockIdx.x % kChunks);
    }
  } else {
    group = blockIdx.x;
    chunk = static_cast<int>(blockIdx.y);
  }
  const long long tok = group * TPB + sub;
  const int first_slot = chunk * (TPT * UPT) + lane;
  // A dependent launch waits before any memory access (only hints before it): the routing, the
  // rows and (accumulating) out may be the previous kernel's output, and out may be its input.
  // The list path always waits (below): its previous kernel is token_index_assign, whose lists
  // it reads.
  if constexpr (!kTokenIndex || SCAN) {
    if (p.dependent_launch != 0) {
      prefetch_routing<LAYOUT, IdxT, TOP_K, TPT, TPB>(p, tok, chunk, lane);
      wait_for_predecessor();
    }
  }
  // Token index: this token's rows (in arrival order; ascending from the ordered scan) and how
  // many there are.
  int count = TOP_K;
  int* list = nullptr;
  if constexpr (kOrderedScan) {
    // The small-call form scans in the held rounds below (its first window there): one copy of
    // the scan in the module, not two.
    if constexpr (!SMALL_SCAN)
      count = detail::scan_token_rows_ordered<IdxT, TPT, LIST_CAP, false>(p, tok, list);
    if (tok >= p.num_tokens) return;  // after the scan's barriers; none below
  } else if constexpr (SCAN) {
    __shared__ int s_count[TPB];
    __shared__ int s_rows[TPB][LIST_CAP];
    detail::scan_token_rows<IdxT, TPT * TPB, TPB, LIST_CAP>(p, group * TPB, s_count, s_rows);
    if (tok >= p.num_tokens) return;  // after the scan's barriers; none below
    count = s_count[sub];
    list = s_rows[sub];
  } else {
    if constexpr (kTokenIndex) {
      detail::wait_for_predecessor();  // token_index_assign's lists
    }
    if (tok >= p.num_tokens) return;  // no barrier below: idle token groups may leave
    if constexpr (kTokenIndex) {
      count = __ldg(p.token_counts + tok);
      list = p.token_rows + tok * LIST_CAP;
    }
  }

  float sum[UPT][VEC];
#pragma unroll
  for (int u = 0; u < UPT; ++u)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;

  // Token index: every row of the token is among the held (sorted) ones. Otherwise (a skewed
  // routing) the slow paths below add them, in the same order. The ordered scan's list (ascending,
  // in shared memory) needs no slow path: it reaches every row of the token through its windows,
  // and its rows are held in rounds of kHeld list entries, each round the held path below (a
  // whole batch of loads per round trip, where the in-order slow path loaded two rows per round
  // trip and selected each next row). Locally that took the single-launch module's compile from
  // 144 to 131 ms (DeepSeek-V3 decode geometry) and from 143 to 123 ms (K = 2, prefill geometry);
  // on the H200, A B B A x 2 against the slow-path form, T = 8-256 within -1.2% / +1.5%.
  const bool held_all = !kTokenIndex || kOrderedScan || count <= kHeld;
  int held_from = 0;    // list position of this round's first held row
  int window_from = 0;  // list position of `list`'s first entry (the ordered scan's window)
  do {                  // one round, except for the ordered scan's longer lists
    // Routing of the held rows: row ids (R < 2^31; token index: -1 when dropped or absent) and
    // gates. Gather map: `mapped` says whether the entry names a row; row[] is 0 where it does not,
    // so the row's address needs no select (see the batch below).
    int row[kHeld];
    bool mapped[kHeld];
    float gate[kHeld];
    if constexpr (kTokenIndex) {
      // The entries are read together with the count, not after it (entries past the count are
      // stale but inside the list): one round trip before the rows, as for a gather map.
      if constexpr (SMALL_SCAN) {
        if (held_from == 0 || held_from - window_from == kScanWindow) {  // uniform
          window_from = held_from;
          __syncwarp();  // every lane has read the last window
          count =
              detail::scan_token_rows_ordered<IdxT, TPT, LIST_CAP, true>(p, tok, list, window_from);
        }
      } else if constexpr (kOrderedScan) {
        if (held_from - window_from == kScanWindow) {  // uniform: past the list (rare)
          window_from = held_from;
          detail::relist_slab_window<IdxT, TPT, LIST_CAP>(indices, static_cast<int>(p.num_rows),
                                                          tok, window_from, count, list);
        }
      }
      if constexpr (kOrderedScan) {
        detail::load_list_entries(list + (held_from - window_from), row);  // shared memory
      } else {
#pragma unroll
        for (int k = 0; k < kHeld; ++k) {
          if constexpr (SCAN)
            row[k] = list[k];  // shared memory
          else
            row[k] = __ldg(list + k);
        }
      }
      if constexpr (!kOrderedScan) {
#pragma unroll
        for (int k = 0; k < kHeld; ++k)
          if (k >= count) row[k] = 0x7fffffff;
        sort_rows(row);
      }
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        if (held_from + k >= count) row[k] = -1;
        gate[k] = p.gates != nullptr && row[k] >= 0 ? __ldg(p.gates + row[k]) : 1.0f;
      }
    } else {
      // At decode sizes the kernel is bound by one warp's instruction chain: every instruction
      // between the map load and the row loads counts. (Together with the row address below, these
      // cut the gather map's chain to the first row load from 141 to 71 instructions; on the H200
      // level to 2% at T = 1, 32 and 64 against Triton in the same harness, prefill level.)
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        if constexpr (LAYOUT == kLayoutTokenMajor) {
          row[k] = 0;  // unused: the row is tok * TOP_K + k
        } else {
          const IdxT m = __ldg(indices + tok * TOP_K + k);
          mapped[k] = detail::names_row(m, p.num_rows);  // out of range: dropped
          row[k] = mapped[k] ? static_cast<int>(m) : 0;
        }
      }
      // Gates from one base address under one (uniform) branch: a null check per gate made the
      // compiler build each gate's address separately.
      if (p.gates != nullptr) {
        const float* __restrict__ g = p.gates + tok * TOP_K;
#pragma unroll
        for (int k = 0; k < kHeld; ++k) gate[k] = __ldg(g + k);
      } else {
#pragma unroll
        for (int k = 0; k < kHeld; ++k) gate[k] = 1.0f;
      }
    }

    // The held rows, routing from registers, a batch at a time: every load of a batch is issued
    // before its first add. (One batch for the fixed layouts.)
    if (held_all) {
#pragma unroll
      for (int b = 0; b < kHeld; b += kBatchRows) {
        detail::Pack<S, VEC> v[kBatchRows][UPT];
        bool present[kBatchRows];
#pragma unroll
        for (int i = 0; i < kBatchRows; ++i) {
          const int j = b + i, k = j < kHeld ? j : 0;
          if constexpr (LAYOUT != kLayoutTokenMajor) {
            // The row's address from this thread's first slot: one unsigned 32 x 64-bit product
            // with the stride in bytes, from a valid row id (0 where the entry is dropped or
            // absent). The token index used a signed 64-bit row index before (more instructions
            // in the single launch's decode chain; measured together with its small-call scan).
            unsigned rid;
            if constexpr (LAYOUT == kLayoutGatherMap) {
              present[i] = j < kHeld && mapped[k];
              rid = static_cast<unsigned>(row[k]);
            } else {
              present[i] = j < kHeld && row[k] >= 0;  // -1: past the count, or dropped
              rid = present[i] ? static_cast<unsigned>(row[k]) : 0u;
            }
            const char* at = reinterpret_cast<const char*>(expert + first_slot * VEC) +
                             static_cast<unsigned long long>(rid) *
                                 static_cast<unsigned long long>(p.expert_stride * sizeof(S));
            detail::load_slots_at<S, VEC, HIDDEN, UPT, TPT, kCachedRowLoads>(
                present[i], reinterpret_cast<const S*>(at), first_slot, v[i]);
          } else {
            present[i] = j < kHeld;
            detail::load_row_slots<S, VEC, HIDDEN, UPT, TPT, kCachedRowLoads>(
                present[i], expert + (tok * TOP_K + j) * p.expert_stride, first_slot, v[i]);
          }
        }
        // Adds of a dropped or absent row: skipped (a branch, uniform across a token's threads)
        // where a batch has at most four rows at one slot per thread, as the token index always
        // did; otherwise branch-free (an absent row was loaded as zeros and gets weight 0, its
        // gate may be anything). The branch changes no bit: fmaf(0, 0, s) is s for every s but
        // -0.0, and a sum that starts at +0.0 never becomes -0.0. With most slots dropped the
        // gather map is bound by instruction issue: under Nsight Compute on the H200 (T4096 K8
        // H7168 bf16, 87.5% of slots dropped) the branch-free adds kept 36.4M instructions, as
        // many as with every slot routed, at 72% of issue slots. Skipping them took that to 27.4M,
        // but the branches' predicates outlive the loads: ptxas took 64 registers where it had
        // 56 at K = 8 (48 -> 56 at K = 7, 47 -> 52 at K = 6, 40 -> 45 at K = 5; fewer blocks per
        // SM), and 48-register K <= 2 forms with four slots spilled. On the H200, A B B A x 2
        // against the branch-free adds (tools/bench/NOTES.md, version 52): K = 8 0.2-0.6% slower
        // with every slot routed for 0.4-2.5% faster at 87.5% dropped, so it keeps them. K = 4
        // (40 registers either way; 38 -> 32 at K = 3), T4096, in two runs: 87.5% dropped 4.7% /
        // 4.8% faster at H2880, 7.6% / 7.7% at H6144; every slot routed, in three runs, -2.6% /
        // +1.1% / -0.6% at H2880 (that shape's spread between runs), +0.1% / +0.2% / 0.0% at
        // H6144, +1.1% at T2048 H2880, -0.4% at T1024.
        // (Branch-free adds in the token index's single launch took 504 -> 445 instructions per
        // warp at T = 1, but the compiler then reused load registers and interleaved loads with
        // adds: 5.64 -> 6.28 us on the H200.)
        constexpr bool kBranchFreeAdds = !kTokenIndex && (UPT > 1 || kBatchRows > 4);
#pragma unroll
        for (int i = 0; i < kBatchRows; ++i) {
          const float w = present[i] ? gate[b + i < kHeld ? b + i : 0] : 0.0f;
          if (kBranchFreeAdds || present[i]) detail::add_row_slots<IN_DT, VEC, UPT>(w, v[i], sum);
        }
      }
    }
    held_from += kHeld;
  } while (kOrderedScan && held_all && held_from < count);
  // Fixed layouts with top_k > kRowsPerBatch: later rows two at a time, routing from memory. A
  // loop that is not unrolled, so the rare large top_k costs no registers on the common path.
  if constexpr (!kTokenIndex) {
#pragma unroll 1
    for (int base = kRowsPerBatch; base < TOP_K; base += 2) {
      detail::Pack<S, VEC> v[2][UPT];
      float w[2];
      bool present[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int k = base + j;
        long long r = -1;
        if (k < TOP_K) {
          if constexpr (LAYOUT == kLayoutTokenMajor) {
            r = tok * TOP_K + k;
          } else {
            const IdxT m = __ldg(indices + tok * TOP_K + k);
            r = detail::names_row(m, p.num_rows) ? static_cast<long long>(m) : -1;
          }
        }
        present[j] = r >= 0;
        w[j] = present[j] && p.gates != nullptr ? __ldg(p.gates + tok * TOP_K + k) : 1.0f;
        detail::load_row_slots<S, VEC, HIDDEN, UPT, TPT, kCachedRowLoads>(
            present[j], expert + (present[j] ? r : 0) * p.expert_stride, first_slot, v[j]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (present[j]) detail::add_row_slots<IN_DT, VEC, UPT>(w[j], v[j], sum);
    }
  }
  if constexpr (kTokenIndex && !kOrderedScan) {
    if (!held_all) {
      if (count <= LIST_CAP)
        detail::add_listed_rows_in_order<IN_DT, VEC, HIDDEN, UPT, TPT>(p, list, count, first_slot,
                                                                       sum);
      else if constexpr (TPT % 32 == 0)
        detail::add_rows_by_warp_walk<IN_DT, VEC, HIDDEN, UPT, TPT, IdxT>(p, tok, first_slot, sum);
      else
        detail::add_rows_by_walk<IN_DT, VEC, HIDDEN, UPT, TPT, IdxT>(p, tok, first_slot, sum);
    }
  }
  detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(
      static_cast<OutS*>(p.out) + tok * p.out_stride, first_slot, sum, p);
}

}  // namespace detail

// Fixed layouts in 128-thread blocks with one slot per thread (the bandwidth geometry at K >= 4):
// the launch bounds promise eight blocks per SM, which lets ptxas use up to 64 registers. Without
// that promise it fitted these kernels into 32 registers (full occupancy) by issuing a batch's row
// loads two, then one at a time (nvdisasm: 2 + 1 + 1 ... LDG.128 between the adds at K = 8)
// instead of all eight back to back. On the H200, A B B A x 2 against that form: gather map
// 0.9-1.2% faster at K8 H7168 (bf16, fp16), K8 H2048 and K4 H2880, token-major 0.45-0.7%; K8 H4096,
// K8 H3584 and K4 H6144 level (+-0.2%). Two or four slots per thread (K <= 2) already had their
// loads back to back; the bound there measured level (fp32) to 0.6% slower (gather map K2 bf16), so
// they, the 16x2 blocks (mid-size calls, the gather map's one-token kernel) and the token index
// keep ptxas's own choice (0: no promise). Except the gather map with four slots (K = 2 at
// prefill): since bf16 rows are unpacked from words (detail::unpack) ptxas gave it 56 registers
// (9 blocks per SM) where it had 48; a promise of 10
// blocks keeps 48, no spill, loads back to back: T8192 K2 H4096 bf16 -0.23%, H2048 -0.15%, fp32
// level on the H200 (A B B A x 4). Token-major with four slots spilled under it (and never takes
// four slots). With 9-16 rows per token in one batch (detail::kWideBatch) the routing and the rows
// take up to about 110 registers: half the blocks (four, 128 registers), the same bytes in flight
// per SM as eight blocks of eight rows.
template <int LAYOUT, int TOP_K, int TPT, int TPB, int UPT>
struct CombineMinBlocks {
  enum {
    value = LAYOUT == kLayoutTokenIndex || TPT * TPB < 128 ? 0
            : UPT == 1 ? (detail::WideBatch<TOP_K, UPT>::value ? 512 : 1024) / (TPT * TPB)
            : UPT == 4 && LAYOUT == kLayoutGatherMap ? 1280 / (TPT * TPB)
                                                     : 0
  };
};

template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT,
          int TPB, int UPT, int LIST_CAP>
__global__ void __launch_bounds__(TPT* TPB, (CombineMinBlocks<LAYOUT, TOP_K, TPT, TPB, UPT>::value))
    combine(const CombineParams p) {
  detail::combine_tokens<LAYOUT, IN_DT, OUT_DT, IdxT, HIDDEN, VEC, TOP_K, TPT, TPB, UPT, LIST_CAP,
                         false, false>(p);
}

// ---- token-index layout, small calls: one launch -----------------------------------------------
// For calls with few rows, the list path's two extra launches (clear, assign) cost more than the
// work: here every block scans all of token_idx for its own tokens' rows, then combines them
// exactly as the list path does (same sorted order, same slow paths: bitwise the same result).
// The host picks it while that re-reading stays cheap (src/combine_plan.cpp), and SMALL (one
// token per block, whole warps) for calls with at most TPT rows.
// SMALL promises four blocks per SM (up to 128 registers), as the fixed layouts do (above): without
// it ptxas gave the form's windowed scan loop 40 registers at K = 1 with two slots per thread by
// loading a row's second slot only after adding its first (nvdisasm: LDG, FFMA, LDG, FFMA), two
// round trips per row; on the H200 T = 96-128 K = 1 ran 0.3-0.45 us slower than the pre-split
// kernel. With the promise the loads are back to back at every small-form geometry (K = 1-8) and
// nothing spills (eight blocks, 64 registers, spilled at K = 8). Small-form grids are small: at
// most a few blocks per SM at the benchmark's shapes.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT, int TPB,
          int UPT, int LIST_CAP, bool SMALL>
__global__ void __launch_bounds__(TPT* TPB, SMALL ? 4 : 0) combine_scan(const CombineParams p) {
  detail::combine_tokens<kLayoutTokenIndex, IN_DT, OUT_DT, IdxT, HIDDEN, VEC, TOP_K, TPT, TPB, UPT,
                         LIST_CAP, true, SMALL>(p);
}

// ---- token-index layout, one token: one launch, no scan --------------------------------------
// A call with one token (single-sequence decode) needs no search: every row whose token_idx entry
// is 0 belongs to it, and every other row is dropped. So the row, its gate and its token_idx entry
// are loaded together, a batch of rows at a time, and the entry only decides whether the row is
// added: one round trip to memory before the adds, where the single launch's scan needs two (the
// entries, then the rows they name). Rows are added in ascending order with the same fp32 fma
// chain as every other path: bitwise the same result. The host takes it for num_rows <=
// kOneTokenMaxRows (src/combine_plan.cpp): a dropped row is still read, so many of them would cost
// bandwidth the scan does not spend.
// TOP_K: rows per batch (the rows the call has, rounded up to 1, 2, 4, 8, 12 or 16); the grid is
// the token index's: x the token groups (one, whose other tokens leave at once), y the chunks.
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT, int TPB,
          int UPT>
__global__ void __launch_bounds__(TPT* TPB) combine_one_token(const CombineParams p) {
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  // Up to kBatch rows per batch; with 12 or 16 rows per token held, all of them.
  constexpr int kMostPerBatch = detail::WideBatch<TOP_K, UPT>::value ? detail::kWideBatch
                                : detail::kBatch / UPT > 0           ? detail::kBatch / UPT
                                                                     : 1;
  constexpr int kRowsPerBatch = TOP_K < kMostPerBatch ? TOP_K : kMostPerBatch;
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  if (p.dependent_launch != 0) {  // token_idx and the gates first (detail::prefetch_routing)
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
  const int rows = static_cast<int>(p.num_rows);  // <= kOneTokenMaxRows (host)

  float sum[UPT][VEC];
#pragma unroll
  for (int u = 0; u < UPT; ++u)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;
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
// bitwise the fixed layouts' result. The host takes it for num_tokens == 1, num_rows <= top_k <=
// kBatch (src/combine_plan.cpp, KernelSpec::fits_one_token_map); its grid is the fixed layouts' 1-D
// one (the token's chunks; a second token group of the block leaves at once).
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
    detail::prefetch_routing<kLayoutGatherMap, IdxT, TOP_K, TPT, TPB>(p, tok, chunk, lane);
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
#pragma unroll
  for (int u = 0; u < UPT; ++u)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;
#pragma unroll
  for (int k = 0; k < TOP_K; ++k)
    detail::add_row_slots<IN_DT, VEC, UPT>(mapped[k] ? gate[k] : 0.0f, x[k], sum);
  detail::store_row_slots<OUT_DT, VEC, HIDDEN, UPT, TPT>(static_cast<OutS*>(p.out), first_slot, sum,
                                                         p);  // token 0's row
}

// ---- token-index layout: building the per-token row lists ------------------------------------
// Two small steps before the combine: per-token lists of row ids in arrival order. The combine
// sorts each list in registers, so the summation order never depends on the atomics.

// Step 1: forget the previous call's lists (the workspace may hold anything).
// A template only so that NVRTC compiles it into the modules that name it: a plain __global__
// function is compiled into every module, and cost 12-13 ms of each fixed-layout compile.
template <int UNUSED = 0>
__global__ void token_index_clear(const CombineParams p) {
  // A dependent launch (the caller asked): the previous kernel on the stream may still read this
  // workspace (an earlier call's combine) or write token_idx, which token_index_assign reads
  // before its own wait; assign is not scheduled before every block of this kernel has passed the
  // wait and allowed it.
  if (p.dependent_launch != 0) detail::wait_for_predecessor();
  detail::allow_dependents();
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       t < p.num_tokens; t += static_cast<long long>(gridDim.x) * blockDim.x)
    p.token_counts[t] = 0;
}

// Step 2: every row announces itself to its token. Arrival order is not deterministic.
template <typename IdxT>
__global__ void token_index_assign(const CombineParams p) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  detail::allow_dependents();
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  // The first row's entry is loaded before the wait: token_idx is the caller's input, complete
  // before token_index_clear passed its own wait (and allowed this kernel only then), so its round
  // trip overlaps the clear.
  IdxT entry = first < p.num_rows ? __ldg(token_idx + first) : IdxT(-1);
  detail::wait_for_predecessor();  // the counts are token_index_clear's
  for (long long r = first; r < p.num_rows; r += stride) {
    if (r != first) entry = __ldg(token_idx + r);
    const long long t = static_cast<long long>(entry);
    if (t < 0 || t >= p.num_tokens) continue;  // dropped (-1) or out of range
    const int arrival = atomicAdd(p.token_counts + t, 1);
    if (arrival < p.list_capacity)
      p.token_rows[t * p.list_capacity + arrival] = static_cast<int>(r);
  }
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_CUH_
