// moejit-bench's host side (tools/bench/bench_data.h): the minimal bytes its GB/s and % figures
// divide, and the float64 check that decides whether a combine's result is correct. No GPU: the
// "kernel outputs" here are computed on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bench_data.h"

namespace moejit_bench {
namespace {

Shape make_shape(int64_t t, int64_t k, int64_t h, moejit_dtype in, moejit_dtype out) {
  Shape s;
  s.tokens = t;
  s.top_k = k;
  s.hidden = h;
  s.in_dtype = in;
  s.out_dtype = out;
  return s;
}

TEST(BenchData, MinimalBytesAreRowsRoutingAndOutput) {
  // R*H*in + R*8 + T*H*out, R = T*K.
  EXPECT_EQ(make_shape(4096, 8, 7168, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16).minimal_bytes(),
            32768.0 * 7168 * 2 + 32768.0 * 8 + 4096.0 * 7168 * 2);
  EXPECT_EQ(make_shape(1536, 2, 128, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32).minimal_bytes(),
            3072.0 * 128 * 4 + 3072.0 * 8 + 1536.0 * 128 * 4);
  EXPECT_EQ(make_shape(64, 2, 4096, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT32).minimal_bytes(),
            128.0 * 4096 * 2 + 128.0 * 8 + 64.0 * 4096 * 4);
}

double value(moejit_dtype dtype, const std::vector<uint8_t>& bytes, size_t i) {
  if (dtype == MOEJIT_DTYPE_FLOAT32) {
    float f;
    std::memcpy(&f, bytes.data() + i * 4, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + i * 2, 2);
  if (dtype == MOEJIT_DTYPE_BFLOAT16) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const double sign = (b & 0x8000u) ? -1.0 : 1.0;
  const int exponent = (b >> 10) & 0x1f, mantissa = b & 0x3ff;
  return exponent == 0 ? sign * std::ldexp(mantissa, -24)
                       : sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Round to nearest even with `bits` significant bits (no overflow in these magnitudes); values
// under 2^-14 keep the fp16 subnormals' absolute step.
double round_to(double v, int bits) {
  if (v == 0.0) return 0.0;
  int e = 0;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const int step = std::max(e - bits, -24);
  return std::ldexp(std::nearbyint(std::ldexp(v, -step)), step);
}

void store(moejit_dtype dtype, double v, std::vector<uint8_t>* bytes, size_t i) {
  if (dtype == MOEJIT_DTYPE_FLOAT32) {
    const float f = static_cast<float>(v);
    std::memcpy(bytes->data() + i * 4, &f, 4);
    return;
  }
  uint16_t b = 0;
  if (dtype == MOEJIT_DTYPE_BFLOAT16) {
    const float f = static_cast<float>(round_to(v, 8));  // exact in float
    uint32_t u;
    std::memcpy(&u, &f, 4);
    b = static_cast<uint16_t>(u >> 16);
  } else {
    const double r = round_to(v, 11), a = std::fabs(r);
    const uint16_t sign = r < 0 ? 0x8000u : 0u;
    if (a < std::ldexp(1.0, -14)) {
      b = static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(a, 24)));
    } else {
      int e = 0;
      const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
      b = static_cast<uint16_t>(sign | (e + 14) << 10 |
                                (static_cast<int>(std::ldexp(m, 11)) - 1024));
    }
  }
  std::memcpy(bytes->data() + i * 2, &b, 2);
}

// The combine's result computed in double (by layout-independent token-major order) and stored
// in the output dtype, as a kernel with fp32 accumulation and one final rounding would; `hook`
// may change each value first (a kernel's bug).
template <typename Hook>
std::vector<uint8_t> host_combine(const HostInputs& in, Hook hook) {
  const Shape& s = in.shape;
  std::vector<uint8_t> out(static_cast<size_t>(s.tokens * s.hidden * dtype_bytes(s.out_dtype)));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.hidden; ++h) {
      double acc = 0.0;
      for (int64_t k = 0; k < s.top_k; ++k) {
        const size_t row = static_cast<size_t>(t * s.top_k + k);
        acc += in.gates[row] * value(s.in_dtype, in.token_major,
                                     row * static_cast<size_t>(s.hidden) + static_cast<size_t>(h));
      }
      store(s.out_dtype, hook(t, h, acc), &out, static_cast<size_t>(t * s.hidden + h));
    }
  return out;
}

const auto kExact = [](int64_t, int64_t, double v) { return v; };

TEST(BenchData, CheckPassesARightResultInEveryDtype) {
  for (moejit_dtype dt : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16}) {
    const HostInputs in = make_inputs(make_shape(64, 4, 256, dt, dt), 7);
    const CheckResult c = check_output(in, host_combine(in, kExact), check_tokens(64, 512));
    EXPECT_EQ(c.unwritten, 0);
    EXPECT_LE(c.rel_err, error_bound(dt)) << dtype_text(dt);
    EXPECT_GT(c.rel_err, 0.0) << dtype_text(dt);  // one rounding is not exact
  }
}

TEST(BenchData, CheckCatchesAMissingRowAndNaN) {
  const HostInputs in =
      make_inputs(make_shape(512, 8, 1024, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 11);
  // One token loses its last row: the error the reference must see.
  const auto drop_row = [&](int64_t t, int64_t h, double v) {
    if (t != 100) return v;
    const size_t row = static_cast<size_t>(t * 8 + 7);
    return v - in.gates[row] * value(MOEJIT_DTYPE_BFLOAT16, in.token_major,
                                     row * 1024 + static_cast<size_t>(h));
  };
  const CheckResult missing = check_output(in, host_combine(in, drop_row), check_tokens(512, 512));
  EXPECT_GT(missing.rel_err, error_bound(MOEJIT_DTYPE_BFLOAT16));

  std::vector<uint8_t> out = host_combine(in, kExact);
  std::memset(out.data() + 2 * (511 * 1024 + 5), 0xff, 2);  // one element left poisoned
  EXPECT_EQ(check_output(in, out, check_tokens(512, 16)).unwritten, 1);
}

TEST(BenchData, Fp16BoundCatchesAResultRoundedThroughBf16) {
  // fp16 output that lost precision on the way (rounded to bf16's 8 bits, then stored as fp16):
  // bf16's bound (1e-2) passed it; fp16's own rounding is 8 times finer.
  const HostInputs in =
      make_inputs(make_shape(256, 8, 512, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT16), 3);
  const auto through_bf16 = [](int64_t, int64_t, double v) { return round_to(v, 8); };
  const CheckResult right = check_output(in, host_combine(in, kExact), check_tokens(256, 512));
  const CheckResult coarse =
      check_output(in, host_combine(in, through_bf16), check_tokens(256, 512));
  EXPECT_LE(right.rel_err, error_bound(MOEJIT_DTYPE_FLOAT16));
  EXPECT_GT(coarse.rel_err, error_bound(MOEJIT_DTYPE_FLOAT16));
  EXPECT_LT(coarse.rel_err, 1e-2);
}

TEST(BenchData, CheckTokensSpreadOverTheOutputWithBothEnds) {
  EXPECT_EQ(check_tokens(3, 512), (std::vector<int64_t>{0, 1, 2}));
  const std::vector<int64_t> t = check_tokens(4096, 512);
  EXPECT_EQ(t.size(), 512u);
  EXPECT_EQ(t.front(), 0);
  EXPECT_EQ(t.back(), 4095);
}

}  // namespace
}  // namespace moejit_bench
