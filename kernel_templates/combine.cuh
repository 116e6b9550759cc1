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
//   TOP_K     slots per token (token-major and gather map; 0 for token index)
//   TPT       threads per token group (one vector slot per thread)
//   TPB       token groups per block (several tokens share a block when rows are short)
//   LIST_CAP  token-index layout: rows per token kept in the workspace list (0 otherwise)
//
// Grid: one block per (group of TPB tokens) x (chunk of TPT vector slots); 1-D, token-major.
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
  // Round to nearest even; NaN stays a (quiet) NaN of the same sign.
  static __device__ __forceinline__ unsigned short from_float(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
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

// Reads a pack of expert data that no thread of this kernel writes: through the non-coherent
// path, without allocating in L1 (each row is read once; L1 is better left to the indices).
template <typename P>
__device__ __forceinline__ P load_streaming(const P* ptr) {
  P v;
  if constexpr (sizeof(P) == 16) {
    unsigned* u = reinterpret_cast<unsigned*>(&v);
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3])
        : "l"(ptr));
  } else if constexpr (sizeof(P) == 8) {
    unsigned* u = reinterpret_cast<unsigned*>(&v);
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(u[0]), "=r"(u[1]) : "l"(ptr));
  } else if constexpr (sizeof(P) == 4) {
    unsigned* u = reinterpret_cast<unsigned*>(&v);
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(u[0]) : "l"(ptr));
  } else {
    v = *ptr;
  }
  return v;
}

// Loads slot `slot` of a row: a full vector, or the partial tail element by element.
template <typename S, int VEC, int HIDDEN>
__device__ __forceinline__ Pack<S, VEC> load_slot(const S* __restrict__ row, int slot) {
  constexpr int kFull = HIDDEN / VEC;
  Pack<S, VEC> v;
  if (HIDDEN % VEC == 0 || slot < kFull) {
    v = load_streaming(reinterpret_cast<const Pack<S, VEC>*>(row + static_cast<long long>(slot) * VEC));
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.e[e] = e < HIDDEN % VEC ? row[kFull * VEC + e] : S(0);
  }
  return v;
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
      const Pack<S, VEC> o = *reinterpret_cast<const Pack<S, VEC>*>(dst);
#pragma unroll
      for (int e = 0; e < VEC; ++e) old[e] = E::to_float(o.e[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (e < n) old[e] = E::to_float(dst[e]);
    }
  }
  Pack<S, VEC> r;
#pragma unroll
  for (int e = 0; e < VEC; ++e) r.e[e] = E::from_float(acc[e] * scale + old[e]);
  if (full) {
    *reinterpret_cast<Pack<S, VEC>*>(dst) = r;
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (e < n) dst[e] = r.e[e];
  }
}

// Rows in flight per thread: enough independent 16-byte loads to cover memory latency without
// spilling the loaded vectors.
constexpr int kBatch = 8;

// Sums `count` rows given by row_of(j), j = 0..count-1, in that order, into acc.
template <int IN_DT, int VEC, int HIDDEN, int MAX_COUNT, typename RowOf>
__device__ __forceinline__ void gather_rows(const CombineParams& p, int slot, int count,
                                            RowOf row_of, float (&acc)[VEC]) {
  typedef Elem<IN_DT> E;
  typedef typename E::storage S;
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  for (int base = 0; base < count; base += kBatch) {
    Pack<S, VEC> v[kBatch];
    float w[kBatch];
    bool present[kBatch];  // a real row (not dropped, not past count)
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      present[j] = false;
      w[j] = 0.0f;
      if ((MAX_COUNT == 0 || base + j < MAX_COUNT) && base + j < count) {
        const long long row = row_of(base + j);
        if (row >= 0) {
          present[j] = true;
          w[j] = p.gates != nullptr ? __ldg(p.gates + row_of.gate_index(base + j, row)) : 1.0f;
          v[j] = load_slot<S, VEC, HIDDEN>(expert + row * p.expert_stride, slot);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (present[j]) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = fmaf(w[j], E::to_float(v[j].e[e]), acc[e]);
      }
    }
  }
}

}  // namespace detail

