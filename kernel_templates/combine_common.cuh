// Device code every combine kernel shares: element types and their conversions, predicated vector
// loads, the one store, programmatic dependent launch, the routing prefetch, and the batch of held
// rows that every gather kernel adds. Specialized at run time by libmoejit; the kernels are in
// combine_fixed.cuh, combine_token_index.cuh and combine_one_token.cuh.
//
//   out[t, :] (+)= scale * sum over rows r of token t of gate(r) * expert[r, :]
//
// Every design here gathers: the threads that own an output vector read that token's source rows,
// sum them in fp32 in a fixed order and write once. No zero-fill, no read-modify-write of out
// (except in accumulate mode, which reads its own element), no atomics on data: results are
// bitwise deterministic and do not depend on the batch. (The approach of TensorRT-LLM's finalize
// and vLLM's moe_unpermute kernels.)
//
// Template parameters, chosen by the host's kernel-choice table (src/combine_dispatch.cpp):
//   LAYOUT    kLayoutTokenMajor | kLayoutGatherMap | kLayoutTokenIndex (see combine_params.h)
//   IN_DT     element type code of the expert rows  (kFloat32 | kFloat16 | kBFloat16)
//   OUT_DT    element type code of the output
//   IdxT      int or long long: gather map / token_idx element type
//   HIDDEN    elements per row
//   VEC       elements per vector access; VEC * sizeof(element) <= 16 bytes, and every row start
//             is VEC-aligned (the host picks VEC from the pointers and strides). A hidden size that
//             is not a multiple of VEC gets one partial "tail" vector handled element by element.
//   TOP_K     fixed layouts: slots per token
//   HELD      token index: rows of a token held in registers at once (1, 2, 4, 8, 12 or 16)
//   TPT       threads per token group (one vector slot per thread)
//   TPB       token groups per block (several tokens share a block when rows are short)
//   UPT       vector slots per thread (a work item spans TPT * UPT slots of one token)
//   LIST_CAP  token index: rows per token kept in its list
//   GRID      kGridFlat, kGridTokensByChunks or kGridFlatOrTokensByChunks (work_item)
//   CACHED    row loads through L1 (load_pack_if)
//
// One block per work item: a group of TPB tokens x a chunk of TPT * UPT vector slots. All
// addresses are computed in 64 bits: R * H passes 2^31 at realistic prefill sizes.
//
// No toolkit header is included: fp16/bf16 conversions use PTX or bit operations, so NVRTC needs
// no include path and runtime-only installs (libnvrtc without headers) still compile.
#ifndef MOEJIT_COMBINE_COMMON_CUH_
#define MOEJIT_COMBINE_COMMON_CUH_

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
//  - CACHED: a plain ld.global, which allocates in L1: faster for whole 128-thread groups reading
//    rows whose chunks are all full, slower elsewhere (the host decides: cached_rows in
//    src/combine_dispatch.cpp; docs/performance.md#geometry-within-a-variant). Of the flavours
//    tried, only L1 allocation changes the speed.
// One predicated instruction and no branch: with each row load of a batch in its own `if`, the
// register allocator gave them one shared destination plus copies, and every load then waited for
// the one before it. With the destination an in-out operand, each load keeps its own registers
// and a batch issues back to back.
//
// Not volatile, and no memory operand: to the compiler the asm is a pure function of its address,
// as the CUDA headers' __ldg is. Nothing pins such a load after griddepcontrol.wait
// (wait_for_predecessor) but the code's shape: the wait sits in its own branch, which a
// side-effect-free asm is not speculated above. The PTX of every kernel a dependent launch can
// start with is checked to have no load before its wait (tests/unit/test_kernel_compile.cpp,
// DependentLaunchPrefetchesRoutingAndLeavesTheNextKernelAlone). volatile would pin it too, but
// changes modules that were never measured with it.
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
#define MOEJIT_PRED_LOAD_U16(OP)                                               \
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p " OP ".u16 %0, [%1];\n}" \
      : "+h"(*reinterpret_cast<unsigned short*>(&v))                           \
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
  } else if constexpr (sizeof(P) == 2) {  // one 16-bit element: rows of odd hidden sizes
    if constexpr (CACHED)
      MOEJIT_PRED_LOAD_U16("ld.global");
    else
      MOEJIT_PRED_LOAD_U16("ld.global.nc.L1::no_allocate");
  } else {
    if (pred) v = *ptr;
  }
}
#undef MOEJIT_PRED_LOAD_V4
#undef MOEJIT_PRED_LOAD_V2
#undef MOEJIT_PRED_LOAD_V1
#undef MOEJIT_PRED_LOAD_U16

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
// shifted up, the high one the word with its low half cleared, one instruction each (element by
// element the compiler extracted and shifted each half, a large share of a decode warp's chain).
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
// instruction chain. A NaN stays a NaN (then the canonical one).
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
// on older GPUs, but not free at decode sizes, so a call's first kernel waits only when the caller
// asked for the dependent launch (a uniform branch on p.dependent_launch).
// Only the chain's helpers (token_index_clear, token_index_assign, token_index_heavy) allow their
// dependents, which are the chain's next kernels. The combine kernels never allow the caller's
// next kernel early: a combine that did slowed the caller's next kernel more than it gained (at
// its start, and just before its stores). Figures: docs/performance.md#dependent-launch.
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
enum { kBatch = 8 };  // an enum, not a variable: see kScanBatch (token_index_rows.cuh)
// Rows per batch at UPT slots per thread: kBatch 16-byte vectors in flight, kBatch / UPT rows;
// with vectors of 4 bytes or less (rows whose starts allow no wider access: odd hidden sizes)
// every load takes one register whatever its width, so a batch keeps kBatch rows at any UPT
// (kBatch * UPT loads, as many registers as kBatch 16-byte vectors at UPT = 4).
template <int VEC_BYTES, int UPT>
struct BatchRows {
  enum { value = VEC_BYTES <= 4 ? kBatch : kBatch / UPT > 0 ? kBatch / UPT : 1 };
};
// Fixed layouts with kBatch < TOP_K <= kWideBatch, and the token index holding that many rows
// (one slot per thread): every row in one batch, one round trip (combine_fixed.cuh,
// combine_one_token.cuh); the fixed layouts under a launch bound of half the blocks.
enum { kWideBatch = 16 };
template <int ROWS, int UPT>
struct WideBatch {  // a struct's enum, not a function or variable: see kScanBatch
  enum { value = UPT == 1 && (ROWS > kBatch) && (ROWS <= kWideBatch) };
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

// Whether gather-map entry e names one of `rows` rows (negative entries do not, by the unsigned
// compare). An int32 map is checked in 32 bits (num_rows < 2^31 for this layout; a 64-bit
// compare costs instructions in every thread).
template <typename IdxT>
__device__ __forceinline__ bool names_row(IdxT e, long long rows) {
  if constexpr (sizeof(IdxT) == 4)
    return static_cast<unsigned>(e) < static_cast<unsigned>(rows);
  else
    return static_cast<unsigned long long>(e) < static_cast<unsigned long long>(rows);
}

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
// come from the kernel just before, still in L2. One request per line is enough (every block
// repeating them measured slower): here, for the fixed layouts, the token's map entries and gates
// from its first chunk's block. The token index's: prefetch_scan_routing.
template <int LAYOUT, typename IdxT, int TOP_K>
__device__ __forceinline__ void prefetch_slot_routing(const CombineParams& p, long long tok,
                                                      int chunk, int lane) {
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
  }
}

