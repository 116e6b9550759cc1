// The kernel-choice table. Every combine call takes one variant (KernelKind) in one geometry;
// choose_kernel() below is the only place either is decided. The measured gain of each variant
// and geometry rule, with the GPU: docs/performance.md#kernel-variants.
//
// Variants (T tokens, R rows, K slots per token; rows per token = R / T rounded up), and why:
//
//   token_major  kTokenMajor           every call
//                                      a token's rows are t*K..: nothing to find
//   gather_map   kGatherMapOneToken    T = 1, R <= K, K * upt <= 8, not a dependent launch
//                                      rows load with the map: one round trip, not two (they
//                                      are staged in shared memory: late as a dependent)
//                kGatherMap            every other call
//                                      one map load, then the rows
//   token_index  kTokenIndexOneToken   T = 1, R <= 64
//                                      rows load with token_idx: one round trip, nothing to find
//                kTokenIndexSmallScan  the single launch pays; one token per block in whole
//                                      warps; R <= the block's threads
//                                      every warp reads all of token_idx and lists the rows in
//                                      order: no atomics, sort or barrier; a smaller module
//                kTokenIndexScan       the single launch pays (other calls)
//                                      one launch where the lists need four
//                kTokenIndexLists      every other call
//                                      list helpers (clear, assign), token_index_heavy (tokens
//                                      past their lists, over the whole GPU), then the combine:
//                                      token_idx is read once, not once per block
//   The single launch pays while each of its threads reads at most kScanMaxRowsPerThread entries of
//   token_idx and all its blocks together at most kScanMaxBytes (re-read from L2).
//
//   Calls with an epilogue (a residual, a norm weight or an fp8 out) come first: the norm needs a
//   token's whole row in blocks that can meet (combine_epilogue.cpp: the geometry):
//   any layout   kEpilogueCluster<L>   T <= kDecodeMaxTokens and the row splits into 2..8 slices
//                                      the row's slices on a thread-block cluster (sm_90+; before,
//                                      the module's one-block kernel); no cluster without a norm
//                kEpilogue<L>          every other epilogue call
//                                      a token's row in one block (slices one after another)
//   The token index's are launched after the list helpers and token_index_heavy, as
//   kTokenIndexLists is (token_index_heavy without its finish: the epilogue adds a heavy token's
//   sum itself).
//
// Geometry (choose_geometry; slots = vectors per row; decode: T <= 64; mid-size: T * slots <= 2^21;
// prefill: larger, or T unknown):
//   - one slot per thread in 128-thread blocks; rows shorter than 128 slots share a block between
//     tokens (groups of the row's slots rounded up to a power of two, at least 4).
//   - fixed layouts, mid-size, K >= 8, rows of whole 128-byte lines: 16-thread groups, two per
//     block (gather map: eight).
//   - token index, decode, list path and one-token kernel: one 64-thread group per block; the
//     single launch keeps 128 where a row fills them.
//   - token index, not decode: two slots per thread with at most 4 rows held; the list path in
//     64-thread groups except at prefill where whole 128 x upt chunks tile the row; the single
//     launch's short-row blocks 512 threads (lists permitting).
//   - fixed layouts, not decode: K = 1 two slots per thread; gather map K = 2 four where 512-slot
//     chunks tile the row.
//   - vectors of 4 bytes or less (odd hidden sizes), not decode: four slots per thread.
//   - one-token kernels: their own vectors and blocks (one_token_map_spec, one_token_index_spec).
// Grid: one dimension with a token's chunks adjacent for the fixed layouts and the list path with
// two or more rows held; the gather map up to mid-size calls x the token groups, y the chunks (one
// module serves both, kFlatOrTokensByChunks); the single launches and the token index's one-token
// kernel always x by y. Row loads through L1 for the 128-thread groups of the fixed layouts and the
// list path where whole chunks tile the row, streaming elsewhere.
#include "combine_dispatch.h"

#include <algorithm>
#include <climits>
#include <string>

#include "../kernel_templates/token_index_workspace.h"
#include "combine_args.h"
#include "combine_epilogue.h"
#include "combine_plan.h"
#include "error.h"

