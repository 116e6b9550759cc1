// The combine with the MoE decoder layer's epilogue in the same pass (moejit.h, "The epilogue"):
// per token, c = scale * (the combine's fp32 sum) + out's prior contents; with a residual,
// residual = round(residual + c); with a norm weight, RMSNorm of that (as rounded to the model
// dtype) times the weight; out receives the normed row or c, in its dtype or as fp8 e4m3 with one
// scale per 128 channels. Every fp32 operation is an explicitly rounded one (no contraction), and
// the sum of squares follows one fixed pairwise order, so that a token's bits depend on its own
// data only, never on the geometry, the layout, the batch or the GPU.
//
// The norm needs a token's whole row, so a token is never split across blocks that cannot talk:
//  - combine_epilogue: a token's row in one block (or in TPT threads of it, short rows), held in
//    registers slice by slice: SPLIT slices of TPT * UPT slots, one after another. With one slice
//    the row never leaves registers, and the residual it waits for after the sums (with fp8
//    output the norm weight too) is copied into shared memory as the kernel starts (cp.async), so
//    its round trip overlaps the rows'; with more slices (rows too long for registers), the normed
//    pass reads the row again: the residual it has just written (in L2), or without a residual
//    the combine again.
//  - combine_epilogue_cluster: a token's SPLIT slices on the SPLIT blocks of a thread-block cluster
//    (sm_90+, launched with the cluster dimension), each block holding its slice in registers; the
//    sum of squares' partial sums meet in distributed shared memory. Without a norm the slices
//    need not talk: the same kernel is launched without a cluster, on any GPU.
// Slices are whole fp8 groups of 128 channels, so a group's amax stays within one block.
//
// Template parameters (the common ones: combine_common.cuh):
//   ROWS      token-major, gather map: TOP_K; token index: HELD (its rows come from the lists that
//             token_index_assign built, through add_listed_token_rows; a token past its list from
//             token_index_heavy's ranks and pieces, which the module's own token_index_heavy
//             leaves without its finish step: add_heavy_token)
//   LIST_CAP  token index: rows per token list (0 for the fixed layouts)
//   SPLIT     slices per row (see above)
//   RES_DT    the residual's element type code, -1: no residual
//   W_DT      the norm weight's element type code, -1: no norm
//   OUT_DT    may be kFloat8E4M3 (fp8_e4m3.h): the quantized output, scales in p.out_scales
// TPT threads per token: up to 32, a power of two, TPB tokens per block, every reduction by
// shuffles; more, whole warps and one token per block, the sum of squares through shared memory.
#ifndef MOEJIT_COMBINE_EPILOGUE_CUH_
#define MOEJIT_COMBINE_EPILOGUE_CUH_

#include "combine_fixed.cuh"
#include "combine_token_index.cuh"
#include "fp8_e4m3.h"

namespace moejit {
namespace detail {

// fp8 e4m3 values: the output's type. From sm_89 the hardware conversion (cvt ... satfinite:
// nearest even, saturating at +-448, NaN kept), before it the same in integer operations.
template <>
struct Elem<kFloat8E4M3> {
  typedef unsigned char storage;
  static __device__ __forceinline__ float to_float(unsigned char x) {
    return __uint_as_float(e4m3_to_float_bits(x));
  }
  static __device__ __forceinline__ unsigned char from_float(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    return static_cast<unsigned char>(pair & 0xffu);
#else
    return e4m3_from_float_bits(__float_as_uint(f));
#endif
  }
};

// VEC floats as e4m3, two per conversion where the hardware has it.
template <int VEC>
__device__ __forceinline__ Pack<unsigned char, VEC> to_e4m3_pack(const float (&v)[VEC]) {
  Pack<unsigned char, VEC> r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kPairs = VEC % 2 == 0;
#else
  constexpr bool kPairs = false;
#endif
  if constexpr (kPairs) {
#pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      unsigned short pair;  // the first operand lands in the upper byte: element e + 1
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[e + 1]), "f"(v[e]));
      r.e[e] = static_cast<unsigned char>(pair & 0xffu);
      r.e[e + 1] = static_cast<unsigned char>(pair >> 8);
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.e[e] = Elem<kFloat8E4M3>::from_float(v[e]);
  }
  return r;
}

// fp32 operations rounded to nearest even, each on its own: the compiler never fuses them into an
// fma (it would for a * b + c), so the result is what moejit.h writes down.
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// x rounded to element type DT, as fp32.
template <int DT>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (DT == kFloat32)
    return x;
  else
    return Elem<DT>::to_float(Elem<DT>::from_float(x));
}

