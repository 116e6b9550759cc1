// The dispatcher: the only module that knows what "combine" means. It validates the public
// arguments, picks the specialization (vector width from the pointers and strides, thread layout
// from the hidden size) and the launch geometry, and launches the kernels of a plan.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../kernel_templates/combine_params.h"
#include "kernel_spec.h"
#include "module_cache.h"
#include "moejit/moejit.h"
#include "stats.h"

namespace moejit {

// sizeof(moejit_combine_args) in the 0.1 header: it ended before dependent_launch. A struct of
// that size is accepted (its later fields take their defaults).
constexpr size_t kCombineArgsSizeV01 = offsetof(moejit_combine_args, dependent_launch);

struct CombinePlan {
  KernelSpec spec;
  CombineParams params{};
  bool nothing_to_do = false;  // T == 0
  // Combine grid (also the single-launch and one-token kernels'). Where spec.one_dim_grid() (the
  // fixed layouts, the token index's list path with two or more rows held): 1-D, x = groups *
  // chunks (a token's chunks adjacent), y = 1, except the gather map up to mid-size calls.
  // Otherwise x the token groups (spec.tpb tokens each), y the chunks of spec.tpt * spec.upt vector
  // slots per row.
  unsigned int combine_grid_x = 0;
  unsigned int combine_grid_y = 0;
  unsigned int clear_blocks = 0;  // token-index helpers (0 for other layouts)
  unsigned int assign_blocks = 0;
  // Token index, few rows: the single-launch scan kernel (spec.scan).
  bool token_scan() const { return spec.scan; }
  // Token index, one token and few rows: combine_one_token alone (spec.one_token).
  bool one_token() const { return spec.one_token; }
  // Token index, list path: clear and assign run first, from the module of spec.helpers_spec().
  bool list_helpers() const { return spec.needs_list_helpers(); }
};

// Validates args (throws Error naming the argument, its value and what is allowed) and plans the
// launch. Reads no device memory and needs no GPU.
CombinePlan plan_combine(const moejit_combine_args* args);

// Bytes of workspace the token-index layout needs (0 for the others); validates the shape fields.
size_t combine_workspace_bytes(const moejit_combine_args* args);

// num_tokens for spec_for_shape when the batch size is not known: a large (prefill) batch.
constexpr int64_t kAnyTokens = -1;

// The specialization moe_combine() would use for this shape, with buffers aligned to
// `alignment_bytes` (256 for fresh allocations) and rows not padded. `rows_per_token` is top_k for
// the fixed layouts and the expected rows per token (R / T) for the token-index layout; the
// thread geometry also depends on the batch size (num_tokens; kAnyTokens: large).
KernelSpec spec_for_shape(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                          moejit_index_type index_type, int hidden, int rows_per_token,
                          size_t alignment_bytes, int64_t num_tokens = kAnyTokens);

// Token index: the single-launch module's spec for calls of num_tokens tokens whose list-path spec
// is `list_spec` (spec_for_shape with the same num_tokens). Its thread geometry is its own: at
// prefill its blocks keep 128 threads where the list path's have 64 (every block scans all of
// token_idx, so fewer blocks scan less).
KernelSpec single_launch_spec(const KernelSpec& list_spec, int64_t num_tokens);

// The single launch a call with `num_rows` rows takes: `single` (single_launch_spec), or its
// small-call form where it lists rows in order and the call has at most one block's threads in
// rows (KernelSpec::small_scan).
KernelSpec single_launch_for_rows(const KernelSpec& single, int64_t num_rows);

// Gather map: the one-token module's spec (combine_one_token_map) for a one-token call whose
// decode spec is `decode` (spec_for_shape with num_tokens = 1). Its thread geometry is its own:
// 16x2 blocks at K > 2 where the fixed kernel has 128x1.
KernelSpec one_token_map_spec(const KernelSpec& decode);

// Token index: the one-token module's spec (combine_one_token) for a one-token call whose decode
// spec is `decode` (spec_for_shape with num_tokens = 1): 128-thread blocks in 8-byte vectors with
// one or two rows, in 4-byte ones with five or more rows of 2-byte elements, the decode geometry
// otherwise.
KernelSpec one_token_index_spec(const KernelSpec& decode);

// Every specialization moe_combine() may use for this shape, whatever the batch size (decode and
// prefill geometries, deduplicated; for the token index each batch size's list-path and
// single-launch modules (with the small-call form where a call of that batch size with
// rows_per_token rows per token, R / T rounded up as the plan takes it, can take it), the
// one-token module, and the list helpers' module): what tools/precompile warms.
std::vector<KernelSpec> specs_for_shape(moejit_layout layout, moejit_dtype in_dtype,
                                        moejit_dtype out_dtype, moejit_index_type index_type,
                                        int hidden, int rows_per_token, size_t alignment_bytes);

// Enqueues the plan's kernels on stream: `kernels` is the module of plan.spec (ModuleCache::get;
// for the list path it carries the helpers' module).
void launch_combine(const CombinePlan& plan, const LoadedKernels& kernels, CUstream stream,
                    Stats& stats);

}  // namespace moejit