// ---- the combine -----------------------------------------------------------------------------

template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K,
          int TPT, int TPB, int LIST_CAP>
__global__ void __launch_bounds__(TPT * TPB) combine(const CombineParams p) {
  static_assert(LAYOUT != kLayoutTokenIndex || (LIST_CAP > 0 && TOP_K == 0), "token index");
  static_assert(LAYOUT == kLayoutTokenIndex || (TOP_K > 0 && LIST_CAP == 0), "fixed top_k");
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;  // vectors per row, tail included
  constexpr int kChunks = (kSlots + TPT - 1) / TPT;

  const long long group = blockIdx.x / kChunks;
  const int chunk = static_cast<int>(blockIdx.x % kChunks);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  const long long t = group * TPB + sub;
  const int slot = chunk * TPT + lane;
  const bool token_ok = t < p.num_tokens;
  const bool active = token_ok && slot < kSlots;

  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;

  if constexpr (LAYOUT == kLayoutTokenMajor || LAYOUT == kLayoutGatherMap) {
    // Persistent loop over work items (TPB tokens x TPT slots each). The routing of the next
    // item (its gather-map entries and gates) is loaded while this item's rows are in flight, so
    // the dependent index load no longer stalls the memory pipe between items.
    const IdxT* __restrict__ map = static_cast<const IdxT*>(p.indices);
    typedef typename detail::Elem<IN_DT>::storage S;
    const S* __restrict__ expert = static_cast<const S*>(p.expert);
    constexpr bool kPrefetch = TOP_K <= 16;  // routing kept in registers: 2 per slot
    struct Routing {
      int row[TOP_K];  // gather map: row id (R < 2^31), -1 if dropped
      float gate[TOP_K];
    };
    auto route = [&](long long item, Routing& r) {
      const long long tok = (item / kChunks) * TPB + sub;
      if (tok >= p.num_tokens) return;
#pragma unroll
      for (int k = 0; k < TOP_K; ++k) {
        if (LAYOUT == kLayoutGatherMap) {
          const long long m = static_cast<long long>(__ldg(map + tok * TOP_K + k));
          r.row[k] = (m >= 0 && m < p.num_rows) ? static_cast<int>(m) : -1;  // -1 / out of range
        }
        r.gate[k] = p.gates != nullptr ? __ldg(p.gates + tok * TOP_K + k) : 1.0f;
      }
    };
    const long long total = ((p.num_tokens + TPB - 1) / TPB) * kChunks;
    Routing cur;
    if (kPrefetch) route(blockIdx.x, cur);
    for (long long item = blockIdx.x; item < total; item += gridDim.x) {
      const long long tok = (item / kChunks) * TPB + sub;
      const int s_slot = static_cast<int>(item % kChunks) * TPT + lane;
      const bool on = tok < p.num_tokens && s_slot < kSlots;
      if (!kPrefetch) route(item, cur);
      float sum[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum[e] = 0.0f;
      Routing next;
#pragma unroll
      for (int base = 0; base < TOP_K; base += detail::kBatch) {
        detail::Pack<S, VEC> v[detail::kBatch];
#pragma unroll
        for (int j = 0; j < detail::kBatch; ++j) {
          const int k = base + j;
          if (k < TOP_K && on) {
            const long long row = LAYOUT == kLayoutTokenMajor ? tok * TOP_K + k : cur.row[k];
            if (row >= 0)
              v[j] = detail::load_slot<S, VEC, HIDDEN>(expert + row * p.expert_stride, s_slot);
          }
        }
        if (kPrefetch && base == 0 && item + gridDim.x < total) route(item + gridDim.x, next);
#pragma unroll
        for (int j = 0; j < detail::kBatch; ++j) {
          const int k = base + j;
          if (k < TOP_K && on && (LAYOUT == kLayoutTokenMajor || cur.row[k] >= 0)) {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              sum[e] = fmaf(cur.gate[k], detail::Elem<IN_DT>::to_float(v[j].e[e]), sum[e]);
          }
        }
      }
      if (on) {
        OutS* out_row = static_cast<OutS*>(p.out) + tok * p.out_stride;
        detail::store_slot<OUT_DT, VEC, HIDDEN>(out_row, s_slot, sum, p.scale, p.accumulate != 0);
      }
      if (kPrefetch) cur = next;
    }
    return;
  } else {
    // Token-index layout. The workspace holds, per token, how many rows named it and (up to
    // LIST_CAP of) their ids in arrival order, which depends on atomics. Sorting the ids makes
    // the summation order "ascending row", whatever the arrival order: deterministic.
    __shared__ int s_arrived[TPB][LIST_CAP];
    __shared__ int s_sorted[TPB][LIST_CAP];
    const int count = token_ok ? p.token_counts[t] : 0;
    const bool listed = count <= LIST_CAP;
    if (token_ok && listed)
      for (int i = lane; i < count; i += TPT)
        s_arrived[sub][i] = p.token_rows[t * LIST_CAP + i];
    __syncthreads();
    if (token_ok && listed)
      for (int i = lane; i < count; i += TPT) {
        const int r = s_arrived[sub][i];
        int rank = 0;
        for (int j = 0; j < count; ++j) rank += s_arrived[sub][j] < r;
        s_sorted[sub][rank] = r;
      }
    __syncthreads();
    if (!active) return;
    struct ListedRows {
      const int* sorted;
      __device__ long long operator()(int j) const { return sorted[j]; }
      __device__ long long gate_index(int, long long row) const { return row; }
    };
    if (listed) {
      detail::gather_rows<IN_DT, VEC, HIDDEN, LIST_CAP>(p, slot, count, ListedRows{s_sorted[sub]},
                                                        acc);
    } else {
      // More rows than the list holds (a pathological routing): walk token_idx in row order and
      // take this token's rows, in the same ascending order as the listed path. Slow, bounded,
      // and bitwise identical to what a larger list would give.
      const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
      typedef typename detail::Elem<IN_DT>::storage S;
      const S* __restrict__ expert = static_cast<const S*>(p.expert);
      for (long long r = 0; r < p.num_rows; ++r) {
        if (static_cast<long long>(__ldg(token_idx + r)) != t) continue;
        const float w = p.gates != nullptr ? __ldg(p.gates + r) : 1.0f;
        const detail::Pack<S, VEC> v =
            detail::load_slot<S, VEC, HIDDEN>(expert + r * p.expert_stride, slot);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          acc[e] = fmaf(w, detail::Elem<IN_DT>::to_float(v.e[e]), acc[e]);
      }
    }
  }

  OutS* out_row = static_cast<OutS*>(p.out) + t * p.out_stride;
  detail::store_slot<OUT_DT, VEC, HIDDEN>(out_row, slot, acc, p.scale, p.accumulate != 0);
}

// ---- token-index layout: building the per-token row lists ------------------------------------

// Step 1: forget the previous call's lists (the workspace may hold anything).
__global__ void token_index_clear(const CombineParams p) {
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       t < p.num_tokens; t += static_cast<long long>(gridDim.x) * blockDim.x)
    p.token_counts[t] = 0;
}

// Step 2: every row announces itself to its token. Arrival order is not deterministic; the
// combine sorts each list before summing, so the result is.
template <typename IdxT>
__global__ void token_index_assign(const CombineParams p) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       r < p.num_rows; r += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long t = static_cast<long long>(__ldg(token_idx + r));
    if (t < 0 || t >= p.num_tokens) continue;  // dropped (-1) or out of range
    const int arrival = atomicAdd(p.token_counts + t, 1);
    if (arrival < p.list_capacity)
      p.token_rows[t * p.list_capacity + arrival] = static_cast<int>(r);
  }
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_CUH_