// The pairwise sum of v[0..N) (N a power of two): a balanced binary tree, neighbours first.
template <int N>
__device__ __forceinline__ float pairwise_sum(float (&v)[N]) {
  static_assert((N & (N - 1)) == 0, "a power of two");
#pragma unroll
  for (int width = 1; width < N; width *= 2)
#pragma unroll
    for (int i = 0; i + width < N; i += 2 * width) v[i] = add_rn(v[i], v[i + width]);
  return v[0];
}

// The least power of two >= N (1 for N <= 1).
template <int N, int P = 1, bool DONE = (P >= N)>
struct NextPow2 {
  enum { value = NextPow2<N, 2 * P>::value };
};
template <int N, int P>
struct NextPow2<N, P, true> {
  enum { value = P };
};

// The lanes of this thread's token group of TPT lanes (TPT <= 32, a power of two): shuffles of a
// group whose token does not exist (past the batch, its threads gone) never involve the others.
template <int TPT>
__device__ __forceinline__ unsigned group_lanes() {
  if constexpr (TPT >= 32) {
    return 0xffffffffu;
  } else {
    const unsigned lane = threadIdx.x % 32u;
    return ((1u << TPT) - 1u) << (lane & ~static_cast<unsigned>(TPT - 1));
  }
}

// Sum (pairwise: the xor butterfly adds sibling subtrees) and max over LANES lanes (a power of two
// up to 32, aligned), every lane getting the result.
template <int LANES>
__device__ __forceinline__ float lanes_sum(float v, unsigned mask) {
#pragma unroll
  for (int off = 1; off < LANES; off *= 2) v = add_rn(v, __shfl_xor_sync(mask, v, off));
  return v;
}
template <int LANES>
__device__ __forceinline__ float lanes_max(float v, unsigned mask) {
#pragma unroll
  for (int off = 1; off < LANES; off *= 2) v = fmaxf(v, __shfl_xor_sync(mask, v, off));
  return v;
}

// Slot `slot` of a row of DT elements as VEC floats, 0 past the row. Plain loads (the residual is
// written by this kernel too); CACHED: through L1 (the norm weight, which every token reads).
template <int DT, int VEC, int HIDDEN, bool CACHED = false>
__device__ __forceinline__ void load_values(const typename Elem<DT>::storage* row, int slot,
                                            float (&x)[VEC]) {
  typedef typename Elem<DT>::storage S;
  const S* at = row + static_cast<long long>(slot) * VEC;
  if (HIDDEN % VEC == 0 || slot < HIDDEN / VEC) {
    Pack<S, VEC> v = zero_pack<S, VEC>();
    if constexpr (CACHED)
      load_pack_if<true>(true, reinterpret_cast<const Pack<S, VEC>*>(at), v);
    else
      v = *reinterpret_cast<const Pack<S, VEC>*>(at);
    unpack<DT, VEC>(v, x);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = e < HIDDEN % VEC ? Elem<DT>::to_float(at[e]) : 0.0f;
  }
}

// The same for a thread's slot that may lie past the row's slots (then zeros).
template <int DT, int VEC, int HIDDEN, bool CACHED = false>
__device__ __forceinline__ void load_values_if(bool in_row, const typename Elem<DT>::storage* row,
                                               int slot, float (&x)[VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) x[e] = 0.0f;
  if (in_row) load_values<DT, VEC, HIDDEN, CACHED>(row, slot, x);
}

// Stores VEC values into slot `slot` of a row of DT elements (fp32, fp16, bf16), each rounded
// once; past the row nothing.
template <int DT, int VEC, int HIDDEN>
__device__ __forceinline__ void store_values(typename Elem<DT>::storage* row, int slot,
                                             const float (&v)[VEC]) {
  typedef typename Elem<DT>::storage S;
  S* at = row + static_cast<long long>(slot) * VEC;
  const Pack<S, VEC> r = to_pack<DT, VEC>(v);
  if (HIDDEN % VEC == 0 || slot < HIDDEN / VEC) {
    *reinterpret_cast<Pack<S, VEC>*>(at) = r;
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (e < HIDDEN % VEC) at[e] = r.e[e];
  }
}

// ---- asynchronous copies into shared memory (sm_80+) ------------------------------------------
// BYTES (4, 8 or 16) from global `src` to shared `dst`, in flight until cp_async_wait_all(); L1:
// through L1 (data other blocks read too), else 16-byte copies bypass it. Before sm_80 a copy.
template <int BYTES, bool L1, typename P>
__device__ __forceinline__ void cp_async(P* dst, const P* src) {
  static_assert(sizeof(P) == BYTES && (BYTES == 4 || BYTES == 8 || BYTES == 16), "4, 8, 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (BYTES == 16 && !L1)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(to), "l"(src), "n"(BYTES)
                 : "memory");
#else
  *dst = *src;
#endif
}
// This thread's copies so far have landed (visible to this thread).
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ---- thread-block clusters (sm_90+) ------------------------------------------------------------
// The templates include no toolkit header, so the cluster's operations are inline PTX. Before sm_90
// a cluster kernel with a norm is never launched (the host launches the one-block kernel of its
// module instead): these trap there.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}
// The first arrival of a block: no memory ordering, only "this block has started" (a block may
// write to another's shared memory once it has waited for that).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}
// v to shared address `local` (as in this block) in the shared memory of cluster block `rank`.
__device__ __forceinline__ void store_cluster_float(unsigned local, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
#else
  __trap();
#endif
}

