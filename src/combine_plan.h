// A combine call's plan: the module the kernel-choice table picked (combine_dispatch.cpp), its
// launch geometry and its parameter block, from the validated arguments (combine_args.cpp); and
// the launch of a plan (combine_launch.cpp, the only one of them that talks to the driver).
#pragma once

#include <cuda.h>

#include <cstddef>

#include "../kernel_templates/combine_params.h"
#include "combine_args.h"
#include "combine_dispatch.h"
#include "kernel_spec.h"
#include "module_cache.h"
#include "moejit/moejit.h"
#include "stats.h"

namespace moejit {

constexpr int kHelperThreads = 256;  // token-index list helpers: threads per block
constexpr unsigned kMaxHelperBlocks = 4096;

struct CombinePlan {
  KernelSpec spec;  // the variant (spec.kind) and its geometry
  CombineParams params{};
  bool nothing_to_do = false;  // T == 0
  // The combine's grid: flat (x = groups * chunks, y = 1) or x the token groups (spec.tpb tokens
  // each) and y the chunks of spec.tpt * spec.upt vector slots per row (spec.grid).
  unsigned int combine_grid_x = 0;
  unsigned int combine_grid_y = 0;
  unsigned int clear_blocks = 0;  // token-index list helpers (0 for other layouts)
  unsigned int assign_blocks = 0;
  // token_index_heavy after the list helpers (kHeavyThreads each; heavy_kernel_slot()).
  unsigned int heavy_blocks = 0;
  // The epilogue's split kernel with a norm: blocks per thread-block cluster (0: no cluster), and
  // the grid of its module's one-block kernel, which GPUs without clusters launch instead.
  unsigned int cluster_blocks = 0;
  unsigned int one_block_grid_x = 0;
  // The token index's single launch (either form).
  bool token_scan() const {
    return spec.kind == KernelKind::kTokenIndexScan ||
           spec.kind == KernelKind::kTokenIndexSmallScan;
  }
  // A one-token kernel (token index or gather map).
  bool one_token() const {
    return spec.kind == KernelKind::kTokenIndexOneToken ||
           spec.kind == KernelKind::kGatherMapOneToken;
  }
  // The list path and the token index's epilogue: clear and assign run first, from the companion
  // module (companion_module()), then token_index_heavy from the spec's own module.
  bool list_helpers() const { return after_list_helpers(spec.kind); }
};

// Validates args (throws Error naming the argument, its value and what is allowed) and plans the
// launch. Reads no device memory and needs no GPU.
CombinePlan plan_combine(const moejit_combine_args* args);

// Bytes of workspace the token-index layout needs (0 for the others); validates the shape fields.
size_t combine_workspace_bytes(const moejit_combine_args* args);

// Enqueues the plan's kernels on stream: `kernels` is the module of plan.spec (ModuleCache::get;
// for the list path it carries the companion module, the list helpers).
void launch_combine(const CombinePlan& plan, const LoadedKernels& kernels, CUstream stream,
                    Stats& stats);

}  // namespace moejit