// This thread's work item: its token (the block's token group and the thread's group in it), the
// chunk of the row the block covers and the thread's lane in the group, from the grid the host
// launched (GRID, combine_params.h). kGridFlatOrTokensByChunks reads which from gridDim.y, a
// uniform branch, so that one module serves both grids; the host asks for it only where a row has
// several chunks (with one the grids are the same blocks).
struct WorkItem {
  long long tok;
  int chunk, lane;
  int first_slot;  // the thread's first vector slot of the row: chunk * TPT * UPT + lane
};
template <int GRID, int HIDDEN, int VEC, int TPT, int TPB, int UPT>
__device__ __forceinline__ WorkItem work_item() {
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
  constexpr unsigned kChunks = (kSlots + TPT * UPT - 1) / (TPT * UPT);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  long long group;
  int chunk;
  if constexpr (GRID == kGridTokensByChunks) {
    group = blockIdx.x;
    chunk = static_cast<int>(blockIdx.y);
  } else {
    if (GRID == kGridFlatOrTokensByChunks && gridDim.y > 1) {
      group = blockIdx.x;
      chunk = static_cast<int>(blockIdx.y);
    } else {
      group = blockIdx.x / kChunks;
      chunk = static_cast<int>(blockIdx.x % kChunks);
    }
  }
  return WorkItem{group * TPB + sub, chunk, lane, chunk * (TPT * UPT) + lane};
}