namespace moejit {
namespace {

constexpr int kBlockThreads = 128;         // the combine's block
constexpr int kShortRowScanThreads = 512;  // the single launch with several tokens per block
// Up to this many token slots (T * vectors per row) a larger call is mid-size: some geometries
// that win at prefill lose there.
constexpr int64_t kMidSlotsMax = int64_t{1} << 21;
// The single launch pays while its re-reading of token_idx (every block reads all of it) costs
// less than the list path's two extra launches: a few batches of loads per thread, and a re-read
// that L2 serves.
constexpr int64_t kScanMaxRowsPerThread = 24;
constexpr double kScanMaxBytes = 32.0 * (1 << 20);
// The token index's one-token kernel reads dropped rows too: only calls with few rows take it.
constexpr int64_t kOneTokenMaxRows = 64;
// The single launch keeps its tokens' lists in shared memory: at most this many bytes of them
// (static shared memory stops at 48 KB per block).
constexpr int kScanListBytes = 32 * 1024;
// Rows a single launch with several tokens per block holds: with 12 or 16 ptxas spilled there.
constexpr int kHeldInSharedBlocks = 8;

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Rows listed per token: four times the average or more, so that a routing whose counts vary at
// random (about Poisson(K) rows per token) overflows a list with probability under 1e-9 and stays
// off the heavy-token work that a token past its list takes (token_index_heavy.cuh).
constexpr int kLongestList = 128;
static_assert(kLongestList <= kPieceRows, "a token that fits its list is one piece");
int list_capacity(int64_t rows_per_token) {
  if (rows_per_token <= 2) return kMinListCapacity;
  if (rows_per_token <= 8) return 32;
  if (rows_per_token <= 16) return 64;
  return kLongestList;
}

// The token-index workspace's parts for a validated call with tokens, its lists included.
TokenIndexWorkspace token_index_parts(int64_t num_tokens, int64_t num_rows, int64_t hidden) {
  const int64_t cap = list_capacity((num_rows + num_tokens - 1) / num_tokens);
  return token_index_workspace(num_tokens, num_rows, hidden, cap);
}

// Token index: rows per token held (and sorted) in registers, the expected count rounded up to 1,
// 2, 4, 8, 12 or 16. A token with more takes extra rounds; holding more than a token has costs
// every thread. Twelve, not sixteen, for 9-12 rows: fewer registers, more blocks per SM.
int held_rows(int64_t rows_per_token) {
  if (rows_per_token <= 1) return 1;
  if (rows_per_token <= 2) return 2;
  if (rows_per_token <= 4) return 4;
  if (rows_per_token <= 8) return 8;
  if (rows_per_token <= 12) return 12;
  return 16;
}

// Blocks of token_index_heavy (kHeavyThreads each; its warps take work items until none is left):
// one per 128 rows, between one and kMaxHeavyBlocks. Without heavy tokens they only read a counter;
// with a hot token, that keeps about a warp per 16 of its rows streaming (several MB in flight).
constexpr int64_t kMaxHeavyBlocks = 512;
unsigned heavy_blocks(int64_t num_rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(num_rows / 128, kMaxHeavyBlocks)));
}

// The three sets of geometry rules: the fixed layouts' kernel, the token index's list path, its
// single launch.
enum class Path { kFixed, kLists, kSingle };

