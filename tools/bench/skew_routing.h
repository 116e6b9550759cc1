// Skewed token-index routing for moejit-bench --skew (issue 58): the same R = T*K rows spread over
// T tokens in distributions far from K rows per token, rows in a random ("expert-sorted") order,
// some dropped. tools/bench/skew_routing.py reproduces every routing exactly for a seed (its tests
// and tests/unit/test_bench_data.cpp pin the same fingerprints), so peers.py times its peers on
// the very routing moejit-bench timed.
//
// The algorithm, which both implementations follow step by step. All integers are uint64 with
// wrap-around; mix() is bench_data.h's splitmix64 finalizer; key(salt, i) = mix(mix(seed ^ salt)
// + i); draw(h, n) = ((h >> 32) * n) >> 32, an integer in [0, n); unit(h) = (h >> 11) * 2^-53 in
// [0, 1). A sort "by key" orders indices by key(salt, i), ties by i.
//   1. token order: the T tokens sorted by key(kTokenSalt, t). The hot set of "1% of tokens" and
//      the Zipf ranks take tokens in this order, so hot tokens are not simply the first ones.
//   2. each slot j in [0, R) gets a token, h = key(kSlotSalt, j):
//        uniform    j / K                      (exactly K rows per token: every other case's)
//        hot(n)     0 for j < n; else 1 + draw(h, T - 1), uniform over the other tokens (0 if
//                   T = 1)
//        top 1%     the hot set is the first max(1, (T + 50) / 100) tokens of the order; slots
//                   j < R / 2 go to hot token draw(h, hot), the others to cold token
//                   hot + draw(h, T - hot) (to a hot one if every token is hot)
//        zipf(s)    rank r with probability (r + 1)^-s / sum: w[r] = pow(r + 1, -s), cdf[r] the
//                   running sum in order, u = unit(h) * cdf[T - 1], r = the first rank with
//                   cdf[r] > u (T - 1 if none); the token is order[r]
//   3. rows: the slots sorted by key(kRowSalt, j); row p holds slot source[p], token_idx[p] its
//      token.
//   4. drops: the round(drop_percent% of R) rows p first by key(kDropSalt, p) get token_idx -1.
//   5. gates: gate[p] = float(0.05 + 0.95 * (key(kGateSalt, p) >> 11) * 2^-53), a router score in
//      [0.05, 1), not normalized per token (tokens have any number of rows).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moejit_bench {

enum class Spread {
  kUniform,     // exactly K rows per token: the baseline each skewed time is divided by
  kHot,         // token 0 with hot_rows rows, the others uniformly at random over tokens 1..T-1
  kTopPercent,  // 1% of the tokens (at least one) with half the rows, the rest over the others
  kZipf,        // token popularity Zipf(zipf_s) over ranks, ranks mapped to a random token order
};

struct RoutingSpec {
  Spread spread = Spread::kUniform;
  int64_t hot_rows = 0;  // kHot
  double zipf_s = 1.2;   // kZipf
  double drop_percent = 0.0;
  // "uniform", "one token" (kHot with every row), "token 0: 64 rows", "1% of tokens: half",
  // "zipf 1.2"; the drop is not part of it.
  std::string name(int64_t rows) const;
};

struct Routing {
  std::vector<int32_t> token_idx;  // [R]: the token of each row in the (expert-sorted) order, -1
  std::vector<float> gates;        // [R], indexed by row
  int64_t dropped = 0;             // rows whose token_idx is -1
};

// The routing of R = tokens * top_k rows for spec, deterministic in seed (see the file comment).
// tokens >= 1, top_k >= 1, R <= INT32_MAX, 0 <= hot_rows <= R, zipf_s > 0, drop_percent in
// [0, 100]; std::invalid_argument otherwise.
Routing make_routing(int64_t tokens, int64_t top_k, const RoutingSpec& spec, uint64_t seed);

// Rows per token (dropped rows not counted): [tokens].
std::vector<int64_t> rows_per_token(const std::vector<int32_t>& token_idx, int64_t tokens);

// moejit-bench --skew's distributions for one shape of R rows, in the order they print: uniform,
// one token with all rows, 1% of tokens with half of them, Zipf(1.2); issue 58's table, token 0
// with 0, R/512, R/64, R/8 and R/2 rows and the rest at random (R itself is "one token"; a count
// met twice is left out); then, unless drop_percent is 0, the first four again with that
// percentage of the rows dropped.
std::vector<RoutingSpec> skew_specs(int64_t rows, double drop_percent);

// A fingerprint of a routing (its token_idx and the bits of its gates, in order), which the C++
// and the Python tests pin to the same values.
uint64_t routing_fingerprint(const Routing& routing);

}  // namespace moejit_bench
