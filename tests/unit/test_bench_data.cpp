// moejit-bench's host side (tools/bench/bench_data.h): the minimal bytes its GB/s and % figures
// divide, and the float64 check that decides whether a combine's result is correct. No GPU: the
// "kernel outputs" here are computed on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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
  // Dropped slots' rows are not read; their index and gate are.
  EXPECT_EQ(make_shape(64, 2, 4096, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT32).minimal_bytes(16),
            112.0 * 4096 * 2 + 128.0 * 8 + 64.0 * 4096 * 4);
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
double round_bits(double v, int bits) {
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
    const float f = static_cast<float>(round_bits(v, 8));  // exact in float
    uint32_t u;
    std::memcpy(&u, &f, 4);
    b = static_cast<uint16_t>(u >> 16);
  } else {
    const double r = round_bits(v, 11), a = std::fabs(r);
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

// The combine's result computed in double (by layout-independent token-major order, dropped slots
// left out) and stored in the output dtype, as a kernel with fp32 accumulation and one final
// rounding would; `hook` may change each value first (a kernel's bug). With accumulate_bits, every
// product and partial sum is rounded to that many significant bits instead, as a kernel
// accumulating in bf16 (8) or fp16 (11) would.
template <typename Hook>
std::vector<uint8_t> host_combine(const HostInputs& in, Hook hook, int accumulate_bits = 0) {
  const Shape& s = in.shape;
  const auto rounded = [&](double v) {
    return accumulate_bits ? round_bits(v, accumulate_bits) : v;
  };
  std::vector<uint8_t> out(static_cast<size_t>(s.tokens * s.hidden * dtype_bytes(s.out_dtype)));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.hidden; ++h) {
      double acc = 0.0;
      for (int64_t k = 0; k < s.top_k; ++k) {
        const size_t row = static_cast<size_t>(t * s.top_k + k);
        if (in.gather_map[row] < 0) continue;
        const double x = value(s.in_dtype, in.token_major,
                               row * static_cast<size_t>(s.hidden) + static_cast<size_t>(h));
        acc = rounded(acc + rounded(in.gates[row] * x));
      }
      store(s.out_dtype, hook(t, h, acc), &out, static_cast<size_t>(t * s.hidden + h));
    }
  return out;
}

const auto kExact = [](int64_t, int64_t, double v) { return v; };

std::vector<int64_t> all_tokens(const HostInputs& in) {
  return check_tokens(in.shape.tokens, INT64_MAX);
}

TEST(BenchData, CheckPassesARightResultInEveryDtype) {
  for (moejit_dtype dt : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16})
    for (int64_t k : {1, 2, 8}) {
      const HostInputs in = make_inputs(make_shape(64, k, 256, dt, dt), 7);
      const CheckResult c = check_output(in, host_combine(in, kExact), all_tokens(in));
      EXPECT_TRUE(c.passed()) << dtype_text(dt) << " K" << k << ": rel_err " << c.rel_err
                              << ", bound " << c.bound << ", bad tokens " << c.bad_tokens;
      EXPECT_EQ(c.checked_tokens, 64);
      EXPECT_GT(c.rel_err, 0.0) << dtype_text(dt);  // one rounding is not exact
      // The bound follows from the reference's own rounding: about one rounding's error.
      EXPECT_GT(c.rounding_err, 0.0);
      EXPECT_NEAR(c.rel_err, c.rounding_err, 0.05 * c.rounding_err + 1e-7);
      EXPECT_EQ(c.bound, error_bound(c.rounding_err));
    }
}

TEST(BenchData, RoundToIsNearestEvenInEachDtype) {
  // Ties go to the even neighbour; fp16 keeps its subnormals' step of 2^-24.
  EXPECT_EQ(round_to(MOEJIT_DTYPE_BFLOAT16, 1.0 + 0x1p-8), 1.0);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_BFLOAT16, 1.0 + 3 * 0x1p-8), 1.0 + 0x1p-6);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_BFLOAT16, -1.5 - 0x1p-9), -1.5);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT16, 1.0 + 0x1p-11), 1.0);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT16, 1.0 + 3 * 0x1p-11), 1.0 + 0x1p-9);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT16, 0x1p-25), 0.0);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT16, 3 * 0x1p-26), 0x1p-24);
  EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT16, 0.0), 0.0);
  for (double v : {0.1, -1.0 / 3, 1.7e-30, 123.456})
    EXPECT_EQ(round_to(MOEJIT_DTYPE_FLOAT32, v), static_cast<double>(static_cast<float>(v))) << v;
}

