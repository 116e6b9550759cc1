// The epilogue's part of the kernel-choice table (residual, RMSNorm, fp8 output: moejit.h, "The
// epilogue"): which of its variants and which geometry serve a call, the vector width its extra
// buffers allow, and the batch sizes at which its choice changes (for the precompile set).
// choose_kernel() (combine_dispatch.cpp) hands every call with an epilogue here; the rules are in
// combine_epilogue.cpp's top comment, the kernels in kernel_templates/combine_epilogue.cuh.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "combine_dispatch.h"
#include "kernel_spec.h"

namespace moejit {

// Whether the call has an epilogue: a residual, a norm weight or an fp8 out.
bool has_epilogue(const CallShape& call);

// The epilogue variant and geometry of a call with an epilogue; `base` is the call's spec without
// one (its dtypes, index type, vector width, and K or the token index's held rows and lists).
KernelSpec choose_epilogue_kernel(const CallShape& call, const KernelSpec& base);

// Empty if the epilogue kernels can run spec (an epilogue kind), else why not, naming the field.
std::string check_epilogue_spec(const KernelSpec& spec);

// The widest vector (elements), at most `vec`, such that the residual's row starts and the norm
// weight are aligned to it as well, and that moves at most 16 bytes of every element type (dtype
// -1: no such buffer).
int epilogue_vec(int vec, int hidden, int res_dtype, uintptr_t residual, int64_t residual_stride,
                 int weight_dtype, uintptr_t weight);

// Whether a call of spec launches its kernel as a thread-block cluster (the split kernel with a
// norm); without cluster support it launches the module's one-block kernel instead.
bool needs_cluster(const KernelSpec& spec);

// Batch sizes that reach every epilogue module of a shape through choose_kernel (each decode
// split, and one past decode).
std::vector<int64_t> epilogue_token_counts();

}  // namespace moejit
