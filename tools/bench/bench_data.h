// Host side of one benchmark case: random inputs in every layout, and the float64 reference.
//
// Every layout describes the same combine. Rows are generated in token-major order (row t*K + k is
// slot k of token t); the "expert-sorted" buffer is a random permutation of those rows
// (sorted[p] = token_major[source[p]]). The gather map is its inverse (map[t*K + k] = the p
// holding that slot) and token_idx[p] = source[p] / K, with the gates permuted the same way.
// So one reference serves all three layouts.
//
// Dropped slots (moejit-bench --drop, capacity-factor routing): a dropped slot's map entry is -1
// and so is token_idx of the row that held it; the row stays in `sorted`, unreferenced. The
// token-major buffer has no index to mark a slot dropped, so that layout cannot run such inputs.
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
  // BENCHMARKS.md's minimal bytes: R*H*in + R*8 (index + gate) + T*H*out. With dropped slots
  // (moejit-bench --drop) their rows need not be read: (R - dropped)*H*in + R*8 + T*H*out.
  double minimal_bytes(int64_t dropped = 0) const;
  std::string describe() const;  // "T4096 K8 H7168 bf16" (+ "->fp32" when the output differs)
};

// The counter-based generator every random input of the bench is drawn from (splitmix64's
// finalizer): element i of a stream is mix(stream_seed + i), so any thread can make any element.
uint64_t mix(uint64_t x);

int dtype_bytes(moejit_dtype dtype);
const char* dtype_text(moejit_dtype dtype);  // "fp32" | "fp16" | "bf16"
bool parse_dtype(const std::string& text, moejit_dtype* dtype);

struct HostInputs {
  Shape shape;
  std::vector<uint8_t> token_major;  // R rows of H elements of in_dtype
  std::vector<uint8_t> sorted;       // the same rows, permuted
  // [T*K], indexed t*K + k: for K > 1 each token's gates sum to 1 (a top-k softmax); for K = 1 a
  // top-1 router's sigmoid score in [0.05, 1) (Llama 4), so a kernel that ignores gates fails.
  std::vector<float> gates;
  std::vector<float> gates_by_row;  // [R], gates of the sorted rows (token-index layout)
  std::vector<int32_t> gather_map;  // [T*K] -> row of `sorted`, -1 for a dropped slot
  std::vector<int32_t> token_idx;   // [R] -> token of each row of `sorted`, -1 for a dropped one
  double drop_percent = 0.0;        // as asked of make_inputs
  int64_t dropped_slots = 0;        // how many map entries are -1
  // make_token_index_inputs (moejit-bench --skew): the routing's name, and the most rows any token
  // has. make_inputs: "" and K.
  std::string routing;
  int64_t max_rows_per_token = 0;
};

// Random inputs, never zero: every element has magnitude in [1/16, 2) and a random sign, drawn as
// bit patterns so each value is exact in its dtype. Deterministic in seed; multithreaded.
// drop_percent (0..100) drops round(drop_percent% of T*K) slots, a uniformly random set drawn
// from a stream of its own: rows, gates and the permutation are those of drop_percent 0 with the
// same seed. Gates stay as they are, not renormalized over the slots left: most engines' capacity
// dropping does not renormalize either.
HostInputs make_inputs(const Shape& shape, uint64_t seed, double drop_percent = 0.0);

// Inputs for the token-index layout alone, with any number of rows per token (moejit-bench
// --skew): `sorted` holds R = T*K rows drawn like make_inputs' (same element stream), token_idx
// and gates_by_row are the given routing's ([R]; -1 a dropped row, `dropped` of them), and there
// are no token-major rows, no gather map and no per-slot gates: the token-major and gather-map
// layouts cannot run them. check_output's reference then sums each token's rows by token_idx.
HostInputs make_token_index_inputs(const Shape& shape, std::vector<int32_t> token_idx,
                                   std::vector<float> gates_by_row, int64_t dropped,
                                   double drop_percent, const std::string& routing, uint64_t seed);

// How many of `rows` slots make_inputs drops at drop_percent: round(drop_percent% of rows).
int64_t dropped_slot_count(int64_t rows, double drop_percent);

// The tokens the reference is computed for: all of them up to max_tokens, else max_tokens spread
// evenly over [0, T) with the first and last included. moejit-bench checks every token unless
// --check-tokens says otherwise: a sample of 512 once left every 16th token of T=4096 unchecked
// (a kernel that zeroed them passed).
std::vector<int64_t> check_tokens(int64_t tokens, int64_t max_tokens);

// `value` rounded to nearest-even in out_dtype (fp32, bf16 or fp16, subnormals included; no
// overflow handling: the benchmark's sums stay under 2 in magnitude).
double round_to(moejit_dtype out_dtype, double value);

// What an error may be, relative to the reference's norm, given what rounding the float64
// reference once to the output dtype costs (`rounding`, relative too): 1.25 times that, plus 1e-6
// for the fp32 accumulation the library promises. Its one final rounding of an fp32 sum lands on
// `rounding` itself (bf16 1.7e-3, fp16 2.1e-4, fp32 3e-8 in the record). Accumulating in the
// output dtype lands 1.45 times over it at K=2 and more at larger K, and fails (a fixed bound of
// 1e-2 for bf16 and 1e-3 for fp16 once passed that).
// With norm (the reference's), rounding is the rounding error's norm and the bound absolute: a
// token's own bound without dividing by its norm.
// rows: the most terms a sum has. fp32 accumulation in order errs by about 2^-24 * sqrt(rows / 2)
// relative (random rounding errors), which 1e-6 covers up to K's limit of 64; a token with more
// rows (--skew: up to all R) gets sqrt(rows / 64) times that, else a correct fp32 sum of 32768
// rows fails the fp32 bound (relative error about 8e-6).
double error_bound(double rounding, double norm = 1.0, int64_t rows = 1);

struct CheckResult {
  double rel_err = 0.0;       // ||out - ref|| / ||ref|| over the checked tokens
  double rounding_err = 0.0;  // ||round_to(ref) - ref|| / ||ref|| over the same tokens
  double bound = 0.0;         // error_bound(rounding_err): what rel_err must meet
  int64_t checked_tokens = 0;
  // Checked tokens whose own error is over their own bound (error_bound of their own rounding,
  // on their own norm): a few wrong tokens among thousands barely move rel_err.
  int64_t bad_tokens = 0;
  int64_t first_bad_token = -1;
  int64_t nonfinite = 0;  // NaN or Inf elements anywhere in out (the poison survived, or worse)
  bool passed() const { return nonfinite == 0 && bad_tokens == 0 && rel_err <= bound; }
};

// Compares out (T rows of H elements of out_dtype, as downloaded) against the float64 reference on
// `tokens`, and scans all of out for NaN and Inf. Multithreaded. The reference leaves out dropped
// slots (gather map -1): a token whose slots were all dropped has reference 0, its own bound is 0,
// and any output but 0 makes it a bad token. Inputs without a gather map
// (make_token_index_inputs) are summed by token_idx, each token's rows in ascending order, and
// held to error_bound with the rows each token (and the busiest checked one, for rel_err) has.
CheckResult check_output(const HostInputs& in, const std::vector<uint8_t>& out,
                         const std::vector<int64_t>& tokens);

}  // namespace moejit_bench
