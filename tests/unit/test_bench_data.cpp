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
#include "skew_routing.h"

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

// ---- --skew: the routings (skew_routing.h) and their check -----------------------------------

RoutingSpec spec_of(Spread spread, int64_t hot_rows = 0, double drop = 0.0) {
  RoutingSpec s;
  s.spread = spread;
  s.hot_rows = hot_rows;
  s.drop_percent = drop;
  return s;
}

std::vector<int64_t> sorted_counts(const Routing& r, int64_t tokens) {
  std::vector<int64_t> c = rows_per_token(r.token_idx, tokens);
  std::sort(c.rbegin(), c.rend());
  return c;
}

int64_t total(const std::vector<int64_t>& counts) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  return n;
}

TEST(SkewRouting, RowsPerTokenFollowEachSpread) {
  const int64_t T = 4096, K = 8, R = T * K;
  const Routing uniform = make_routing(T, K, spec_of(Spread::kUniform), 3);
  for (int64_t c : rows_per_token(uniform.token_idx, T)) ASSERT_EQ(c, K);

  const Routing one = make_routing(T, K, spec_of(Spread::kHot, R), 3);
  const std::vector<int64_t> one_count = rows_per_token(one.token_idx, T);
  EXPECT_EQ(one_count[0], R);
  EXPECT_EQ(total(one_count), R);

  for (int64_t hot : {0, 64, 512, 4096, 16384}) {
    const std::vector<int64_t> c =
        rows_per_token(make_routing(T, K, spec_of(Spread::kHot, hot), 3).token_idx, T);
    EXPECT_EQ(c[0], hot);
    EXPECT_EQ(total(c), R);
    // The rest spread at random over tokens 1..T-1: about (R - hot) / (T - 1) each, none piled up.
    const double mean = static_cast<double>(R - hot) / (T - 1);
    EXPECT_LT(*std::max_element(c.begin() + 1, c.end()), mean + 8 * std::sqrt(mean) + 2) << hot;
  }

  // 1% of the tokens (41 of 4096) hold exactly half the rows, about 400 each; the other 4055 about
  // 4 each, so the 41 busiest tokens are the hot set.
  const std::vector<int64_t> top =
      sorted_counts(make_routing(T, K, spec_of(Spread::kTopPercent), 3), T);
  int64_t busiest = 0;
  for (int i = 0; i < 41; ++i) busiest += top[static_cast<size_t>(i)];
  EXPECT_EQ(busiest, R / 2);
  EXPECT_GT(top[40], 250);
  EXPECT_LT(top[41], 30);
  EXPECT_EQ(total(top), R);
}

