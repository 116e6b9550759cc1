// GPU correctness of the epilogue (moejit.h, "The epilogue"): every layout x dtype pair x
// epilogue (residual; residual + norm; residual + norm + fp8; norm alone; fp8 alone) against the
// documented math, emulated on the host in fp32 operation for operation (the fixed fma chain, the
// pairwise sum of squares, IEEE division and square root, the roundings where moejit.h puts them,
// the integer e4m3 conversion of kernel_templates/fp8_e4m3.h): the residual, the output and the
// scales must equal it bit for bit. A float64 evaluation of the same formulas bounds the emulation
// itself (a shared misreading would otherwise pass). Hidden sizes {1, 7, 128, 2880, 4096, 7168},
// T {0, 1, 33, 4096}, K {1, 2, 8}, rotated through the combinations with strides, misaligned
// (element-aligned) pointers, dropped rows, gates, scale, accumulate, both scale layouts and
// power-of-two scales; every call twice (bitwise equal), padding and guards poisoned and checked.
// Then: every decode batch size (the cluster split), rows long enough for passes, batch and
// layout invariance, CUDA-graph capture, and the paths of GPUs without clusters (sm_80, sm_89)
// run on this GPU from their PTX. Built with the library's internals (moejit_core) for the last.
// Every test skips with its reason where no GPU is usable.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "../../kernel_templates/fp8_e4m3.h"
#include "combine_plan.h"
#include "driver.h"
#include "gpu_harness.h"
#include "kernel_store.h"
#include "nvrtc_compiler.h"