// Thread geometry (tpt, tpb, upt) for a spec whose shape and vector are set. The rules and why:
// the table above; the figures: docs/performance.md#geometry-within-a-variant.
void choose_geometry(KernelSpec* s, Path path, int64_t num_tokens) {
  const int slots = s->slots();
  const bool ti = path != Path::kFixed, single = path == Path::kSingle;
  const bool gather_map = s->layout() == MOEJIT_LAYOUT_GATHER_MAP;
  const int rows = ti ? s->held : s->top_k;
  s->upt = 1;
  if (slots >= kBlockThreads) {
    s->tpt = kBlockThreads;
    s->tpb = 1;
  } else {
    s->tpt = std::max(4, next_pow2(slots));
    s->tpb = kBlockThreads / s->tpt;
  }
  const bool decode = num_tokens >= 0 && num_tokens <= kDecodeMaxTokens;
  const bool up_to_mid =
      num_tokens >= 0 && num_tokens * static_cast<int64_t>(slots) <= kMidSlotsMax;
  // Fixed layouts, mid-size calls with K >= 8: a token's row spread over 16-slot groups, more
  // blocks in flight. Not at decode sizes, where the 128-thread blocks measured faster; nor where
  // a row is not a whole number of 128-byte lines (H = 1000 in 2-byte elements: rows of 2000
  // bytes), where each group's 256 bytes of a row share their end lines with the next group's,
  // which other blocks read at other times.
  const bool whole_lines = s->hidden * element_bytes(s->in_dtype) % 128 == 0;
  const bool mid_k8 = !ti && !decode && rows >= 8 && up_to_mid && whole_lines;
  // Token index at decode: one 64-thread group per block (fewer, larger blocks than 16x2), except
  // the single launch where a row fills 128 threads: its small-call form then has every warp read
  // up to 128 rows of token_idx with no barrier.
  const bool token_index_decode = ti && decode && !(single && slots >= kBlockThreads);
  if ((mid_k8 || token_index_decode) && slots > 32) {
    s->tpt = ti ? 64 : 16;
    // Gather map: eight groups per block. With most slots dropped (expert parallelism) 32-thread
    // blocks end faster than the SMs start new ones.
    s->tpb = ti ? 1 : gather_map ? 8 : 2;
  }
  // Token index with short lists: two slots per thread, so each block's routing round trip
  // carries twice the rows.
  if (ti && !decode && rows <= 4 && slots >= 2 * s->tpt) s->upt = 2;
  // Token index, list path: 64-thread groups (twice the blocks), except at prefill where whole
  // 128 x upt chunks tile the row: there 128 threads load their expert-ordered rows through L1.
  if (ti && !single && !decode && s->tpt == kBlockThreads &&
      (up_to_mid || slots % (kBlockThreads * s->upt) != 0))
    s->tpt = 64;
  // Single launch with short rows: 512-thread blocks, a quarter of the blocks re-reading
  // token_idx. Not at decode sizes, where the blocks are few anyway and 512 threads lost.
  if (single && !decode && s->tpb > 1) s->tpb = kShortRowScanThreads / s->tpt;
  // ... as many tokens as their shared-memory lists allow.
  while (single && s->tpb > 1 &&
         static_cast<int64_t>(s->tpb) * s->list_cap * static_cast<int64_t>(sizeof(int)) >
             kScanListBytes)
    s->tpb /= 2;
  // Fixed layouts with one row per token: two slots per thread (one 16-byte load in flight per
  // thread is too few).
  if (!ti && !decode && rows == 1 && slots >= 2 * s->tpt) s->upt = 2;
  // Gather map with two rows per token: four slots per thread where whole 512-slot chunks tile
  // the row (a partial chunk lost).
  if (gather_map && !ti && !decode && rows == 2 && slots % (4 * kBlockThreads) == 0) s->upt = 4;
  // Vectors of 4 bytes or less (rows whose starts allow no wider access: odd hidden sizes of
  // 2-byte elements, or of fp32): four slots per thread beyond decode sizes where a row fills
  // them, so that a thread keeps as many loads in flight as with 16-byte vectors (each load a
  // register whatever its width; the kernels' batches keep eight rows: BatchRows).
  if (!decode && s->vec * element_bytes(s->in_dtype) <= 4 && slots >= 4 * s->tpt) s->upt = 4;
}

