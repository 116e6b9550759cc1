// KernelSpec: everything compile-time about one combine module, and what it turns into: the tiny
// generated source (an include of its kernel family's template; NVRTC instantiates the kernels
// from their name expressions), the name expressions, and its one-line text form (describe /
// parse_kernel_spec), which logs, messages and the precompile manifest use. Value type; hashable;
// no I/O. Which spec a call gets is the dispatcher's decision (combine_dispatch.cpp).
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace moejit {

// Every kind of module the library builds. Each but the last is a kernel variant: a path a combine
// call can take, named by the module that does its work (the decision table in
// combine_dispatch.cpp picks one per call). Values are stable only within one library version.
enum class KernelKind : int {
  kTokenMajor = 0,       // combine_fixed: rows t*K .. t*K+K-1
  kGatherMap,            // combine_fixed: the map names each (token, slot)'s row
  kGatherMapOneToken,    // combine_one_token_map: one token, rows loaded with the map
  kTokenIndexLists,      // combine_lists (and token_index_heavy), after the list helpers
  kTokenIndexScan,       // combine_scan: each block lists its tokens' rows in shared memory
  kTokenIndexSmallScan,  // combine_scan, calls of at most a block of rows: each warp scans all
  kTokenIndexOneToken,   // combine_one_token: one token, rows loaded with token_idx

  // The epilogue (residual, RMSNorm, fp8 output: combine_epilogue.cuh), per layout: a token's
  // whole row in one block (SPLIT slices one after another), or split across a thread-block
  // cluster of SPLIT blocks (sm_90+; its module carries the one-block kernel for older GPUs).
  // The token index's, after the list helpers, carry token_index_heavy too (without its finish).
  kEpilogueTokenMajor,         // combine_epilogue, rows t*K ..
  kEpilogueGatherMap,          // combine_epilogue, rows named by the map
  kEpilogueTokenIndex,         // combine_epilogue (and token_index_heavy), after the lists
  kEpilogueClusterTokenMajor,  // combine_epilogue_cluster (+ combine_epilogue)
  kEpilogueClusterGatherMap,   // combine_epilogue_cluster (+ combine_epilogue)
  kEpilogueClusterTokenIndex,  // combine_epilogue_cluster (+ combine_epilogue, token_index_heavy)

  kTokenIndexListHelpers,  // token_index_clear + token_index_assign (launched before the lists)
};
constexpr int kKernelKinds = 14;

// "token_major", "gather_map", "gather_map_one_token", "token_index_lists", ...: the kind's name
// in describe() and the manifest.
const char* kind_name(KernelKind kind);
// The kernel template a kind's module instantiates ("combine_fixed", ...; the list helpers:
// "token_index_clear/assign"), for messages.
const char* kernel_name(KernelKind kind);
// The moejit_layout a kind serves.
int kind_layout(KernelKind kind);
// The token-index kinds whose combine holds `held` rows per token (every token-index kind but the
// list helpers).
bool holds_rows(KernelKind kind);
// The kinds that keep per-token lists of LIST_CAP rows (list_cap).
bool keeps_lists(KernelKind kind);
// The kinds launched after the token index's list helpers (their companion module); their own
// module holds token_index_heavy too, at heavy_kernel_slot().
bool after_list_helpers(KernelKind kind);
int heavy_kernel_slot(KernelKind kind);
// The epilogue's kinds (residual, norm_weight, fp8 out); those split across a cluster.
bool is_epilogue(KernelKind kind);
bool is_cluster_epilogue(KernelKind kind);

// The launch grid of a combine module. kTokensByChunks: x the token groups, y the chunks of a row.
// kFlat: one dimension, x = groups * chunks, a token's chunks adjacent. kFlatOrTokensByChunks: the
// kernel serves both, reading which from gridDim.y (the dispatcher picks per call).
enum class Grid : int { kTokensByChunks = 0, kFlat = 1, kFlatOrTokensByChunks = 2 };

struct KernelSpec {
  KernelKind kind = KernelKind::kTokenMajor;
  int in_dtype = 0;     // moejit_dtype of the expert rows
  int out_dtype = 0;    // moejit_dtype of out
  int index_bytes = 4;  // 4 (int32) or 8 (int64); 4 for token-major, which reads no index
  int hidden = 0;       // H
  int vec = 1;          // elements per vector access
  int top_k = 0;        // token-major, gather map: K slots per token. 0 for the token index
  int held = 0;         // token index: rows of a token held in registers at once. 0 otherwise
  int tpt = 0;          // threads per token group
  int tpb = 0;          // token groups per block
  int upt = 1;          // vector slots per thread
  int list_cap = 0;     // token index with lists: rows listed per token. 0 otherwise
  // The epilogue's kinds: the residual's and the norm weight's moejit_dtype (-1: none), and the
  // slices of tpt * upt slots a row is cut into (a cluster's blocks, or one block's passes).
  int res_dtype = -1;
  int weight_dtype = -1;
  int split = 0;
  // Rules the kernel takes as template arguments, set by the dispatcher (finish_spec) from the
  // fields above; not part of the text form, which they follow from.
  Grid grid = Grid::kTokensByChunks;
  bool cached_rows = false;  // row loads through L1 (ld.global) instead of streaming past it

  int layout() const { return kind_layout(kind); }
  bool token_index() const;
  int block_threads() const { return tpt * tpb; }
  int slots() const { return vec > 0 ? (hidden + vec - 1) / vec : 0; }
  // Chunks of tpt * upt slots per row (0 for the list helpers, which have no geometry).
  int chunks() const { return tpt * upt > 0 ? (slots() + tpt * upt - 1) / (tpt * upt) : 0; }

  // Name expressions, in the order of the slot enums below.
  std::vector<std::string> name_expressions() const;
  // The generated translation unit.
  std::string source() const;
  // One line, the fields of the kind in a fixed order, e.g.
  //   kind=gather_map in=bf16 out=bf16 idx=int32 H=7168 vec=8 K=8 tpt=128 tpb=1 upt=1
  //   kind=token_index_lists in=bf16 out=bf16 idx=int32 H=7168 vec=8 held=8 tpt=128 tpb=1 upt=1
  //     cap=32
  //   kind=token_index_list_helpers idx=int32
  //   kind=gather_map_epilogue in=bf16 out=fp8 idx=int32 H=7168 vec=8 K=8 tpt=224 tpb=1 upt=4
  //     split=1 res=bf16 weight=bf16
  // The fixed layouts' kinds carry K, the token index's held (and cap where it keeps lists); the
  // epilogue's split, res and weight (none where absent).
  std::string describe() const;

  bool operator==(const KernelSpec& o) const;
  bool operator!=(const KernelSpec& o) const { return !(*this == o); }
  std::size_t hash() const;
};

// The fields of one describe() line, parsed and range-checked: the kind's exact key set, each
// value in the range its template parameter takes (what would make NVRTC fail or the kernel
// nonsensical). grid and cached_rows are left at their defaults: the dispatcher's finish_spec sets
// them, and its check_spec says whether the table's kernels can run such a spec. Throws
// std::invalid_argument with a message naming the field, its value and what is allowed.
KernelSpec parse_kernel_spec(const std::map<std::string, std::string>& fields);

// Index of each kernel in name_expressions() / a loaded module's functions.
enum KernelSlot {
  kCombineKernel = 0,  // every kind but the list helpers: its combine kernel

  // Slot 1 holds a different kernel in different kinds' modules (no module has both):
  // the token index after the list helpers (the list path, the one-block epilogue):
  // token_index_heavy, launched between the helpers and the combine;
  kHeavyKernel = 1,
  // the epilogue's cluster kinds: the one-block kernel that GPUs without clusters launch instead
  // of the split kernel (a row's slices one after another in one block).
  kEpilogueOneBlockKernel = 1,
  // The token index's cluster epilogue: token_index_heavy after both of those.
  kClusterHeavyKernel = 2,
};
enum HelperSlot {  // the list helpers' module
  kClearKernel = 0,
  kAssignKernel = 1,
};
enum { kMaxKernels = 3 };  // kernels in one module

const char* dtype_name(int dtype);    // "fp32" | "fp16" | "bf16" | "fp8"
const char* layout_name(int layout);  // "token_major" | "gather_map" | "token_index"

struct KernelSpecHash {
  std::size_t operator()(const KernelSpec& s) const { return s.hash(); }
};

}  // namespace moejit