// One token's row through the epilogue, a slice (TPT * UPT slots) at a time; the kernels below
// only arrange the slices.
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int ROWS, int TPT,
          int TPB, int UPT, int LIST_CAP, int SPLIT, int RES_DT, int W_DT>
struct EpilogueRow {
  typedef typename Elem<IN_DT>::storage InS;
  typedef typename Elem<OUT_DT>::storage OutS;
  enum {
    kSlots = (HIDDEN + VEC - 1) / VEC,
    kSliceSlots = TPT * UPT,
    kResidual = RES_DT >= 0,
    kNorm = W_DT >= 0,
    kFp8 = OUT_DT == kFloat8E4M3,
    // The model dtype, which the norm rounds to: the residual's, else the weight's.
    kModel = RES_DT >= 0 ? RES_DT
             : W_DT >= 0 ? W_DT
                         : kFloat32,
    kResDt = RES_DT >= 0 ? RES_DT : kFloat32,  // (a type for the code that never runs)
    kWDt = W_DT >= 0 ? W_DT : kFloat32,
    // Whole warps with one token per block (more than 32 threads, or slices that must meet): the
    // sum of squares' warp partials go through shared memory.
    kShared = TPT > 32 || SPLIT > 1,
    kWarps = TPT >= 32 ? TPT / 32 : 1,
    kSegments = TPT >= 32 ? UPT * TPT / 32 : 1,  // 32-slot segments of a slice
    kRowSegments = kSegments * SPLIT,
    kSegmentsPerLane =
        NextPow2<kRowSegments>::value / 32 > 0 ? NextPow2<kRowSegments>::value / 32 : 1,
    kUptPow2 = NextPow2<UPT>::value,
    // fp8: a scale group is 128 channels, kGroupSlots slots: lanes of one group side by side.
    kGroupSlots = 128 / VEC,
    kGroupLanes = kGroupSlots < TPT ? kGroupSlots : TPT,
    kGroups = (HIDDEN + 127) / 128,
    // One-slice rows of whole vectors of 4 bytes or more (cp.async's sizes) take their residual
    // from shared memory, copied in as the kernel starts (stage()), and with fp8 output the norm
    // weight too (for 16-bit outputs that cost the H = 2880 kernels a block per SM of occupancy;
    // docs/performance.md#epilogue).
    kResidualBytes = static_cast<int>(sizeof(typename Elem<kResDt>::storage)) * VEC,
    kWeightBytes = static_cast<int>(sizeof(typename Elem<kWDt>::storage)) * VEC,
    kStagedResidual = kResidual && SPLIT == 1 && HIDDEN % VEC == 0 && kResidualBytes >= 4,
    kStagedWeight = kNorm && kFp8 && SPLIT == 1 && HIDDEN % VEC == 0 && kWeightBytes >= 4,
  };
  typedef Pack<typename Elem<kResDt>::storage, VEC> ResPack;
  typedef Pack<typename Elem<kWDt>::storage, VEC> WPack;
  // A thread's u-th slot in the block's staged copies (UPT arrays of the block's threads).
  static __device__ __forceinline__ int stage_index(int u) {
    return u * TPT * TPB + static_cast<int>(threadIdx.x);
  }
  static_assert(TPT <= 32 ? (TPT & (TPT - 1)) == 0 : TPT % 32 == 0,
                "up to 32 threads per token a power of two, else whole warps");
  static_assert(!kShared || TPB == 1, "one token per block where warps meet in shared memory");
  static_assert(SPLIT * kSliceSlots >= kSlots, "the slices cover the row");
  static_assert(TPT < kGroupSlots ? UPT == 1 && SPLIT == 1 : TPT % kGroupSlots == 0,
                "fp8 groups within a slot column (or one group for the whole row)");
  static_assert(LAYOUT != kLayoutTokenIndex || LIST_CAP >= ROWS, "a list, at least HELD long");