// The list-path or fixed-layout spec for a shape whose vector width is known.
KernelSpec make_spec(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                     moejit_index_type index_type, int hidden, int rows_per_token, int vec,
                     int64_t num_tokens) {
  KernelSpec s;
  s.kind = layout == MOEJIT_LAYOUT_TOKEN_MAJOR  ? KernelKind::kTokenMajor
           : layout == MOEJIT_LAYOUT_GATHER_MAP ? KernelKind::kGatherMap
                                                : KernelKind::kTokenIndexLists;
  s.in_dtype = in_dtype;
  s.out_dtype = out_dtype;
  s.index_bytes =
      layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? 4 : (index_type == MOEJIT_INDEX_INT64 ? 8 : 4);
  s.hidden = hidden;
  s.vec = vec;
  if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
    s.held = held_rows(rows_per_token);
    s.list_cap = list_capacity(rows_per_token);
  } else {
    s.top_k = rows_per_token;
  }
  choose_geometry(&s, layout == MOEJIT_LAYOUT_TOKEN_INDEX ? Path::kLists : Path::kFixed,
                  num_tokens);
  finish_spec(&s);
  return s;
}

// Whether a token-index call of T tokens and R rows takes `single` rather than the list path.
bool single_launch_pays(const KernelSpec& single, int64_t num_tokens, int64_t num_rows) {
  const double blocks =
      static_cast<double>((num_tokens + single.tpb - 1) / single.tpb) * single.chunks();
  const int64_t rows_per_thread = (num_rows + single.block_threads() - 1) / single.block_threads();
  return rows_per_thread <= kScanMaxRowsPerThread &&
         blocks * static_cast<double>(num_rows) * single.index_bytes <= kScanMaxBytes;
}

}  // namespace

int choose_vec(int in_dtype, int out_dtype, int hidden, uintptr_t expert, int64_t expert_stride,
               uintptr_t out, int64_t out_stride) {
  const int in_b = element_bytes(in_dtype), out_b = element_bytes(out_dtype);
  int vec = 16 / std::max(in_b, out_b);
  while (vec > 1 && vec > hidden) vec /= 2;
  auto aligned = [&](int v) {
    const uint64_t ia = static_cast<uint64_t>(v) * in_b, oa = static_cast<uint64_t>(v) * out_b;
    return expert % ia == 0 && (static_cast<uint64_t>(expert_stride) * in_b) % ia == 0 &&
           out % oa == 0 && (static_cast<uint64_t>(out_stride) * out_b) % oa == 0;
  };
  while (vec > 1 && !aligned(vec)) vec /= 2;
  return vec;
}

void finish_spec(KernelSpec* s) {
  if (is_epilogue(s->kind)) {  // one launch grid of its own (plan_combine), rows streamed
    s->grid = Grid::kFlat;
    s->cached_rows = false;
    return;
  }
  const bool fixed = s->kind == KernelKind::kTokenMajor || s->kind == KernelKind::kGatherMap;
  const bool lists = s->kind == KernelKind::kTokenIndexLists;
  // A flat grid dispatches a token's chunks back to back: token-major then reads its K adjacent
  // rows as one stretch. The list path only with two or more rows held (one lost). The gather
  // map takes x by y up to mid-size calls (plan_combine) where a row has several chunks.
  if (s->kind == KernelKind::kGatherMap)
    s->grid = s->chunks() > 1 ? Grid::kFlatOrTokensByChunks : Grid::kFlat;
  else if (s->kind == KernelKind::kTokenMajor || s->kind == KernelKind::kGatherMapOneToken ||
           (lists && s->held >= 2))
    s->grid = Grid::kFlat;
  else
    s->grid = Grid::kTokensByChunks;
  // Row loads through L1 for whole 128-thread groups where every chunk of a row is full; rows
  // with a partial last chunk, smaller groups and the single launch stream past L1.
  s->cached_rows = (fixed || lists) && s->tpt >= kBlockThreads && s->chunks() > 0 &&
                   s->slots() % (s->tpt * s->upt) == 0;
}

