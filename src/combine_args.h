// Validating the arguments of a combine call: every shape field, pointer, alignment and buffer
// overlap that moejit.h documents, each refused with Error naming the argument, its value and
// what is allowed. Reads no device memory and knows nothing of kernels (combine_dispatch.cpp
// chooses those).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moejit/moejit.h"

namespace moejit {

// sizeof(moejit_combine_args) in the 0.1 header: it ended before dependent_launch; in the 0.2
// header, before residual (the epilogue's fields). Structs of those sizes are accepted (their
// later fields take their defaults).
constexpr size_t kCombineArgsSizeV01 = offsetof(moejit_combine_args, dependent_launch);
constexpr size_t kCombineArgsSizeV02 = offsetof(moejit_combine_args, residual);
// Whether `size` is sizeof(moejit_combine_args) of a released header (0.1, 0.2 or this one).
bool known_combine_args_size(size_t size);

// MOEJIT_MAX_NUM_TOKENS (2^40): far beyond what one launch takes (2^31 - 1 token groups, at most
// 32 tokens each), and small enough that no size computed from it (slots, lists, workspace bytes)
// can overflow 64 bits.
constexpr int64_t kMaxTokens = MOEJIT_MAX_NUM_TOKENS;
constexpr int64_t kMaxRows = INT32_MAX;  // token-index lists store row ids as int32

// Copies the caller's struct into a full-size one (defaults for fields an older caller lacks,
// strides of 0 replaced by hidden_dim, token-major's num_rows set to T * K, its index_type to
// int32) and checks every shape field.
moejit_combine_args validated_shape(const moejit_combine_args* args);

// Checks the pointers of a call whose shape validated_shape() accepted: present where the call
// reads or writes them, aligned, no written buffer (out, the residual, the fp8 scales, the
// workspace) overlapping any other buffer, and for the token-index layout a workspace of at least
// `workspace_bytes`.
void check_buffers(const moejit_combine_args& a, size_t workspace_bytes);

// Scale groups per token of an fp8 out: one per 128 channels, ceil(hidden_dim / 128).
int64_t scale_groups(int64_t hidden_dim);
// Floats of out_scales a validated fp8 call writes up to (the last one's index + 1).
uint64_t out_scales_span(const moejit_combine_args& a);

int element_bytes(int dtype);  // 4 for fp32, 2 for fp16 and bf16, 1 for fp8

}  // namespace moejit
