#include "bench_data.h"

#include "moejit_internal.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

namespace moejit_bench {
namespace {

// Runs body(begin, end) over [0, n) split across the host's cores. Big prefill cases generate
// hundreds of millions of elements; one thread would dominate the tool's run time.
// `grain` is the least work worth a thread.
template <typename Body>
void parallel_for(int64_t n, int64_t grain, Body body) {
  const int64_t workers = std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()),
                           (n + grain - 1) / grain));
  if (workers == 1) {
    body(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> threads;
  const int64_t per = (n + workers - 1) / workers;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t begin = w * per, end = std::min(n, begin + per);
    if (begin < end) threads.emplace_back([=] { body(begin, end); });
  }
  for (std::thread& t : threads) t.join();
}

// Magnitude in [1/16, 2): one of five binades, random mantissa, random sign.
uint32_t random_fp32(uint64_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 63);
  const uint32_t exponent = 123u + static_cast<uint32_t>((h >> 32) % 5u);
  return sign << 31 | exponent << 23 | static_cast<uint32_t>(h & 0x7fffffu);
}
uint16_t random_bf16(uint64_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 63);
  const uint32_t exponent = 123u + static_cast<uint32_t>((h >> 32) % 5u);
  return static_cast<uint16_t>(sign << 15 | exponent << 7 | static_cast<uint32_t>(h & 0x7fu));
}
uint16_t random_fp16(uint64_t h) {
  const uint32_t sign = static_cast<uint32_t>(h >> 63);
  const uint32_t exponent = 11u + static_cast<uint32_t>((h >> 32) % 5u);
  return static_cast<uint16_t>(sign << 15 | exponent << 10 | static_cast<uint32_t>(h & 0x3ffu));
}

// n elements of dtype, element i from the seed's data stream (make_inputs' token-major rows,
// make_token_index_inputs' sorted ones).
void fill_random_rows(moejit_dtype dt, int64_t n, uint64_t seed, uint8_t* out);

double decode(moejit_dtype dtype, const uint8_t* base, int64_t index) {
  switch (dtype) {
    case MOEJIT_DTYPE_FLOAT32: {
      float f;
      std::memcpy(&f, base + index * 4, 4);
      return f;
    }
    case MOEJIT_DTYPE_BFLOAT16: {
      uint16_t b;
      std::memcpy(&b, base + index * 2, 2);
      const uint32_t u = static_cast<uint32_t>(b) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case MOEJIT_DTYPE_FLOAT16: {
      uint16_t b;
      std::memcpy(&b, base + index * 2, 2);
      const double sign = (b & 0x8000u) ? -1.0 : 1.0;
      const int exponent = (b >> 10) & 0x1f;
      const int mantissa = b & 0x3ff;
      if (exponent == 0) return sign * std::ldexp(mantissa, -24);
      if (exponent == 31) return mantissa != 0 ? std::nan("") : sign * HUGE_VAL;
      return sign * std::ldexp(1024 + mantissa, exponent - 25);
    }
    case MOEJIT_DTYPE_FLOAT8_E4M3:  // an epilogue's output only: moejit-bench writes none
      break;
  }
  return std::nan("");
}

void fill_random_rows(moejit_dtype dt, int64_t n, uint64_t seed, uint8_t* out) {
  const uint64_t data_seed = mix(seed ^ 0x5eedda7aull);
  parallel_for(n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t h = mix(data_seed + static_cast<uint64_t>(i));
      if (dt == MOEJIT_DTYPE_FLOAT32) {
        const uint32_t bits = random_fp32(h);
        std::memcpy(out + i * 4, &bits, 4);
      } else {
        const uint16_t bits = dt == MOEJIT_DTYPE_BFLOAT16 ? random_bf16(h) : random_fp16(h);
        std::memcpy(out + i * 2, &bits, 2);
      }
    }
  });
}

}  // namespace

// Element i's bits depend only on (seed, i), so the inputs do not depend on the thread count.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int dtype_bytes(moejit_dtype dtype) {
  return dtype == MOEJIT_DTYPE_FLOAT32 ? 4 : 2;
}

const char* dtype_text(moejit_dtype dtype) {
  return moejit::dtype_name(dtype);
}