// A 512-token sample once left every 16th token of T=4096 unchecked: a kernel that zeroed those
// tokens passed. Every token is checked now, and each against its own bound.
TEST(BenchData, CheckCatchesTokensASampleWouldMiss) {
  const HostInputs in =
      make_inputs(make_shape(4096, 8, 64, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 5);
  const auto zero_some = [](int64_t t, int64_t, double v) { return t % 16 == 7 ? 0.0 : v; };
  const std::vector<uint8_t> out = host_combine(in, zero_some);
  const std::vector<int64_t> sample = check_tokens(4096, 512);
  EXPECT_TRUE(std::none_of(sample.begin(), sample.end(), [](int64_t t) { return t % 16 == 7; }));
  const CheckResult c = check_output(in, out, all_tokens(in));
  EXPECT_FALSE(c.passed());
  EXPECT_EQ(c.bad_tokens, 256);
  EXPECT_EQ(c.first_bad_token, 7);
}

// One wrong token among 4096: missing one row of its eight, or 3% off (a wrong gate, say). The
// second moves the whole output's relative error by less than its bound; the token's own bound
// catches both.
TEST(BenchData, CheckCatchesOneWrongToken) {
  const HostInputs in =
      make_inputs(make_shape(4096, 8, 256, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 11);
  const auto drop_row = [&](int64_t t, int64_t h, double v) {
    if (t != 100) return v;
    const size_t row = static_cast<size_t>(t * 8 + 7);
    return v - in.gates[row] *
                   value(MOEJIT_DTYPE_BFLOAT16, in.token_major, row * 256 + static_cast<size_t>(h));
  };
  const auto off = [](int64_t t, int64_t, double v) { return t == 100 ? v * 1.03 : v; };
  const CheckResult missing = check_output(in, host_combine(in, drop_row), all_tokens(in));
  const CheckResult slightly = check_output(in, host_combine(in, off), all_tokens(in));
  EXPECT_LE(slightly.rel_err, slightly.bound);
  for (const CheckResult& c : {missing, slightly}) {
    EXPECT_EQ(c.bad_tokens, 1);
    EXPECT_EQ(c.first_bad_token, 100);
    EXPECT_FALSE(c.passed());
  }
}

TEST(BenchData, CheckCatchesNaNAndInf) {
  const HostInputs in =
      make_inputs(make_shape(512, 8, 1024, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 11);
  std::vector<uint8_t> out = host_combine(in, kExact);
  std::memset(out.data() + 2 * (511 * 1024 + 5), 0xff, 2);  // one element left poisoned (NaN)
  const uint16_t inf = 0x7f80;                              // bf16 +Inf
  std::memcpy(out.data() + 2 * (3 * 1024 + 9), &inf, 2);
  const CheckResult c = check_output(in, out, all_tokens(in));
  EXPECT_EQ(c.nonfinite, 2);
  EXPECT_EQ(c.bad_tokens, 2);
  EXPECT_EQ(c.first_bad_token, 3);
  EXPECT_FALSE(c.passed());
}

// The library accumulates in fp32 and rounds once. A kernel accumulating in bf16 (or fp16) lands
// 1.45 times one rounding over it at K=2, more at larger K: the old fixed bounds (1e-2, 1e-3) let
// it pass.
TEST(BenchData, CheckCatchesAccumulationInTheOutputDtype) {
  for (moejit_dtype dt : {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT16})
    for (int64_t k : {2, 4, 8}) {
      const HostInputs in = make_inputs(make_shape(512, k, 512, dt, dt), 13);
      const int bits = dt == MOEJIT_DTYPE_BFLOAT16 ? 8 : 11;
      const CheckResult c = check_output(in, host_combine(in, kExact, bits), all_tokens(in));
      EXPECT_FALSE(c.passed()) << dtype_text(dt) << " K" << k << ": rel_err " << c.rel_err
                               << ", bound " << c.bound;
      EXPECT_GT(c.rel_err, c.bound) << dtype_text(dt) << " K" << k;
    }
}

TEST(BenchData, Fp16CheckCatchesAResultRoundedThroughBf16) {
  // fp16 output that lost precision on the way (rounded to bf16's 8 bits, then stored as fp16).
  const HostInputs in =
      make_inputs(make_shape(256, 8, 512, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT16), 3);
  const auto through_bf16 = [](int64_t, int64_t, double v) { return round_bits(v, 8); };
  EXPECT_TRUE(check_output(in, host_combine(in, kExact), all_tokens(in)).passed());
  EXPECT_FALSE(check_output(in, host_combine(in, through_bf16), all_tokens(in)).passed());
}

// At K=1 softmax-normalized gates would all be exactly 1, and a kernel ignoring them would pass.
TEST(BenchData, TopOneGatesAreScoresAndAreChecked) {
  const HostInputs one =
      make_inputs(make_shape(256, 1, 512, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 17);
  for (float g : one.gates) {
    EXPECT_GE(g, 0.05f);
    EXPECT_LT(g, 1.0f);
  }
  const auto ignore_gate = [&](int64_t t, int64_t h, double) {
    return value(MOEJIT_DTYPE_BFLOAT16, one.token_major, static_cast<size_t>(t * 512 + h));
  };
  EXPECT_FALSE(check_output(one, host_combine(one, ignore_gate), all_tokens(one)).passed());
  // K > 1: each token's gates still sum to 1.
  const HostInputs eight =
      make_inputs(make_shape(16, 8, 8, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 17);
  for (int64_t t = 0; t < 16; ++t) {
    double sum = 0.0;
    for (int64_t k = 0; k < 8; ++k) sum += eight.gates[static_cast<size_t>(t * 8 + k)];
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
}

// --drop: round(P% of T*K) slots dropped, marked alike in both index layouts; everything else as
// at drop 0 with the same seed, so a drop run's rows and gates are the plain run's.
TEST(BenchData, DropMarksTheSameSlotsInTheGatherMapAndTokenIdx) {
  struct Case {
    int64_t t, k;
    double percent;
  };
  for (const Case& c : {Case{4096, 8, 12.5}, Case{1000, 2, 33.3}, Case{512, 1, 90.0},
                        Case{1, 8, 12.5}, Case{3, 1, 10.0}}) {
    const Shape shape = make_shape(c.t, c.k, 16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16);
    const HostInputs plain = make_inputs(shape, 23);
    const HostInputs in = make_inputs(shape, 23, c.percent);
    const int64_t rows = shape.rows();
    const std::string what = shape.describe() + " drop " + std::to_string(c.percent);
    EXPECT_EQ(plain.dropped_slots, 0);
    EXPECT_EQ(std::count(plain.gather_map.begin(), plain.gather_map.end(), -1), 0);
    EXPECT_EQ(in.drop_percent, c.percent);
    EXPECT_EQ(in.dropped_slots, std::llround(static_cast<double>(rows) * c.percent / 100.0))
        << what;
    EXPECT_NEAR(static_cast<double>(in.dropped_slots) / static_cast<double>(rows),
                c.percent / 100.0, 0.5 / static_cast<double>(rows))
        << what;
    EXPECT_EQ(std::count(in.gather_map.begin(), in.gather_map.end(), -1), in.dropped_slots);
    EXPECT_EQ(std::count(in.token_idx.begin(), in.token_idx.end(), -1), in.dropped_slots);
    // The plain run's map names the row holding each slot: dropped in one layout iff in the other.
    for (int64_t slot = 0; slot < rows; ++slot) {
      const size_t row = static_cast<size_t>(plain.gather_map[static_cast<size_t>(slot)]);
      const bool dropped = in.gather_map[static_cast<size_t>(slot)] == -1;
      EXPECT_EQ(dropped, in.token_idx[row] == -1) << what << " slot " << slot;
      if (!dropped) {
        EXPECT_EQ(in.gather_map[static_cast<size_t>(slot)],
                  plain.gather_map[static_cast<size_t>(slot)]);
        EXPECT_EQ(in.token_idx[row], plain.token_idx[row]);
      }
    }
    EXPECT_EQ(in.token_major, plain.token_major) << what;
    EXPECT_EQ(in.sorted, plain.sorted) << what;  // dropped rows stay, unreferenced
    EXPECT_EQ(in.gates, plain.gates) << what;    // not renormalized
    EXPECT_EQ(in.gates_by_row, plain.gates_by_row) << what;
  }
}

// The dropped set follows the seed (the same seed, the same set) and is spread over the slots,
// not the first round(P% of R) of them.
TEST(BenchData, DroppedSlotsFollowTheSeedAndSpreadOut) {
  const Shape shape = make_shape(4096, 8, 4, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32);
  const HostInputs a = make_inputs(shape, 5, 10.0), again = make_inputs(shape, 5, 10.0),
                   other = make_inputs(shape, 6, 10.0);
  EXPECT_EQ(a.gather_map, again.gather_map);
  EXPECT_EQ(a.token_idx, again.token_idx);
  std::vector<int64_t> dropped, dropped_other;
  for (int64_t slot = 0; slot < shape.rows(); ++slot) {
    if (a.gather_map[static_cast<size_t>(slot)] == -1) dropped.push_back(slot);
    if (other.gather_map[static_cast<size_t>(slot)] == -1) dropped_other.push_back(slot);
  }
  EXPECT_NE(dropped, dropped_other);
  // Each quarter of the slots holds about a quarter of the dropped ones.
  for (int64_t quarter = 0; quarter < 4; ++quarter) {
    const int64_t begin = quarter * shape.rows() / 4, end = (quarter + 1) * shape.rows() / 4;
    const auto in_quarter = std::count_if(dropped.begin(), dropped.end(),
                                          [&](int64_t s) { return s >= begin && s < end; });
    EXPECT_NEAR(static_cast<double>(in_quarter), static_cast<double>(dropped.size()) / 4, 100.0)
        << "quarter " << quarter;
  }
}

// Both index layouts describe the combine the check's reference computes: summed through the
// gather map or through token_idx, each token gets the same rows and gates.
TEST(BenchData, DroppedInputsGiveOneCombineInEveryIndexLayout) {
  const Shape shape = make_shape(300, 4, 8, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32);
  const HostInputs in = make_inputs(shape, 31, 40.0);
  const int64_t T = shape.tokens, K = shape.top_k, H = shape.hidden;
  std::vector<double> by_map(static_cast<size_t>(T * H)), by_token_idx(by_map.size());
  for (int64_t slot = 0; slot < T * K; ++slot) {
    const int32_t row = in.gather_map[static_cast<size_t>(slot)];
    if (row < 0) continue;
    for (int64_t h = 0; h < H; ++h)
      by_map[static_cast<size_t>(slot / K * H + h)] +=
          in.gates[static_cast<size_t>(slot)] *
          value(shape.in_dtype, in.sorted, static_cast<size_t>(row * H + h));
  }
  for (int64_t row = 0; row < T * K; ++row) {
    const int32_t t = in.token_idx[static_cast<size_t>(row)];
    if (t < 0) continue;
    for (int64_t h = 0; h < H; ++h)
      by_token_idx[static_cast<size_t>(t * H + h)] +=
          in.gates_by_row[static_cast<size_t>(row)] *
          value(shape.in_dtype, in.sorted, static_cast<size_t>(row * H + h));
  }
  for (size_t i = 0; i < by_map.size(); ++i) EXPECT_NEAR(by_map[i], by_token_idx[i], 1e-12) << i;
  // The check's reference (through the token-major rows) is that combine too.
  std::vector<uint8_t> out(by_token_idx.size() * 4);
  for (size_t i = 0; i < by_token_idx.size(); ++i)
    store(MOEJIT_DTYPE_FLOAT32, by_token_idx[i], &out, i);
  EXPECT_TRUE(check_output(in, out, all_tokens(in)).passed());
}

// The reference leaves dropped slots out: a combine without them passes in every dtype, one that
// adds a dropped slot's row back fails, on that token.
TEST(BenchData, CheckLeavesOutDroppedSlots) {
  for (moejit_dtype dt : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16})
    for (int64_t k : {1, 2, 8}) {
      const HostInputs in = make_inputs(make_shape(256, k, 256, dt, dt), 7, 25.0);
      ASSERT_GT(in.dropped_slots, 0);
      const CheckResult c = check_output(in, host_combine(in, kExact), all_tokens(in));
      EXPECT_TRUE(c.passed()) << dtype_text(dt) << " K" << k << ": rel_err " << c.rel_err
                              << ", bound " << c.bound << ", bad tokens " << c.bad_tokens;
      EXPECT_GT(c.rounding_err, 0.0);
      EXPECT_NEAR(c.rel_err, c.rounding_err, 0.05 * c.rounding_err + 1e-7);

      // A kernel that read a dropped slot's row anyway (say, through a stale map entry): the
      // first token with a dropped slot gets that slot's gate times its row.
      int64_t slot = 0;
      while (in.gather_map[static_cast<size_t>(slot)] != -1) ++slot;
      const int64_t token = slot / k;
      const auto with_dropped = [&](int64_t t, int64_t h, double v) {
        if (t != token) return v;
        return v + in.gates[static_cast<size_t>(slot)] *
                       value(dt, in.token_major, static_cast<size_t>(slot * 256 + h));
      };
      const CheckResult wrong = check_output(in, host_combine(in, with_dropped), all_tokens(in));
      EXPECT_FALSE(wrong.passed()) << dtype_text(dt) << " K" << k;
      EXPECT_EQ(wrong.bad_tokens, 1) << dtype_text(dt) << " K" << k;
      EXPECT_EQ(wrong.first_bad_token, token) << dtype_text(dt) << " K" << k;
    }
}

// A token whose slots were all dropped has reference 0 and bound 0 (its norm is 0): its output
// must be exactly 0 (the library writes 0 for a token without rows); anything else, however
// small, makes it a bad token.
TEST(BenchData, TokenWithEverySlotDroppedMustBeZero) {
  for (int64_t k : {1, 4}) {
    const HostInputs in =
        make_inputs(make_shape(64, k, 32, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16), 3, 90.0);
    int64_t empty = -1;
    for (int64_t t = 0; t < 64 && empty < 0; ++t) {
      const auto first = in.gather_map.begin() + t * k;
      if (std::all_of(first, first + k, [](int32_t row) { return row == -1; })) empty = t;
    }
    ASSERT_GE(empty, 0) << "K" << k << ": no token with every slot dropped";
    std::vector<uint8_t> out = host_combine(in, kExact);
    EXPECT_TRUE(check_output(in, out, all_tokens(in)).passed()) << "K" << k;
    const uint16_t negative_zero = 0x8000;  // also exactly 0
    std::memcpy(out.data() + 2 * (empty * 32 + 1), &negative_zero, 2);
    EXPECT_TRUE(check_output(in, out, all_tokens(in)).passed()) << "K" << k;
    const uint16_t least_subnormal = 0x0001;  // bf16's smallest positive value
    std::memcpy(out.data() + 2 * (empty * 32 + 5), &least_subnormal, 2);
    const CheckResult c = check_output(in, out, all_tokens(in));
    EXPECT_FALSE(c.passed()) << "K" << k;
    EXPECT_EQ(c.bad_tokens, 1) << "K" << k;
    EXPECT_EQ(c.first_bad_token, empty) << "K" << k;
  }
  // Every slot of the output dropped: the whole reference is 0, and so must the output be.
  const HostInputs none =
      make_inputs(make_shape(1, 1, 8, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32), 3, 90.0);
  ASSERT_EQ(none.dropped_slots, 1);
  std::vector<uint8_t> out = host_combine(none, kExact);
  const CheckResult zero = check_output(none, out, all_tokens(none));
  EXPECT_TRUE(zero.passed());
  EXPECT_EQ(zero.rel_err, 0.0);
  const float tiny = 1e-30f;
  std::memcpy(out.data() + 4 * 3, &tiny, 4);
  const CheckResult c = check_output(none, out, all_tokens(none));
  EXPECT_FALSE(c.passed());
  EXPECT_EQ(c.bad_tokens, 1);
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