// Adds a token's HELD rows, their routing already in registers, a batch of BATCH_ROWS at a time:
// every load of a batch is issued before its first add. Token-major: rows tok * TOP_K + k. Gather
// map: row[k] where mapped[k] (0 elsewhere, so the address needs no select). Token index: row[k]
// where it is not negative (-1: dropped, or past the token's count); mapped is not read.
template <int LAYOUT, int IN_DT, int HIDDEN, int VEC, int TOP_K, int TPT, int UPT, int HELD,
          int BATCH_ROWS, bool CACHED, typename S>
__device__ __forceinline__ void add_held_rows(const CombineParams& p, const S* __restrict__ expert,
                                              long long tok, int first_slot, const int (&row)[HELD],
                                              const bool (&mapped)[HELD], const float (&gate)[HELD],
                                              Pack<S, VEC> (&v)[BATCH_ROWS][UPT],
                                              bool (&present)[BATCH_ROWS], float (&sum)[UPT][VEC]) {
#pragma unroll
  for (int b = 0; b < HELD; b += BATCH_ROWS) {
#pragma unroll
    for (int i = 0; i < BATCH_ROWS; ++i) {
      const int j = b + i, k = j < HELD ? j : 0;
      if constexpr (LAYOUT != kLayoutTokenMajor) {
        // The row's address from this thread's first slot: one unsigned 32 x 64-bit product with
        // the stride in bytes, from a valid row id (0 where the entry is dropped or absent): fewer
        // instructions in the decode chain than a signed 64-bit row index.
        unsigned rid;
        if constexpr (LAYOUT == kLayoutGatherMap) {
          present[i] = j < HELD && mapped[k];
          rid = static_cast<unsigned>(row[k]);
        } else {
          present[i] = j < HELD && row[k] >= 0;  // -1: past the count, or dropped
          rid = present[i] ? static_cast<unsigned>(row[k]) : 0u;
        }
        const char* at = reinterpret_cast<const char*>(expert + first_slot * VEC) +
                         static_cast<unsigned long long>(rid) *
                             static_cast<unsigned long long>(p.expert_stride * sizeof(S));
        load_slots_at<S, VEC, HIDDEN, UPT, TPT, CACHED>(present[i], reinterpret_cast<const S*>(at),
                                                        first_slot, v[i]);
      } else {
        present[i] = j < HELD;
        load_row_slots<S, VEC, HIDDEN, UPT, TPT, CACHED>(
            present[i], expert + (tok * TOP_K + j) * p.expert_stride, first_slot, v[i]);
      }
    }
    // Adds of a dropped or absent row: skipped (a branch, uniform across a token's threads) where
    // a batch has at most four rows at one slot per thread, as the token index always does;
    // otherwise branch-free (an absent row was loaded as zeros and gets weight 0, its gate may be
    // anything). The branch changes no bit: fmaf(0, 0, s) is s for every s but -0.0, and a sum
    // that starts at +0.0 never becomes -0.0. Where the branches pay: with most slots dropped the
    // gather map is bound by instruction issue and skipping saves issue slots, but the branches'
    // predicates outlive the loads and take registers, which at five or more rows cost more than
    // they saved (docs/performance.md#geometry-within-a-variant). The token index's single launch
    // lost with branch-free adds (the compiler reused load registers and interleaved loads with
    // adds).
    constexpr bool kBranchFreeAdds = LAYOUT != kLayoutTokenIndex && (UPT > 1 || BATCH_ROWS > 4);
#pragma unroll
    for (int i = 0; i < BATCH_ROWS; ++i) {
      const float w = present[i] ? gate[b + i < HELD ? b + i : 0] : 0.0f;
      if (kBranchFreeAdds || present[i]) add_row_slots<IN_DT, VEC, UPT>(w, v[i], sum);
    }
  }
}

// sum[UPT][VEC] = 0: a thread's accumulators.
template <int UPT, int VEC>
__device__ __forceinline__ void clear_sums(float (&sum)[UPT][VEC]) {
#pragma unroll
  for (int u = 0; u < UPT; ++u)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;
}

}  // namespace detail
}  // namespace moejit

#endif  // MOEJIT_COMBINE_COMMON_CUH_
