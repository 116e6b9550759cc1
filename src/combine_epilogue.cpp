// The epilogue's rows of the kernel-choice table. A call with a residual, a norm weight or an fp8
// out takes one of two variants per layout (the norm needs a token's whole row, so a token's
// slices always end up in blocks that can meet):
//
//   <layout>_epilogue          T > kDecodeMaxTokens, or rows too short to split
//                              a token's row in one block (or TPT threads of one), held in
//                              registers; rows too long for them in SPLIT slices one after another
//                              (the normed pass reads the row back from L2)
//   <layout>_epilogue_cluster  T <= kDecodeMaxTokens and the row splits into 2+ slices
//                              a token's SPLIT slices on SPLIT blocks: a thread-block cluster
//                              exchanging the sum of squares through distributed shared memory
//                              (sm_90+); its module also holds the one-block kernel, which GPUs
//                              without clusters launch. Without a norm, no cluster: plain blocks.
//   The token index's are launched after the list helpers and the module's token_index_heavy
//   (its rows from the per-token lists, a token past its list from token_index_heavy's pieces).
//
// Geometry (vec: the widest vector every buffer allows; slots = vectors per row; a 128-channel fp8
// group is 128 / vec slots, and every slice is whole groups and whole warps: slices are multiples
// of max(32, 128 / vec) slots):
//   - rows of fewer than 32 slots: one slot per thread, groups of the row's slots rounded up to a
//     power of two (at least 4), 128-thread blocks of several tokens.
//   - otherwise up to 32 fp32 values (16 with fp8 output but for a token-index row that would then
//     take two passes) and 8 slots per thread (half of each in groups of more than 256 threads),
//     tpt the row's slots over upt rounded up to whole slices' alignment; past 512 threads the row
//     takes several slices (passes). 32-thread groups share a block four to one.
//   - decode (T <= kDecodeMaxTokens): the row split into about 128 / T slices (8 at most, a power
//     of two: the portable cluster size), each in one block of up to 512 threads holding up to 32
//     values each (else one block per token, with passes).
// Figures: docs/performance.md#epilogue.
#include "combine_epilogue.h"

#include <algorithm>

#include "combine_args.h"

