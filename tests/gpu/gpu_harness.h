// Shared pieces of the GPU tests: device checks that skip cleanly without a GPU, host-side dtype
// encoding, random pools uploaded once, and a float64 reference with per-dtype error bounds.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "driver_probe.h"
#include "moejit/moejit.h"

namespace moejit_test {

#define CUDA_OK(call)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (call);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_); \
  } while (0)

// Empty string if a GPU is usable; otherwise why not (the skip reason), in the library's own words:
// the driver is asked first (moejit::probe_driver, shared with the library and the tools), since
// the CUDA runtime calls a missing driver an "insufficient" one; then the runtime, which the tests
// use for memory and streams.
inline std::string gpu_unavailable_reason() {
  const moejit::DriverProbe probe = moejit::probe_driver();
  if (probe.status != MOEJIT_SUCCESS) return "no usable CUDA GPU: " + probe.message;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return std::string("no usable CUDA GPU: the CUDA runtime says: ") + cudaGetErrorString(err);
  return "";
}

// Makes device 0's primary context current on this thread (what the CUDA runtime does for
// frameworks), so moe_combine finds it.
inline void bind_device() {
  cudaSetDevice(0);
  cudaFree(nullptr);
}

// MOEJIT_REQUIRE_GPU=1 (tools/gpu-session.sh) turns the skip into a failure: on the GPU machine
// a GPU that cannot be used is a broken setup, and every test skipping would pass the run.
inline bool gpu_required() {
  const char* v = std::getenv("MOEJIT_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    const std::string reason_ = moejit_test::gpu_unavailable_reason(); \
    if (!reason_.empty() && moejit_test::gpu_required())               \
      FAIL() << "MOEJIT_REQUIRE_GPU=1 but " << reason_;                \
    if (!reason_.empty()) GTEST_SKIP() << reason_;                     \
    moejit_test::bind_device();                                        \
  } while (0)

inline int dtype_bytes(moejit_dtype d) {
  return d == MOEJIT_DTYPE_FLOAT32 ? 4 : 2;
}
inline const char* dtype_str(moejit_dtype d) {
  return d == MOEJIT_DTYPE_FLOAT32 ? "fp32" : d == MOEJIT_DTYPE_FLOAT16 ? "fp16" : "bf16";
}
inline const char* layout_str(moejit_layout l) {
  return l == MOEJIT_LAYOUT_TOKEN_MAJOR  ? "token_major"
         : l == MOEJIT_LAYOUT_GATHER_MAP ? "gather_map"
                                         : "token_index";
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u = float_bits(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float half_to_float(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(mant), -24);
  else if (exp == 31)
    v = mant ? NAN : INFINITY;
  else
    v = std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, exp - 15);
  return sign ? -v : v;
}
inline uint16_t float_to_half(float f) {  // for |f| <= 1 test data: normal or subnormal
  const uint16_t sign = (f < 0) ? 0x8000 : 0;
  const float a = std::fabs(f);
  if (a < std::ldexp(1.0f, -14))
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)));
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1 + 15;
  long mant = std::lrint((m * 2.0f - 1.0f) * 1024.0f);
  if (mant == 1024) {
    mant = 0;
    ++exp;
  }
  return static_cast<uint16_t>(sign | (exp << 10) | mant);
}