std::string check_spec(const KernelSpec& s) {
  if (s.kind == KernelKind::kTokenIndexListHelpers) return "";
  const bool ordered = s.tpb == 1 && s.tpt % 32 == 0;
  if (s.kind == KernelKind::kTokenIndexSmallScan && !ordered)
    return "tpb = " + std::to_string(s.tpb) + ", tpt = " + std::to_string(s.tpt) + ": kind " +
           kind_name(s.kind) +
           " is one token per block in whole warps (tpb=1, tpt a multiple of 32)";
  if (s.kind == KernelKind::kTokenIndexScan &&
      static_cast<int64_t>(s.tpb) * s.list_cap * static_cast<int64_t>(sizeof(int)) > kScanListBytes)
    return "tpb = " + std::to_string(s.tpb) + " with cap = " + std::to_string(s.list_cap) +
           ": the block's lists take more than " + std::to_string(kScanListBytes) +
           " bytes of shared memory";
  if (keeps_lists(s.kind) && s.list_cap < s.held)
    return "cap = " + std::to_string(s.list_cap) + ": at least held = " + std::to_string(s.held);
  if (s.kind == KernelKind::kGatherMapOneToken && !fits_one_token_map(s))
    return "K = " + std::to_string(s.top_k) +
           ": a gather_map_one_token module holds all its rows at once: K * upt at most 8";
  if (is_epilogue(s.kind)) return check_epilogue_spec(s);
  return "";
}

KernelSpec list_helpers_spec(int index_bytes) {
  KernelSpec h;
  h.kind = KernelKind::kTokenIndexListHelpers;
  h.index_bytes = index_bytes;
  return h;
}

std::optional<KernelSpec> companion_module(const KernelSpec& spec) {
  if (!after_list_helpers(spec.kind)) return std::nullopt;
  return list_helpers_spec(spec.index_bytes);
}

size_t token_index_workspace_bytes(int64_t num_tokens, int64_t num_rows, int64_t hidden) {
  if (num_tokens == 0) return 0;
  return static_cast<size_t>(token_index_parts(num_tokens, num_rows, hidden).bytes);
}

KernelSpec spec_for_shape(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                          moejit_index_type index_type, int hidden, int rows_per_token,
                          size_t alignment_bytes, int64_t num_tokens) {
  const int vec =
      choose_vec(in_dtype, out_dtype, hidden, alignment_bytes, hidden, alignment_bytes, hidden);
  return make_spec(layout, in_dtype, out_dtype, index_type, hidden, rows_per_token, vec,
                   num_tokens);
}

KernelSpec single_launch_spec(const KernelSpec& list_spec, int64_t num_tokens) {
  KernelSpec s = list_spec;
  choose_geometry(&s, Path::kSingle, num_tokens);
  if (s.tpb > 1) s.held = std::min(s.held, kHeldInSharedBlocks);
  s.kind = KernelKind::kTokenIndexScan;
  finish_spec(&s);
  return s;
}

KernelSpec single_launch_for_rows(const KernelSpec& single, int64_t num_rows) {
  // One token per block in whole warps: each warp can read all of token_idx and list the token's
  // rows in order. Its list is a window of them, listed again past its end: twice the expected
  // count, at least 8 (shared memory slows a dependent launch after a producer that uses none).
  if (single.kind != KernelKind::kTokenIndexScan || single.tpb != 1 || single.tpt % 32 != 0 ||
      num_rows > single.block_threads())
    return single;
  KernelSpec s = single;
  s.kind = KernelKind::kTokenIndexSmallScan;
  s.list_cap = s.held <= 4 ? 8 : s.list_cap / 2;
  return s;
}

bool fits_one_token_map(const KernelSpec& spec) {
  return spec.top_k * spec.upt <= 8;  // the kernel's batch of rows in flight
}

// At K > 2 in 16-slot groups, two per block, where rows are longer than 32 slots (each thread
// stages K + 1 rows in shared memory); with one or two rows the decode blocks in 8-byte vectors
// where a row fills them (twice the blocks, half the adds per thread after the round trip).
KernelSpec one_token_map_spec(const KernelSpec& decode) {
  KernelSpec s = decode;
  s.kind = KernelKind::kGatherMapOneToken;
  if (s.top_k > 2 && s.slots() > 32) {
    s.tpt = 16;
    s.tpb = 2;
    s.upt = 1;
  } else if (s.top_k <= 2 && s.tpt == kBlockThreads && s.vec * element_bytes(s.in_dtype) == 16) {
    s.vec /= 2;
  }
  finish_spec(&s);
  return s;
}

