// KernelSpec: everything compile-time about one combine specialization, and what it turns into:
// the tiny generated source (an include of the template; NVRTC instantiates the kernels from
// their name expressions) and the name expressions themselves. Value type; hashable; no I/O.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace moejit {

struct KernelSpec {
  int layout = 0;       // moejit_layout
  int in_dtype = 0;     // moejit_dtype of the expert rows
  int out_dtype = 0;    // moejit_dtype of out
  int index_bytes = 4;  // 4 (int32) or 8 (int64)
  int hidden = 0;       // H
  int vec = 1;          // elements per vector access
  int top_k = 0;        // K (token-major, gather map); token index: rows held in registers
                        // (the expected rows per token rounded up to 1, 2, 4, 8, 12 or 16)
  int tpt = 0;          // threads per token group
  int tpb = 0;          // token groups per block
  int upt = 1;          // vector slots per thread (combine kernel)
  int list_cap = 0;     // token index: rows listed per token; 0 otherwise
  // Token index, small calls: this spec's module is the single-launch kernel alone (combine_scan),
  // not the list path's combine. Two modules per shape and batch size, so a call compiles only the
  // kernels it launches (each is a large share of a token-index compile); their geometries may
  // differ (single_launch_spec in combine_plan.h).
  bool scan = false;
  // Token index, single launch with one token per block (ordered_scan()): the form for calls with
  // at most block_threads() rows, where every warp reads all of token_idx and lists the token's
  // rows a LIST_CAP window at a time (no slab scan, no merge, no walk of token_idx). Its own
  // module: a quarter faster to compile than the slab form (99 against 129 ms locally), and faster
  // at decode (combine.cuh, scan_token_rows_ordered). The host sets it from the call's rows
  // (single_launch_for_rows in combine_plan.h).
  bool small_scan = false;
  // One-token calls with few rows: the module is one kernel that loads every row with the routing
  // (one round trip before the adds). Token index: combine_one_token (no scan, no lists: every row
  // whose entry is 0 is the token's), top_k the rows per batch, list_cap 0. Gather map:
  // combine_one_token_map (at most top_k rows, each slot's row picked from them), top_k the K.
  bool one_token = false;
  // Token index, list path: the module of the two helpers that build the per-token lists
  // (token_index_clear, token_index_assign). They depend on the index type alone, so one module
  // per index type and architecture serves every shape (in every list module they cost 13 ms of
  // each compile). Such a spec has only layout, index_bytes and helpers set (helpers_spec()).
  bool helpers = false;

  int block_threads() const { return tpt * tpb; }
  int slots() const { return (hidden + vec - 1) / vec; }
  // Chunks of tpt * upt slots per row (0 for a helpers spec, which has no geometry).
  int chunks() const { return tpt * upt > 0 ? (slots() + tpt * upt - 1) / (tpt * upt) : 0; }
  bool token_index() const;
  // A single launch that lists each token's rows in ascending order (one token per block, whole
  // warps): the scan that has a small-call form. combine.cuh (kOrderedScan) applies the same rule.
  bool ordered_scan() const { return scan && tpb == 1 && tpt % 32 == 0; }
  // This ordered scan's small-call form (calls with at most block_threads() rows). It lists a
  // window of a token's rows and scans again past it (no slow path), so its list stays at twice
  // the expected count, at least 8 (half the single launch's list_capacity() in combine_plan.cpp):
  // its shared memory matters after a producer kernel that uses none (combine.cuh,
  // scan_token_rows_ordered).
  // Idempotent: the list is halved once, from the single launch's spec.
  KernelSpec with_small_scan() const {
    if (small_scan) return *this;
    KernelSpec s = *this;
    s.small_scan = true;
    s.list_cap = top_k <= 4 ? 8 : list_cap / 2;
    return s;
  }
  // The one-token kernel's spec for this geometry (token index, gather map): no list.
  KernelSpec with_one_token_kernel() const {
    KernelSpec s = *this;
    s.one_token = true;
    s.list_cap = 0;
    return s;
  }
  // Whether a gather-map one-token module (combine_one_token_map) can hold all of a call's rows in
  // flight at once: top_k * upt vectors per thread, at most combine.cuh's kBatch (8).
  bool fits_one_token_map() const { return top_k * upt <= 8; }
  // The list helpers' module for this spec's index type (token index, list path).
  KernelSpec helpers_spec() const;
  // A token-index list-path combine: its calls launch the helpers of helpers_spec() first.
  bool needs_list_helpers() const { return token_index() && !scan && !one_token && !helpers; }
  // The combine can run on a 1-D grid (x = token groups * chunks, a token's chunks adjacent) rather
  // than x = token groups, y = chunks: the fixed layouts (the gather map's one-token kernel too),
  // and the token index's list path with two or more rows per token held. combine.cuh
  // (kOneDimGrid, combine_one_token_map) applies the same rule. The plan launches it so, except the
  // gather map up to mid-size calls, which the kernel takes on the 2-D grid (gridDim.y > 1).
  bool one_dim_grid() const {
    return !helpers && !scan && (!token_index() || (!one_token && top_k >= 2));
  }

  // Name expressions, in the order of the slot enums below: the combine (for a scan spec, the
  // single-launch kernel; for a one-token spec, combine_one_token or combine_one_token_map), or for
  // a helpers spec the clear and assign kernels.
  std::vector<std::string> name_expressions() const;
  // The generated translation unit.
  std::string source() const;
  // "layout=gather_map in=bf16 out=bf16 idx=int32 H=7168 vec=8 K=8 tpt=128 tpb=1 upt=1 cap=0": for
  // logs, messages and the precompile manifest; a scan spec ends in " scan=1" (its small-call form
  // in " scan=1 small_scan=1"), a one-token spec in " one_token=1"; a helpers spec is
  // "layout=token_index idx=int32 helpers=1".
  std::string describe() const;

  bool operator==(const KernelSpec& o) const;
  bool operator!=(const KernelSpec& o) const { return !(*this == o); }
  std::size_t hash() const;
};

// Index of each kernel in name_expressions() / a loaded module's functions.
enum KernelSlot {
  kCombineKernel = 0,  // the combine; in a scan spec's module, the single-launch kernel
};
enum HelperSlot {  // a helpers spec's module (token index, list path)
  kClearKernel = 0,
  kAssignKernel = 1,
};
enum { kMaxKernels = 2 };  // kernels in one module

const char* dtype_name(int dtype);    // "fp32" | "fp16" | "bf16"
const char* layout_name(int layout);  // "token_major" | "gather_map" | "token_index"

struct KernelSpecHash {
  std::size_t operator()(const KernelSpec& s) const { return s.hash(); }
};

}  // namespace moejit
