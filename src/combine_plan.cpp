#include "combine_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "c_enum.h"
#include "driver.h"
#include "error.h"

namespace moejit {
namespace {

constexpr int kBlockThreads = 128;         // combine block size
constexpr int kShortRowScanThreads = 512;  // token-index single launch, rows shorter than a block
constexpr int kHelperThreads = 256;        // token-index clear / assign
constexpr unsigned kMaxHelperBlocks = 4096;
constexpr int64_t kMaxRows = INT32_MAX;  // token-index lists store row ids as int32
// Token-index single launch with several tokens per block: the most bytes of row lists it keeps in
// shared memory (choose_geometry). Static shared memory stops at 48 KB per block.
constexpr int kScanListBytes = 32 * 1024;
// MOEJIT_MAX_NUM_TOKENS (2^40): far beyond what one launch takes (2^31 - 1 token groups, at most
// 32 tokens each), and small enough that no size computed from it (slots, lists, workspace bytes)
// can overflow 64 bits.
constexpr int64_t kMaxTokens = MOEJIT_MAX_NUM_TOKENS;
// No buffer's extent in bytes (rows x row stride x element size) may exceed this: device
// addresses have at most 57 bits, and the kernels form row offsets in 64-bit arithmetic that
// must not wrap.
constexpr int64_t kMaxExtentBytes = int64_t{1} << 62;
// Token index, small calls: every block scans all of token_idx for its own tokens (one launch,
// combine_scan) instead of the list path's clear and assign launches, while that re-reading stays
// cheaper than those launches: each thread reads at most kScanMaxRowsPerThread entries (a few
// batches of independent loads) and all blocks together at most kScanMaxBytes (from L2). On the
// H200: T=1536 K=2 H=128 fp32 (5 MB re-read) 8.6 us in one launch vs 9.7 through the lists,
// T=256 K=8 H=7168 (15 MB) 16.1 vs 17.9; T=512 K=8 (58 MB) 31.4 vs 26.4, T=2048 K=2 H=4096
// (64 MB) 32.8 vs 22.9. Entries per thread, A B B A x 2 (tools/bench/NOTES.md, version 18), us,
// one launch vs the lists: 32 lost (T=1024 K=4 H=2880 17.86 vs 15.26, T=512 K=8 H=4096 19.6 vs
// 18.9), 24 and 20 mostly won (T=384 K=8 H=4096 15.8 vs 16.6, T=1280 K=2 H=4096 16.2 vs 17.0,
// T=320 K=8 H=7168 18.4 vs 18.5; T=768 K=4 H=2880 14.6 vs 14.3). Short rows in 512-thread blocks
// (version 22) agree: 24 wins or is within 3% (T=3072 K=4 H=128 fp32 10.7 vs 11.2, T=6144 K=2
// 11.6 vs 11.3), 32 loses (T=8192 K=2 14.8 vs 12.0).
constexpr int64_t kScanMaxRowsPerThread = 24;
constexpr double kScanMaxBytes = 32.0 * (1 << 20);
// Token index, one token (single-sequence decode): combine_one_token loads every row with its
// token_idx entry instead of scanning first (one round trip instead of two). It reads the dropped
// rows too, so only calls with few rows take it; more go through the scan.
constexpr int64_t kOneTokenMaxRows = 64;

int element_bytes(int dtype) {
  return dtype == MOEJIT_DTYPE_FLOAT32 ? 4 : 2;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Rows listed per token (the workspace lists of the list path, the single launch's lists in shared
// memory): four times the average or more, so that a routing whose counts vary at random, not only
// one with exactly K rows per token, stays on the listed paths. A token past its list takes the
// slowest path, a walk of all of token_idx (combine.cuh, add_rows_by_walk): on the H200 with every
// row's token drawn uniformly (about Poisson(K) rows per token), lists of twice the average
// overflowed for a few tokens per call and took T = 4096, K = 8 from 135 us to 2.8 ms, T = 8192,
// K = 2 from 58 us to 1.5 ms, T = 384, K = 8 (single launch) from 20 to 188 us. At four times the
// average a token overflows with probability under 1e-9 for K = 1..8 (Poisson tails). The cost is
// workspace (T * cap * 4 bytes: 512 KB at T = 4096, K = 8; balanced calls at K <= 4 0.3-0.6%
// slower, K = 8 level) and a longer shared list in the single launch's slab form (656 bytes of
// shared memory at K = 8; its calls, dependent ones too, level): not registers or code (NOTES,
// version 34). Since version 35 the walk is shorter: whole warps walk 32 entries per step
// (add_rows_by_warp_walk; T = 4096, K = 8 with 64 rows on one token 2.9 ms -> 452 us), and the
// slab form lists the token's rows again a list at a time (relist_slab_window).
int list_capacity(int64_t rows_per_token) {
  if (rows_per_token <= 2) return 16;
  if (rows_per_token <= 8) return 32;
  if (rows_per_token <= 16) return 64;
  return 128;
}

// Token index: rows per token the combine holds (and sorts) in registers, the expected count
// rounded up to 1, 2, 4, 8, 12 or 16 (KernelSpec::top_k). A token with more takes extra rounds;
// holding more than a token has costs every thread (8 held: 35% slower at K=1, 8% at K=2, on the
// H200). With more than eight rows per token, 16 held (combine.cuh, kWideBatch) in one batch: with
// eight held, the rest took the slow paths, and T4096 K9 H7168 ran 34% behind the gather map, K10
// H2048 29%, K16 H4096 45%. On the H200 in interleaved rounds against eight held
// (tools/bench/NOTES.md, version 42): T4096 K9 / K10 / K16 4.1% / 9.8% / 37.8% faster, T1 10-13.5%,
// T64 K9 / K10 3.4% / 7.6%, T64 K16 1.5% slower; those modules take about 45% longer to compile
// (the 16-entry sort). Twelve held for 9-12: the held arrays' registers (80 against 110 at sixteen,
// six 128-thread blocks per SM instead of four) put more of those rows in flight: against sixteen
// held, T4096 K9 H7168 21.7% faster, K10 H2048 9.5%, K12 H4096 4.2%, T64 level to 2% (version 42).
int held_rows(int64_t rows_per_token) {
  if (rows_per_token <= 1) return 1;
  if (rows_per_token <= 2) return 2;
  if (rows_per_token <= 4) return 4;
  if (rows_per_token <= 8) return 8;
  if (rows_per_token <= 12) return 12;
  return 16;
}

// Token-index workspace: counts [T] (padded to 256 bytes), then row ids [T * cap].
size_t counts_bytes(int64_t tokens) {
  return (static_cast<size_t>(tokens) * sizeof(int) + 255) / 256 * 256;
}

// Up to this many tokens a call is decode-sized: latency, not bandwidth, decides.
constexpr int64_t kDecodeMaxTokens = 64;
// Up to this many token slots (T * vectors per row) a larger call is mid-size: some geometries
// that win at prefill lose there (choose_geometry).
constexpr int64_t kMidSlotsMax = int64_t{1} << 21;

// The gather map up to mid-size calls (T * vectors per row <= kMidSlotsMax) runs on the 2-D grid
// (x the token groups, y the chunks: the blocks running together read different tokens' rows at
// the same offset), not on the 1-D grid with a token's chunks adjacent that its prefill calls and
// the other fixed layouts take (combine.cuh, kOneDimGrid; the kernel reads which from gridDim.y).
// On the H200, in interleaved rounds against the 1-D grid (tools/bench/NOTES.md, version 39; two
// runs): T = 64 with K = 2 and 8 0-1.2% faster, T = 4-32 level; T = 128-1024 at K = 8 H = 7168
// 0.9-1.7% faster, T = 1024 K = 4 H = 2880 level to 1.5%, K = 8 H = 2048 level to 0.4% slower; at
// prefill it is 1.2-1.6% slower. Token-major measured level to 2% either way at decode sizes and
// slower at mid-size: it keeps the 1-D grid.
bool gather_map_two_dim_grid(const KernelSpec& s, int64_t num_tokens) {
  return s.layout == MOEJIT_LAYOUT_GATHER_MAP && !s.one_token && num_tokens >= 0 &&
         num_tokens * static_cast<int64_t>(s.slots()) <= kMidSlotsMax;
}

// Thread geometry, from the H200 sweeps (tools/bench/NOTES.md): one vector slot per thread and
// 128-thread blocks for bandwidth; short rows share a block between several tokens. The fixed
// layouts keep those blocks at decode sizes too, and spread a token's row over 16-slot token
// groups, two per 32-thread block, only for mid-size calls with eight or more rows per token (see
// below); the gather map's one-token kernel keeps 16x2 at K > 2 (one_token_map_spec). The token
// index takes one 64-thread group per block for its list path and one-token kernel at decode
// (fewer, larger blocks measured 2-7% faster than 16x2 at T = 1, 32 and 64; the one-token kernel
// takes 128 in narrower vectors with few or many rows: one_token_index_spec), and at larger calls
// too (see below); its single launch keeps the 128-thread blocks (see below).
void choose_geometry(KernelSpec* s, int64_t num_tokens) {
  const int slots = s->slots();
  s->upt = 1;
  if (slots >= kBlockThreads) {
    s->tpt = kBlockThreads;
    s->tpb = 1;
  } else {
    s->tpt = std::max(4, next_pow2(slots));
    s->tpb = kBlockThreads / s->tpt;
  }
  const bool decode = num_tokens >= 0 && num_tokens <= kDecodeMaxTokens;
  // Fixed layouts with K >= 8 take 16x2 blocks for mid-size calls (T = 65 up to T * slots <= 2^21:
  // T = 2048 at H = 7168 bf16, T = 4096 at H = 4096). On the H200, A B B A x 2, 16x2 against 128x1
  // blocks: 6-9% faster at T = 256-1024 with H = 7168 and T = 512 with H = 2048, 2.3% / 0.8%
  // (token-major / gather map) at T = 4096 H = 4096; past the limit 128x1 wins (T = 4096 H = 7168:
  // level / 1.2%, T = 16384 H = 2048: 0.8% / 1.2%). Fewer rows per token (K <= 4) measured level to
  // worse.
  //
  // Not at decode sizes (T <= 64), where they took 16x2 until version 38 at K > 2 (the decode and
  // mid-size calls shared a module). Timed in interleaved rounds, one output buffer, the two forms
  // in one process (tools/bench/NOTES.md, version 38; 1000 rounds, 95% intervals), 128x1 against
  // 16x2: gather map T8 / T24 / T32 / T64 K8 H7168 2.3 / 2.0 / 2.4 / 1.2% faster, T16 / T64 K4
  // H2880 2.8 / 2.3%, T4 K8 3.5%, T32 K8 H4096 1.1%; token-major level to 1.4% faster; T1-T2
  // level. Block medians had called them level (0-0.15 us, version 11): every other flushed run
  // is 0.6-0.75 us slower, and a median falls anywhere between. The decode spec at K > 2 is now the
  // prefill spec: no module is added, and at K < 8 one fewer.
  const bool up_to_mid =
      num_tokens >= 0 && num_tokens * static_cast<int64_t>(slots) <= kMidSlotsMax;
  const bool mid_k8 = !s->token_index() && !decode && s->top_k >= 8 && up_to_mid;
  // Token index, single launch (2-64 tokens at decode; one token with more rows than the one-token
  // kernel takes): the 128-thread blocks where a row fills them, as for mid-size calls. Up to 128
  // rows, each of the four warps then reads all of token_idx and keeps its own list (no barrier,
  // no merge of slabs); in 64-thread blocks that stops at 64 rows. On the H200 against 64x1, A B B
  // A x 2, medians of four runs, us: T64 K2 H4096 6.40 -> 6.11, T48 K2 H2048 fp32 6.24 -> 6.04,
  // T16 K8 H2048 fp16 6.34 -> 6.10, T64 K8 H7168 9.27 -> 9.17; T = 2-32 at K = 2-8 and T64 K1
  // level (within 0.05 us). With eight rows per token the decode and mid-size calls then share
  // one single-launch module; the one-token kernel keeps the 64-thread blocks (no better in 128
  // at 16-byte vectors; one_token_index_spec).
  const bool scan_block = s->scan && slots >= kBlockThreads;
  const bool token_index_decode = s->token_index() && decode && !scan_block;
  if ((mid_k8 || token_index_decode) && slots > 32) {
    s->tpt = s->token_index() ? 64 : 16;
    // Groups per block: one for the token index, two for token-major, eight for the gather map
    // (128-thread blocks, a quarter of the blocks for the same work per thread). Where most slots
    // are dropped (-1: capacity-factor routing, or a rank's partial combine under expert
    // parallelism, 7 of 8 slots elsewhere at EP = 8) a 32-thread block has almost nothing to do:
    // Nsight Compute had T4096 K8 H4096 at 87.5% dropped at 20% achieved occupancy (44% with every
    // slot routed) and 24% of DRAM bandwidth, half a same-size copy's speed, the blocks ending
    // faster than the SMs started new ones. On the H200 (tools/bench/NOTES.md, version 51;
    // moejit-bench, medians of two to four runs), 16x8 against 16x2 at 87.5% dropped: 27-31% faster
    // from 2^20 token slots on (T1200-2048 H7168, T2048-4096 H4096, T4096 H3584, T4096-8192 H2048),
    // 7-27% below (T256, T1024 H7168, T512 H2048, T1024 H4096). At T1024 H7168 that is 22.1 -> 16.1
    // us, where Triton's gather takes 15.9 (level with 16x8 in peers.py's paired rounds). With
    // every slot routed level from 2^20 slots on (-0.8% to +0.4%) and 0.8-1.2% slower below
    // (T256, T1024 H7168: fewer, larger blocks leave a longer tail), still 2.4-6.1% ahead of
    // Triton there. Token-major has no dropped slots and keeps 16x2. (In 128 threads the kernel
    // takes the fixed layouts' launch bounds, eight blocks per SM: 56 registers at K = 8, no
    // spill.)
    s->tpb = s->token_index() ? 1 : s->layout == MOEJIT_LAYOUT_GATHER_MAP ? 8 : 2;
  }
  // Token index with short lists (<= 4 rows per token on average): two slots per thread, so
  // each block's routing round trip (count and list, then rows and gates) carries twice the rows.
  if (s->token_index() && !decode && s->top_k <= 4 && slots >= 2 * s->tpt) s->upt = 2;
  // Token index, list path at prefill: 64-thread blocks where a row fills 128 threads, as at decode
  // (twice the blocks, half the work each). Swept on the 1-D grid, H200, A B B A x 2, all shapes,
  // us: K1 H5120 31.07 -> 30.43 (a 640-slot row in five 128-slot chunks, not 2.5 of 256), K2 bf16
  // 60.21 -> 59.95, K2 fp32 109.36 -> 108.95, K4 H2880 and K8 H3584 0.25% faster, the other shapes
  // level; 64 x 2 blocks measured the same, 256 x 1 up to 11% slower. With eight rows per token
  // (one slot per thread) mid-size and decode calls then share one list module. The single launch
  // keeps 128 threads: every block scans all of token_idx, and with twice the blocks mid-size
  // calls were 4-9% slower (T = 65-256 at K = 8, T = 512-1024 at K = 2, T = 256 at K = 4).
  //
  // Except at the largest calls (T * slots > 2^21, or T unknown: the prefill spec), where every
  // 128 x upt chunk of a row is full: there the 128-thread blocks stay and load their rows through
  // L1, as the fixed layouts do (combine.cuh, kCachedRowLoads). The rows arrive in expert order,
  // scattered over the buffer, and the streaming loads lost more to that than the gather map's
  // L1-allocating ones (bench rows in token order: the token index's combine alone 0.5 us behind
  // the gather map at T4096 K8 H7168, shuffled 2.6 us). On the H200, A B B A x 2 against 64 x 1
  // streaming (tools/bench/NOTES.md, version 24), us: T8192 K2 fp32 108.54 -> 104.70, T4096 K2
  // fp32 59.21 -> 57.58, T8192 K2 bf16 59.90 -> 59.02, T4096 K8 H7168 138.02 -> 136.41, T16384 K8
  // H2048 158.09 -> 156.90, T4096 K4 H6144 level; at or under the limit it lost (T2048 K8 H7168
  // +1.2%, T8192 K8 H2048 +1.3%, T2048 K4 H6144 +2.0%, T512 K8 H7168 +6.5%), as the fixed layouts'
  // 128-thread blocks lose to their mid-size 16x2 blocks there (mid_k8 above).
  if (s->token_index() && !s->scan && !decode && s->tpt == kBlockThreads &&
      (up_to_mid || slots % (kBlockThreads * s->upt) != 0))
    s->tpt = 64;
  // Token index, single launch with short rows (several tokens per block): 512-thread blocks, four
  // times the tokens per block. Every block reads all of token_idx, so a quarter of the blocks
  // re-read a quarter of the bytes from L2, and more calls stay within the scan's limits. On the
  // H200, A B C D D C B A x 2 with 32-slot rows (H=128 fp32), 128 / 256 / 512 / 1024 threads,
  // medians of four, us: T1536 K2 8.82 / 7.64 / 7.14 / 7.50 (the gather map 5.9-6.1), T768 K4
  // 8.18 / 7.65 / 7.15 / 7.56, T3072 K1 9.02 / 7.78 / 7.29 / 7.43; T4096 K2 10.42 through the lists
  // at 128 threads, 9.61 in one launch at 512 (9.06 at 1024). Not at decode sizes, where the
  // blocks are few anyway: there 512 threads were 0.25-0.4 us slower (A B B A x 2, T32 and T64 K2
  // 5.40 / 5.34 against 5.09 / 5.07, T64 K8 7.50 against 7.08; T8 K2 level).
  if (s->scan && !decode && s->tpb > 1) s->tpb = kShortRowScanThreads / s->tpt;
  // That launch keeps every token's list in shared memory (combine.cuh, scan_token_rows): tpb *
  // list_cap ints. With lists of four times the average (list_capacity) 4-thread groups of
  // 128-entry lists (rows of at most 4 vectors, more than 16 rows per token on average) took 64
  // KB and did not compile: fewer tokens per block there.
  while (s->scan && s->tpb > 1 &&
         static_cast<int64_t>(s->tpb) * s->list_cap * static_cast<int64_t>(sizeof(int)) >
             kScanListBytes)
    s->tpb /= 2;
  // Fixed layouts with one row per token: two slots per thread as well (one 16-byte load in
  // flight per thread is too few). On the H200, two runs: 0.4-5% faster at K=1 for H = 2048-7168
  // bf16 in both layouts, level for fp32; four slots no better.
  if (!s->token_index() && !decode && s->top_k == 1 && slots >= 2 * s->tpt) s->upt = 2;
  // Gather map with two rows per token: four slots per thread (eight 16-byte loads in flight, not
  // two) where whole 512-slot chunks tile the row. On the H200, two runs each: 1.4% faster at
  // H=4096 fp32, 1.9% at H=4096 bf16, 2.3% at H=2048 fp32; 3.4% slower at H=7168 bf16 (896 slots:
  // a partial chunk), hence the rule. Token-major measured level, and stays at one slot.
  if (s->layout == MOEJIT_LAYOUT_GATHER_MAP && !decode && s->top_k == 2 &&
      slots % (4 * kBlockThreads) == 0)
    s->upt = 4;
}

// Widest vector (elements) such that every row start of both buffers is aligned to it.
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

void check_enum(const char* name, int value, int max, const char* allowed) {
  if (value < 0 || value > max) invalid_argument(name, std::to_string(value), allowed);
}

void check_aligned(const char* name, const void* p, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
    invalid_argument(name, hex(p),
                     std::string("must be aligned to its element size (") + std::to_string(bytes) +
                         " bytes for " + what + ")");
}

// rows rows of `stride` elements must span at most kMaxExtentBytes: a larger stride names memory
// no device has, and the kernels' 64-bit row offsets would wrap.
void check_extent(const char* name, int64_t stride, int64_t rows, const char* rows_name,
                  int dtype) {
  // Multiplications with an overflow check, not divisions: this runs on every call.
  int64_t bytes = 0;
  if (__builtin_mul_overflow(stride, rows, &bytes) ||
      __builtin_mul_overflow(bytes, int64_t{element_bytes(dtype)}, &bytes) ||
      bytes > kMaxExtentBytes)
    invalid_argument(name, std::to_string(stride),
                     std::string("is too large: ") + rows_name + " = " + std::to_string(rows) +
                         " rows of that many " + dtype_name(dtype) +
                         " elements span more than 2^62 bytes, more memory than any device has");
}

// One device buffer an argument names: [begin, end) in bytes (empty where the call reads none).
struct ByteRange {
  const char* name;
  uint64_t begin = 0, end = 0;
};

ByteRange byte_range(const char* name, const void* p, uint64_t bytes) {
  const uint64_t begin = reinterpret_cast<uintptr_t>(p);
  uint64_t end = 0;
  if (p == nullptr || bytes == 0) return {name, 0, 0};
  if (__builtin_add_overflow(begin, bytes, &end)) end = UINT64_MAX;
  return {name, begin, end};
}

// The kernels read the routing, gates and rows (and the workspace lists) while they write out, in
// no order between blocks: buffers that share bytes give a race, not an error. The written buffer
// w is compared with each one read (a few comparisons per call); a padded row stride counts its
// padding.
void check_no_overlap(const ByteRange& w, std::initializer_list<ByteRange> read) {
  for (const ByteRange& o : read)
    if (w.begin < w.end && o.begin < o.end && w.begin < o.end && o.begin < w.end)
      invalid_argument(w.name,
                       "[" + hex(reinterpret_cast<const void*>(w.begin)) + ", " +
                           hex(reinterpret_cast<const void*>(w.end)) + ")",
                       std::string("overlaps ") + o.name + " [" +
                           hex(reinterpret_cast<const void*>(o.begin)) + ", " +
                           hex(reinterpret_cast<const void*>(o.end)) +
                           "): the kernels read it while they write; pass separate buffers");
}

// Copies the caller's struct into a full-size one (defaults for fields an older caller lacks) and
// checks every shape field. Shared by plan_combine and combine_workspace_bytes.
moejit_combine_args validated_shape(const moejit_combine_args* in) {
  if (in == nullptr) invalid_argument("args", "NULL", "must point to a moejit_combine_args");
  // The defaults as a constant, not through the exported init function: this runs on every call.
  moejit_combine_args a = MOEJIT_COMBINE_ARGS_INIT;
  // A 0.1 header's struct ends before dependent_launch: its fields keep their defaults.
  if (in->struct_size != sizeof(moejit_combine_args) && in->struct_size != kCombineArgsSizeV01)
    invalid_argument(
        "args->struct_size", std::to_string(in->struct_size),
        "must be sizeof(moejit_combine_args) = " + std::to_string(sizeof(moejit_combine_args)) +
            " for this library version (" + moejit_version_string() + "), or " +
            std::to_string(kCombineArgsSizeV01) +
            " from a 0.1 header; initialize args with moejit_combine_args_init()");
  std::memcpy(&a, in, in->struct_size);
  a.struct_size = sizeof(a);

  check_enum("args->layout", c_enum_value(a.layout), 2,
             "must be MOEJIT_LAYOUT_TOKEN_MAJOR (0), MOEJIT_LAYOUT_GATHER_MAP (1) or "
             "MOEJIT_LAYOUT_TOKEN_INDEX (2)");
  check_enum("args->expert_dtype", c_enum_value(a.expert_dtype), 2,
             "must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or "
             "MOEJIT_DTYPE_BFLOAT16 (2)");
  check_enum("args->out_dtype", c_enum_value(a.out_dtype), 2,
             "must be MOEJIT_DTYPE_FLOAT32 (0), MOEJIT_DTYPE_FLOAT16 (1) or "
             "MOEJIT_DTYPE_BFLOAT16 (2)");
  if (a.layout != MOEJIT_LAYOUT_TOKEN_MAJOR)
    check_enum("args->index_type", c_enum_value(a.index_type), 1,
               "must be MOEJIT_INDEX_INT32 (0) or MOEJIT_INDEX_INT64 (1)");
  else
    // Token-major reads no indices, so any int the caller left there is accepted; overwritten,
    // since the plan still reads the field as the enum (a load of an out-of-range value is UB).
    a.index_type = MOEJIT_INDEX_INT32;
  if (a.num_tokens < 0 || a.num_tokens > kMaxTokens)
    invalid_argument("args->num_tokens", std::to_string(a.num_tokens),
                     "must be in 0.." + std::to_string(kMaxTokens) + " (2^40)");
  if (a.hidden_dim < 1 || a.hidden_dim > MOEJIT_MAX_HIDDEN_DIM)
    invalid_argument("args->hidden_dim", std::to_string(a.hidden_dim),
                     "must be in 1.." + std::to_string(MOEJIT_MAX_HIDDEN_DIM));
  if (a.layout != MOEJIT_LAYOUT_TOKEN_INDEX && (a.top_k < 1 || a.top_k > MOEJIT_MAX_TOP_K))
    invalid_argument("args->top_k", std::to_string(a.top_k),
                     std::string("must be in 1..") + std::to_string(MOEJIT_MAX_TOP_K) +
                         " for the " + layout_name(a.layout) + " layout");
  if (a.layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
    if (a.num_tokens > INT64_MAX / a.top_k)
      invalid_argument("args->num_tokens", std::to_string(a.num_tokens), "is too large");
    const int64_t rows = a.num_tokens * a.top_k;
    if (a.num_rows != 0 && a.num_rows != rows)
      invalid_argument("args->num_rows", std::to_string(a.num_rows),
                       "must be 0 or num_tokens * top_k = " + std::to_string(rows) +
                           " for the token-major layout");
    a.num_rows = rows;
  } else {
    if (a.num_rows < 0 || a.num_rows > kMaxRows)
      invalid_argument("args->num_rows", std::to_string(a.num_rows),
                       "must be in 0.." + std::to_string(kMaxRows));
  }
  if (a.dependent_launch != 0 && a.dependent_launch != 1)
    invalid_argument("args->dependent_launch", std::to_string(a.dependent_launch),
                     "must be 0 (plain launch) or 1 (programmatic dependent launch)");
  if (a.expert_row_stride == 0) a.expert_row_stride = a.hidden_dim;
  if (a.out_row_stride == 0) a.out_row_stride = a.hidden_dim;
  if (a.expert_row_stride < a.hidden_dim)
    invalid_argument("args->expert_row_stride", std::to_string(a.expert_row_stride),
                     "must be 0 (= hidden_dim) or >= hidden_dim = " + std::to_string(a.hidden_dim));
  if (a.out_row_stride < a.hidden_dim)
    invalid_argument("args->out_row_stride", std::to_string(a.out_row_stride),
                     "must be 0 (= hidden_dim) or >= hidden_dim = " + std::to_string(a.hidden_dim));
  check_extent("args->expert_row_stride", a.expert_row_stride, a.num_rows, "num_rows",
               a.expert_dtype);
  check_extent("args->out_row_stride", a.out_row_stride, a.num_tokens, "num_tokens", a.out_dtype);
  return a;
}

// Workspace bytes of already validated arguments.
size_t workspace_bytes(const moejit_combine_args& a) {
  if (a.layout != MOEJIT_LAYOUT_TOKEN_INDEX || a.num_tokens == 0) return 0;
  const int64_t cap = list_capacity((a.num_rows + a.num_tokens - 1) / a.num_tokens);
  const size_t list = static_cast<size_t>(a.num_tokens) * static_cast<size_t>(cap);
  return counts_bytes(a.num_tokens) + list * sizeof(int);
}

// The spec for a shape once the vector width is known (from real pointers, or an alignment).
KernelSpec make_spec(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                     moejit_index_type index_type, int hidden, int rows_per_token, int vec,
                     int64_t num_tokens) {
  KernelSpec s;
  s.layout = layout;
  s.in_dtype = in_dtype;
  s.out_dtype = out_dtype;
  s.index_bytes =
      layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? 4 : (index_type == MOEJIT_INDEX_INT64 ? 8 : 4);
  s.hidden = hidden;
  s.vec = vec;
  if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
    s.top_k = held_rows(rows_per_token);
    s.list_cap = list_capacity(rows_per_token);
  } else {
    s.top_k = rows_per_token;
  }
  choose_geometry(&s, num_tokens);
  return s;
}

}  // namespace

size_t combine_workspace_bytes(const moejit_combine_args* args) {
  return workspace_bytes(validated_shape(args));
}

KernelSpec spec_for_shape(moejit_layout layout, moejit_dtype in_dtype, moejit_dtype out_dtype,
                          moejit_index_type index_type, int hidden, int rows_per_token,
                          size_t alignment_bytes, int64_t num_tokens) {
  const int vec =
      choose_vec(in_dtype, out_dtype, hidden, alignment_bytes, hidden, alignment_bytes, hidden);
  return make_spec(layout, in_dtype, out_dtype, index_type, hidden, rows_per_token, vec,
                   num_tokens);
}

// Rows a single launch with several tokens per block holds (below).
constexpr int kHeldInSharedBlocks = 8;

KernelSpec single_launch_spec(const KernelSpec& list_spec, int64_t num_tokens) {
  KernelSpec s = list_spec;
  s.scan = true;
  choose_geometry(&s, num_tokens);
  // Several tokens per block (short rows, up to 512 threads): at most eight held rows. With more
  // (held_rows: 12 or 16) ptxas spilled there (sm_89, H=1).
  if (s.tpb > 1) s.top_k = std::min(s.top_k, kHeldInSharedBlocks);
  return s;
}

KernelSpec single_launch_for_rows(const KernelSpec& single, int64_t num_rows) {
  return single.ordered_scan() && num_rows <= single.block_threads() ? single.with_small_scan()
                                                                     : single;
}

// The gather map's one-token kernel (combine_one_token_map) for a decode spec: at K > 2 in 16-slot
// token groups, two per 32-thread block, where rows are longer than 32 slots. Each thread stages
// its K + 1 rows in shared memory, and in the fixed kernel's 128-thread blocks it was 6-10% slower
// (tools/bench/NOTES.md, version 38, interleaved rounds: T1 K8 H7168 4.74 -> 5.18 us, K4 H2880
// 4.58 -> 4.83); in 64x1 0.4-0.5 us slower at K = 4 and 8 (version 37). With one or two rows per
// token it keeps the 128-thread blocks, and where a row fills them loads 8-byte vectors instead of
// 16-byte ones: twice the blocks, half the adds per thread after the one round trip. On the H200 in
// interleaved rounds against 16-byte vectors (NOTES, version 39), T = 1: K2 bf16 H2048 / H4096 /
// H7168 3.4-3.6% faster, K2 H4096 fp16 and fp32 1.4-1.5%, K1 H4096 fp32 1.5%, K1 H5120 bf16 level
// to 1.0% (two runs). 4-byte vectors were no better (K2 H4096 bf16 2.2%, K1 H5120 2.8%).
KernelSpec one_token_map_spec(const KernelSpec& decode) {
  KernelSpec s = decode.with_one_token_kernel();
  if (s.top_k > 2 && s.slots() > 32) {
    s.tpt = 16;
    s.tpb = 2;
    s.upt = 1;
  } else if (s.top_k <= 2 && s.tpt == kBlockThreads && s.vec * element_bytes(s.in_dtype) == 16) {
    s.vec /= 2;
  }
  return s;
}

// The token index's one-token kernel (combine_one_token) for a decode spec: the decode geometry
// (64-thread blocks in 16-byte vectors where a row fills them), except in two cases, where
// 128-thread blocks load narrower vectors: four or eight times the blocks, a few adds per thread
// after each round trip. At T = 1 the decode geometry has few blocks (14 for a 7168-wide bf16 row)
// and a call with more than eight rows takes several round trips, one batch of rows after the
// other. On the H200 in interleaved rounds against the decode geometry (tools/bench/NOTES.md,
// version 40), T = 1:
// - one or two rows: 8-byte vectors. K2 bf16 H2048 / H4096 / H7168 1.2-3.0% faster, fp16 2.9%,
//   fp32 1.4%, K1 level. 4-byte vectors were no better.
// - five or more rows of 2-byte elements: 4-byte vectors. K8 bf16 H2880 / H5120 / H7168 2.1-2.8%
//   faster, K8 H4096 fp16 2.8%, K6 2.1%, 16 rows 4.4%, 32 rows 9.2%. fp32 in 4-byte vectors was
//   level at K8, and bf16 with three or four rows level to 2.9% slower: both keep the decode
//   geometry.
KernelSpec one_token_index_spec(const KernelSpec& decode) {
  const KernelSpec s = decode.with_one_token_kernel();
  const int elem = element_bytes(s.in_dtype);
  if (s.vec * elem != 16) return s;  // only from the widest vectors
  int vector_bytes = 16;
  if (s.top_k <= 2)
    vector_bytes = 8;
  else if (s.top_k >= 8 && elem == 2)
    vector_bytes = 4;
  if (vector_bytes == 16) return s;
  KernelSpec narrow = s;
  narrow.vec = vector_bytes / elem;
  if (narrow.slots() < kBlockThreads) return s;  // a row must fill the blocks
  narrow.tpt = kBlockThreads;
  narrow.tpb = 1;
  narrow.upt = 1;
  return narrow;
}

std::vector<KernelSpec> specs_for_shape(moejit_layout layout, moejit_dtype in_dtype,
                                        moejit_dtype out_dtype, moejit_index_type index_type,
                                        int hidden, int rows_per_token, size_t alignment_bytes) {
  std::vector<KernelSpec> specs;
  auto add = [&](const KernelSpec& s) {
    if (std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
  };
  // Batch sizes with their own geometry: prefill (any large call), decode, and mid-size (the
  // token index's list path there, choose_geometry).
  for (int64_t tokens : {kAnyTokens, int64_t{1}, kDecodeMaxTokens + 1}) {
    const KernelSpec s = spec_for_shape(layout, in_dtype, out_dtype, index_type, hidden,
                                        rows_per_token, alignment_bytes, tokens);
    add(s);
    // Token index: small calls of either batch size take the single-launch kernel instead, in
    // its small-call form where the fewest rows such a call has fit one block; large ones launch
    // the list helpers first; one-token calls take their own kernel. The plan's rows per token
    // are R / T rounded up, so a call of T tokens has from T x (rows_per_token - 1) + 1 rows (some
    // dropped), not only T x rows_per_token: at T = 65 and two rows per token, 66-128 rows take
    // the small-call form, which T x 2 = 130 missed. At decode from T = 2, or T = 1 with more rows
    // than the one-token kernel takes (then R = rows_per_token).
    if (s.token_index()) {
      const KernelSpec single = single_launch_spec(s, tokens);
      add(single);
      const int64_t fewest_tokens =
          tokens != 1 ? kDecodeMaxTokens + 1 : (rows_per_token > kOneTokenMaxRows ? 1 : 2);
      const KernelSpec smallest =
          single_launch_for_rows(single, fewest_tokens * (rows_per_token - 1) + 1);
      if (smallest.small_scan) add(smallest);
      add(s.helpers_spec());
      if (tokens == 1) add(one_token_index_spec(s));
    }
    // Gather map: one-token calls whose buffer holds at most top_k rows take their own kernel.
    if (tokens == 1 && s.layout == MOEJIT_LAYOUT_GATHER_MAP) {
      const KernelSpec one = one_token_map_spec(s);
      if (one.fits_one_token_map()) add(one);
    }
  }
  return specs;
}

CombinePlan plan_combine(const moejit_combine_args* args) {
  const moejit_combine_args a = validated_shape(args);
  CombinePlan plan;
  const int in_b = element_bytes(a.expert_dtype), out_b = element_bytes(a.out_dtype);
  const bool any_rows = a.num_rows > 0 && a.num_tokens > 0;
  if (a.num_tokens > 0 && a.out == nullptr)
    invalid_argument("args->out", "NULL", "must be a device pointer when num_tokens > 0");
  if (any_rows && a.expert_hidden == nullptr)
    invalid_argument("args->expert_hidden", "NULL", "must be a device pointer when num_rows > 0");
  // The gather map has T * K entries whatever R is (with R = 0 every one is dropped, but the
  // kernels still read them); token_idx has R.
  if (a.layout == MOEJIT_LAYOUT_GATHER_MAP && a.num_tokens > 0 && a.indices == nullptr)
    invalid_argument("args->indices", "NULL",
                     "must be a device pointer (the gather map, num_tokens * top_k entries) for "
                     "the gather_map layout when num_tokens > 0, even with num_rows = 0");
  if (a.layout == MOEJIT_LAYOUT_TOKEN_INDEX && any_rows && a.indices == nullptr)
    invalid_argument("args->indices", "NULL",
                     "must be a device pointer (the token_idx) for the token_index layout when "
                     "num_rows > 0");
  check_aligned("args->expert_hidden", a.expert_hidden, in_b, dtype_name(a.expert_dtype));
  check_aligned("args->out", a.out, out_b, dtype_name(a.out_dtype));
  check_aligned("args->gates", a.gates, 4, "fp32 gates");
  if (a.layout != MOEJIT_LAYOUT_TOKEN_MAJOR)
    check_aligned("args->indices", a.indices, a.index_type == MOEJIT_INDEX_INT64 ? 8 : 4,
                  a.index_type == MOEJIT_INDEX_INT64 ? "int64 indices" : "int32 indices");
  if (a.accumulate != 0 && a.accumulate != 1)
    invalid_argument("args->accumulate", std::to_string(a.accumulate),
                     "must be 0 (overwrite out) or 1 (add into out)");
  if (!std::isfinite(a.scale))
    invalid_argument("args->scale", std::to_string(a.scale), "must be a finite number");

  if (a.num_tokens == 0) {
    plan.nothing_to_do = true;
    return plan;
  }

  // The bytes each buffer spans (strides included), for the overlap checks here and with the
  // workspace below.
  const uint64_t idx_b = a.index_type == MOEJIT_INDEX_INT64 ? 8 : 4;
  const uint64_t routed = a.layout == MOEJIT_LAYOUT_TOKEN_INDEX
                              ? static_cast<uint64_t>(a.num_rows)
                              : static_cast<uint64_t>(a.num_tokens * a.top_k);
  const ByteRange out_bytes = byte_range(
      "args->out", a.out,
      (static_cast<uint64_t>(a.num_tokens - 1) * static_cast<uint64_t>(a.out_row_stride) +
       static_cast<uint64_t>(a.hidden_dim)) *
          static_cast<uint64_t>(out_b));
  const ByteRange expert_bytes =
      byte_range("args->expert_hidden", any_rows ? a.expert_hidden : nullptr,
                 (static_cast<uint64_t>(a.num_rows > 0 ? a.num_rows - 1 : 0) *
                      static_cast<uint64_t>(a.expert_row_stride) +
                  static_cast<uint64_t>(a.hidden_dim)) *
                     static_cast<uint64_t>(in_b));
  const ByteRange index_bytes = byte_range(
      "args->indices", a.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : a.indices, routed * idx_b);
  const ByteRange gate_bytes = byte_range("args->gates", a.gates, routed * 4);
  check_no_overlap(out_bytes, {expert_bytes, index_bytes, gate_bytes});

  const int64_t rows_per_token = a.layout == MOEJIT_LAYOUT_TOKEN_INDEX
                                     ? (a.num_rows + a.num_tokens - 1) / a.num_tokens
                                     : a.top_k;
  KernelSpec& s = plan.spec;
  const int hidden = static_cast<int>(a.hidden_dim);
  s = make_spec(
      static_cast<moejit_layout>(a.layout), static_cast<moejit_dtype>(a.expert_dtype),
      static_cast<moejit_dtype>(a.out_dtype), static_cast<moejit_index_type>(a.index_type), hidden,
      static_cast<int>(std::min<int64_t>(rows_per_token, MOEJIT_MAX_TOP_K)),
      choose_vec(a.expert_dtype, a.out_dtype, hidden, reinterpret_cast<uintptr_t>(a.expert_hidden),
                 a.expert_row_stride, reinterpret_cast<uintptr_t>(a.out), a.out_row_stride),
      a.num_tokens);

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

  if (s.token_index()) {
    const size_t needed = workspace_bytes(a);
    if (a.workspace == nullptr || a.workspace_bytes < needed)
      throw Error(MOEJIT_ERROR_WORKSPACE_TOO_SMALL,
                  "args->workspace = " + hex(a.workspace) +
                      " with workspace_bytes = " + std::to_string(a.workspace_bytes) +
                      ": the token-index layout needs " + std::to_string(needed) +
                      " bytes of device memory here (moejit_combine_workspace_size())");
    if (reinterpret_cast<uintptr_t>(a.workspace) % 16 != 0)
      invalid_argument("args->workspace", hex(a.workspace),
                       "must be aligned to 16 bytes, as moejit.h asks of the workspace");
    const ByteRange ws_bytes = byte_range("args->workspace", a.workspace, needed);
    check_no_overlap(ws_bytes, {out_bytes, expert_bytes, index_bytes, gate_bytes});
    char* ws = static_cast<char*>(a.workspace);
    p.token_counts = reinterpret_cast<int*>(ws);
    p.token_rows = reinterpret_cast<int*>(ws + counts_bytes(a.num_tokens));
    auto helper_blocks = [](int64_t n) {
      return static_cast<unsigned>(std::max<int64_t>(
          1, std::min<int64_t>((n + kHelperThreads - 1) / kHelperThreads, kMaxHelperBlocks)));
    };
    plan.clear_blocks = helper_blocks(a.num_tokens);
    plan.assign_blocks = helper_blocks(a.num_rows);
    // Their own modules: the list path is not compiled for a call that skips it.
    if (a.num_tokens == 1 && a.num_rows <= kOneTokenMaxRows) {
      s = one_token_index_spec(s);
    } else {
      // The single launch in its own geometry: every one of its blocks reads all of token_idx.
      const KernelSpec single = single_launch_spec(s, a.num_tokens);
      const double blocks =
          static_cast<double>((a.num_tokens + single.tpb - 1) / single.tpb) * single.chunks();
      const int64_t rows_per_thread =
          (a.num_rows + single.block_threads() - 1) / single.block_threads();
      const bool token_scan =
          rows_per_thread <= kScanMaxRowsPerThread &&
          blocks * static_cast<double>(a.num_rows) * (a.index_type == MOEJIT_INDEX_INT64 ? 8 : 4) <=
              kScanMaxBytes;
      if (token_scan) s = single_launch_for_rows(single, a.num_rows);
    }
  }
  // Gather map, one token (single-sequence decode) with at most top_k rows, as an engine passes
  // the token's own expert outputs: combine_one_token_map loads every row with the map and the
  // gates (one round trip instead of two) and picks each slot's row from them, all of them in
  // flight at once (KernelSpec::fits_one_token_map: top_k <= 8 at one slot per thread), in its own
  // geometry (one_token_map_spec). On the H200 against the fixed layouts' kernel, A B C C B A x 2
  // (tools/bench/NOTES.md, version 37), T = 1, us: K8 H7168 bf16 5.41 -> 5.08, K8 H4096 5.38 ->
  // 5.04, K4 H2880 5.17 -> 4.81, K2 H4096 fp32 5.17 -> 4.75, K1 H5120 5.05 -> 4.71.
  //
  // Not as a programmatic dependent (args->dependent_launch): it stages the rows in shared memory,
  // and after a producer kernel that uses none the dependent launch then started late. In a decode
  // step of `moejit-bench --pipeline` (a PDL-aware producer, then the combine) it took 1.0 us
  // longer as a dependent than as a plain launch, where the fixed kernel saves 0.3 us (NOTES,
  // version 44; the same cause as the small-call scan's 2 KB list, version 28).
  if (s.layout == MOEJIT_LAYOUT_GATHER_MAP && a.num_tokens == 1 && a.num_rows <= a.top_k &&
      a.dependent_launch == 0) {
    const KernelSpec one = one_token_map_spec(s);
    if (one.fits_one_token_map()) s = one;
  }
  p.list_capacity = s.list_cap;  // of the module chosen (0: no list)

  // Grid x: token groups (at most 2^31 - 1). Grid y: chunks per row, at most 65536 / 4 (hidden
  // <= MOEJIT_MAX_HIDDEN_DIM, >= 4 slots per chunk), under the 65535 limit.
  const int64_t groups = (a.num_tokens + s.tpb - 1) / s.tpb;
  if (groups > INT32_MAX)
    throw Error(MOEJIT_ERROR_UNSUPPORTED,
                "args->num_tokens = " + std::to_string(a.num_tokens) + " needs " +
                    std::to_string(groups) +
                    " token groups, more than one launch allows (2^31 - 1): split the batch");

  // The grid of the module chosen: x the token groups and y the chunks, or one 1-D grid with a
  // token's chunks adjacent (the kernel splits blockIdx.x; see combine.cuh, kOneDimGrid).
  plan.combine_grid_x = static_cast<unsigned>(groups);
  plan.combine_grid_y = static_cast<unsigned>(s.chunks());
  if (s.one_dim_grid() && !gather_map_two_dim_grid(s, a.num_tokens)) {
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

void launch_combine(const CombinePlan& plan, const LoadedKernels& kernels, CUstream stream,
                    Stats& stats) {
  if (plan.nothing_to_do) return;
  const bool chained = plan.list_helpers();
  if (chained && kernels.helpers == nullptr)
    throw Error(MOEJIT_ERROR_INTERNAL, "launch_combine: the list helpers' module is missing");
  const DriverApi& d = driver();
  CombineParams params = plan.params;
  // Where the first kernel cannot be launched as a dependent (before sm_90, or a driver without
  // cuLaunchKernelEx) it runs in plain stream order: clearing the flag spares it the routing
  // prefetch and the wait, which would buy nothing there.
  if (!kernels.dependent_launch) params.dependent_launch = 0;
  void* kernel_args[] = {&params};
  // Each kernel after the first of the token-index chain may start while its predecessor drains
  // (programmatic dependent launch): it waits in griddepcontrol.wait before touching memory, so
  // only the launch latency overlaps. The call's first kernel does so only if the caller asked
  // (args->dependent_launch). Where unsupported, plain stream order.
  auto launch = [&](const LoadedKernels& module, int kernel, unsigned gx, unsigned gy,
                    unsigned threads, bool dependent, const char* name) {
    const bool programmatic = dependent && module.dependent_launch;
    const CUresult result =
        programmatic
            ? launch_programmatic(d, module.functions[kernel], gx, gy, threads, stream, kernel_args)
            : d.cuLaunchKernel(module.functions[kernel], gx, gy, 1, threads, 1, 1, 0, stream,
                               kernel_args, nullptr);
    if (result != CUDA_SUCCESS)  // the call's name is built only for the message
      throw_launch_failure(
          d, stream, result,
          std::string(programmatic ? "cuLaunchKernelEx(" : "cuLaunchKernel(") + name + ")");
    stats.launches.fetch_add(1, std::memory_order_relaxed);
  };
  const unsigned threads = static_cast<unsigned>(plan.spec.block_threads());
  const bool first_dependent = params.dependent_launch != 0;  // the caller asked, and it can
  if (plan.token_scan() || plan.one_token()) {
    launch(kernels, kCombineKernel, plan.combine_grid_x, plan.combine_grid_y, threads,
           first_dependent,
           !plan.one_token()         ? "combine_scan"
           : plan.spec.token_index() ? "combine_one_token"
                                     : "combine_one_token_map");
    return;
  }
  if (chained) {
    launch(*kernels.helpers, kClearKernel, plan.clear_blocks, 1, kHelperThreads, first_dependent,
           "token_index_clear");
    launch(*kernels.helpers, kAssignKernel, plan.assign_blocks, 1, kHelperThreads, true,
           "token_index_assign");
  }
  launch(kernels, kCombineKernel, plan.combine_grid_x, plan.combine_grid_y, threads,
         chained || first_dependent, "combine");
}

}  // namespace moejit