// Zipf(1.2): P(rank r) = r^-1.2 / sum over r = 1..T of r^-1.2 (4.64 at T = 4096): the busiest
// token gets about 21.5% of the rows, and counts fall as rank^-1.2.
TEST(SkewRouting, ZipfFollowsItsLaw) {
  const int64_t T = 4096, K = 8, R = T * K;
  double norm = 0.0;
  for (int64_t r = 1; r <= T; ++r) norm += std::pow(static_cast<double>(r), -1.2);
  const std::vector<int64_t> c = sorted_counts(make_routing(T, K, spec_of(Spread::kZipf), 5), T);
  EXPECT_EQ(total(c), R);
  for (int rank = 1; rank <= 4; ++rank) {
    const double p = std::pow(rank, -1.2) / norm, expected = p * R;
    EXPECT_NEAR(static_cast<double>(c[static_cast<size_t>(rank - 1)]), expected,
                5 * std::sqrt(expected * (1 - p)))
        << "rank " << rank;
  }
  // Least-squares slope of log(count) over log(rank), ranks 1..32: -1.2.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const int n = 32;
  for (int rank = 1; rank <= n; ++rank) {
    const double x = std::log(rank),
                 y = std::log(static_cast<double>(c[static_cast<size_t>(rank - 1)]));
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  EXPECT_NEAR((n * sxy - sx * sy) / (n * sxx - sx * sx), -1.2, 0.1);
}

TEST(SkewRouting, DropsExactlyTheAskedShareSpreadOverTheRows) {
  const int64_t T = 4096, K = 8, R = T * K;
  for (Spread spread : {Spread::kUniform, Spread::kHot, Spread::kTopPercent, Spread::kZipf}) {
    const RoutingSpec spec = spec_of(spread, spread == Spread::kHot ? R : 0, 25.0);
    const Routing r = make_routing(T, K, spec, 9);
    const Routing kept = make_routing(T, K, spec_of(spec.spread, spec.hot_rows), 9);
    EXPECT_EQ(r.dropped, R / 4);
    EXPECT_EQ(std::count(r.token_idx.begin(), r.token_idx.end(), -1), R / 4);
    // The rows left are those of drop 0 with the same seed (gates too), and each quarter of the
    // rows loses about a quarter of its rows.
    for (int64_t q = 0; q < 4; ++q) {
      int64_t dropped = 0;
      for (int64_t p = q * R / 4; p < (q + 1) * R / 4; ++p) {
        const int32_t t = r.token_idx[static_cast<size_t>(p)];
        if (t == -1)
          ++dropped;
        else
          ASSERT_EQ(t, kept.token_idx[static_cast<size_t>(p)]);
      }
      EXPECT_NEAR(static_cast<double>(dropped), R / 16.0, 6 * std::sqrt(R / 16.0)) << q;
    }
    EXPECT_EQ(r.gates, kept.gates);
  }
  EXPECT_EQ(make_routing(100, 3, spec_of(Spread::kZipf, 0, 12.5), 1).dropped, 38);  // llround(37.5)
}

TEST(SkewRouting, FollowsTheSeedAndOnlyIt) {
  for (Spread spread : {Spread::kUniform, Spread::kHot, Spread::kTopPercent, Spread::kZipf}) {
    const RoutingSpec spec = spec_of(spread, spread == Spread::kHot ? 100 : 0, 25.0);
    const Routing a = make_routing(512, 4, spec, 11), again = make_routing(512, 4, spec, 11),
                  other = make_routing(512, 4, spec, 12);
    EXPECT_EQ(a.token_idx, again.token_idx);
    EXPECT_EQ(a.gates, again.gates);
    EXPECT_EQ(routing_fingerprint(a), routing_fingerprint(again));
    EXPECT_NE(a.token_idx, other.token_idx);
    EXPECT_NE(routing_fingerprint(a), routing_fingerprint(other));
    for (float g : a.gates) {
      EXPECT_GE(g, 0.05f);
      EXPECT_LT(g, 1.0f);
    }
  }
}

// tools/bench/skew_routing.py must give the very same routings: tests/python/test_skew_routing.py
// pins the same fingerprints (seed 7; T = 64, K = 4 for every spread at drop 0 and 25%; T = 4096,
// K = 8 at 25% for the spreads that draw).
TEST(SkewRouting, FingerprintsMatchThePythonGenerator) {
  struct Pinned {
    int64_t tokens, top_k;
    Spread spread;
    int64_t hot_rows;
    double drop;
    uint64_t fingerprint;
  };
  const Pinned pinned[] = {
      {64, 4, Spread::kUniform, 0, 0.0, 0x008afd6400eb0faeull},
      {64, 4, Spread::kUniform, 0, 25.0, 0x96fa5e434472d316ull},
      {64, 4, Spread::kHot, 256, 0.0, 0x393bdd0d0cd0bdbdull},
      {64, 4, Spread::kHot, 256, 25.0, 0x13f7a7ea5f29181full},
      {64, 4, Spread::kHot, 32, 0.0, 0x5896030a6a7ffa9aull},
      {64, 4, Spread::kTopPercent, 0, 0.0, 0x9fe79594c8fa3a14ull},
      {64, 4, Spread::kTopPercent, 0, 25.0, 0xbdbff3ca9d8305e1ull},
      {64, 4, Spread::kZipf, 0, 0.0, 0x2f39af070d06800eull},
      {64, 4, Spread::kZipf, 0, 25.0, 0x26201fedb26ce892ull},
      {4096, 8, Spread::kHot, 64, 25.0, 0x6b24099a1f4729a5ull},
      {4096, 8, Spread::kTopPercent, 0, 25.0, 0x29e1d0663b879724ull},
      {4096, 8, Spread::kZipf, 0, 25.0, 0x55257a7c5df0d47eull},
  };
  for (const Pinned& p : pinned) {
    const RoutingSpec spec = spec_of(p.spread, p.hot_rows, p.drop);
    const uint64_t got = routing_fingerprint(make_routing(p.tokens, p.top_k, spec, 7));
    char text[32];
    std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(got));
    EXPECT_EQ(got, p.fingerprint) << "T" << p.tokens << " K" << p.top_k << " "
                                  << spec.name(p.tokens * p.top_k) << " drop " << p.drop << ": "
                                  << text;
  }
}

