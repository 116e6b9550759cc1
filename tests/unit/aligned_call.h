// A combine call on fake device addresses, each buffer in a region of its own far from the others
// (no call of any size overlaps) and 256-byte aligned, as moejit-precompile assumes: for tests of
// the plan, which reads no device memory.
#pragma once

#include <cstdint>

#include "combine_plan.h"

namespace moejit::test {

inline moejit_combine_args aligned_call(moejit_layout layout, moejit_dtype in, moejit_dtype out,
                                        moejit_index_type index_type, int hidden, int k,
                                        int64_t tokens, int64_t rows, int dependent) {
  constexpr uintptr_t kRegion = uintptr_t{1} << 46;  // past the largest span a test plans
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = layout;
  a.num_tokens = tokens;
  a.top_k = layout == MOEJIT_LAYOUT_TOKEN_INDEX ? 0 : k;
  a.num_rows = rows;
  a.hidden_dim = hidden;
  a.expert_hidden = reinterpret_cast<void*>(1 * kRegion);
  a.expert_dtype = in;
  a.out = reinterpret_cast<void*>(2 * kRegion);
  a.out_dtype = out;
  if (layout != MOEJIT_LAYOUT_TOKEN_MAJOR) {
    a.indices = reinterpret_cast<void*>(3 * kRegion);
    a.index_type = index_type;
  }
  a.dependent_launch = dependent;
  if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
    a.workspace = reinterpret_cast<void*>(4 * kRegion);
    a.workspace_bytes = combine_workspace_bytes(&a);
  }
  return a;
}

}  // namespace moejit::test
