// The kernel-choice table: which kernel variant (KernelKind) and which geometry serve a combine
// call, as one function, choose_kernel(); the runtime (plan_combine), the precompile set
// (specs_for_shape) and precompile's exact specs (finish_spec, check_spec) all go through it. The
// decision table itself is the top comment of combine_dispatch.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernel_spec.h"
#include "moejit/moejit.h"

namespace moejit {

// Up to this many tokens a call is decode-sized: latency, not bandwidth, decides.
constexpr int64_t kDecodeMaxTokens = 64;

// What the choice reads from a validated call.
struct CallShape {
  moejit_layout layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
  moejit_dtype in_dtype = MOEJIT_DTYPE_FLOAT32;
  moejit_dtype out_dtype = MOEJIT_DTYPE_FLOAT32;  // fp8 e4m3: an epilogue's quantized output
  // The epilogue (combine_epilogue.h): the residual's and the norm weight's dtype, -1 for none.
  int res_dtype = -1;
  int weight_dtype = -1;
  moejit_index_type index_type = MOEJIT_INDEX_INT32;
  int hidden = 0;
  int vec = 1;             // widest vector every row start of both buffers is aligned to
  int64_t num_tokens = 0;  // T >= 1
  int64_t num_rows = 0;    // R (token-major: T * K)
  int top_k = 0;           // K (fixed layouts)
  bool dependent_launch = false;
};

// The module that does a call's work: its variant (spec.kind) and geometry.
KernelSpec choose_kernel(const CallShape& call);

// The widest vector (elements) such that every row start of both buffers is aligned to it.
int choose_vec(int in_dtype, int out_dtype, int hidden, uintptr_t expert, int64_t expert_stride,
               uintptr_t out, int64_t out_stride);

// The module a call of `spec` launches before it (the token index's list path: the list helpers,
// shared by every shape of an index type), if any. ModuleCache loads it together with spec.
std::optional<KernelSpec> companion_module(const KernelSpec& spec);
// The list helpers' module for an index type (4 or 8 bytes).
KernelSpec list_helpers_spec(int index_bytes);

// Sets the rules the kernel takes as template arguments (grid, cached_rows) from the spec's other
// fields. choose_kernel's specs have them; parse_kernel_spec's get them here.
void finish_spec(KernelSpec* spec);
// Empty if the table's kernels can run spec (a parsed spec that no call may choose merely costs
// one compile); otherwise why not, naming the field.
std::string check_spec(const KernelSpec& spec);

// Bytes of workspace a validated token-index call needs (0 for T = 0): its parts and their sizes
// are token_index_workspace() (kernel_templates/token_index_workspace.h), with the lists of
// list_capacity rows per token this shape takes.
size_t token_index_workspace_bytes(int64_t num_tokens, int64_t num_rows, int64_t hidden);

// num_tokens for spec_for_shape when the batch size is not known: a large (prefill) batch.
constexpr int64_t kAnyTokens = -1;

// The spec of the list path (token index) or of the fixed layouts' kernel for this shape, with
// buffers aligned to `alignment_bytes` (256 for fresh allocations) and rows not padded, at batch
// size num_tokens (kAnyTokens: large). `rows_per_token` is K for the fixed layouts and the
// expected rows per token (R / T) for the token index.
KernelSpec spec_for_shape(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                          moejit_index_type index_type, int hidden, int rows_per_token,
                          size_t alignment_bytes, int64_t num_tokens = kAnyTokens);

// The token index's single launch for calls of num_tokens tokens whose list-path spec is
// `list_spec`: kTokenIndexScan in its own geometry.
KernelSpec single_launch_spec(const KernelSpec& list_spec, int64_t num_tokens);
// The single launch a call with num_rows rows takes: `single`, or its small-call form
// (kTokenIndexSmallScan) where `single` has one token per block in whole warps and the rows fit
// its threads.
KernelSpec single_launch_for_rows(const KernelSpec& single, int64_t num_rows);
// The gather map's one-token module for a one-token call whose decode spec is `decode`.
KernelSpec one_token_map_spec(const KernelSpec& decode);
// Whether a gather-map one-token module holds all of a call's rows in flight at once.
bool fits_one_token_map(const KernelSpec& spec);
// The token index's one-token module for a one-token call whose decode spec is `decode`.
KernelSpec one_token_index_spec(const KernelSpec& decode);

// Exactly the modules moe_combine() may load for this shape, whatever the batch size (for the
// token index: calls whose rows per token, R / T rounded up, is rows_per_token), the list
// helpers included: what tools/precompile warms. With an epilogue: res_dtype and weight_dtype
// (-1: none), out_dtype fp8 for a quantized output; the residual and weight aligned like the rest.
std::vector<KernelSpec> specs_for_shape(moejit_layout layout, moejit_dtype in_dtype,
                                        moejit_dtype out_dtype, moejit_index_type index_type,
                                        int hidden, int rows_per_token, size_t alignment_bytes,
                                        int res_dtype = -1, int weight_dtype = -1);

}  // namespace moejit
