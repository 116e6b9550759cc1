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
//   UPT       vector slots per thread (a work item spans TPT * UPT slots of one token)
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
    v = load_streaming(
        reinterpret_cast<const Pack<S, VEC>*>(row + static_cast<long long>(slot) * VEC));
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

// More rows for one token than its list holds (a skewed routing): walk token_idx in row order
// and add this token's rows, in the same ascending order as the listed path. Slow but bounded,
// and bitwise identical to what a longer list would give.
template <int IN_DT, int VEC, int HIDDEN, typename IdxT>
__device__ __forceinline__ void add_rows_by_walk(const CombineParams& p, long long tok, int slot,
                                                 float (&sum)[VEC]) {
  typedef typename Elem<IN_DT>::storage S;
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  for (long long r = 0; r < p.num_rows; ++r) {
    if (static_cast<long long>(__ldg(token_idx + r)) != tok) continue;
    const float w = p.gates != nullptr ? __ldg(p.gates + r) : 1.0f;
    const Pack<S, VEC> v = load_slot<S, VEC, HIDDEN>(expert + r * p.expert_stride, slot);
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[e] = fmaf(w, Elem<IN_DT>::to_float(v.e[e]), sum[e]);
  }
}

}  // namespace detail

// ---- the combine -----------------------------------------------------------------------------

// One persistent loop for every layout. A work item is TPB tokens x TPT vector slots; blocks loop
// over items with a grid stride. Each thread keeps the routing of its token (rows and gates) in
// registers and loads the routing of its NEXT item while the current item's rows are in flight,
// so the dependent index load never leaves the memory pipe idle between items.
template <int LAYOUT, int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TOP_K, int TPT,
          int TPB, int UPT, int LIST_CAP>