  // out's prior contents (accumulate) or zeros, for this thread's UPT slots.
  static __device__ __forceinline__ void load_old(const CombineParams& p, long long tok,
                                                  int first_slot, float (&old)[UPT][VEC]) {
    const OutS* out_row = static_cast<const OutS*>(p.out) + tok * p.out_stride;
#pragma unroll
    for (int u = 0; u < UPT; ++u)
      load_values_if<OUT_DT, VEC, HIDDEN>(p.accumulate != 0 && first_slot + u * TPT < kSlots,
                                          out_row, first_slot + u * TPT, old[u]);
  }

  // The residual's values of this thread's UPT slots (zeros past the row).
  static __device__ __forceinline__ void load_residual(const CombineParams& p, long long tok,
                                                       int first_slot, float (&r)[UPT][VEC]) {
    typedef typename Elem<kResDt>::storage ResS;
    const ResS* row = static_cast<const ResS*>(p.residual) + tok * p.residual_stride;
#pragma unroll
    for (int u = 0; u < UPT; ++u)
      load_values_if<kResDt, VEC, HIDDEN>(first_slot + u * TPT < kSlots, row, first_slot + u * TPT,
                                          r[u]);
  }

  // Starts copying this thread's slots of the residual and the norm weight into shared memory
  // (kStagedResidual, kStagedWeight; values() and load_and_normalize() wait for them).
  static __device__ __forceinline__ void stage(const CombineParams& p, long long tok,
                                               int first_slot, ResPack* residual, WPack* weight) {
    if constexpr (kStagedWeight) {
      const WPack* w_row = static_cast<const WPack*>(p.norm_weight);
#pragma unroll
      for (int u = 0; u < UPT; ++u)
        if (first_slot + u * TPT < kSlots)
          cp_async<kWeightBytes, true>(weight + stage_index(u), w_row + first_slot + u * TPT);
    }
    if constexpr (kStagedResidual) {
      const ResPack* res_row = reinterpret_cast<const ResPack*>(
          static_cast<const typename Elem<kResDt>::storage*>(p.residual) + tok * p.residual_stride);
#pragma unroll
      for (int u = 0; u < UPT; ++u)
        if (first_slot + u * TPT < kSlots)
          cp_async<kResidualBytes, false>(residual + stage_index(u),
                                          res_row + first_slot + u * TPT);
    }
  }

  // The norm weight at this thread's UPT slots (zeros past the row).
  static __device__ __forceinline__ void load_weights(const CombineParams& p, int first_slot,
                                                      float (&w)[UPT][VEC]) {
    typedef typename Elem<kWDt>::storage WS;
#pragma unroll
    for (int u = 0; u < UPT; ++u)
      load_values_if<kWDt, VEC, HIDDEN, true>(first_slot + u * TPT < kSlots,
                                              static_cast<const WS*>(p.norm_weight),
                                              first_slot + u * TPT, w[u]);
  }

