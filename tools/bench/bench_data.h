// Host side of one benchmark case: random inputs in every layout, and the float64 reference.
//
// Every layout describes the same combine. Rows are generated in token-major order (row t*K + k is
// slot k of token t); the "expert-sorted" buffer is a random permutation of those rows
// (sorted[p] = token_major[source[p]]). The gather map is its inverse (map[t*K + k] = the p
// holding that slot) and token_idx[p] = source[p] / K, with the gates permuted the same way.
// So one reference serves all three layouts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moejit/moejit.h"

namespace moejit_bench {

struct Shape {
  int64_t tokens = 0;  // T
  int64_t top_k = 0;   // K
  int64_t hidden = 0;  // H
  moejit_dtype in_dtype = MOEJIT_DTYPE_BFLOAT16;
  moejit_dtype out_dtype = MOEJIT_DTYPE_BFLOAT16;
  std::string label;  // e.g. "DeepSeek-V3 prefill"; empty for command-line cases

  int64_t rows() const { return tokens * top_k; }
  // BENCHMARKS.md's minimal bytes: R*H*in + R*8 (index + gate) + T*H*out.
  double minimal_bytes() const;
  std::string describe() const;  // "T4096 K8 H7168 bf16" (+ "->fp32" when the output differs)
};

int dtype_bytes(moejit_dtype dtype);
const char* dtype_text(moejit_dtype dtype);  // "fp32" | "fp16" | "bf16"
bool parse_dtype(const std::string& text, moejit_dtype* dtype);

struct HostInputs {
  Shape shape;
  std::vector<uint8_t> token_major;  // R rows of H elements of in_dtype
  std::vector<uint8_t> sorted;       // the same rows, permuted
  std::vector<float> gates;          // [T*K], indexed t*K + k; each token's gates sum to 1
  std::vector<float> gates_by_row;   // [R], gates of the sorted rows (token-index layout)
  std::vector<int32_t> gather_map;   // [T*K] -> row of `sorted`
  std::vector<int32_t> token_idx;    // [R] -> token of each row of `sorted`
};

// Random inputs, never zero: every element has magnitude in [1/16, 2) and a random sign, drawn as
// bit patterns so each value is exact in its dtype. Deterministic in seed; multithreaded.
HostInputs make_inputs(const Shape& shape, uint64_t seed);

// The tokens the reference is computed for: all of them up to max_tokens, else max_tokens spread
// evenly over [0, T) with the first and last included.
std::vector<int64_t> check_tokens(int64_t tokens, int64_t max_tokens);

struct CheckResult {
  double rel_err = 0.0;   // ||out - ref|| / ||ref|| over the checked tokens
  int64_t unwritten = 0;  // NaN elements anywhere in out (the poison survived, or worse)
};

// The bound rel_err must meet, about five times what one final rounding gives: fp32 output 1e-5
// (fp32 accumulation lands near 3e-8), bf16 1e-2 (one rounding lands near 1.7e-3), fp16 1e-3 (near
// 2e-4; bf16's bound would pass an fp16 result rounded through bf16 on the way).
double error_bound(moejit_dtype out_dtype);

// Compares out (T rows of H elements of out_dtype, as downloaded) against the float64 reference on
// `tokens`, and scans all of out for NaN. Multithreaded.
CheckResult check_output(const HostInputs& in, const std::vector<uint8_t>& out,
                         const std::vector<int64_t>& tokens);

}  // namespace moejit_bench