namespace moejit {
namespace {

// A thread's slice in registers: at most this many slots and fp32 values, and half of each in
// blocks of more than kWideBlock threads (ptxas has 128 registers per thread there at most; a
// sweep of the modules spilled at 32 values in 512-thread blocks, at 32 one-element slots, and
// at 8 slots of the token index in 448-thread blocks).
constexpr int kValuesPerThread = 32;
// With fp8 output, in the one-block kernel, half of that: twice the warps per row hide the
// quantization's instruction chain (group maxima, the scale's division, the conversion). Not where
// it takes a token-index row to a second pass, which lists and sorts the token's rows again
// (docs/performance.md#epilogue).
constexpr int kFp8ValuesPerThread = 16;
constexpr int kMaxSlotsPerThread = 8;
constexpr int kWideBlock = 256;
constexpr int kMaxRowThreads = 512;   // threads per token group before the row takes passes
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size
// Decode: blocks over the batch's tokens the slices aim for (about one wave of a 132-SM GPU).
constexpr int64_t kDecodeBlocks = 128;
constexpr int kGroupChannels = 128;  // channels per fp8 scale

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
int round_up(int64_t a, int b) {
  return static_cast<int>(ceil_div(a, b) * b);
}
int next_pow2(int64_t x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Slices are whole warps and whole fp8 groups (128 / vec slots).
int slice_alignment(const KernelSpec& s) {
  return std::max(32, kGroupChannels / s.vec);
}

KernelKind row_kind(int layout) {
  return layout == MOEJIT_LAYOUT_TOKEN_MAJOR  ? KernelKind::kEpilogueTokenMajor
         : layout == MOEJIT_LAYOUT_GATHER_MAP ? KernelKind::kEpilogueGatherMap
                                              : KernelKind::kEpilogueTokenIndex;
}

KernelKind cluster_kind(int layout) {
  return layout == MOEJIT_LAYOUT_TOKEN_MAJOR  ? KernelKind::kEpilogueClusterTokenMajor
         : layout == MOEJIT_LAYOUT_GATHER_MAP ? KernelKind::kEpilogueClusterGatherMap
                                              : KernelKind::kEpilogueClusterTokenIndex;
}

// Slots a thread of a tpt-thread group may hold (at least one), of at most `values` fp32 values.
int max_upt(const KernelSpec& s, int tpt, int values = kValuesPerThread) {
  const int wide = tpt > kWideBlock ? 2 : 1;
  return std::max(1, std::min(kMaxSlotsPerThread / wide, values / wide / s.vec));
}

// A token's row in one block (or TPT threads of one), `values` fp32 values per thread at most.
void row_geometry(KernelSpec* s, int values) {
  const int slots = s->slots();
  s->split = 1;
  if (slots < 32) {
    s->tpt = std::max(4, next_pow2(slots));
    s->tpb = 128 / s->tpt;
    s->upt = 1;
    return;
  }
  const int align = slice_alignment(*s);
  s->upt = static_cast<int>(std::min<int64_t>(max_upt(*s, align, values), ceil_div(slots, align)));
  s->tpt = round_up(ceil_div(slots, s->upt), align);
  if (s->upt > max_upt(*s, s->tpt, values)) {  // a wide block: fewer slots each
    s->upt = max_upt(*s, s->tpt, values);
    s->tpt = round_up(ceil_div(slots, s->upt), align);
  }
  if (s->tpt > kMaxRowThreads) {
    s->split = static_cast<int>(ceil_div(slots, int64_t{kMaxRowThreads} * s->upt));
    s->tpt = round_up(ceil_div(slots, int64_t{s->split} * s->upt), align);
  }
  s->tpb = s->tpt == 32 && s->split == 1 ? 4 : 1;
}

// The one-block kernel's geometry (see kFp8ValuesPerThread).
void row_geometry(KernelSpec* s) {
  const bool fp8 = s->out_dtype == MOEJIT_DTYPE_FLOAT8_E4M3;
  row_geometry(s, fp8 ? kFp8ValuesPerThread : kValuesPerThread);
  if (fp8 && s->split > 1 && s->token_index()) row_geometry(s, kValuesPerThread);
}

// The decode split of a row over num_tokens tokens: false where it would be one slice.
bool cluster_geometry(KernelSpec* s, int64_t num_tokens) {
  int target = 1;
  while (target * 2 <= kMaxClusterBlocks && target * 2 * num_tokens <= kDecodeBlocks) target *= 2;
  const int slots = s->slots(), align = slice_alignment(*s);
  const int slice = round_up(ceil_div(slots, target), align);
  s->upt = static_cast<int>(ceil_div(slice, kMaxRowThreads));
  s->tpt = round_up(ceil_div(slice, s->upt), align);
  s->tpb = 1;
  s->split = static_cast<int>(ceil_div(slots, int64_t{s->tpt} * s->upt));
  // A slice too long for registers: the one-block variant's passes instead.
  return s->split >= 2 && s->upt <= max_upt(*s, s->tpt);
}

}  // namespace

bool has_epilogue(const CallShape& c) {
  return c.res_dtype >= 0 || c.weight_dtype >= 0 || c.out_dtype == MOEJIT_DTYPE_FLOAT8_E4M3;
}

KernelSpec choose_epilogue_kernel(const CallShape& c, const KernelSpec& base) {
  KernelSpec s;
  s.in_dtype = base.in_dtype;
  s.out_dtype = base.out_dtype;
  s.index_bytes = base.index_bytes;
  s.hidden = base.hidden;
  s.vec = base.vec;
  s.top_k = base.top_k;
  s.held = base.held;
  s.list_cap = base.list_cap;
  s.res_dtype = c.res_dtype;
  s.weight_dtype = c.weight_dtype;
  s.kind = cluster_kind(c.layout);
  if (c.num_tokens < 0 || c.num_tokens > kDecodeMaxTokens || !cluster_geometry(&s, c.num_tokens)) {
    s.kind = row_kind(c.layout);
    row_geometry(&s);
  }
  finish_spec(&s);
  return s;
}

std::string check_epilogue_spec(const KernelSpec& s) {
  const int slots = s.slots(), group_slots = kGroupChannels / s.vec;
  const std::string at = "tpt = " + std::to_string(s.tpt) + ", tpb = " + std::to_string(s.tpb) +
                         ", upt = " + std::to_string(s.upt) +
                         ", split = " + std::to_string(s.split) + ": ";
  if (s.res_dtype < 0 && s.weight_dtype < 0 && s.out_dtype != MOEJIT_DTYPE_FLOAT8_E4M3)
    return std::string("res = none, weight = none, out = ") + dtype_name(s.out_dtype) +
           ": an epilogue kind has a residual, a norm weight or an fp8 out";
  if (s.tpt <= 32 ? (s.tpt & (s.tpt - 1)) != 0 : s.tpt % 32 != 0)
    return at + "up to 32 threads per token are a power of two, more are whole warps";
  if ((s.tpt > 32 || s.split > 1) && s.tpb != 1)
    return at + "one token per block where its warps meet (tpt > 32 or split > 1)";
  if (int64_t{s.split} * s.tpt * s.upt < slots)
    return at + "the slices do not cover the row's " + std::to_string(slots) + " slots";
  if (s.tpt < group_slots ? (s.upt != 1 || s.split != 1) : s.tpt % group_slots != 0)
    return at + "the 128-channel groups (" + std::to_string(group_slots) +
           " slots) must lie in a slot column of tpt threads, or be the whole row";
  if (is_cluster_epilogue(s.kind) && (s.tpb != 1 || s.tpt < 32))
    return at + "the cluster kind is one token slice per block of whole warps";
  return "";
}

int epilogue_vec(int vec, int hidden, int res_dtype, uintptr_t residual, int64_t residual_stride,
                 int weight_dtype, uintptr_t weight) {
  auto fits = [&](int v) {
    for (int d : {res_dtype, weight_dtype})
      if (d >= 0 && v * element_bytes(d) > 16) return false;
    if (res_dtype >= 0) {
      const uint64_t bytes = static_cast<uint64_t>(v) * element_bytes(res_dtype);
      if (residual % bytes != 0 ||
          (static_cast<uint64_t>(residual_stride) * element_bytes(res_dtype)) % bytes != 0)
        return false;
    }
    return weight_dtype < 0 ||
           weight % (static_cast<uint64_t>(v) * element_bytes(weight_dtype)) == 0;
  };
  while (vec > 1 && (vec > hidden || !fits(vec))) vec /= 2;
  return vec;
}

bool needs_cluster(const KernelSpec& spec) {
  return is_cluster_epilogue(spec.kind) && spec.weight_dtype >= 0;
}

std::vector<int64_t> epilogue_token_counts() {
  // Every decode batch size (cluster_geometry's split depends on T; 64 plans cost nothing), and
  // the first past decode (the one-block variant, whatever the batch size).
  std::vector<int64_t> counts;
  for (int64_t t = 1; t <= kDecodeMaxTokens; ++t) counts.push_back(t);
  counts.push_back(kDecodeMaxTokens + 1);
  return counts;
}

}  // namespace moejit