bool parse_dtype(const std::string& text, moejit_dtype* dtype) {
  if (text == "fp32" || text == "float32")
    *dtype = MOEJIT_DTYPE_FLOAT32;
  else if (text == "fp16" || text == "float16")
    *dtype = MOEJIT_DTYPE_FLOAT16;
  else if (text == "bf16" || text == "bfloat16")
    *dtype = MOEJIT_DTYPE_BFLOAT16;
  else
    return false;
  return true;
}

double Shape::minimal_bytes(int64_t dropped) const {
  const double r = static_cast<double>(rows()), t = static_cast<double>(tokens),
               h = static_cast<double>(hidden), read = static_cast<double>(rows() - dropped);
  return read * h * dtype_bytes(in_dtype) + r * 8.0 + t * h * dtype_bytes(out_dtype);
}

std::string Shape::describe() const {
  std::string s = "T" + std::to_string(tokens) + " K" + std::to_string(top_k) + " H" +
                  std::to_string(hidden) + " " + dtype_text(in_dtype);
  if (out_dtype != in_dtype) s += std::string("->") + dtype_text(out_dtype);
  return s;
}

HostInputs make_inputs(const Shape& shape, uint64_t seed, double drop_percent) {
  HostInputs in;
  in.shape = shape;
  in.drop_percent = drop_percent;
  in.max_rows_per_token = shape.top_k;
  const int64_t T = shape.tokens, K = shape.top_k, H = shape.hidden, R = shape.rows();
  const size_t row_bytes =
      static_cast<size_t>(H) * static_cast<size_t>(dtype_bytes(shape.in_dtype));
  in.token_major.resize(static_cast<size_t>(R) * row_bytes);

  fill_random_rows(shape.in_dtype, R * H, seed, in.token_major.data());
  uint8_t* tm = in.token_major.data();

  // Gates like a router's top-k softmax: positive, each token's sum 1. At K = 1 that would make
  // every gate exactly 1: a top-1 router's sigmoid score instead (Llama 4), not normalized.
  in.gates.resize(static_cast<size_t>(R));
  const uint64_t gate_seed = mix(seed ^ 0x6a7e5ull);
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const uint64_t h = mix(gate_seed + static_cast<uint64_t>(t * K + k));
      const double u = 0.05 + 0.95 * static_cast<double>(h >> 11) * 0x1.0p-53;  // [0.05, 1)
      in.gates[static_cast<size_t>(t * K + k)] = static_cast<float>(u);
      sum += u;
    }
    if (K == 1) continue;
    for (int64_t k = 0; k < K; ++k)
      in.gates[static_cast<size_t>(t * K + k)] =
          static_cast<float>(in.gates[static_cast<size_t>(t * K + k)] / sum);
  }

  // "Expert-sorted" rows: a random permutation of token-major order.
  std::vector<int32_t> source(static_cast<size_t>(R));
  std::iota(source.begin(), source.end(), 0);
  std::mt19937_64 rng(mix(seed ^ 0x9e47ull));
  std::shuffle(source.begin(), source.end(), rng);

  in.sorted.resize(in.token_major.size());
  uint8_t* sorted = in.sorted.data();
  parallel_for(R, 256, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      std::memcpy(sorted + static_cast<size_t>(p) * row_bytes,
                  tm + static_cast<size_t>(source[static_cast<size_t>(p)]) * row_bytes, row_bytes);
  });
  in.gather_map.resize(static_cast<size_t>(R));
  in.token_idx.resize(static_cast<size_t>(R));
  in.gates_by_row.resize(static_cast<size_t>(R));
  for (int64_t p = 0; p < R; ++p) {
    const int32_t src = source[static_cast<size_t>(p)];
    in.gather_map[static_cast<size_t>(src)] = static_cast<int32_t>(p);
    in.token_idx[static_cast<size_t>(p)] = static_cast<int32_t>(src / K);
    in.gates_by_row[static_cast<size_t>(p)] = in.gates[static_cast<size_t>(src)];
  }

  // Dropped slots: exactly round(drop_percent% of R), every set of that size equally likely
  // (selection sampling: a slot goes with probability slots still to drop / slots left). Drawn
  // counter-based from a seed of their own, after everything else: the inputs above are those of
  // drop_percent 0, and drop_percent 0 draws nothing.
  int64_t to_drop = dropped_slot_count(R, drop_percent);
  const uint64_t drop_seed = mix(seed ^ 0xd2095ull);
  for (int64_t slot = 0; slot < R && to_drop > 0; ++slot) {
    const uint64_t h = mix(drop_seed + static_cast<uint64_t>(slot));
    const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
    if (u * static_cast<double>(R - slot) >= static_cast<double>(to_drop)) continue;
    const int32_t row = in.gather_map[static_cast<size_t>(slot)];
    in.gather_map[static_cast<size_t>(slot)] = -1;
    in.token_idx[static_cast<size_t>(row)] = -1;  // the row stays in `sorted`, unreferenced
    --to_drop;
    ++in.dropped_slots;
  }
  return in;
}

