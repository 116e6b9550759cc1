// What the host and the device templates share: the kernel parameter block and the codes of the
// template arguments the dispatcher chooses (src/combine_dispatch.cpp). One definition on both
// sides, so the layout the host fills is the layout the kernel reads.
// Plain C++ with no includes: NVRTC compiles it without any toolkit header on its search path.
#ifndef MOEJIT_COMBINE_PARAMS_H_
#define MOEJIT_COMBINE_PARAMS_H_

namespace moejit {

// Layout codes, equal to the public moejit_layout values.
enum { kLayoutTokenMajor = 0, kLayoutGatherMap = 1, kLayoutTokenIndex = 2 };
// Element type codes, equal to the public moejit_dtype values (fp8 e4m3: an epilogue's out only).
enum { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };
// Where an fp8 out's scales go (moejit_scales_layout): [T, G] row-major, or [G, T4] column-major
// with T4 = T rounded up to a multiple of 4.
enum { kScalesRowMajor = 0, kScalesColumnMajorAligned4 = 1 };
// Launch grid of a combine module (GRID): x the token groups and y a row's chunks; one dimension,
// x = groups * chunks with a token's chunks adjacent; or either, the kernel reading gridDim.y.
enum { kGridTokensByChunks = 0, kGridFlat = 1, kGridFlatOrTokensByChunks = 2 };
// How the token index's single launch finds a token's rows (FORM of combine_scan): several tokens
// per block in shared lists (sorted after), one token per block in ordered warp slabs, or, for
// calls of at most one block's threads in rows, every warp reading all of token_idx.
enum { kScanShared = 0, kScanOrdered = 1, kScanSmall = 2 };

// 8-byte members first, then 4-byte ones: no padding surprises between compilers.
struct CombineParams {
  const void* expert;       // R rows of InT
  const float* gates;       // nullptr: every weight is 1
  const void* indices;      // gather map [T*K] or token_idx [R], of IdxT
  void* out;                // T rows of OutT
  int* token_counts;        // token-index layout: [T] rows seen per token (workspace)
  int* token_rows;          // token-index layout: [T * list_capacity] row ids (workspace)
  long long expert_stride;  // elements between expert rows
  long long out_stride;     // elements between output rows
  long long num_tokens;     // T
  long long num_rows;       // R
  float scale;              // multiplies the sum
  int accumulate;           // nonzero: add into out
  int list_capacity;        // token-index layout: row ids kept per token before overflowing
  int dependent_launch;     // nonzero: the call's first kernel was launched as a programmatic
                            // dependent of the stream's previous kernel (it waits before it
                            // touches memory)

  // The epilogue (combine_epilogue.cuh), unused by the other kernels; again 8-byte members first.
  void* residual;             // T rows of the residual's dtype, read and overwritten
  const void* norm_weight;    // H elements of the weight's dtype
  float* out_scales;          // an fp8 out's scales (scales_layout)
  long long residual_stride;  // elements between residual rows
  float norm_eps;             // the RMSNorm's epsilon
  int scales_layout;          // kScalesRowMajor | kScalesColumnMajorAligned4
  int scales_pow2;            // nonzero: scales rounded up to a power of two
};

}  // namespace moejit

#endif  // MOEJIT_COMBINE_PARAMS_H_