namespace moejit_test {
namespace {

// ---- host arithmetic: what the kernels compute, in the same fp32 operations ------------------

// fp16 nearest-even of any float (subnormals, overflow to infinity).
uint16_t half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (a >= 0x38800000u) {                                              // normal fp16
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  // Subnormal fp16: a multiple of 2^-24; a * 2^24 rounded to nearest even.
  const uint32_t e = a >> 23;
  if (e < 102) return sign;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;  // 14..24
  const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  return static_cast<uint16_t>(sign | (q + ((rest > half || (rest == half && (q & 1u))) ? 1 : 0)));
}

// v rounded to dtype d (fp32, fp16, bf16), as a float.
float round_to(int d, float v) {
  if (d == MOEJIT_DTYPE_FLOAT32) return v;
  if (d == MOEJIT_DTYPE_BFLOAT16) return bf16_to_float(float_to_bf16(v));
  return half_table()[half_bits(v)];
}

float e4m3_value(uint8_t b) {
  return bits_float(moejit::e4m3_to_float_bits(b));
}

// Element i of a buffer of dtype d (fp8 too).
float value_at(const void* base, int d, size_t i) {
  if (d == MOEJIT_DTYPE_FLOAT8_E4M3) return e4m3_value(static_cast<const uint8_t*>(base)[i]);
  if (d == MOEJIT_DTYPE_FLOAT16) return half_table()[static_cast<const uint16_t*>(base)[i]];
  return decode(base, static_cast<moejit_dtype>(d), i);
}
// Stores v rounded to d (fp32, fp16, bf16) at element i.
void store_at(void* base, int d, size_t i, float v) {
  if (d == MOEJIT_DTYPE_FLOAT32)
    static_cast<float*>(base)[i] = v;
  else if (d == MOEJIT_DTYPE_BFLOAT16)
    static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
  else
    static_cast<uint16_t*>(base)[i] = half_bits(v);
}

int bytes_of(int d) {
  return d == MOEJIT_DTYPE_FLOAT32 ? 4 : d == MOEJIT_DTYPE_FLOAT8_E4M3 ? 1 : 2;
}
const char* name_of(int d) {
  return d < 0                           ? "none"
         : d == MOEJIT_DTYPE_FLOAT8_E4M3 ? "fp8"
                                         : dtype_str(static_cast<moejit_dtype>(d));
}

// The pairwise sum of v[0..n), n a power of two: a balanced tree, neighbours first.
float pairwise(const float* v, size_t n) {
  if (n == 1) return v[0];
  const float a = pairwise(v, n / 2), b = pairwise(v + n / 2, n / 2);
  return a + b;
}

// ---- inputs ---------------------------------------------------------------------------------

// Covers the gather map's buffer of 4/3 x T4096 x K8 rows of H7168 + padding (and offsets).
constexpr size_t kPoolElems = size_t{320} << 20;
constexpr size_t kSmallPool = 1 << 20;  // weights, gates

// Random values in [-1, 1] per dtype (rows, residuals, out's prior contents), weights in
// [0.5, 1.5] per dtype, gates in [0, 1]; on the host and the device, built once.
struct Pools {
  std::vector<uint8_t> rows[3], weights[3];
  void* rows_device[3] = {};
  void* weights_device[3] = {};
  std::vector<float> gates;
  float* gates_device = nullptr;
};

const Pools& pools() {
  static Pools* p = [] {
    auto* pools = new Pools;
    const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
    for (int d = 0; d < 3; ++d) {
      pools->rows[d].resize(kPoolElems * static_cast<size_t>(bytes_of(d)));
      pools->weights[d].resize(kSmallPool * static_cast<size_t>(bytes_of(d)));
      std::vector<std::thread> threads;
      for (unsigned w = 0; w < n_threads; ++w)
        threads.emplace_back([&, w, d] {
          Rng rng(77 + 1000 * d + w);
          const size_t begin = kPoolElems * w / n_threads, end = kPoolElems * (w + 1) / n_threads;
          for (size_t i = begin; i < end; ++i)
            store_at(pools->rows[d].data(), d, i, rng.uniform(-1.0f, 1.0f));
        });
      for (auto& t : threads) t.join();
      Rng rng(5 + d);
      for (size_t i = 0; i < kSmallPool; ++i)
        store_at(pools->weights[d].data(), d, i, rng.uniform(0.5f, 1.5f));
      if (cudaMalloc(&pools->rows_device[d], pools->rows[d].size()) != cudaSuccess ||
          cudaMemcpy(pools->rows_device[d], pools->rows[d].data(), pools->rows[d].size(),
                     cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMalloc(&pools->weights_device[d], pools->weights[d].size()) != cudaSuccess ||
          cudaMemcpy(pools->weights_device[d], pools->weights[d].data(), pools->weights[d].size(),
                     cudaMemcpyHostToDevice) != cudaSuccess)
        throw std::runtime_error("cannot upload the random pools");
    }
    Rng rng(99);
    pools->gates.resize(kSmallPool);
    for (float& g : pools->gates) g = rng.uniform(0.0f, 1.0f);
    if (cudaMalloc(&pools->gates_device, kSmallPool * 4) != cudaSuccess ||
        cudaMemcpy(pools->gates_device, pools->gates.data(), kSmallPool * 4,
                   cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the gates");
    return pools;
  }();
  return *p;
}

struct Case {
  moejit_layout layout = MOEJIT_LAYOUT_GATHER_MAP;
  int in = MOEJIT_DTYPE_BFLOAT16, out = MOEJIT_DTYPE_BFLOAT16;  // out may be fp8
  int res = -1, weight = -1;                                    // -1: none
  moejit_index_type idx = MOEJIT_INDEX_INT32;
  int64_t hidden = 7168, tokens = 1, top_k = 8;
  uint64_t seed = 1;
  // Variations (vary()):
  bool gates = true, accumulate = false, random_routing = false, pow2 = false;
  moejit_scales_layout scales_layout = MOEJIT_SCALES_ROW_MAJOR;
  float scale = 1.0f, eps = 1e-6f;
  int64_t expert_pad = 0, out_pad = 0, res_pad = 0;
  int64_t expert_offset = 0, out_offset = 0, res_offset = 0, weight_offset = 0;
  int drop_percent = 5;  // gather map and token index: slots / rows dropped (-1)
  // Token index: a skewed distribution of its rows (`rows` of them; 0: T * K) over the tokens,
  // issue 58's: every row on one token; 1% of the tokens with half the rows; token popularity
  // Zipf(1.2); or hot_rows rows on one token (kHotRows: past its list, or past a piece of 128), the
  // rest spread at random. The drops (drop_percent) fall on the other rows only where hot_rows
  // are named, so that token's count is exact.
  enum Skew { kNoSkew, kOneToken, kTopPercent, kZipf, kHotRows } skew = kNoSkew;
  int64_t rows = 0, hot_rows = 0;

  std::string name() const {
    std::ostringstream s;
    s << layout_str(layout) << " " << name_of(in) << "->" << name_of(out) << " res=" << name_of(res)
      << " weight=" << name_of(weight) << (idx == MOEJIT_INDEX_INT64 ? " int64" : " int32")
      << " H=" << hidden << " T=" << tokens << " K=" << top_k << " seed=" << seed
      << " gates=" << gates << " acc=" << accumulate << " scale=" << scale << " eps=" << eps
      << " pads=" << expert_pad << "/" << out_pad << "/" << res_pad << " offsets=" << expert_offset
      << "/" << out_offset << "/" << res_offset << "/" << weight_offset
      << " scales=" << (scales_layout == MOEJIT_SCALES_ROW_MAJOR ? "row" : "column")
      << " pow2=" << pow2 << " random_routing=" << random_routing << " drop=" << drop_percent
      << " skew=" << skew << " rows=" << rows << " hot_rows=" << hot_rows;
    return s.str();
  }
};

Case vary(Case c) {
  Rng r(c.seed * 31 + 7);
  c.gates = r.below(5) != 0;
  c.accumulate = r.below(4) == 0;
  c.scale = r.below(3) == 0 ? 1.0f : r.uniform(0.25f, 2.5f);
  const int64_t pads[] = {0, 0, 8, 64, 3};
  c.expert_pad = pads[r.below(5)];
  c.out_pad = pads[r.below(5)];
  c.res_pad = pads[r.below(5)];
  // Element-aligned, maybe not vector-aligned (narrower vectors: fp8 groups across warps).
  c.expert_offset = r.below(4) == 0 ? r.below(8) : 0;
  c.out_offset = r.below(4) == 0 ? r.below(8) : 0;
  c.res_offset = r.below(4) == 0 ? r.below(8) : 0;
  c.weight_offset = r.below(4) == 0 ? r.below(8) : 0;
  c.random_routing = c.layout == MOEJIT_LAYOUT_TOKEN_INDEX && r.below(2) == 0;
  c.pow2 = r.below(2) == 0;
  c.scales_layout = c.hidden % 128 == 0 && r.below(2) == 0 ? MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4
                                                           : MOEJIT_SCALES_ROW_MAJOR;
  const float eps[] = {1e-6f, 1e-5f, 0.25f};
  c.eps = eps[r.below(3)];
  return c;
}

// Each token's rows in the documented order: (row, gate index).
struct Routing {
  int64_t rows = 0;
  std::vector<int64_t> index_values;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> per_token;
};

Routing make_routing(const Case& c) {
  Rng rng(c.seed * 7 + 3);
  Routing r;
  const int64_t T = c.tokens, K = c.top_k;
  r.per_token.resize(static_cast<size_t>(T));
  if (c.layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
    r.rows = T * K;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) r.per_token[t].push_back({t * K + k, t * K + k});
    return r;
  }
  const int64_t used = c.layout == MOEJIT_LAYOUT_TOKEN_INDEX && c.rows > 0 ? c.rows : T * K;
  r.rows = c.layout == MOEJIT_LAYOUT_GATHER_MAP ? used + used / 3 : used;
  std::vector<int64_t> perm(static_cast<size_t>(r.rows));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = r.rows - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  if (c.layout == MOEJIT_LAYOUT_GATHER_MAP) {
    r.index_values.resize(static_cast<size_t>(used));
    for (int64_t slot = 0; slot < used; ++slot) {
      int64_t row = perm[slot];
      const int64_t roll = rng.below(100);
      if (roll < c.drop_percent) row = -1;
      if (roll == c.drop_percent) row = r.rows + rng.below(1000);  // out of range: dropped
      r.index_values[slot] = row;
      if (row >= 0 && row < r.rows) r.per_token[slot / K].push_back({row, slot});
    }
    return r;
  }
  r.index_values.assign(static_cast<size_t>(r.rows), -1);
  const SkewedTokens skewed(c.skew != Case::kNoSkew ? T : 0, c.skew == Case::kZipf, rng);
  for (int64_t i = 0; i < r.rows; ++i) {
    int64_t token = c.random_routing ? rng.below(T) : i / K;
    if (c.skew == Case::kOneToken) {
      token = skewed.hottest();
    } else if (c.skew == Case::kTopPercent) {
      token = skewed.top_percent(i, r.rows, rng);
    } else if (c.skew == Case::kZipf) {
      token = skewed.zipf(static_cast<double>(rng.next() >> 11) * 0x1p-53);
    } else if (c.skew == Case::kHotRows) {
      token = i < c.hot_rows ? skewed.hottest() : rng.below(T);
      if (i < c.hot_rows) {  // exactly hot_rows rows on the hot token
        r.index_values[perm[i]] = token;
        continue;
      }
    }
    const int64_t roll = rng.below(100);
    if (roll < c.drop_percent) token = -1;
    if (roll == c.drop_percent) token = T + rng.below(10);  // out of range: dropped
    r.index_values[perm[i]] = token;
  }
  for (int64_t row = 0; row < r.rows; ++row) {  // ascending rows: the documented order
    const int64_t t = r.index_values[row];
    if (t >= 0 && t < T) r.per_token[t].push_back({row, row});
  }
  return r;
}

// Device scratch of one worker thread, grown on demand.
struct Scratch {
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
    void* get(size_t need) {
      if (need > bytes) {
        if (p) cudaFree(p);
        p = nullptr;
        if (cudaMalloc(&p, need) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
        bytes = need;
      }
      return p;
    }
    ~Buffer() {
      if (p) cudaFree(p);
    }
  };
  Buffer out, residual, weight, scales, indices, workspace;
  cudaStream_t stream = nullptr;
  ~Scratch() {
    if (stream) cudaStreamDestroy(stream);
  }
};

constexpr int64_t kGuard = 64;  // poisoned elements checked past every written buffer
// moejit.h: a token-index token with more rows than this is summed in pieces of this many rows
// (kernel_templates/token_index_workspace.h, kPieceRows).
constexpr int64_t kPieceRows = 128;

// What a case's call writes, as the host expects it (exact), and its float64 evaluation.
struct Expected {
  std::vector<uint8_t> out, residual, scales;  // whole buffers: rows, padding, guards
  std::vector<double> out64, residual64;       // per written element (t * H + h)
  std::vector<double> magnitude64;             // the sum of |terms| of the residual's sum
  std::vector<double> scales64;                // per (t, g): amax / 448 in float64
};

// One prepared case: its buffers' host images and the call.
struct Prepared {
  Routing routing;
  int64_t e_stride, o_stride, r_stride;
  int64_t groups, scales_count;
  std::vector<uint8_t> out_init, residual_init, scales_init, weight_host;
  std::vector<uint8_t> idx_host;
  moejit_combine_args args{};
};

size_t scale_index(const Case& c, int64_t t, int64_t g, int64_t groups) {
  const int64_t t4 = (c.tokens + 3) / 4 * 4;
  return static_cast<size_t>(c.scales_layout == MOEJIT_SCALES_ROW_MAJOR ? t * groups + g
                                                                        : g * t4 + t);
}

Expected expect(const Case& c, const Prepared& pr) {
  const Pools& p = pools();
  const int64_t T = c.tokens, H = c.hidden;
  const bool fp8 = c.out == MOEJIT_DTYPE_FLOAT8_E4M3;
  const int model = c.res >= 0 ? c.res : c.weight;
  const uint8_t* rows = p.rows[c.in].data() + c.expert_offset * bytes_of(c.in);
  Expected e;
  e.out = pr.out_init;
  e.residual = pr.residual_init;
  e.scales = pr.scales_init;
  e.out64.resize(static_cast<size_t>(T * H));
  e.residual64.resize(static_cast<size_t>(T * H));
  e.magnitude64.resize(static_cast<size_t>(T * H));
  e.scales64.resize(static_cast<size_t>(T * pr.groups));
  size_t padded = 1;
  while (padded < static_cast<size_t>(H)) padded *= 2;
  std::vector<float> chain(H), piece(H), c32(H), x(H), v(H), sq(padded);
  std::vector<double> c64(H), v64(H), mag(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(chain.begin(), chain.end(), 0.0f);
    std::fill(c64.begin(), c64.end(), 0.0);
    std::fill(mag.begin(), mag.end(), 0.0);
    // The documented order: the rows in pieces of kPieceRows, each summed from zero (one fma
    // chain), the pieces' sums added in order (0 + a single piece is that piece: a chain from +0.0
    // never gives -0.0). Only token-index tokens have more rows than a piece.
    const auto& token_rows = pr.routing.per_token[t];
    std::fill(piece.begin(), piece.end(), 0.0f);
    for (size_t i = 0; i < token_rows.size(); ++i) {
      const auto& [row, gi] = token_rows[i];
      const float g = c.gates ? p.gates[gi] : 1.0f;
      const size_t base = static_cast<size_t>(row * pr.e_stride);
      for (int64_t h = 0; h < H; ++h) {
        const float xv = value_at(rows, c.in, base + h);
        piece[h] = std::fmaf(g, xv, piece[h]);
        c64[h] += static_cast<double>(g) * xv;
        mag[h] += std::fabs(static_cast<double>(g) * xv);
      }
      if ((i + 1) % kPieceRows == 0 || i + 1 == token_rows.size())
        for (int64_t h = 0; h < H; ++h) {
          chain[h] += piece[h];
          piece[h] = 0.0f;
        }
    }
    const size_t out_row = static_cast<size_t>(c.out_offset + t * pr.o_stride);
    const size_t res_row = static_cast<size_t>(c.res_offset + t * pr.r_stride);
    for (int64_t h = 0; h < H; ++h) {
      const float old = c.accumulate ? value_at(pr.out_init.data(), c.out, out_row + h) : 0.0f;
      c32[h] = std::fmaf(chain[h], c.scale, old);
      c64[h] = c64[h] * c.scale + old;
      mag[h] = mag[h] * std::fabs(c.scale) + std::fabs(old);
    }
    // The residual, then the value the norm reads.
    for (int64_t h = 0; h < H; ++h) {
      float hv = c32[h];
      double h64 = c64[h];
      if (c.res >= 0) {
        const float r = value_at(pr.residual_init.data(), c.res, res_row + h);
        hv = r + c32[h];
        h64 = r + c64[h];
        store_at(e.residual.data(), c.res, res_row + h, hv);
        e.residual64[t * H + h] = h64;
        mag[h] += std::fabs(r);
      }
      e.magnitude64[t * H + h] = mag[h];
      x[h] = c.weight >= 0 ? round_to(model, hv) : hv;
      v64[h] = h64;
    }
    if (c.weight >= 0) {
      std::fill(sq.begin(), sq.end(), 0.0f);
      double ssq64 = 0;
      std::vector<double> x64(H);
      for (int64_t h = 0; h < H; ++h) {
        sq[h] = x[h] * x[h];
        // float64: the value rounded to the model dtype as moejit.h says, the rest unrounded.
        x64[h] = static_cast<double>(round_to(model, static_cast<float>(v64[h])));
        ssq64 += x64[h] * x64[h];
      }
      const float var = pairwise(sq.data(), padded) / static_cast<float>(H);
      const float r = 1.0f / std::sqrt(var + c.eps);
      const double r64 = 1.0 / std::sqrt(ssq64 / static_cast<double>(H) + c.eps);
      const uint8_t* w = p.weights[c.weight].data() + c.weight_offset * bytes_of(c.weight);
      for (int64_t h = 0; h < H; ++h) {
        const float wv = value_at(w, c.weight, static_cast<size_t>(h));
        v[h] = round_to(model, round_to(model, x[h] * r) * wv);
        v64[h] = x64[h] * r64 * wv;
      }
    } else {  // out receives the combine c, with or without a residual
      for (int64_t h = 0; h < H; ++h) {
        v[h] = c32[h];
        v64[h] = c64[h];
      }
    }
    for (int64_t h = 0; h < H; ++h) e.out64[t * H + h] = v64[h];
    if (!fp8) {
      for (int64_t h = 0; h < H; ++h) store_at(e.out.data(), c.out, out_row + h, v[h]);
      continue;
    }
    for (int64_t g = 0; g < pr.groups; ++g) {
      float amax = 0.0f;
      double amax64 = 0.0;
      const int64_t end = std::min(H, (g + 1) * 128);
      for (int64_t h = g * 128; h < end; ++h) {
        amax = std::fmax(amax, std::fabs(v[h]));
        amax64 = std::max(amax64, std::fabs(v64[h]));
      }
      float s = std::fmax(amax, 1e-10f) / 448.0f;
      if (c.pow2) s = bits_float((float_bits(s) + 0x7fffffu) & 0x7f800000u);
      std::memcpy(&e.scales[scale_index(c, t, g, pr.groups) * 4], &s, 4);
      e.scales64[t * pr.groups + g] = std::max(amax64, 1e-10) / 448.0;
      for (int64_t h = g * 128; h < end; ++h)
        e.out[out_row + h] = moejit::e4m3_from_float_bits(float_bits(v[h] / s));
    }
  }
  return e;
}

// Builds the case's buffers (host images and device copies) and its call.
Prepared prepare(const Case& c, Scratch& s) {
  const Pools& p = pools();
  Prepared pr;
  pr.routing = make_routing(c);
  const int64_t T = c.tokens, H = c.hidden;
  pr.e_stride = H + c.expert_pad;
  pr.o_stride = H + c.out_pad;
  pr.r_stride = H + c.res_pad;
  pr.groups = (H + 127) / 128;
  if (static_cast<size_t>(c.expert_offset + pr.routing.rows * pr.e_stride) > kPoolElems)
    throw std::runtime_error("case too large for the pool");
  Rng rng(c.seed * 13 + 5);
  const int out_b = bytes_of(c.out);
  // out: poison (all bits set: NaN in every dtype) around and between rows; with accumulate,
  // prior contents in the rows (fp8: random finite codes).
  const size_t out_elems = static_cast<size_t>(c.out_offset + T * pr.o_stride + kGuard);
  pr.out_init.assign(out_elems * out_b, 0xFF);
  if (c.accumulate)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const size_t i = static_cast<size_t>(c.out_offset + t * pr.o_stride + h);
        if (c.out == MOEJIT_DTYPE_FLOAT8_E4M3)
          pr.out_init[i] = static_cast<uint8_t>(rng.below(0x7f) | (rng.below(2) << 7));
        else
          store_at(pr.out_init.data(), c.out, i, rng.uniform(-1.0f, 1.0f));
      }
  // residual: random rows; padding and guards a pattern that must survive.
  if (c.res >= 0) {
    const size_t elems = static_cast<size_t>(c.res_offset + T * pr.r_stride + kGuard);
    pr.residual_init.assign(elems * bytes_of(c.res), 0xA5);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        store_at(pr.residual_init.data(), c.res,
                 static_cast<size_t>(c.res_offset + t * pr.r_stride + h), rng.uniform(-2.0f, 2.0f));
  }
  const int64_t t4 = (T + 3) / 4 * 4;
  pr.scales_count = c.scales_layout == MOEJIT_SCALES_ROW_MAJOR ? T * pr.groups : pr.groups * t4;
  if (c.out == MOEJIT_DTYPE_FLOAT8_E4M3)
    pr.scales_init.assign(static_cast<size_t>(pr.scales_count + kGuard) * 4, 0xFF);

  const size_t idx_b = c.idx == MOEJIT_INDEX_INT64 ? 8 : 4;
  pr.idx_host.resize(pr.routing.index_values.size() * idx_b);
  for (size_t i = 0; i < pr.routing.index_values.size(); ++i) {
    const int64_t v = pr.routing.index_values[i];
    const int32_t v32 = static_cast<int32_t>(v);
    std::memcpy(&pr.idx_host[i * idx_b], idx_b == 8 ? static_cast<const void*>(&v) : &v32, idx_b);
  }

  moejit_combine_args& a = pr.args;
  moejit_combine_args_init(&a);
  a.layout = c.layout;
  a.num_tokens = T;
  a.top_k = c.top_k;
  a.num_rows = pr.routing.rows;
  a.hidden_dim = H;
  a.expert_hidden = static_cast<uint8_t*>(p.rows_device[c.in]) + c.expert_offset * bytes_of(c.in);
  a.expert_dtype = static_cast<moejit_dtype>(c.in);
  a.expert_row_stride = pr.e_stride;
  a.gates = c.gates ? p.gates_device : nullptr;
  a.index_type = c.idx;
  if (c.layout != MOEJIT_LAYOUT_TOKEN_MAJOR)
    a.indices = s.indices.get(std::max<size_t>(pr.idx_host.size(), 16));
  a.out = static_cast<uint8_t*>(s.out.get(pr.out_init.size())) + c.out_offset * out_b;
  a.out_dtype = static_cast<moejit_dtype>(c.out);
  a.out_row_stride = pr.o_stride;
  a.scale = c.scale;
  a.accumulate = c.accumulate;
  if (c.res >= 0) {
    a.residual = static_cast<uint8_t*>(s.residual.get(pr.residual_init.size())) +
                 c.res_offset * bytes_of(c.res);
    a.residual_dtype = static_cast<moejit_dtype>(c.res);
    a.residual_row_stride = pr.r_stride;
  }
  if (c.weight >= 0) {
    a.norm_weight =
        static_cast<uint8_t*>(p.weights_device[c.weight]) + c.weight_offset * bytes_of(c.weight);
    a.norm_weight_dtype = static_cast<moejit_dtype>(c.weight);
    a.norm_eps = c.eps;
  }
  if (c.out == MOEJIT_DTYPE_FLOAT8_E4M3) {
    a.out_scales = static_cast<float*>(s.scales.get(pr.scales_init.size()));
    a.out_scales_layout = c.scales_layout;
    a.out_scales_pow2 = c.pow2;
  }
  size_t ws = 0;
  if (moejit_combine_workspace_size(&a, &ws) != MOEJIT_SUCCESS)
    throw std::runtime_error(std::string("workspace size: ") + moejit_last_error_message());
  if (ws > 0) {
    a.workspace = s.workspace.get(ws);
    a.workspace_bytes = ws;
    cudaMemsetAsync(a.workspace, 0xA5, ws, s.stream);  // any contents
  }
  if (!pr.idx_host.empty())
    cudaMemcpyAsync(s.indices.p, pr.idx_host.data(), pr.idx_host.size(), cudaMemcpyHostToDevice,
                    s.stream);
  return pr;
}

// The buffers after a call (restored to their initial contents first, then `call` enqueued).
struct Results {
  std::vector<uint8_t> out, residual, scales;
};

template <typename Call>
std::string run_once(const Case& c, const Prepared& pr, Scratch& s, Call call, Results* r) {
  cudaMemcpyAsync(s.out.p, pr.out_init.data(), pr.out_init.size(), cudaMemcpyHostToDevice,
                  s.stream);
  if (c.res >= 0)
    cudaMemcpyAsync(s.residual.p, pr.residual_init.data(), pr.residual_init.size(),
                    cudaMemcpyHostToDevice, s.stream);
  if (!pr.scales_init.empty())
    cudaMemcpyAsync(s.scales.p, pr.scales_init.data(), pr.scales_init.size(),
                    cudaMemcpyHostToDevice, s.stream);
  const std::string failed = call();
  if (!failed.empty()) return failed;
  r->out.resize(pr.out_init.size());
  r->residual.resize(pr.residual_init.size());
  r->scales.resize(pr.scales_init.size());
  cudaMemcpyAsync(r->out.data(), s.out.p, r->out.size(), cudaMemcpyDeviceToHost, s.stream);
  if (c.res >= 0)
    cudaMemcpyAsync(r->residual.data(), s.residual.p, r->residual.size(), cudaMemcpyDeviceToHost,
                    s.stream);
  if (!r->scales.empty())
    cudaMemcpyAsync(r->scales.data(), s.scales.p, r->scales.size(), cudaMemcpyDeviceToHost,
                    s.stream);
  const cudaError_t err = cudaStreamSynchronize(s.stream);
  return err == cudaSuccess ? "" : std::string("CUDA error: ") + cudaGetErrorString(err);
}

// One unit in the last place of dtype d at magnitude |v|.
double ulp(int d, double v) {
  const int bits = d == MOEJIT_DTYPE_FLOAT32 ? 23 : d == MOEJIT_DTYPE_BFLOAT16 ? 7 : 10;
  const int min_exp = d == MOEJIT_DTYPE_FLOAT16 ? -14 : -126;
  int e = 0;
  std::frexp(std::fabs(v), &e);
  return std::ldexp(1.0, std::max(e - 1, min_exp) - bits);
}

// Compares a call's buffers with the expectation: bitwise, then the float64 bounds.
std::string check(const Case& c, const Prepared& pr, const Expected& e, const Results& got) {
  std::ostringstream problems;
  int n = 0;
  auto problem = [&](const std::string& what) {
    if (n++ < 4) problems << what << "; ";
  };
  const int64_t T = c.tokens, H = c.hidden;
  const int out_b = bytes_of(c.out);
  const bool fp8 = c.out == MOEJIT_DTYPE_FLOAT8_E4M3;
  const int model = c.res >= 0 ? c.res : c.weight;
  // Bitwise: every byte of every buffer (rows, padding, guards).
  for (size_t i = 0; i < got.out.size(); ++i)
    if (got.out[i] != e.out[i]) {
      const size_t elem = i / out_b;
      std::ostringstream m;
      m << "out element " << elem << " (token "
        << (static_cast<int64_t>(elem) - c.out_offset) / pr.o_stride
        << ") = " << value_at(got.out.data(), c.out, elem) << ", expected "
        << value_at(e.out.data(), c.out, elem);
      problem(m.str());
      i = (elem + 1) * out_b - 1;
    }
  for (size_t i = 0; i < got.residual.size(); ++i)
    if (got.residual[i] != e.residual[i]) {
      const size_t elem = i / bytes_of(c.res);
      std::ostringstream m;
      m << "residual element " << elem << " = " << value_at(got.residual.data(), c.res, elem)
        << ", expected " << value_at(e.residual.data(), c.res, elem);
      problem(m.str());
      i = (elem + 1) * bytes_of(c.res) - 1;
    }
  for (size_t i = 0; i < got.scales.size(); i += 4)
    if (std::memcmp(&got.scales[i], &e.scales[i], 4) != 0) {
      float g, w;
      std::memcpy(&g, &got.scales[i], 4);
      std::memcpy(&w, &e.scales[i], 4);
      std::ostringstream m;
      m << "out_scales[" << i / 4 << "] = " << g << ", expected " << w;
      problem(m.str());
    }
  // float64: the emulation itself within what its fp32 operations and roundings allow (the sum's
  // error grows with the token's rows: K, or a skewed token's count).
  auto terms = [&](int64_t t) {
    return static_cast<double>(
        std::max<int64_t>(c.top_k, static_cast<int64_t>(pr.routing.per_token[t].size())) + 3);
  };
  int64_t far = 0;
  for (int64_t t = 0; t < T && far < 4; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(t * H + h);
      if (c.res >= 0) {
        const float want = value_at(e.residual.data(), c.res,
                                    static_cast<size_t>(c.res_offset + t * pr.r_stride + h));
        const double ref = e.residual64[i];
        // One rounding to the residual's dtype, and the fp32 sum's own error.
        const double accumulation = 1.2e-7 * terms(t) * e.magnitude64[i];
        if (!(std::fabs(want - ref) <= ulp(c.res, ref) + accumulation)) {
          if (far++ < 2)
            problem("float64: residual[" + std::to_string(t) + "][" + std::to_string(h) + "] " +
                    std::to_string(want) + " vs " + std::to_string(ref));
        }
      }
      if (fp8) continue;
      const double ref = e.out64[i];
      const float want =
          value_at(e.out.data(), c.out, static_cast<size_t>(c.out_offset + t * pr.o_stride + h));
      // Without a norm: one rounding and the sum's error. With one: up to three roundings to
      // the model dtype (the value the norm reads, the normed value, its product with the
      // weight), one to out's dtype, and the fp32 sums' error relative to the row's size.
      const double accumulation = 1.2e-7 * terms(t) * e.magnitude64[i];
      const double bound = c.weight >= 0
                               ? 3 * ulp(model, ref) + ulp(c.out, ref) + 1e-4 * (std::fabs(ref) + 1)
                               : ulp(c.out, ref) + accumulation;
      if (!(std::fabs(want - ref) <= bound) && far++ < 2)
        problem("float64: out[" + std::to_string(t) + "][" + std::to_string(h) + "] " +
                std::to_string(want) + " vs " + std::to_string(ref));
    }
  if (fp8)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < pr.groups; ++g) {
        float s;
        std::memcpy(&s, &e.scales[scale_index(c, t, g, pr.groups) * 4], 4);
        const double ref = e.scales64[t * pr.groups + g];
        const double rel = 4 * ulp(model < 0 ? MOEJIT_DTYPE_FLOAT32 : model, 1.0) + 1e-4;
        const bool ok = c.pow2 ? s >= ref * (1 - rel) && s < 2 * ref * (1 + rel)
                               : std::fabs(s - ref) <= rel * ref;
        if (!ok && far++ < 2)
          problem("float64: scale[" + std::to_string(t) + "][" + std::to_string(g) + "] " +
                  std::to_string(s) + " vs " + std::to_string(ref));
      }
  if (n > 0) problems << "(" << n << " problems)";
  return problems.str();
}

// Runs a case through moe_combine twice: bitwise equal runs, each equal to the expectation.
std::string run_case(const Case& c, moejit_runtime_t rt, Scratch& s) {
  const Prepared pr = prepare(c, s);
  Results first, second;
  auto call = [&] {
    const moejit_status st = moejit_runtime_combine(rt, &pr.args, s.stream);
    return st == MOEJIT_SUCCESS
               ? std::string()
               : std::string(moejit_status_name(st)) + ": " + moejit_last_error_message();
  };
  std::string failed = run_once(c, pr, s, call, &first);
  if (failed.empty()) failed = run_once(c, pr, s, call, &second);
  if (!failed.empty()) return failed;
  if (first.out != second.out || first.residual != second.residual || first.scales != second.scales)
    return "two identical calls gave different bits (not deterministic)";
  return check(c, pr, expect(c, pr), first);
}

// Runs cases on worker threads sharing one memory-only runtime; reports every failure.
void expect_cases_pass(const std::vector<Case>& cases, unsigned threads) {
  moejit_runtime_t rt = memory_only_runtime();
  const std::vector<std::string> failures = run_on_workers<Scratch>(
      cases, threads, [&](const Case& c, Scratch& s) { return run_case(c, rt, s); });
  for (size_t i = 0; i < failures.size() && i < 40; ++i) ADD_FAILURE() << failures[i];
  EXPECT_EQ(failures.size(), 0u) << "of " << cases.size() << " cases";
  moejit_runtime_destroy(rt);
}

void sort_big_first(std::vector<Case>& cases) {
  std::stable_sort(cases.begin(), cases.end(), [](const Case& a, const Case& b) {
    return a.tokens * a.top_k * a.hidden > b.tokens * b.top_k * b.hidden;
  });
}

struct Epilogue {
  int res, weight;
  bool fp8;
};
// residual; residual + norm; residual + norm + fp8; norm alone; fp8 alone. The residual's and
// weight's dtypes rotate with the case (the model dtype, and a weight of another dtype).
const Epilogue kEpilogues[] = {
    {1, -1, false}, {1, 1, false}, {1, 1, true}, {-1, 1, false}, {-1, -1, true}};

// The epilogue e with a bf16 residual and norm weight, and a bf16 out unless e's out is fp8.
void set_bf16_epilogue(Case* c, const Epilogue& e) {
  c->res = e.res >= 0 ? MOEJIT_DTYPE_BFLOAT16 : -1;
  c->weight = e.weight >= 0 ? MOEJIT_DTYPE_BFLOAT16 : -1;
  c->out = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : MOEJIT_DTYPE_BFLOAT16;
}

class EpilogueGpu : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

// Every layout x dtype pair (rows x out: fp8 out for the fp8 epilogues, with the pair's out as the
// residual's dtype) x epilogue x T {0, 1, 33, 4096}, hidden sizes and top_k rotated so that each
// value meets every layout and epilogue, both index types, the variations of vary().
TEST_F(EpilogueGpu, EveryLayoutDtypePairAndEpilogueMatchesTheDocumentedMath) {
  const int hiddens[] = {1, 7, 128, 2880, 4096, 7168};
  const int ks[] = {1, 2, 8};
  std::vector<Case> cases;
  uint64_t seed = 1;
  int n = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (int in = 0; in < 3; ++in)
      for (int out = 0; out < 3; ++out)
        for (int ep = 0; ep < 5; ++ep)
          for (int64_t tokens : {0, 1, 33, 4096}) {
            const Epilogue& e = kEpilogues[ep];
            Case c;
            c.layout = static_cast<moejit_layout>(layout);
            c.in = in;
            c.out = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : out;
            // The model dtype: the pair's out where the epilogue has a residual; the weight in
            // the model dtype, or every third case another one.
            const int model = e.res >= 0 ? out : (out + 2) % 3;
            c.res = e.res >= 0 ? model : -1;
            c.weight = e.weight >= 0 ? (n % 3 == 0 ? (model + 1) % 3 : model) : -1;
            c.idx = layout != MOEJIT_LAYOUT_TOKEN_MAJOR && n % 2 ? MOEJIT_INDEX_INT64
                                                                 : MOEJIT_INDEX_INT32;
            c.hidden = hiddens[(n + n / 6) % 6];
            c.top_k = ks[(n / 2 + n / 18) % 3];
            c.tokens = tokens;
            c.seed = seed++;
            cases.push_back(vary(c));
            ++n;
          }
  sort_big_first(cases);
  expect_cases_pass(cases, worker_count());
}

// Every decode batch size (the split across a cluster changes with T: 8, 4, 2 blocks), rows that
// split unevenly (2880: the last slice partly past the row) and tails (7169), the three layouts.
TEST_F(EpilogueGpu, EveryDecodeBatchSizeSplitsTheRowCorrectly) {
  std::vector<Case> cases;
  uint64_t seed = 5000;
  for (int64_t tokens = 1; tokens <= 65; ++tokens) {
    Case c;
    c.layout = static_cast<moejit_layout>(tokens % 3);
    c.in = MOEJIT_DTYPE_BFLOAT16;
    set_bf16_epilogue(&c, kEpilogues[tokens % 4 == 0 ? 4 : 1 + tokens % 3]);
    const int64_t hiddens[] = {7168, 2880, 4096, 7169};
    c.hidden = hiddens[tokens % 4];
    c.top_k = tokens % 2 ? 8 : 2;
    c.tokens = tokens;
    c.seed = seed++;
    cases.push_back(vary(c));
  }
  expect_cases_pass(cases, worker_count());
}

// Rows too long for one block's registers take slices one after another (the normed pass reads
// the residual back, or without a residual combines again); and at decode a cluster of 8 blocks of
// 512 threads with several slots each. Odd sizes leave partial slices, vectors and fp8 groups.
TEST_F(EpilogueGpu, LongRowsTakePassesAndLargeSlices) {
  std::vector<Case> cases;
  uint64_t seed = 6000;
  int n = 0;
  for (int64_t hidden : {65536, 65535, 33000, 20000})
    for (int64_t tokens : {1, 3, 70})
      for (int ep = 0; ep < 5; ++ep) {
        const Epilogue& e = kEpilogues[ep];
        Case c;
        c.layout = static_cast<moejit_layout>(n % 3);
        c.in = n % 2 ? MOEJIT_DTYPE_BFLOAT16 : MOEJIT_DTYPE_FLOAT32;
        c.res = e.res >= 0 ? (n % 3 == 1 ? MOEJIT_DTYPE_FLOAT32 : MOEJIT_DTYPE_BFLOAT16) : -1;
        c.weight = e.weight >= 0 ? MOEJIT_DTYPE_FLOAT16 : -1;
        c.out = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : MOEJIT_DTYPE_FLOAT16;
        c.hidden = hidden;
        c.top_k = 2;
        c.tokens = tokens;
        c.seed = seed++;
        cases.push_back(vary(c));
        ++n;
      }
  sort_big_first(cases);
  expect_cases_pass(cases, worker_count());
}

// Skewed token-index routings (issue 58's), where tokens pass their lists and the module's
// token_index_heavy ranks their rows (and sums them in pieces of 128 past that many) for the
// epilogue to add: every row on one token; 1% of the tokens with half the rows; Zipf(1.2); a token
// just past its list (ranked, one piece: 33 rows where 8 per token list 32, 17 where 2 per token
// list 16) or past a piece (129, 200, 1000 rows). Decode sizes (the cluster split, or one block
// per token for short rows) and past them, every epilogue, dtype pairs and index types in turn,
// 0% and 25% of the rows dropped, vary()'s variations; bit for bit against the documented math
// (the fma chain in pieces) and within the float64 bounds, twice.
TEST_F(EpilogueGpu, SkewedTokenIndexRoutingsMatchTheDocumentedMath) {
  struct Shape {
    int64_t tokens, top_k, hidden, rows;  // rows 0: T * K
    Case::Skew skew;
    int64_t hot_rows;
  };
  const Shape shapes[] = {
      {1, 8, 7168, 129, Case::kHotRows, 129},   {1, 8, 2880, 1000, Case::kHotRows, 1000},
      {8, 8, 7168, 0, Case::kHotRows, 33},      {64, 2, 4096, 0, Case::kHotRows, 17},
      {33, 8, 7169, 0, Case::kHotRows, 200},    {64, 8, 7168, 0, Case::kZipf, 0},
      {64, 8, 2880, 0, Case::kTopPercent, 0},   {300, 8, 4096, 0, Case::kOneToken, 0},
      {4096, 8, 7168, 0, Case::kOneToken, 0},   {4096, 8, 2048, 0, Case::kZipf, 0},
      {4096, 2, 4096, 0, Case::kTopPercent, 0}, {1536, 2, 128, 0, Case::kZipf, 0},
  };
  std::vector<Case> cases;
  uint64_t seed = 59000;
  int n = 0;
  for (const Shape& sh : shapes)
    for (int ep = 0; ep < 5; ++ep) {
      const Epilogue& e = kEpilogues[ep];
      Case c;
      c.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
      c.in = n % 3;
      const int out = (n / 3) % 3;
      c.out = e.fp8 ? MOEJIT_DTYPE_FLOAT8_E4M3 : out;
      const int model = e.res >= 0 ? out : (out + 2) % 3;
      c.res = e.res >= 0 ? model : -1;
      c.weight = e.weight >= 0 ? model : -1;
      c.idx = n % 2 ? MOEJIT_INDEX_INT64 : MOEJIT_INDEX_INT32;
      c.hidden = sh.hidden;
      c.tokens = sh.tokens;
      c.top_k = sh.top_k;
      c.seed = seed++;
      c = vary(c);
      c.skew = sh.skew;
      c.rows = sh.rows;
      c.hot_rows = sh.hot_rows;
      c.drop_percent = (ep + n / 5) % 2 ? 25 : 0;
      cases.push_back(c);
      ++n;
    }
  sort_big_first(cases);
  expect_cases_pass(cases, worker_count());
}

// The epilogue's combine is the plain combine's, heavy tokens included (moejit.h's order: the
// lists' rows, and past a list token_index_heavy's ranks and pieces, whatever kernel adds them):
// with an fp32 residual of zeros the new residual is exactly c, so it must equal, bit for bit,
// what the plain combine (any of its paths) writes to an fp32 out for the same call, with and
// without a norm (the cluster split, the split without a cluster, one block per token) and with an
// fp8 out; and the epilogue's out without a norm equals it too.
TEST_F(EpilogueGpu, HeavyTokensSumAsThePlainCombineDoes) {
  struct Shape {
    int64_t tokens, top_k, hidden, rows;
    Case::Skew skew;
    int64_t hot_rows;
  };
  const Shape shapes[] = {{1, 8, 7168, 1000, Case::kHotRows, 1000},
                          {8, 8, 7168, 0, Case::kHotRows, 33},
                          {33, 8, 2880, 0, Case::kHotRows, 200},
                          {300, 8, 4096, 0, Case::kOneToken, 0},
                          {4096, 8, 7168, 0, Case::kZipf, 0}};
  moejit_runtime_t rt = memory_only_runtime();
  Scratch s;
  CUDA_OK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  uint64_t seed = 59500;
  for (const Shape& sh : shapes) {
    Case base;
    base.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
    base.in = MOEJIT_DTYPE_BFLOAT16;
    base.hidden = sh.hidden;
    base.tokens = sh.tokens;
    base.top_k = sh.top_k;
    base.seed = seed++;
    base = vary(base);
    base.accumulate = false;
    base.scale = 0.75f;
    base.skew = sh.skew;
    base.rows = sh.rows;
    base.hot_rows = sh.hot_rows;
    base.drop_percent = 0;
    auto call = [&](const Prepared& pr) {
      return [&rt, &s, &pr] {
        const moejit_status st = moejit_runtime_combine(rt, &pr.args, s.stream);
        return st == MOEJIT_SUCCESS ? std::string() : std::string(moejit_last_error_message());
      };
    };
    Case plain_case = base;
    plain_case.out = MOEJIT_DTYPE_FLOAT32;
    SCOPED_TRACE(plain_case.name());
    const Prepared plain = prepare(plain_case, s);
    Results plain_got;
    ASSERT_EQ(run_once(plain_case, plain, s, call(plain), &plain_got), "");
    EXPECT_EQ(check(plain_case, plain, expect(plain_case, plain), plain_got), "");
    // Element h of token t's row of an fp32 buffer.
    auto bits = [](const std::vector<uint8_t>& buffer, int64_t offset, int64_t stride, int64_t t,
                   int64_t h) {
      uint32_t u;
      std::memcpy(&u, &buffer[static_cast<size_t>(offset + t * stride + h) * 4], 4);
      return u;
    };
    for (int ep = 0; ep < 3; ++ep) {  // residual; + norm; + norm + fp8
      Case c = base;
      c.res = MOEJIT_DTYPE_FLOAT32;
      c.weight = ep >= 1 ? MOEJIT_DTYPE_BFLOAT16 : -1;
      c.out = ep == 2 ? MOEJIT_DTYPE_FLOAT8_E4M3 : MOEJIT_DTYPE_FLOAT32;
      SCOPED_TRACE(c.name());
      Prepared pr = prepare(c, s);
      for (int64_t t = 0; t < c.tokens; ++t)  // a residual of zeros: the new one is c
        for (int64_t h = 0; h < c.hidden; ++h)
          store_at(pr.residual_init.data(), c.res,
                   static_cast<size_t>(c.res_offset + t * pr.r_stride + h), 0.0f);
      Results got;
      ASSERT_EQ(run_once(c, pr, s, call(pr), &got), "");
      EXPECT_EQ(check(c, pr, expect(c, pr), got), "");
      int64_t differ = 0;
      for (int64_t t = 0; t < c.tokens; ++t)
        for (int64_t h = 0; h < c.hidden; ++h) {
          const uint32_t want = bits(plain_got.out, plain_case.out_offset, plain.o_stride, t, h);
          if (bits(got.residual, c.res_offset, pr.r_stride, t, h) != want && differ++ < 3)
            ADD_FAILURE() << "residual[" << t << "][" << h << "] differs from the plain combine";
          if (ep == 0 && bits(got.out, c.out_offset, pr.o_stride, t, h) != want && differ++ < 3)
            ADD_FAILURE() << "out[" << t << "][" << h << "] differs from the plain combine";
        }
      EXPECT_EQ(differ, 0);
    }
  }
  moejit_runtime_destroy(rt);
}

// A token's bits depend on its own data only: the same rows and residual give the same residual,
// output and scales whether the token is alone (the decode split), one of 33 (the split in fewer
// blocks) or of 4096 (one block per token), and whichever layout names its rows.
TEST_F(EpilogueGpu, ATokensBitsDependOnItsOwnDataOnly) {
  const Pools& p = pools();
  moejit_runtime_t rt = memory_only_runtime();
  Scratch s;
  CUDA_OK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  const int64_t H = 7168, K = 8, first = 33;  // compare the first 33 tokens
  std::vector<uint8_t> reference_out, reference_res, reference_scales;
  for (int64_t T : {int64_t{4096}, int64_t{33}, int64_t{1}})
    for (int layout = 0; layout < 3; ++layout) {
      SCOPED_TRACE(std::string(layout_str(static_cast<moejit_layout>(layout))) +
                   " T=" + std::to_string(T));
      // Token-major rows t*K + k; the gather map names the same rows; token_idx the same too.
      std::vector<int32_t> idx(static_cast<size_t>(T * K));
      for (int64_t r = 0; r < T * K; ++r)
        idx[r] = static_cast<int32_t>(layout == MOEJIT_LAYOUT_TOKEN_INDEX ? r / K : r);
      Case c;
      c.layout = static_cast<moejit_layout>(layout);
      c.res = c.weight = MOEJIT_DTYPE_BFLOAT16;
      c.out = MOEJIT_DTYPE_FLOAT8_E4M3;
      c.hidden = H;
      c.tokens = T;
      c.top_k = K;
      moejit_combine_args a;
      moejit_combine_args_init(&a);
      a.layout = c.layout;
      a.num_tokens = T;
      a.top_k = K;
      a.num_rows = T * K;
      a.hidden_dim = H;
      a.expert_hidden = p.rows_device[MOEJIT_DTYPE_BFLOAT16];
      a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
      a.gates = p.gates_device;
      a.indices = s.indices.get(idx.size() * 4);
      // Copies on the call's stream: a non-blocking stream does not wait for the legacy one.
      CUDA_OK(cudaMemcpyAsync(s.indices.p, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice,
                              s.stream));
      a.out = s.out.get(static_cast<size_t>(T * H));
      a.out_dtype = MOEJIT_DTYPE_FLOAT8_E4M3;
      a.residual = s.residual.get(static_cast<size_t>(T * H * 2));
      a.residual_dtype = MOEJIT_DTYPE_BFLOAT16;
      // The residual's first rows from a fixed stretch of the pool: the same for every T.
      CUDA_OK(cudaMemcpyAsync(
          a.residual, static_cast<uint8_t*>(p.rows_device[MOEJIT_DTYPE_BFLOAT16]) + (1 << 20),
          static_cast<size_t>(T * H * 2), cudaMemcpyDeviceToDevice, s.stream));
      a.norm_weight = p.weights_device[MOEJIT_DTYPE_BFLOAT16];
      a.norm_weight_dtype = MOEJIT_DTYPE_BFLOAT16;
      a.out_scales = static_cast<float*>(s.scales.get(static_cast<size_t>(T * 56 * 4)));
      size_t ws = 0;
      ASSERT_EQ(moejit_combine_workspace_size(&a, &ws), MOEJIT_SUCCESS);
      if (ws > 0) {
        a.workspace = s.workspace.get(ws);
        a.workspace_bytes = ws;
      }
      ASSERT_EQ(moejit_runtime_combine(rt, &a, s.stream), MOEJIT_SUCCESS)
          << moejit_last_error_message();
      CUDA_OK(cudaStreamSynchronize(s.stream));
      const int64_t tokens = std::min(T, first);
      std::vector<uint8_t> out(static_cast<size_t>(tokens * H)),
          res(static_cast<size_t>(tokens * H * 2)), scales(static_cast<size_t>(tokens * 56 * 4));
      CUDA_OK(cudaMemcpyAsync(out.data(), a.out, out.size(), cudaMemcpyDeviceToHost, s.stream));
      CUDA_OK(
          cudaMemcpyAsync(res.data(), a.residual, res.size(), cudaMemcpyDeviceToHost, s.stream));
      CUDA_OK(cudaMemcpyAsync(scales.data(), a.out_scales, scales.size(), cudaMemcpyDeviceToHost,
                              s.stream));
      CUDA_OK(cudaStreamSynchronize(s.stream));
      if (reference_out.empty()) {
        reference_out = out;
        reference_res = res;
        reference_scales = scales;
        continue;
      }
      EXPECT_TRUE(std::equal(out.begin(), out.end(), reference_out.begin()));
      EXPECT_TRUE(std::equal(res.begin(), res.end(), reference_res.begin()));
      EXPECT_TRUE(std::equal(scales.begin(), scales.end(), reference_scales.begin()));
    }
  moejit_runtime_destroy(rt);
}

// Captured into a CUDA graph (the decode split with its cluster, the token index's four launches,
// with and without a token past its list), a replay gives exactly a direct call's result; so does
// a second replay after the residual is restored.
TEST_F(EpilogueGpu, CudaGraphCaptureAndReplay) {
  moejit_runtime_t rt = memory_only_runtime();
  struct Capture {
    moejit_layout layout;
    int64_t tokens, hot_rows;  // hot_rows > 0: a token past its list (and its first piece)
  };
  for (const auto& [layout, tokens, hot_rows] :
       {Capture{MOEJIT_LAYOUT_GATHER_MAP, 8, 0}, Capture{MOEJIT_LAYOUT_TOKEN_INDEX, 33, 0},
        Capture{MOEJIT_LAYOUT_TOKEN_INDEX, 33, 200}, Capture{MOEJIT_LAYOUT_TOKEN_MAJOR, 300, 0}}) {
    SCOPED_TRACE(std::string(layout_str(layout)) + " T=" + std::to_string(tokens) +
                 " hot_rows=" + std::to_string(hot_rows));
    Scratch s;
    CUDA_OK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    Case c;
    c.layout = layout;
    c.res = c.weight = MOEJIT_DTYPE_BFLOAT16;
    c.out = MOEJIT_DTYPE_FLOAT8_E4M3;
    c.hidden = 7168;
    c.tokens = tokens;
    c.top_k = 8;
    c.seed = 77;
    c = vary(c);
    if (hot_rows > 0) {
      c.skew = Case::kHotRows;
      c.hot_rows = hot_rows;
    }
    const Prepared pr = prepare(c, s);
    const Expected want = expect(c, pr);
    Results direct;
    auto call = [&] {
      return moejit_runtime_combine(rt, &pr.args, s.stream) == MOEJIT_SUCCESS
                 ? std::string()
                 : std::string(moejit_last_error_message());
    };
    ASSERT_EQ(run_once(c, pr, s, call, &direct), "");  // warm: compile and load
    EXPECT_EQ(check(c, pr, want, direct), "");
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
    ASSERT_EQ(moejit_runtime_combine(rt, &pr.args, s.stream), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamEndCapture(s.stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      Results replayed;
      auto launch = [&] {
        const cudaError_t err = cudaGraphLaunch(exec, s.stream);
        return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
      };
      ASSERT_EQ(run_once(c, pr, s, launch, &replayed), "");
      EXPECT_TRUE(replayed.out == direct.out && replayed.residual == direct.residual &&
                  replayed.scales == direct.scales)
          << "replay " << replay << " differs from a direct call";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  moejit_runtime_destroy(rt);
}

// ---- GPUs without clusters, or without the fp8 conversion, on this one ------------------------
// The module of a spec built for an older target as PTX (sm_80: no clusters, fp8 in integer
// operations; sm_89: no clusters, the hardware fp8 conversion), which the driver compiles for this
// GPU; launched as moe_combine launches on such a GPU: the split kernel's module runs its
// one-block kernel. Through the library's internals (plan, store, launch).
struct OlderTarget {
  moejit::LoadedKernels kernels, helpers;
  std::vector<CUmodule> modules;
  ~OlderTarget() {
    for (CUmodule m : modules) moejit::driver().cuModuleUnload(m);
  }
};

void load_for(moejit::KernelStore& store, const moejit::KernelSpec& spec, int sm,
              moejit::LoadedKernels* k, std::vector<CUmodule>* modules) {
  const moejit::DriverApi& d = moejit::driver();
  const auto module = store.obtain(spec, moejit::Target{sm, true});
  ASSERT_EQ(d.cuModuleLoadData(&k->module, module->image.data()), CUDA_SUCCESS) << sm;
  modules->push_back(k->module);
  for (size_t i = 0; i < module->lowered_names.size(); ++i)
    ASSERT_EQ(d.cuModuleGetFunction(&k->functions[i], k->module, module->lowered_names[i].c_str()),
              CUDA_SUCCESS);
  k->dependent_launch = false;  // launched as on a GPU before sm_90
  k->clusters = false;
}

TEST_F(EpilogueGpu, ThePathsOfGpusWithoutClustersFromTheirPtx) {
  moejit::Settings settings;
  settings.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  moejit::Stats stats;
  moejit::KernelStore store(settings, stats);
  // (target, T): sm_80 the decode split (its one-block kernel) and one block per token; sm_89 a
  // split of another size. Each case's modules are built and JIT-compiled by the driver afresh.
  std::vector<std::pair<int, Case>> cases;
  uint64_t seed = 9000;
  for (moejit_layout layout :
       {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_LAYOUT_TOKEN_MAJOR})
    for (const auto& [sm, tokens] :
         {std::pair{80, int64_t{1}}, std::pair{80, int64_t{200}}, std::pair{89, int64_t{33}}})
      for (int ep = 0; ep < 5; ++ep) {
        Case c;
        c.layout = layout;
        set_bf16_epilogue(&c, kEpilogues[ep]);
        c.hidden = tokens == 33 ? 2880 : 7168;
        c.top_k = 8;
        c.tokens = tokens;
        c.seed = seed++;
        cases.emplace_back(sm, vary(c));
      }
  // The token index with tokens past their lists: the one-block kernel adds them as the split
  // kernel does (both bit for bit the documented math).
  for (const auto& [sm, tokens, rows, hot_rows] :
       {std::tuple{80, int64_t{1}, int64_t{1000}, int64_t{1000}},
        std::tuple{80, int64_t{8}, int64_t{0}, int64_t{33}},
        std::tuple{89, int64_t{33}, int64_t{0}, int64_t{200}}})
    for (int ep = 0; ep < 5; ++ep) {
      Case c;
      c.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
      set_bf16_epilogue(&c, kEpilogues[ep]);
      c.hidden = 7168;
      c.top_k = 8;
      c.tokens = tokens;
      c.seed = seed++;
      c = vary(c);
      c.skew = Case::kHotRows;
      c.rows = rows;
      c.hot_rows = hot_rows;
      cases.emplace_back(sm, c);
    }
  Scratch s;
  CUDA_OK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  for (const auto& [sm, c] : cases) {
    SCOPED_TRACE("sm_" + std::to_string(sm) + " " + c.name());
    const Prepared pr = prepare(c, s);
    const moejit::CombinePlan plan = moejit::plan_combine(&pr.args);
    OlderTarget older;
    ASSERT_NO_FATAL_FAILURE(load_for(store, plan.spec, sm, &older.kernels, &older.modules));
    if (const auto helpers = moejit::companion_module(plan.spec)) {
      ASSERT_NO_FATAL_FAILURE(load_for(store, *helpers, sm, &older.helpers, &older.modules));
      older.kernels.companion = &older.helpers;
    }
    Results got;
    auto launch = [&] {
      try {
        moejit::launch_combine(plan, older.kernels, s.stream, stats);
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    ASSERT_EQ(run_once(c, pr, s, launch, &got), "");
    EXPECT_EQ(check(c, pr, expect(c, pr), got), "") << plan.spec.describe();
  }
}

}  // namespace
}  // namespace moejit_test