  // c = fma(sum, scale, old) for this thread's UPT slots (first_slot + u * TPT), 0 past the row.
  // EARLY: out's prior contents are loaded before the rows, not slot by slot after their sums (at
  // decode sizes one round trip fewer on the kernel's path; at prefill the registers matter more).
  template <bool EARLY>
  static __device__ __forceinline__ void combine(const CombineParams& p, long long tok,
                                                 int first_slot, float (&c)[UPT][VEC]) {
    float early_old[EARLY ? UPT : 1][VEC];
    if constexpr (EARLY) load_old(p, tok, first_slot, early_old);
    float sum[UPT][VEC];
    clear_sums(sum);
    if constexpr (LAYOUT == kLayoutTokenIndex) {
      const int count = __ldg(p.token_counts + tok);
      add_listed_token_rows<IN_DT, IdxT, HIDDEN, VEC, ROWS, TPT, UPT, LIST_CAP, false, false>(
          p, static_cast<const InS*>(p.expert), tok, first_slot, p.token_rows + tok * LIST_CAP,
          count, sum);
      // A token past its list (the lists added nothing): this module's token_index_heavy ranked
      // its rows and summed its pieces; its sum in the plain combine's order (moejit.h).
      if (count > LIST_CAP) {
        const HeavyWork heavy = heavy_work<HIDDEN>(p, 0);  // the heavy count is not needed here
        add_heavy_token<IN_DT, VEC, HIDDEN, UPT, TPT,
                        WalkBatch<ROWS, UPT, VecBytes<InS, VEC>::value>::value>(
            p, heavy, tok, count, first_slot, sum);
      }
    } else {
      add_fixed_token_rows<LAYOUT, IN_DT, IdxT, HIDDEN, VEC, ROWS, TPT, UPT, false>(
          p, static_cast<const IdxT*>(p.indices), static_cast<const InS*>(p.expert), tok,
          first_slot, sum);
    }
    const OutS* out_row = static_cast<const OutS*>(p.out) + tok * p.out_stride;
#pragma unroll
    for (int u = 0; u < UPT; ++u) {
      const int sl = first_slot + u * TPT;
      float old[VEC];
      if constexpr (EARLY) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) old[e] = early_old[u][e];
      } else {
        load_values_if<OUT_DT, VEC, HIDDEN>(p.accumulate != 0 && sl < kSlots, out_row, sl, old);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        c[u][e] = sl * VEC + e < HIDDEN ? fmaf(sum[u][e], p.scale, old[e]) : 0.0f;
    }
  }

  // The slice's values: the combine c; with a residual, the residual updated (v = r + c, stored
  // rounded). With a norm v becomes x, the value the norm reads (v rounded to the model dtype);
  // without one it stays c, what out receives. EARLY: the residual (and out's prior contents) are
  // loaded before the rows, else slot by slot after the sums.
  // staged: the residual's copy in shared memory where kStagedResidual (not with EARLY).
  template <bool EARLY = false>
  static __device__ __forceinline__ void values(const CombineParams& p, long long tok,
                                                int first_slot, float (&v)[UPT][VEC],
                                                const ResPack* staged = nullptr) {
    static_assert(!(EARLY && kStagedResidual), "one way to have the residual early");
    float early_r[kResidual && EARLY ? UPT : 1][VEC];
    if constexpr (kResidual && EARLY) load_residual(p, tok, first_slot, early_r);
    combine<EARLY>(p, tok, first_slot, v);
    if constexpr (kStagedResidual) cp_async_wait_all();
    if constexpr (kResidual) {
      typedef typename Elem<kResDt>::storage ResS;
      ResS* row = static_cast<ResS*>(p.residual) + tok * p.residual_stride;
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
        const int sl = first_slot + u * TPT;
        if (sl >= kSlots) continue;
        float h[VEC];
        if constexpr (EARLY) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) h[e] = early_r[u][e];
        } else if constexpr (kStagedResidual) {
          unpack<kResDt, VEC>(staged[stage_index(u)], h);
        } else {
          load_values<kResDt, VEC, HIDDEN>(row, sl, h);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) h[e] = add_rn(h[e], v[u][e]);
        store_values<kResDt, VEC, HIDDEN>(row, sl, h);
        if constexpr (kNorm) {
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            v[u][e] = sl * VEC + e < HIDDEN ? round_to<kResDt>(h[e]) : 0.0f;
        }
      }
    } else if constexpr (kNorm) {
#pragma unroll
      for (int u = 0; u < UPT; ++u)
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[u][e] = round_to<kModel>(v[u][e]);  // 0 stays 0
    }
  }

  // x again in a later pass of the one-block kernel: the residual as this thread stored it, or
  // without a residual the combine again (the same bits: the same loads in the same order).
  static __device__ __forceinline__ void values_again(const CombineParams& p, long long tok,
                                                      int first_slot, float (&x)[UPT][VEC]) {
    if constexpr (kResidual) {
      typedef typename Elem<kResDt>::storage ResS;
      const ResS* row = static_cast<const ResS*>(p.residual) + tok * p.residual_stride;
#pragma unroll
      for (int u = 0; u < UPT; ++u)
        load_values_if<kResDt, VEC, HIDDEN>(first_slot + u * TPT < kSlots, row,
                                            first_slot + u * TPT, x[u]);
    } else {
      values(p, tok, first_slot, x);
    }
  }

  // The sum of squares of each of the thread's slots: the pairwise sum of its VEC squares.
  static __device__ __forceinline__ void slot_squares(const float (&x)[UPT][VEC],
                                                      float (&sq)[UPT]) {
#pragma unroll
    for (int u = 0; u < UPT; ++u) {
      float s[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) s[e] = mul_rn(x[u][e], x[u][e]);
      sq[u] = pairwise_sum(s);
    }
  }

  // Up to 32 threads per token: the row's sum of squares by shuffles (the u-th TPT slots are a
  // subtree of the order; their sums then pairwise in the thread).
  static __device__ __forceinline__ float row_squares_in_lanes(const float (&x)[UPT][VEC]) {
    float slot_sq[UPT];
    slot_squares(x, slot_sq);
    const unsigned mask = group_lanes<TPT>();
    float sq[kUptPow2];
#pragma unroll
    for (int u = 0; u < kUptPow2; ++u) sq[u] = u < UPT ? lanes_sum<TPT>(slot_sq[u], mask) : 0.0f;
    return pairwise_sum(sq);
  }

  // Whole warps: each warp's 32-slot segment sums of the slice, into seg[slice * kSegments + ...]
  // (shared memory), in row order.
  static __device__ __forceinline__ void segment_squares(const float (&x)[UPT][VEC], int slice,
                                                         float* seg) {
    float sq[UPT];
    slot_squares(x, sq);
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
    for (int u = 0; u < UPT; ++u) {
      const float s = lanes_sum<32>(sq[u], 0xffffffffu);
      if (lane == 0) seg[slice * kSegments + u * kWarps + warp] = s;
    }
  }

  // The row's sum of squares from its kRowSegments segment sums (entry j from load(j)): every
  // warp the same tree, lane l the pairwise sum of entries l * kSegmentsPerLane.., then shuffles.
  template <typename Load>
  static __device__ __forceinline__ float row_squares_of_segments(Load load) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    float s[kSegmentsPerLane];