// The decode geometry, except 128-thread blocks in narrower vectors where a row fills them: 8-byte
// vectors with one or two rows, 4-byte ones with eight or more rows of 2-byte elements (more
// blocks, fewer adds per thread after each round trip).
KernelSpec one_token_index_spec(const KernelSpec& decode) {
  KernelSpec s = decode;
  s.kind = KernelKind::kTokenIndexOneToken;
  s.list_cap = 0;
  finish_spec(&s);
  const int elem = element_bytes(s.in_dtype);
  if (s.vec * elem != 16) return s;  // only from the widest vectors
  int vector_bytes = 16;
  if (s.held <= 2)
    vector_bytes = 8;
  else if (s.held >= 8 && elem == 2)
    vector_bytes = 4;
  if (vector_bytes == 16) return s;
  KernelSpec narrow = s;
  narrow.vec = vector_bytes / elem;
  if (narrow.slots() < kBlockThreads) return s;  // a row must fill the blocks
  narrow.tpt = kBlockThreads;
  narrow.tpb = 1;
  narrow.upt = 1;
  finish_spec(&narrow);
  return narrow;
}

KernelSpec choose_kernel(const CallShape& c) {
  const bool token_index = c.layout == MOEJIT_LAYOUT_TOKEN_INDEX;
  const int64_t rows_per_token =
      token_index ? (c.num_rows + c.num_tokens - 1) / c.num_tokens : c.top_k;
  const KernelSpec base = make_spec(
      c.layout, c.in_dtype, c.out_dtype, c.index_type, c.hidden,
      static_cast<int>(std::min<int64_t>(rows_per_token, MOEJIT_MAX_TOP_K)), c.vec, c.num_tokens);
  if (has_epilogue(c)) return choose_epilogue_kernel(c, base);
  if (token_index) {
    if (c.num_tokens == 1 && c.num_rows <= kOneTokenMaxRows) return one_token_index_spec(base);
    const KernelSpec single = single_launch_spec(base, c.num_tokens);
    if (single_launch_pays(single, c.num_tokens, c.num_rows))
      return single_launch_for_rows(single, c.num_rows);
    return base;
  }
  if (c.layout == MOEJIT_LAYOUT_GATHER_MAP && c.num_tokens == 1 && c.num_rows <= c.top_k &&
      !c.dependent_launch) {
    const KernelSpec one = one_token_map_spec(base);
    if (fits_one_token_map(one)) return one;
  }
  return base;
}

