#include "skew_routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "bench_data.h"

namespace moejit_bench {
namespace {

// The streams' salts (skew_routing.py has the same).
constexpr uint64_t kTokenSalt = 0x70c3e5ull, kSlotSalt = 0x5107ull, kRowSalt = 0x7035ull,
                   kDropSalt = 0xd209a1ull, kGateSalt = 0x6a7e5b1ull;

class Stream {
 public:
  Stream(uint64_t seed, uint64_t salt) : base_(mix(seed ^ salt)) {}
  uint64_t key(int64_t i) const { return mix(base_ + static_cast<uint64_t>(i)); }

 private:
  uint64_t base_;
};

// An integer in [0, n) from the high half of h (n < 2^32).
int64_t draw(uint64_t h, int64_t n) {
  return static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(n)) >> 32);
}

double unit(uint64_t h) {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// 0..n-1 ordered by the stream's keys, ties by index.
std::vector<int64_t> sorted_by_key(int64_t n, const Stream& stream) {
  std::vector<std::pair<uint64_t, int64_t>> keyed(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keyed[static_cast<size_t>(i)] = {stream.key(i), i};
  std::sort(keyed.begin(), keyed.end());
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    order[static_cast<size_t>(i)] = keyed[static_cast<size_t>(i)].second;
  return order;
}

// Step 2 of the file comment: the token of every slot.
std::vector<int32_t> slot_tokens(int64_t T, int64_t K, const RoutingSpec& spec, uint64_t seed) {
  const int64_t R = T * K;
  const Stream slots(seed, kSlotSalt);
  std::vector<int32_t> token(static_cast<size_t>(R));
  const auto set = [&](int64_t j, int64_t t) {
    token[static_cast<size_t>(j)] = static_cast<int32_t>(t);
  };
  switch (spec.spread) {
    case Spread::kUniform:
      for (int64_t j = 0; j < R; ++j) set(j, j / K);
      break;
    case Spread::kHot:
      for (int64_t j = 0; j < R; ++j)
        set(j, j < spec.hot_rows || T == 1 ? 0 : 1 + draw(slots.key(j), T - 1));
      break;
    case Spread::kTopPercent: {
      const std::vector<int64_t> order = sorted_by_key(T, Stream(seed, kTokenSalt));
      const int64_t hot = std::max<int64_t>(1, (T + 50) / 100);
      for (int64_t j = 0; j < R; ++j) {
        const uint64_t h = slots.key(j);
        const bool to_hot = j < R / 2 || hot == T;
        set(j, order[static_cast<size_t>(to_hot ? draw(h, hot) : hot + draw(h, T - hot))]);
      }
      break;
    }
    case Spread::kZipf: {
      const std::vector<int64_t> order = sorted_by_key(T, Stream(seed, kTokenSalt));
      std::vector<double> cdf(static_cast<size_t>(T));
      double sum = 0.0;
      for (int64_t r = 0; r < T; ++r) {
        sum += std::pow(static_cast<double>(r + 1), -spec.zipf_s);
        cdf[static_cast<size_t>(r)] = sum;
      }
      for (int64_t j = 0; j < R; ++j) {
        const double u = unit(slots.key(j)) * sum;
        const auto it = std::upper_bound(cdf.begin(), cdf.end(), u);
        const int64_t rank = std::min<int64_t>(it - cdf.begin(), T - 1);
        set(j, order[static_cast<size_t>(rank)]);
      }
      break;
    }
  }
  return token;
}

}  // namespace

std::string RoutingSpec::name(int64_t rows) const {
  switch (spread) {
    case Spread::kUniform:
      return "uniform";
    case Spread::kHot:
      return hot_rows == rows ? "one token" : "token 0: " + std::to_string(hot_rows) + " rows";
    case Spread::kTopPercent:
      return "1% of tokens: half";
    case Spread::kZipf: {
      char text[32];
      std::snprintf(text, sizeof text, "zipf %g", zipf_s);
      return text;
    }
  }
  return "?";
}

Routing make_routing(int64_t tokens, int64_t top_k, const RoutingSpec& spec, uint64_t seed) {
  if (tokens < 1 || top_k < 1 || tokens > INT32_MAX / top_k)
    throw std::invalid_argument("make_routing: tokens " + std::to_string(tokens) + " x top_k " +
                                std::to_string(top_k) + " must be 1..INT32_MAX rows");
  const int64_t R = tokens * top_k;
  if (spec.hot_rows < 0 || spec.hot_rows > R)
    throw std::invalid_argument("make_routing: hot_rows " + std::to_string(spec.hot_rows) +
                                " must be in 0.." + std::to_string(R));
  if (!(spec.zipf_s > 0) || !(spec.drop_percent >= 0 && spec.drop_percent <= 100))
    throw std::invalid_argument("make_routing: zipf_s must be > 0, drop_percent in 0..100");

  const std::vector<int32_t> token = slot_tokens(tokens, top_k, spec, seed);
  Routing routing;
  routing.token_idx.resize(static_cast<size_t>(R));
  const std::vector<int64_t> source = sorted_by_key(R, Stream(seed, kRowSalt));
  for (int64_t p = 0; p < R; ++p)
    routing.token_idx[static_cast<size_t>(p)] =
        token[static_cast<size_t>(source[static_cast<size_t>(p)])];

  const int64_t drop = dropped_slot_count(R, spec.drop_percent);
  if (drop > 0) {
    const std::vector<int64_t> by_key = sorted_by_key(R, Stream(seed, kDropSalt));
    for (int64_t i = 0; i < drop; ++i)
      routing.token_idx[static_cast<size_t>(by_key[static_cast<size_t>(i)])] = -1;
  }
  routing.dropped = drop;

  const Stream gates(seed, kGateSalt);
  routing.gates.resize(static_cast<size_t>(R));
  for (int64_t p = 0; p < R; ++p)
    routing.gates[static_cast<size_t>(p)] =
        static_cast<float>(0.05 + 0.95 * static_cast<double>(gates.key(p) >> 11) * 0x1.0p-53);
  return routing;
}

std::vector<int64_t> rows_per_token(const std::vector<int32_t>& token_idx, int64_t tokens) {
  std::vector<int64_t> count(static_cast<size_t>(tokens), 0);
  for (int32_t t : token_idx)
    if (t >= 0 && t < tokens) ++count[static_cast<size_t>(t)];
  return count;
}

std::vector<RoutingSpec> skew_specs(int64_t rows, double drop_percent) {
  std::vector<RoutingSpec> specs;
  const auto add_set = [&](double drop) {
    for (Spread spread : {Spread::kUniform, Spread::kHot, Spread::kTopPercent, Spread::kZipf}) {
      RoutingSpec s;
      s.spread = spread;
      s.hot_rows = spread == Spread::kHot ? rows : 0;
      s.drop_percent = drop;
      specs.push_back(s);
    }
  };
  add_set(0.0);
  std::vector<int64_t> counts;
  for (int64_t divisor : {0, 512, 64, 8, 2}) {
    const int64_t n = divisor == 0 ? 0 : rows / divisor;
    if (n == rows || std::find(counts.begin(), counts.end(), n) != counts.end()) continue;
    counts.push_back(n);
    RoutingSpec s;
    s.spread = Spread::kHot;
    s.hot_rows = n;
    specs.push_back(s);
  }
  if (drop_percent > 0) add_set(drop_percent);
  return specs;
}

uint64_t routing_fingerprint(const Routing& routing) {
  uint64_t h = 0;
  for (size_t p = 0; p < routing.token_idx.size(); ++p) {
    uint32_t gate_bits = 0;
    std::memcpy(&gate_bits, &routing.gates[p], 4);
    h = mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(routing.token_idx[p])) |
                 static_cast<uint64_t>(gate_bits) << 32));
  }
  return h;
}

}  // namespace moejit_bench