#pragma unroll
    for (int i = 0; i < kSegmentsPerLane; ++i) {
      const int j = lane * kSegmentsPerLane + i;
      s[i] = j < kRowSegments ? load(j) : 0.0f;
    }
    return lanes_sum<32>(pairwise_sum(s), 0xffffffffu);
  }

  // x -> n = round_m(round_m(x * r) * w), r = 1 / sqrt(ssq / H + eps); w: load_weights().
  static __device__ __forceinline__ void normalize(const CombineParams& p, float ssq,
                                                   const float (&w)[UPT][VEC],
                                                   float (&x)[UPT][VEC]) {
    const float r =
        div_rn(1.0f, sqrt_rn(add_rn(div_rn(ssq, static_cast<float>(HIDDEN)), p.norm_eps)));
#pragma unroll
    for (int u = 0; u < UPT; ++u)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        x[u][e] = round_to<kModel>(mul_rn(round_to<kModel>(mul_rn(x[u][e], r)), w[u][e]));
  }

  // normalize() in the one-block kernel: the weights from `staged` (kStagedWeight), else loaded
  // here (from L1 or L2).
  static __device__ __forceinline__ void load_and_normalize(const CombineParams& p, float ssq,
                                                            int first_slot, const WPack* staged,
                                                            float (&x)[UPT][VEC]) {
    float w[UPT][VEC];
    if constexpr (kStagedWeight) {
      cp_async_wait_all();
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) w[u][e] = 0.0f;
        if (first_slot + u * TPT < kSlots) unpack<kWDt, VEC>(staged[stage_index(u)], w[u]);
      }
    } else {
      load_weights(p, first_slot, w);
    }
    normalize(p, ssq, w, x);
  }

  // Stores the values out receives: rounded to out's dtype, or fp8 with the groups' scales.
  // amax_stage: shared memory of kWarps * UPT floats per slice where a group spans warps.
  static __device__ __forceinline__ void store(const CombineParams& p, long long tok,
                                               int first_slot, int slice, float (&v)[UPT][VEC],
                                               float* amax_stage) {
    OutS* out_row = static_cast<OutS*>(p.out) + tok * p.out_stride;
    if constexpr (!kFp8) {
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
        const int sl = first_slot + u * TPT;
        if (sl < kSlots) store_values<OUT_DT, VEC, HIDDEN>(out_row, sl, v[u]);
      }
    } else {
      // amax over the group: the slot's elements (0 past the row), then its lanes.
      float amax[UPT];
      const unsigned mask = group_lanes<TPT>();
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
        float m = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) m = fmaxf(m, fabsf(v[u][e]));
        amax[u] = lanes_max<(kGroupLanes < 32 ? kGroupLanes : 32)>(m, mask);
      }
      if constexpr (kGroupLanes > 32) {  // 64 or 128 lanes: the group's warps meet
        const int warp = static_cast<int>(threadIdx.x) / 32;
        constexpr int kGroupWarps = kGroupLanes / 32;
        float* stage = amax_stage + slice * UPT * kWarps;
        if (threadIdx.x % 32 == 0)
#pragma unroll
          for (int u = 0; u < UPT; ++u) stage[u * kWarps + warp] = amax[u];
        __syncthreads();
        const int first_warp = warp / kGroupWarps * kGroupWarps;
#pragma unroll
        for (int u = 0; u < UPT; ++u) {
          float m = 0.0f;
#pragma unroll
          for (int w = 0; w < kGroupWarps; ++w) m = fmaxf(m, stage[u * kWarps + first_warp + w]);
          amax[u] = m;
        }
      }
      const long long padded_tokens = (p.num_tokens + 3) / 4 * 4;