TEST(SkewRouting, SpecsCoverIssue58sTable) {
  // T4096 K8: token 0 with 0, 64, 512, 4096, 16384 rows and all 32768 ("one token").
  const std::vector<RoutingSpec> specs = skew_specs(32768, 25.0);
  std::vector<std::string> names;
  for (const RoutingSpec& s : specs)
    names.push_back(s.name(32768) + (s.drop_percent > 0 ? " drop" : ""));
  EXPECT_EQ(names, (std::vector<std::string>{
                       "uniform", "one token", "1% of tokens: half", "zipf 1.2", "token 0: 0 rows",
                       "token 0: 64 rows", "token 0: 512 rows", "token 0: 4096 rows",
                       "token 0: 16384 rows", "uniform drop", "one token drop",
                       "1% of tokens: half drop", "zipf 1.2 drop"}));
  // Without a drop rate, no second set; a small R leaves out the counts met twice (R/512 = 0).
  EXPECT_EQ(skew_specs(32768, 0.0).size(), 9u);
  EXPECT_EQ(skew_specs(256, 0.0).size(), 8u);  // 0, 0 (256/512), 4, 32, 128
}

TEST(SkewRouting, RefusesBadArguments) {
  EXPECT_THROW(make_routing(0, 8, spec_of(Spread::kUniform), 1), std::invalid_argument);
  EXPECT_THROW(make_routing(1 << 30, 8, spec_of(Spread::kUniform), 1), std::invalid_argument);
  EXPECT_THROW(make_routing(4, 2, spec_of(Spread::kHot, 9), 1), std::invalid_argument);
  EXPECT_THROW(make_routing(4, 2, spec_of(Spread::kHot, -1), 1), std::invalid_argument);
  RoutingSpec bad_zipf = spec_of(Spread::kZipf);
  bad_zipf.zipf_s = 0;
  EXPECT_THROW(make_routing(4, 2, bad_zipf, 1), std::invalid_argument);
  EXPECT_THROW(make_routing(4, 2, spec_of(Spread::kZipf, 0, 101), 1), std::invalid_argument);
  // One token, T = 1: every row on it whatever the spread.
  for (Spread spread : {Spread::kHot, Spread::kTopPercent, Spread::kZipf})
    for (int32_t t : make_routing(1, 8, spec_of(spread), 1).token_idx) EXPECT_EQ(t, 0);
}

HostInputs skewed_inputs(const Shape& shape, const RoutingSpec& spec, uint64_t seed) {
  Routing r = make_routing(shape.tokens, shape.top_k, spec, seed);
  return make_token_index_inputs(shape, std::move(r.token_idx), std::move(r.gates), r.dropped,
                                 spec.drop_percent, spec.name(shape.rows()), seed);
}