__global__ void __launch_bounds__(TPT* TPB) combine(const CombineParams p) {
  static_assert(LAYOUT != kLayoutTokenIndex || (LIST_CAP > 0 && TOP_K == 0), "token index");
  static_assert(LAYOUT == kLayoutTokenIndex || (TOP_K > 0 && LIST_CAP == 0), "fixed top_k");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;  // vectors per row, tail included
  constexpr int kSpan = TPT * UPT;                  // slots of one token per work item
  constexpr int kChunks = (kSlots + kSpan - 1) / kSpan;
  constexpr bool kTokenIndex = LAYOUT == kLayoutTokenIndex;
  constexpr int kMaxRows = kTokenIndex ? LIST_CAP : TOP_K;  // rows a token can have listed
  // Rows whose routing is held (and prefetched) in registers; later rows, rare (top_k > 8), are
  // read when their batch comes. Keeps registers bounded for every top_k.
  // Rows loaded together: kBatch 16-byte vectors in flight per thread, whatever UPT is.
  constexpr int kRowsPerBatch = detail::kBatch / UPT > 0 ? detail::kBatch / UPT : 1;
  constexpr int kHeld = kMaxRows < kRowsPerBatch ? kMaxRows : kRowsPerBatch;

  const IdxT* __restrict__ indices = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;

  struct Routing {
    int count;       // rows of the token (token index: may exceed kMaxRows: overflow)
    int row[kHeld];  // row ids (R < 2^31); -1: dropped. Unused for token-major.
    float gate[kHeld];
  };
  // Row k of token tok (-1: dropped) and its gate, from memory.
  auto row_of = [&](long long tok, int k) -> int {
    if constexpr (kTokenIndex) {
      return __ldg(p.token_rows + tok * LIST_CAP + k);  // sorted by token_index_sort
    } else {
      const long long m = static_cast<long long>(__ldg(indices + tok * TOP_K + k));
      return (m >= 0 && m < p.num_rows) ? static_cast<int>(m) : -1;  // -1 / out of range: dropped
    }
  };
  auto gate_of = [&](long long tok, int k) -> float {
    if constexpr (kTokenIndex) return __ldg(p.token_gates + tok * LIST_CAP + k);
    return p.gates != nullptr ? __ldg(p.gates + tok * TOP_K + k) : 1.0f;
  };
  auto route = [&](long long item, Routing& r) {
    const long long tok = (item / kChunks) * TPB + sub;
    r.count = 0;
    if (tok >= p.num_tokens) return;
    r.count = kTokenIndex ? __ldg(p.token_counts + tok) : TOP_K;
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {  // entries past count are stale and never used
      if (LAYOUT != kLayoutTokenMajor) r.row[k] = row_of(tok, k);
      r.gate[k] = gate_of(tok, k);
    }
  };

  const long long total = ((p.num_tokens + TPB - 1) / TPB) * kChunks;
  Routing cur;
  route(blockIdx.x, cur);
  for (long long item = blockIdx.x; item < total; item += gridDim.x) {
    const long long tok = (item / kChunks) * TPB + sub;
    const int first_slot = static_cast<int>(item % kChunks) * kSpan + lane;
    const bool token_on = tok < p.num_tokens;
    float sum[UPT][VEC];
#pragma unroll
    for (int u = 0; u < UPT; ++u)
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;
    Routing next;
    const bool listed = cur.count <= kMaxRows;
    // First batch: routing from registers; all its loads are issued before the next item's
    // routing is prefetched, then the rows are added in order.
    {
      detail::Pack<S, VEC> v[kRowsPerBatch][UPT];
      bool present[kRowsPerBatch];
#pragma unroll
      for (int j = 0; j < kRowsPerBatch; ++j) {
        present[j] = false;
        if (j < kMaxRows && token_on && listed && j < cur.count) {
          const long long row =
              LAYOUT == kLayoutTokenMajor ? tok * TOP_K + j : cur.row[j < kHeld ? j : 0];
          if (row >= 0) {
            present[j] = true;
#pragma unroll
            for (int u = 0; u < UPT; ++u)
              if (first_slot + u * TPT < kSlots)
                v[j][u] = detail::load_slot<S, VEC, HIDDEN>(expert + row * p.expert_stride,
                                                            first_slot + u * TPT);
          }
        }
      }
      if (item + gridDim.x < total) route(item + gridDim.x, next);
#pragma unroll
      for (int j = 0; j < kRowsPerBatch; ++j)
        if (present[j]) {
#pragma unroll
          for (int u = 0; u < UPT; ++u)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              sum[u][e] = fmaf(cur.gate[j < kHeld ? j : 0],
                               detail::Elem<IN_DT>::to_float(v[j][u].e[e]), sum[u][e]);
        }
    }
    // Later rows (top_k or a list longer than one batch), two at a time, routing from memory: a
    // loop that is not unrolled, so the rare long lists cost no registers on the common path.
#pragma unroll 1
    for (int base = kRowsPerBatch; base < kMaxRows && base < cur.count; base += 2) {
      detail::Pack<S, VEC> v[2][UPT];
      float w[2];
      bool present[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int k = base + j;
        present[j] = false;
        w[j] = 0.0f;
        if (k < kMaxRows && token_on && listed && k < cur.count) {
          const long long row = LAYOUT == kLayoutTokenMajor ? tok * TOP_K + k : row_of(tok, k);
          if (row >= 0) {
            present[j] = true;
            w[j] = gate_of(tok, k);
#pragma unroll
            for (int u = 0; u < UPT; ++u)
              if (first_slot + u * TPT < kSlots)
                v[j][u] = detail::load_slot<S, VEC, HIDDEN>(expert + row * p.expert_stride,
                                                            first_slot + u * TPT);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (present[j]) {
#pragma unroll
          for (int u = 0; u < UPT; ++u)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              sum[u][e] = fmaf(w[j], detail::Elem<IN_DT>::to_float(v[j][u].e[e]), sum[u][e]);
        }
    }
#pragma unroll
    for (int u = 0; u < UPT; ++u) {
      const int slot = first_slot + u * TPT;
      if (!token_on || slot >= kSlots) continue;
      if constexpr (kTokenIndex) {
        if (!listed) detail::add_rows_by_walk<IN_DT, VEC, HIDDEN, IdxT>(p, tok, slot, sum[u]);
      }
      OutS* out_row = static_cast<OutS*>(p.out) + tok * p.out_stride;
      detail::store_slot<OUT_DT, VEC, HIDDEN>(out_row, slot, sum[u], p.scale, p.accumulate != 0);
    }
    cur = next;
  }
}

// ---- token-index layout, small batches: one launch ---------------------------------------------
// For decode-sized calls (few rows) the three list-building launches would cost more than the
// work. Here each block reads all of token_idx (a few KB, from L2) and its first warp per token
// collects that token's rows in ascending order with warp ballots: one launch, no workspace.
// One work item per block. Needs TPT to be a multiple of 32 (a token owns whole warps), and at
// most kScanMaxRows rows (combine_params.h; the host only picks this kernel then).
template <int IN_DT, int OUT_DT, typename IdxT, int HIDDEN, int VEC, int TPT, int TPB, int LIST_CAP>
__global__ void __launch_bounds__(TPT* TPB) combine_scan(const CombineParams p) {
  static_assert(TPT % 32 == 0, "a token must own whole warps");
  typedef typename detail::Elem<IN_DT>::storage S;
  typedef typename detail::Elem<OUT_DT>::storage OutS;
  constexpr int kBlock = TPT * TPB;
  constexpr int kSlots = (HIDDEN + VEC - 1) / VEC;
  constexpr int kChunks = (kSlots + TPT - 1) / TPT;
  __shared__ IdxT s_idx[kScanMaxRows];
  __shared__ int s_rows[TPB][LIST_CAP];
  __shared__ int s_count[TPB];

  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  const S* __restrict__ expert = static_cast<const S*>(p.expert);
  const int sub = static_cast<int>(threadIdx.x) / TPT;
  const int lane = static_cast<int>(threadIdx.x) % TPT;
  const long long tok = (blockIdx.x / kChunks) * static_cast<long long>(TPB) + sub;
  const int slot = static_cast<int>(blockIdx.x % kChunks) * TPT + lane;
  const bool collector = lane < 32 && tok < p.num_tokens;  // the group's first warp
  const int rows = static_cast<int>(p.num_rows);           // <= kScanMaxRows (host checks)

  // All of token_idx into shared memory at once: independent loads, one round trip to L2.
  for (int j = static_cast<int>(threadIdx.x); j < rows; j += kBlock)
    s_idx[j] = __ldg(token_idx + j);
  __syncthreads();
  int found = 0;  // rows of tok seen so far (kept by the collector warp)
  if (collector) {
    for (int c = 0; c < rows; c += 32) {
      const bool mine = c + lane < rows && static_cast<long long>(s_idx[c + lane]) == tok;
      const unsigned mask = __ballot_sync(0xffffffffu, mine);
      const int pos = found + __popc(mask & ((1u << lane) - 1u));
      if (mine && pos < LIST_CAP) s_rows[sub][pos] = c + lane;
      found += __popc(mask);
    }
  }
  if (collector && lane == 0) s_count[sub] = found;
  __syncthreads();
  if (tok >= p.num_tokens || slot >= kSlots) return;
  const int count = s_count[sub];

  float sum[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) sum[e] = 0.0f;
  if (count <= LIST_CAP) {
    for (int base = 0; base < count; base += detail::kBatch) {
      detail::Pack<S, VEC> v[detail::kBatch];
      float w[detail::kBatch];
#pragma unroll
      for (int j = 0; j < detail::kBatch; ++j)
        if (base + j < count) {
          const int row = s_rows[sub][base + j];
          w[j] = p.gates != nullptr ? __ldg(p.gates + row) : 1.0f;
          v[j] = detail::load_slot<S, VEC, HIDDEN>(expert + row * p.expert_stride, slot);
        }
#pragma unroll
      for (int j = 0; j < detail::kBatch; ++j)
        if (base + j < count) {
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            sum[e] = fmaf(w[j], detail::Elem<IN_DT>::to_float(v[j].e[e]), sum[e]);
        }
    }
  } else {
    detail::add_rows_by_walk<IN_DT, VEC, HIDDEN, IdxT>(p, tok, slot, sum);
  }
  OutS* out_row = static_cast<OutS*>(p.out) + tok * p.out_stride;
  detail::store_slot<OUT_DT, VEC, HIDDEN>(out_row, slot, sum, p.scale, p.accumulate != 0);
}

// ---- token-index layout: building the per-token row lists ------------------------------------
// Three small steps before the combine; together they are a counting sort of token_idx into
// per-token lists in ascending row order, so the summation order never depends on atomics.

// Step 1: forget the previous call's lists (the workspace may hold anything).
__global__ void token_index_clear(const CombineParams p) {
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       t < p.num_tokens; t += static_cast<long long>(gridDim.x) * blockDim.x)
    p.token_counts[t] = 0;
}

// Step 2: every row announces itself to its token. Arrival order is not deterministic.
template <typename IdxT>
__global__ void token_index_assign(const CombineParams p) {
  const IdxT* __restrict__ token_idx = static_cast<const IdxT*>(p.indices);
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < p.num_rows;
       r += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long t = static_cast<long long>(__ldg(token_idx + r));
    if (t < 0 || t >= p.num_tokens) continue;  // dropped (-1) or out of range
    const int arrival = atomicAdd(p.token_counts + t, 1);
    if (arrival < p.list_capacity)
      p.token_rows[t * p.list_capacity + arrival] = static_cast<int>(r);
  }
}

// Step 3: one thread per token sorts its list (ascending row id: the documented, deterministic
// summation order) and gathers the gates in that order, so the combine reads both contiguously.
// A sorting network on registers: compile-time indices only, no local memory.
template <int LIST_CAP>
__global__ void token_index_sort(const CombineParams p) {
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
       t < p.num_tokens; t += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int count = p.token_counts[t];
    if (count > LIST_CAP) continue;  // overflow: the combine walks token_idx instead
    int r[LIST_CAP];
#pragma unroll
    for (int k = 0; k < LIST_CAP; ++k)
      r[k] = k < count ? p.token_rows[t * LIST_CAP + k] : 0x7fffffff;
#pragma unroll
    for (int round = 0; round < LIST_CAP; ++round)
#pragma unroll
      for (int i = round & 1; i + 1 < LIST_CAP; i += 2) {
        const int lo = min(r[i], r[i + 1]), hi = max(r[i], r[i + 1]);
        r[i] = lo;
        r[i + 1] = hi;
      }
#pragma unroll
    for (int k = 0; k < LIST_CAP; ++k)
      if (k < count) {
        p.token_rows[t * LIST_CAP + k] = r[k];
        p.token_gates[t * LIST_CAP + k] = p.gates != nullptr ? __ldg(p.gates + r[k]) : 1.0f;
      }
  }
}

}  // namespace moejit

#endif  // MOEJIT_COMBINE_CUH_