#pragma unroll
      for (int u = 0; u < UPT; ++u) {
        const int sl = first_slot + u * TPT;
        float s = div_rn(fmaxf(amax[u], 1e-10f), 448.0f);
        if (p.scales_pow2 != 0) s = __uint_as_float((__float_as_uint(s) + 0x7fffffu) & 0x7f800000u);
        if (sl >= kSlots) continue;
        float q[VEC];
        if (s < __int_as_float(0x7f800000)) {  // finite: one division for the group's values
          const float r = div_rn(1.0f, s);
#pragma unroll
          for (int e = 0; e < VEC; ++e) q[e] = divide_by_scale(v[u][e], s, r);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) q[e] = div_rn(v[u][e], s);
        }
        const Pack<unsigned char, VEC> r = to_e4m3_pack<VEC>(q);
        unsigned char* at = out_row + static_cast<long long>(sl) * VEC;
        if (HIDDEN % VEC == 0 || sl < HIDDEN / VEC) {
          *reinterpret_cast<Pack<unsigned char, VEC>*>(at) = r;
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            if (e < HIDDEN % VEC) at[e] = r.e[e];
        }
        if (sl % kGroupSlots == 0) {  // the group's first slot (a whole row's group: lane 0)
          const long long g = static_cast<long long>(sl) * VEC / 128;
          p.out_scales[p.scales_layout == kScalesRowMajor ? tok * kGroups + g
                                                          : g * padded_tokens + tok] = s;
        }
      }
    }
  }
};

}  // namespace detail

// Blocks per SM the kernels' launch bounds promise: at least 512 threads' worth. Left to itself
// ptxas spilled a few bytes at 40 registers in some modules (looped ones, 512-thread splits);
// with no floor it took 182 registers for the token index's (one 224-thread block per SM).
template <int THREADS>
struct EpilogueMinBlocks {
  enum { value = THREADS >= 512 ? 1 : 512 / THREADS };
};

// A token's whole row in one block (TPT > 32, or slices that must meet) or in TPT threads of one
// (TPB tokens per block); its SPLIT slices one after another. The grid: x the token groups. Also
// the cluster kind's kernel for GPUs without clusters (then TPB = 1).
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int ROWS, int TPT,
          int TPB, int UPT, int LIST_CAP, int SPLIT, int RES_DT, int W_DT>
__global__ void __launch_bounds__(TPT* TPB, EpilogueMinBlocks<TPT * TPB>::value)
    combine_epilogue(const CombineParams p) {
  typedef detail::EpilogueRow<LAYOUT, IN_DT, OUT_DT, IdxT, HIDDEN, VEC, ROWS, TPT, TPB, UPT,
                              LIST_CAP, SPLIT, RES_DT, W_DT>
      Row;
  // Segment sums of the whole row and the fp8 groups' warp maxima (where a group spans warps).
  __shared__ float s_segments[Row::kShared && Row::kNorm ? Row::kRowSegments : 1];
  __shared__ float s_amax[Row::kFp8 && Row::kGroupLanes > 32 ? SPLIT * UPT * Row::kWarps : 1];
  // The one-slice row's residual and weight (Row::stage).
  __shared__ typename Row::ResPack s_residual[Row::kStagedResidual ? UPT * TPT * TPB : 1];
  __shared__ typename Row::WPack s_weight[Row::kStagedWeight ? UPT * TPT * TPB : 1];
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  const long long tok = static_cast<long long>(blockIdx.x) * TPB + sub;
  // The routing, rows, residual and (accumulating) out may be the previous kernel's output: a
  // dependent launch waits before any memory access; after the list helpers always (the module's
  // token_index_heavy, after token_index_assign).
  if constexpr (LAYOUT == kLayoutTokenIndex) {
    detail::wait_for_predecessor();
  } else if (p.dependent_launch != 0) {
    detail::prefetch_slot_routing<LAYOUT, IdxT, ROWS>(p, tok, 0, lane);
    detail::wait_for_predecessor();
  }
  if (tok >= p.num_tokens) return;  // a token group past the batch (TPB > 1: no barrier below)
  if constexpr (SPLIT == 1) Row::stage(p, tok, lane, s_residual, s_weight);

  if constexpr (SPLIT == 1 && !Row::kShared) {
    float v[UPT][VEC];
    Row::values(p, tok, lane, v, s_residual);
    if constexpr (Row::kNorm)
      Row::load_and_normalize(p, Row::row_squares_in_lanes(v), lane, s_weight, v);
    Row::store(p, tok, lane, 0, v, s_amax);
  } else if constexpr (SPLIT == 1 || !Row::kNorm) {
    // Every slice on its own: the row never needs to be whole, or it is held whole.
#pragma unroll 1
    for (int slice = 0; slice < SPLIT; ++slice) {
      const int first_slot = slice * Row::kSliceSlots + lane;
      float v[UPT][VEC];
      Row::values(p, tok, first_slot, v, s_residual);
      if constexpr (Row::kNorm) {  // SPLIT == 1: the row in registers
        Row::segment_squares(v, 0, s_segments);
        __syncthreads();
        const float ssq = Row::row_squares_of_segments([&](int j) { return s_segments[j]; });
        Row::load_and_normalize(p, ssq, first_slot, s_weight, v);
      }
      Row::store(p, tok, first_slot, slice, v, s_amax);
    }
  } else {
    // Rows too long for registers, normed: every slice's squares first (storing the residual),
    // then every slice again, read back, normed and stored.
#pragma unroll 1
    for (int slice = 0; slice < SPLIT; ++slice) {
      float v[UPT][VEC];
      Row::values(p, tok, slice * Row::kSliceSlots + lane, v);
      Row::segment_squares(v, slice, s_segments);
    }
    __syncthreads();
    const float ssq = Row::row_squares_of_segments([&](int j) { return s_segments[j]; });
#pragma unroll 1
    for (int slice = 0; slice < SPLIT; ++slice) {
      const int first_slot = slice * Row::kSliceSlots + lane;
      float v[UPT][VEC];
      Row::values_again(p, tok, first_slot, v);
      Row::load_and_normalize(p, ssq, first_slot, s_weight, v);
      Row::store(p, tok, first_slot, slice, v, s_amax);
    }
  }
}