HostInputs make_token_index_inputs(const Shape& shape, std::vector<int32_t> token_idx,
                                   std::vector<float> gates_by_row, int64_t dropped,
                                   double drop_percent, const std::string& routing, uint64_t seed) {
  const int64_t R = shape.rows();
  if (static_cast<int64_t>(token_idx.size()) != R || static_cast<int64_t>(gates_by_row.size()) != R)
    throw std::invalid_argument("make_token_index_inputs: token_idx and gates_by_row need " +
                                std::to_string(R) + " entries");
  HostInputs in;
  in.shape = shape;
  in.sorted.resize(static_cast<size_t>(R * shape.hidden) *
                   static_cast<size_t>(dtype_bytes(shape.in_dtype)));
  fill_random_rows(shape.in_dtype, R * shape.hidden, seed, in.sorted.data());
  in.token_idx = std::move(token_idx);
  in.gates_by_row = std::move(gates_by_row);
  in.dropped_slots = dropped;
  in.drop_percent = drop_percent;
  in.routing = routing;
  std::vector<int64_t> count(static_cast<size_t>(shape.tokens), 0);
  for (int32_t t : in.token_idx)
    if (t >= 0 && t < shape.tokens) ++count[static_cast<size_t>(t)];
  in.max_rows_per_token = count.empty() ? 0 : *std::max_element(count.begin(), count.end());
  return in;
}

int64_t dropped_slot_count(int64_t rows, double drop_percent) {
  return std::llround(static_cast<double>(rows) * drop_percent / 100.0);
}

double round_to(moejit_dtype out_dtype, double value) {
  if (value == 0.0 || !std::isfinite(value)) return value;
  // Significand bits after the leading one, and the least normal exponent, of each dtype.
  const int mantissa = out_dtype == MOEJIT_DTYPE_FLOAT32   ? 23
                       : out_dtype == MOEJIT_DTYPE_FLOAT16 ? 10
                                                           : 7;
  const int min_exponent = out_dtype == MOEJIT_DTYPE_FLOAT16 ? -14 : -126;
  int e = 0;
  std::frexp(value, &e);  // |value| in [2^(e-1), 2^e)
  const double quantum = std::ldexp(1.0, std::max(e - 1, min_exponent) - mantissa);
  return std::nearbyint(value / quantum) * quantum;  // ties to even: the default rounding mode
}

double error_bound(double rounding, double norm, int64_t rows) {
  const double terms = std::max(1.0, static_cast<double>(rows) / 64.0);
  return 1.25 * rounding + 1e-6 * norm * std::sqrt(terms);
}

std::vector<int64_t> check_tokens(int64_t tokens, int64_t max_tokens) {
  std::vector<int64_t> list;
  if (tokens <= max_tokens || max_tokens < 2) {
    for (int64_t t = 0; t < tokens; ++t) list.push_back(t);
    return list;
  }
  for (int64_t i = 0; i < max_tokens; ++i) list.push_back(i * (tokens - 1) / (max_tokens - 1));
  list.erase(std::unique(list.begin(), list.end()), list.end());
  return list;
}