// The combine of token-index inputs by token_idx (rows of a token in ascending order), stored in
// the output dtype; accumulate_bits as host_combine's; float_sum: accumulated in fp32 (a float),
// as a correct kernel does.
template <typename Hook>
std::vector<uint8_t> host_combine_by_index(const HostInputs& in, Hook hook, int accumulate_bits = 0,
                                           bool float_sum = false) {
  const Shape& s = in.shape;
  std::vector<double> acc(static_cast<size_t>(s.tokens * s.hidden), 0.0);
  std::vector<float> acc32(acc.size(), 0.0f);
  for (size_t row = 0; row < in.token_idx.size(); ++row) {
    const int32_t t = in.token_idx[row];
    if (t < 0) continue;
    for (int64_t h = 0; h < s.hidden; ++h) {
      const size_t o = static_cast<size_t>(t * s.hidden + h);
      const double x = value(s.in_dtype, in.sorted,
                             row * static_cast<size_t>(s.hidden) + static_cast<size_t>(h));
      const double term = in.gates_by_row[row] * x;
      if (float_sum)
        acc32[o] += static_cast<float>(term);
      else
        acc[o] = accumulate_bits
                     ? round_bits(acc[o] + round_bits(term, accumulate_bits), accumulate_bits)
                     : acc[o] + term;
    }
  }
  std::vector<uint8_t> out(acc.size() * static_cast<size_t>(dtype_bytes(s.out_dtype)));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t h = 0; h < s.hidden; ++h) {
      const size_t o = static_cast<size_t>(t * s.hidden + h);
      store(s.out_dtype, hook(t, h, float_sum ? static_cast<double>(acc32[o]) : acc[o]), &out, o);
    }
  return out;
}

TEST(SkewCheck, TokenIndexInputsCarryOnlyTheirLayout) {
  const Shape shape = make_shape(256, 4, 32, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16);
  const HostInputs in = skewed_inputs(shape, spec_of(Spread::kZipf, 0, 25.0), 3);
  EXPECT_TRUE(in.token_major.empty());
  EXPECT_TRUE(in.gather_map.empty());
  EXPECT_TRUE(in.gates.empty());
  EXPECT_EQ(in.sorted.size(), 1024u * 32 * 2);
  EXPECT_EQ(in.dropped_slots, 256);
  EXPECT_EQ(in.routing, "zipf 1.2");
  const std::vector<int64_t> c = rows_per_token(in.token_idx, 256);
  EXPECT_EQ(in.max_rows_per_token, *std::max_element(c.begin(), c.end()));
  EXPECT_GT(in.max_rows_per_token, 100);
  // The same element stream as make_inputs: the sorted rows of the uniform routing are values
  // that stream gives, magnitude in [1/16, 2).
  for (size_t i = 0; i < 1024u * 32; ++i) {
    const double v = std::fabs(value(MOEJIT_DTYPE_BFLOAT16, in.sorted, i));
    ASSERT_GE(v, 1.0 / 16);
    ASSERT_LT(v, 2.0);
  }
}

TEST(SkewCheck, PassesRightResultsAndCatchesWrongOnes) {
  for (moejit_dtype dt : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16})
    for (Spread spread : {Spread::kUniform, Spread::kHot, Spread::kTopPercent, Spread::kZipf})
      for (double drop : {0.0, 25.0}) {
        const Shape shape = make_shape(512, 4, 64, dt, dt);
        const RoutingSpec spec = spec_of(spread, spread == Spread::kHot ? 1024 : 0, drop);
        const HostInputs in = skewed_inputs(shape, spec, 21);
        const std::string what =
            std::string(dtype_text(dt)) + " " + spec.name(2048) + " drop " + std::to_string(drop);
        const CheckResult ok = check_output(in, host_combine_by_index(in, kExact), all_tokens(in));
        EXPECT_TRUE(ok.passed()) << what << ": rel_err " << ok.rel_err << " bound " << ok.bound
                                 << " bad " << ok.bad_tokens;
        EXPECT_NEAR(ok.rel_err, ok.rounding_err, 0.05 * ok.rounding_err + 1e-7) << what;
        // The busiest token off by 3%: caught on that token.
        const std::vector<int64_t> c = rows_per_token(in.token_idx, 512);
        const int64_t busiest = std::max_element(c.begin(), c.end()) - c.begin();
        const auto off = [&](int64_t t, int64_t, double v) { return t == busiest ? v * 1.03 : v; };
        const CheckResult wrong = check_output(in, host_combine_by_index(in, off), all_tokens(in));
        EXPECT_FALSE(wrong.passed()) << what;
        EXPECT_EQ(wrong.first_bad_token, busiest) << what;
        // A token without rows (every skewed spread leaves some) must be exactly 0.
        if (spread != Spread::kUniform) {
          const int64_t empty = std::find(c.begin(), c.end(), 0) - c.begin();
          ASSERT_LT(empty, 512) << what;
          const auto nonzero = [&](int64_t t, int64_t, double v) { return t == empty ? 1e-3 : v; };
          const CheckResult leaked =
              check_output(in, host_combine_by_index(in, nonzero), all_tokens(in));
          EXPECT_EQ(leaked.bad_tokens, 1) << what;
          EXPECT_EQ(leaked.first_bad_token, empty) << what;
        }
      }
}

