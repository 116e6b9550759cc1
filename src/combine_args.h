// Validating the arguments of a combine call: every shape field, pointer, alignment and buffer
// overlap that moejit.h documents, each refused with Error naming the argument, its value and
// what is allowed. Reads no device memory and knows nothing of kernels (combine_dispatch.cpp
// chooses those).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moejit/moejit.h"

namespace moejit {

// sizeof(moejit_combine_args) in the 0.1 header: it ended before dependent_launch. A struct of
// that size is accepted (its later fields take their defaults).
constexpr size_t kCombineArgsSizeV01 = offsetof(moejit_combine_args, dependent_launch);

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
// reads or writes them, aligned, no buffer overlapping out, and for the token-index layout a
// workspace of at least `workspace_bytes`, aligned, overlapping nothing.
void check_buffers(const moejit_combine_args& a, size_t workspace_bytes);

int element_bytes(int dtype);  // 4 for fp32, 2 for fp16 and bf16

}  // namespace moejit