CheckResult check_output(const HostInputs& in, const std::vector<uint8_t>& out,
                         const std::vector<int64_t>& tokens) {
  const Shape& s = in.shape;
  const int64_t K = s.top_k, H = s.hidden;
  CheckResult result;
  result.checked_tokens = static_cast<int64_t>(tokens.size());

  std::atomic<int64_t> nonfinite{0};
  parallel_for(s.tokens * H, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t n = 0;
    for (int64_t i = begin; i < end; ++i) n += !std::isfinite(decode(s.out_dtype, out.data(), i));
    nonfinite += n;
  });
  result.nonfinite = nonfinite.load();

  // Each token's rows: (row of the values, gate). Fixed K: the token-major rows t*K + k whose slot
  // was not dropped. Token index only: the sorted rows whose token_idx is t, in ascending order.
  const bool by_token_idx = in.gather_map.empty();
  std::vector<int64_t> first_row, rows_of;  // rows of token t: rows_of[first_row[t] ...]
  if (by_token_idx) {
    first_row.assign(static_cast<size_t>(s.tokens) + 1, 0);
    for (int32_t t : in.token_idx)
      if (t >= 0 && t < s.tokens) ++first_row[static_cast<size_t>(t) + 1];
    std::partial_sum(first_row.begin(), first_row.end(), first_row.begin());
    rows_of.resize(static_cast<size_t>(first_row.back()));
    std::vector<int64_t> next(first_row.begin(), first_row.end() - 1);
    for (size_t r = 0; r < in.token_idx.size(); ++r) {
      const int32_t t = in.token_idx[r];
      if (t >= 0 && t < s.tokens)
        rows_of[static_cast<size_t>(next[static_cast<size_t>(t)]++)] = static_cast<int64_t>(r);
    }
  }

  // Squared norms over the checked tokens: error, rounding, reference. Each token is also held to
  // its own bound; bad tokens are counted and the first one named.
  struct Sums {
    double err2 = 0.0, round2 = 0.0, ref2 = 0.0;
    int64_t bad = 0, first_bad = -1, most_rows = 0;
  };
  std::mutex mutex;
  Sums total;
  parallel_for(static_cast<int64_t>(tokens.size()), 4, [&](int64_t begin, int64_t end) {
    Sums part;
    std::vector<double> ref(static_cast<size_t>(H));
    const auto add_row = [&](const std::vector<uint8_t>& rows, int64_t row, double g) {
      for (int64_t h = 0; h < H; ++h)
        ref[static_cast<size_t>(h)] += g * decode(s.in_dtype, rows.data(), row * H + h);
    };
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = tokens[static_cast<size_t>(i)];
      std::fill(ref.begin(), ref.end(), 0.0);
      int64_t terms = 0;
      if (by_token_idx) {
        for (int64_t j = first_row[static_cast<size_t>(t)];
             j < first_row[static_cast<size_t>(t) + 1]; ++j) {
          const int64_t row = rows_of[static_cast<size_t>(j)];
          add_row(in.sorted, row, in.gates_by_row[static_cast<size_t>(row)]);
        }
        terms = first_row[static_cast<size_t>(t) + 1] - first_row[static_cast<size_t>(t)];
      } else {
        for (int64_t k = 0; k < K; ++k) {
          if (in.gather_map[static_cast<size_t>(t * K + k)] < 0) continue;  // a dropped slot
          add_row(in.token_major, t * K + k, in.gates[static_cast<size_t>(t * K + k)]);
        }
        terms = K;
      }
      double e = 0.0, q = 0.0, r = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const double x = ref[static_cast<size_t>(h)];
        const double d = decode(s.out_dtype, out.data(), t * H + h) - x;
        const double dq = round_to(s.out_dtype, x) - x;
        e += d * d;
        q += dq * dq;
        r += x * x;
      }
      // NaN compares false: a NaN error is a bad token. A token whose slots were all dropped has
      // reference 0 and so bound 0: only an output of exactly 0 (either sign) passes.
      if (!(std::sqrt(e) <= error_bound(std::sqrt(q), std::sqrt(r), terms))) {
        if (part.bad++ == 0) part.first_bad = t;
      }
      part.err2 += e;
      part.round2 += q;
      part.ref2 += r;
      part.most_rows = std::max(part.most_rows, terms);
    }
    std::lock_guard<std::mutex> lock(mutex);
    total.err2 += part.err2;
    total.round2 += part.round2;
    total.ref2 += part.ref2;
    total.most_rows = std::max(total.most_rows, part.most_rows);
    if (part.bad > 0 && (total.first_bad < 0 || part.first_bad < total.first_bad))
      total.first_bad = part.first_bad;
    total.bad += part.bad;
  });
  const double norm = total.ref2 > 0.0 ? std::sqrt(total.ref2) : 1.0;
  result.rel_err = std::sqrt(total.err2) / norm;
  result.rounding_err = std::sqrt(total.round2) / norm;
  result.bound = error_bound(result.rounding_err, 1.0, total.most_rows);
  result.bad_tokens = total.bad;
  result.first_bad_token = total.first_bad;
  return result;
}

}  // namespace moejit_bench