// A dropped row added anyway, and one row of the hot token left out, fail: the reference follows
// token_idx, not the slots.
TEST(SkewCheck, CatchesADroppedRowAddedAndAMissingRow) {
  const Shape shape = make_shape(512, 8, 64, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16);
  const int64_t R = shape.rows();
  const HostInputs in = skewed_inputs(shape, spec_of(Spread::kHot, R / 2, 25.0), 4);
  size_t dropped_row = 0, hot_row = 0;
  while (in.token_idx[dropped_row] != -1) ++dropped_row;
  while (in.token_idx[hot_row] != 0) ++hot_row;
  for (size_t row : {dropped_row, hot_row}) {
    const int64_t token = row == hot_row ? 0 : 7;  // the dropped row lands on token 7
    const double sign = row == hot_row ? -1.0 : 1.0;
    const auto hook = [&](int64_t t, int64_t h, double v) {
      if (t != token) return v;
      return v + sign * in.gates_by_row[row] *
                     value(MOEJIT_DTYPE_BFLOAT16, in.sorted, row * 64 + static_cast<size_t>(h));
    };
    const CheckResult c = check_output(in, host_combine_by_index(in, hook), all_tokens(in));
    EXPECT_FALSE(c.passed()) << row;
    EXPECT_EQ(c.bad_tokens, 1) << row;
    EXPECT_EQ(c.first_bad_token, token) << row;
  }
}

// One token with all 32768 rows in fp32: a correct kernel accumulating in fp32, in order, errs by
// about 2^-24 * sqrt(R / 2) = 8e-6 relative, over the 1e-6 that covers K <= 64 rows; the bound
// grows with the token's rows (sqrt(rows / 64)) so that it passes, while accumulating in bf16 or
// fp16 still fails in their dtypes.
TEST(SkewCheck, Fp32BoundGrowsWithTheRowsOfAToken) {
  const Shape fp32 = make_shape(4096, 8, 16, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32);
  const HostInputs in = skewed_inputs(fp32, spec_of(Spread::kHot, fp32.rows()), 2);
  const CheckResult c =
      check_output(in, host_combine_by_index(in, kExact, 0, true), all_tokens(in));
  EXPECT_GT(c.rel_err, error_bound(c.rounding_err)) << "the fixed K bound would fail it";
  EXPECT_TRUE(c.passed()) << c.rel_err << " " << c.bound;
  EXPECT_EQ(c.bound, error_bound(c.rounding_err, 1.0, fp32.rows()));
  for (moejit_dtype dt : {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT16}) {
    const Shape half = make_shape(256, 8, 64, dt, dt);
    const HostInputs h = skewed_inputs(half, spec_of(Spread::kZipf), 2);
    const int bits = dt == MOEJIT_DTYPE_BFLOAT16 ? 8 : 11;
    EXPECT_TRUE(check_output(h, host_combine_by_index(h, kExact, 0, true), all_tokens(h)).passed());
    EXPECT_FALSE(check_output(h, host_combine_by_index(h, kExact, bits), all_tokens(h)).passed())
        << dtype_text(dt);
  }
}

TEST(SkewCheck, ErrorBoundIsUnchangedUpToSixtyFourRows) {
  EXPECT_EQ(error_bound(1e-3, 2.0, 1), error_bound(1e-3, 2.0));
  EXPECT_EQ(error_bound(1e-3, 2.0, 64), 1.25e-3 + 2e-6);
  EXPECT_DOUBLE_EQ(error_bound(0.0, 1.0, 64 * 400), 20e-6);
}

}  // namespace
}  // namespace moejit_bench