// A token's SPLIT slices on SPLIT consecutive blocks (x = token * SPLIT + slice), each slice in
// registers. With a norm the blocks are one thread-block cluster (sm_90+): each block pushes its
// warps' segment sums into every block's shared memory (distributed shared memory), and after one
// cluster barrier every warp sums all of them in the row's order from its own block's copy. Pushes
// wait for a first barrier phase that says every block has started (its arrival is the kernel's
// first instruction, so the wait costs nothing by then). Without a norm the slices are independent
// and the kernel is launched without a cluster.
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int ROWS, int TPT,
          int TPB, int UPT, int LIST_CAP, int SPLIT, int RES_DT, int W_DT>
__global__ void __launch_bounds__(TPT* TPB, EpilogueMinBlocks<TPT * TPB>::value)
    combine_epilogue_cluster(const CombineParams p) {
  typedef detail::EpilogueRow<LAYOUT, IN_DT, OUT_DT, IdxT, HIDDEN, VEC, ROWS, TPT, TPB, UPT,
                              LIST_CAP, SPLIT, RES_DT, W_DT>
      Row;
  static_assert(TPB == 1 && TPT >= 32 && SPLIT >= 2, "one token's slice per block, whole warps");
  static_assert(SPLIT <= 32, "a lane per block of the cluster pushes the segment sums");
  __shared__ float s_segments[Row::kNorm ? Row::kRowSegments : 1];
  __shared__ float s_amax[Row::kFp8 && Row::kGroupLanes > 32 ? UPT * Row::kWarps : 1];
  if constexpr (Row::kNorm) detail::cluster_arrive_relaxed();
  const long long tok = blockIdx.x / SPLIT;
  const int slice = static_cast<int>(blockIdx.x % SPLIT);  // the block's rank in its cluster
  const int first_slot = slice * Row::kSliceSlots + static_cast<int>(threadIdx.x);
  if constexpr (LAYOUT == kLayoutTokenIndex) {
    detail::wait_for_predecessor();
  } else if (p.dependent_launch != 0) {
    detail::prefetch_slot_routing<LAYOUT, IdxT, ROWS>(p, tok, slice, static_cast<int>(threadIdx.x));
    detail::wait_for_predecessor();
  }
  // Decode sizes: every independent load goes out with the rows' (the residual, out's prior
  // contents, the weight), so that the rows' round trip is the only one before the exchange.
  float w[Row::kNorm ? UPT : 1][VEC];
  if constexpr (Row::kNorm) Row::load_weights(p, first_slot, w);
  float v[UPT][VEC];
  Row::template values<true>(p, tok, first_slot, v);
  if constexpr (Row::kNorm) {
    float sq[UPT];
    Row::slot_squares(v, sq);
#pragma unroll
    for (int u = 0; u < UPT; ++u) sq[u] = detail::lanes_sum<32>(sq[u], 0xffffffffu);
    detail::cluster_wait();  // every block has started
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(s_segments));
    if (lane < SPLIT)
#pragma unroll
      for (int u = 0; u < UPT; ++u)
        detail::store_cluster_float(
            local + 4u * static_cast<unsigned>(slice * Row::kSegments + u * Row::kWarps + warp),
            static_cast<unsigned>(lane), sq[u]);
    detail::cluster_arrive();  // release: the pushes are visible to their blocks
    detail::cluster_wait();
    const float ssq = Row::row_squares_of_segments([&](int j) { return s_segments[j]; });
    Row::normalize(p, ssq, w, v);
    Row::store(p, tok, first_slot, 0, v, s_amax);
  } else {
    Row::store(p, tok, first_slot, 0, v, s_amax);
  }
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_EPILOGUE_CUH_