// All 65536 fp16 values, decoded once (the reference decodes billions of elements).
inline const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = half_to_float(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

// Value of element i of a buffer of dtype d.
inline float decode(const void* base, moejit_dtype d, size_t i) {
  if (d == MOEJIT_DTYPE_FLOAT32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return d == MOEJIT_DTYPE_BFLOAT16 ? bf16_to_float(h) : half_table()[h];
}
inline void encode(void* base, moejit_dtype d, size_t i, float v) {
  if (d == MOEJIT_DTYPE_FLOAT32)
    static_cast<float*>(base)[i] = v;
  else
    static_cast<uint16_t*>(base)[i] =
        d == MOEJIT_DTYPE_BFLOAT16 ? float_to_bf16(v) : float_to_half(v);
}

// Fast deterministic random numbers (splitmix64).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) / static_cast<float>(1ull << 24);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// The tokens of a skewed token-index routing, in a shuffled order (the hot ones anywhere in the
// batch): the hottest token, the top 1% for half the rows, or Zipf(1.2) (rank k of weight
// (k + 1)^-1.2; its table built only when asked for).
class SkewedTokens {
 public:
  SkewedTokens(int64_t num_tokens, bool zipf, Rng& rng)
      : order_(static_cast<size_t>(num_tokens)),
        top_(std::max<int64_t>(1, (num_tokens + 50) / 100)) {
    std::iota(order_.begin(), order_.end(), 0);
    for (int64_t i = num_tokens - 1; i > 0; --i) std::swap(order_[i], order_[rng.below(i + 1)]);
    double total = 0;
    for (int64_t k = 0; zipf && k < num_tokens; ++k)
      cdf_.push_back(total += std::pow(k + 1.0, -1.2));
  }
  int64_t hottest() const { return order_[0]; }
  // Row i of `rows`: the first half to one of the top 1% of tokens, the rest to the others.
  int64_t top_percent(int64_t i, int64_t rows, Rng& rng) const {
    const int64_t n = static_cast<int64_t>(order_.size());
    return i < rows / 2 || top_ == n ? order_[rng.below(top_)] : order_[top_ + rng.below(n - top_)];
  }
  // The Zipf token at u in [0, 1).
  int64_t zipf(double u) const {
    const auto at = std::upper_bound(cdf_.begin(), cdf_.end(), u * cdf_.back()) - cdf_.begin();
    return order_[std::min<int64_t>(at, static_cast<int64_t>(order_.size()) - 1)];
  }

 private:
  std::vector<int64_t> order_;
  std::vector<double> cdf_;
  int64_t top_;
};

// Largest error allowed between an output element and the float64 reference:
// fp32 accumulation of `terms` products (a few fp32 ulps of the sum of magnitudes), plus one
// final rounding to the output type (half an ulp; we allow one ulp).
inline double tolerance(moejit_dtype out, double magnitude_sum, double ref, int terms) {
  const double accumulation = 1.2e-7 * (terms + 2) * magnitude_sum;
  double rounding;
  switch (out) {
    case MOEJIT_DTYPE_FLOAT32:
      rounding = 1.2e-7 * std::fabs(ref);
      break;
    case MOEJIT_DTYPE_BFLOAT16:
      rounding = std::ldexp(1.0, -8) * std::fabs(ref);
      break;
    default:
      rounding = std::ldexp(1.0, -10) * std::fabs(ref) + std::ldexp(1.0, -24);
      break;
  }
  return accumulation + rounding + 1e-30;
}

// Device buffers of a bf16 token-major combine of T tokens x K rows of H: T * K rows of zeros,
// and out_rows rows of output (T, unless a test means otherwise). Freed with the object.
struct TokenMajorBf16 {
  int64_t T = 0, K = 0, H = 0;
  void* rows = nullptr;
  void* out = nullptr;
  moejit_combine_args args() const {
    moejit_combine_args a;
    moejit_combine_args_init(&a);
    a.layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
    a.num_tokens = T;
    a.top_k = K;
    a.num_rows = T * K;
    a.hidden_dim = H;
    a.expert_hidden = rows;
    a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
    a.out = out;
    a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
    return a;
  }
  ~TokenMajorBf16() {
    cudaFree(out);
    cudaFree(rows);
  }
};
inline void allocate(TokenMajorBf16* b, int64_t T, int64_t K, int64_t H, int64_t out_rows) {
  b->T = T, b->K = K, b->H = H;
  const size_t row = static_cast<size_t>(H) * 2;
  CUDA_OK(cudaMalloc(&b->rows, row * static_cast<size_t>(T * K)));
  CUDA_OK(cudaMemset(b->rows, 0, row * static_cast<size_t>(T * K)));
  CUDA_OK(cudaMalloc(&b->out, row * static_cast<size_t>(out_rows)));
}

// A runtime of its own with no disk cache: these tests check kernels, not the disk cache.
inline moejit_runtime_t memory_only_runtime() {
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  moejit_runtime_t rt = nullptr;
  if (moejit_runtime_create(&o, &rt) != MOEJIT_SUCCESS)
    throw std::runtime_error(moejit_last_error_message());
  return rt;
}

inline unsigned worker_count() {
  return std::min(16u, std::max(2u, std::thread::hardware_concurrency()));
}

// Runs cases on `threads` worker threads, each bound to device 0 with its own Scratch (which has
// a `stream` member, created here as a non-blocking stream): run(case, scratch) returns "" or what
// went wrong. Returns "<case.name()>: <problem>" for every case that failed (an exception
// included).
template <typename Scratch, typename Case, typename Run>
std::vector<std::string> run_on_workers(const std::vector<Case>& cases, unsigned threads, Run run) {
  std::atomic<size_t> next{0};
  std::mutex mutex;
  std::vector<std::string> failures;
  std::vector<std::thread> workers;
  for (unsigned w = 0; w < threads; ++w)
    workers.emplace_back([&] {
      bind_device();
      Scratch s;
      cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking);
      for (size_t i = next++; i < cases.size(); i = next++) {
        std::string result;
        try {
          result = run(cases[i], s);
        } catch (const std::exception& e) {
          result = e.what();
        }
        if (!result.empty()) {
          std::lock_guard<std::mutex> lock(mutex);
          failures.push_back(cases[i].name() + ": " + result);
        }
      }
    });
  for (auto& w : workers) w.join();
  return failures;
}

}  // namespace moejit_test