std::vector<KernelSpec> specs_for_shape(moejit_layout layout, moejit_dtype in_dtype,
                                        moejit_dtype out_dtype, moejit_index_type index_type,
                                        int hidden, int rows_per_token, size_t alignment_bytes,
                                        int res_dtype, int weight_dtype) {
  CallShape c;
  c.layout = layout;
  c.in_dtype = in_dtype;
  c.out_dtype = out_dtype;
  c.index_type = layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? MOEJIT_INDEX_INT32 : index_type;
  c.hidden = hidden;
  c.vec = choose_vec(in_dtype, out_dtype, hidden, alignment_bytes, hidden, alignment_bytes, hidden);
  c.res_dtype = res_dtype;
  c.weight_dtype = weight_dtype;
  c.top_k = rows_per_token;
  const int64_t k = std::max(rows_per_token, 0);  // 0: token-index calls without rows
  std::vector<KernelSpec> specs;
  auto add = [&](const KernelSpec& s) {
    if (std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
  };
  auto take = [&](int64_t tokens, int64_t rows) {
    c.num_tokens = tokens;
    c.num_rows = rows;
    const KernelSpec s = choose_kernel(c);
    add(s);
    if (const std::optional<KernelSpec> before = companion_module(s)) add(*before);
  };
  if (has_epilogue(c)) {  // its choice reads T only (the rows per token are the shape's)
    c.vec = epilogue_vec(c.vec, hidden, res_dtype, alignment_bytes, hidden, weight_dtype,
                         alignment_bytes);
    for (const int64_t tokens : epilogue_token_counts()) take(tokens, tokens * k);
    return specs;
  }
  // The batch sizes of each geometry: prefill (past mid-size, and large enough that the single
  // launch no longer pays), one token, decode, mid-size. Within one, the choice between the
  // single launch and the lists is monotone in T and R (the single launch pays less the more there
  // are), so the fewest rows of its first T, the most of its last and the first call with more
  // rows than a single launch's block (past its small-call form) reach every module it has.
  const int64_t slots = (hidden + c.vec - 1) / c.vec;
  const int64_t mid_last = kMidSlotsMax / slots;
  const int64_t prefill_first = std::max(kDecodeMaxTokens + 1, mid_last + 1);
  const int64_t prefill = std::max(prefill_first, kScanMaxRowsPerThread * kShortRowScanThreads + 1);
  struct Range {
    int64_t first, last;
  };
  std::vector<Range> ranges{{prefill_first, prefill}, {1, 1}, {2, kDecodeMaxTokens}};
  if (mid_last > kDecodeMaxTokens) ranges.push_back({kDecodeMaxTokens + 1, mid_last});
  for (const Range& r : ranges) {
    take(r.last, r.last * k);                          // the most rows
    take(r.first, k > 0 ? r.first * (k - 1) + 1 : 0);  // the fewest
    if (layout != MOEJIT_LAYOUT_TOKEN_INDEX || r.first == r.last || k == 0) continue;
    const KernelSpec single =
        single_launch_spec(spec_for_shape(layout, in_dtype, out_dtype, index_type, hidden,
                                          rows_per_token, alignment_bytes, r.first),
                           r.first);
    const int64_t past_block = single.block_threads() + 1;
    const int64_t tokens = std::max(r.first, single.block_threads() / k + 1);
    if (tokens <= r.last) take(tokens, std::max(tokens * (k - 1) + 1, past_block));
  }
  return specs;
}

size_t combine_workspace_bytes(const moejit_combine_args* args) {
  const moejit_combine_args a = validated_shape(args);
  return a.layout == MOEJIT_LAYOUT_TOKEN_INDEX
             ? token_index_workspace_bytes(a.num_tokens, a.num_rows, a.hidden_dim)
             : 0;
}

CombinePlan plan_combine(const moejit_combine_args* args) {
  const moejit_combine_args a = validated_shape(args);
  const bool token_index = a.layout == MOEJIT_LAYOUT_TOKEN_INDEX;
  const TokenIndexWorkspace parts = token_index && a.num_tokens > 0
                                        ? token_index_parts(a.num_tokens, a.num_rows, a.hidden_dim)
                                        : TokenIndexWorkspace{};
  check_buffers(a, static_cast<size_t>(parts.bytes));
  CombinePlan plan;
  if (a.num_tokens == 0) {
    plan.nothing_to_do = true;
    return plan;
  }
  CallShape call;
  call.layout = static_cast<moejit_layout>(a.layout);
  call.in_dtype = static_cast<moejit_dtype>(a.expert_dtype);
  call.out_dtype = static_cast<moejit_dtype>(a.out_dtype);
  call.index_type = static_cast<moejit_index_type>(a.index_type);
  call.hidden = static_cast<int>(a.hidden_dim);
  call.vec = choose_vec(a.expert_dtype, a.out_dtype, call.hidden,
                        reinterpret_cast<uintptr_t>(a.expert_hidden), a.expert_row_stride,
                        reinterpret_cast<uintptr_t>(a.out), a.out_row_stride);
  call.res_dtype = a.residual != nullptr ? static_cast<int>(a.residual_dtype) : -1;
  call.weight_dtype = a.norm_weight != nullptr ? static_cast<int>(a.norm_weight_dtype) : -1;
  if (has_epilogue(call))
    call.vec = epilogue_vec(call.vec, call.hidden, call.res_dtype,
                            reinterpret_cast<uintptr_t>(a.residual), a.residual_row_stride,
                            call.weight_dtype, reinterpret_cast<uintptr_t>(a.norm_weight));
  call.num_tokens = a.num_tokens;
  call.num_rows = a.num_rows;
  call.top_k = static_cast<int>(a.top_k);
  call.dependent_launch = a.dependent_launch != 0;
  const KernelSpec& s = plan.spec = choose_kernel(call);

  CombineParams& p = plan.params;
  p.expert = a.expert_hidden;
  p.gates = a.gates;
  p.indices = a.indices;
  p.out = a.out;
  p.expert_stride = a.expert_row_stride;
  p.out_stride = a.out_row_stride;
  p.num_tokens = a.num_tokens;
  p.num_rows = a.num_rows;
  p.scale = a.scale;
  p.accumulate = a.accumulate;
  p.dependent_launch = a.dependent_launch;  // the first kernel prefetches and waits only then
  p.list_capacity = s.list_cap;             // of the module chosen (0: no list)
  p.residual = a.residual;
  p.norm_weight = a.norm_weight;
  p.out_scales = a.out_scales;
  p.residual_stride = a.residual_row_stride;
  p.norm_eps = a.norm_eps;
  p.scales_layout = a.out_scales_layout;
  p.scales_pow2 = a.out_scales_pow2;
  if (token_index) {
    char* ws = static_cast<char*>(a.workspace);
    p.token_counts = reinterpret_cast<int*>(ws);
    // The counts first (the list helpers find the heavy tokens' counters from T alone), the lists
    // last (token_index_workspace.h).
    p.token_rows = reinterpret_cast<int*>(ws + parts.lists);
    auto helper_blocks = [](int64_t n) {
      return static_cast<unsigned>(std::max<int64_t>(
          1, std::min<int64_t>((n + kHelperThreads - 1) / kHelperThreads, kMaxHelperBlocks)));
    };
    plan.clear_blocks = helper_blocks(a.num_tokens);
    plan.assign_blocks = helper_blocks(a.num_rows);
    plan.heavy_blocks = heavy_blocks(a.num_rows);
  }

  // Grid x: token groups (at most 2^31 - 1). Grid y: chunks per row, at most 65536 / 4 (hidden
  // <= MOEJIT_MAX_HIDDEN_DIM, >= 4 slots per chunk), under the 65535 limit.
  const int64_t groups = (a.num_tokens + s.tpb - 1) / s.tpb;
  if (groups > INT32_MAX)
    throw Error(MOEJIT_ERROR_UNSUPPORTED,
                "args->num_tokens = " + std::to_string(a.num_tokens) + " needs " +
                    std::to_string(groups) +
                    " token groups, more than one launch allows (2^31 - 1): split the batch");
  plan.combine_grid_x = static_cast<unsigned>(groups);
  plan.combine_grid_y = static_cast<unsigned>(s.chunks());
  if (is_epilogue(s.kind)) {
    // A token group per block; the split kernel a block per slice (T <= kDecodeMaxTokens), its
    // one-block kernel a block per token.
    plan.combine_grid_y = 1;
    if (is_cluster_epilogue(s.kind)) {
      plan.combine_grid_x = static_cast<unsigned>(groups * s.split);
      plan.one_block_grid_x = static_cast<unsigned>(groups);
      plan.cluster_blocks = needs_cluster(s) ? static_cast<unsigned>(s.split) : 0;
    }
    return plan;
  }
  // The gather map takes x by y up to mid-size calls: the blocks running together read
  // different tokens' rows at the same offset.
  const bool flat =
      s.grid == Grid::kFlat || (s.grid == Grid::kFlatOrTokensByChunks &&
                                a.num_tokens * static_cast<int64_t>(s.slots()) > kMidSlotsMax);
  if (flat) {
    const int64_t blocks = groups * s.chunks();
    if (blocks > INT32_MAX)
      throw Error(MOEJIT_ERROR_UNSUPPORTED,
                  "args->num_tokens = " + std::to_string(a.num_tokens) + " with hidden_dim = " +
                      std::to_string(a.hidden_dim) + " needs " + std::to_string(blocks) +
                      " blocks, more than one launch allows (2^31 - 1): split the batch");
    plan.combine_grid_x = static_cast<unsigned>(blocks);
    plan.combine_grid_y = 1;
  }
  return plan;
}

}  // namespace moejit
