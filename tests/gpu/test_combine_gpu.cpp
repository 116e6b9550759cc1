// GPU correctness of moe_combine against a float64 CPU reference (ctest label `gpu`; every test
// skips with its reason where no GPU is usable).
//
// The matrix covers every layout x dtype pair x index type x hidden size {1, 7, 128, 2880, 4096,
// 7168} x T {0, 1, 33, 4096} x top_k {1, 2, 8}; each case also varies, by its index, gates
// present/absent, scale, accumulate mode, padded row strides and misaligned (element-aligned)
// base pointers, and, for the token-index layout, balanced or random routing. Outputs are poisoned
// (all bits set: NaN in every dtype) before each call and checked everywhere: every element of
// every row against the reference, every padding element and a guard region for untouched poison.
// Every case runs twice and the two outputs must be bitwise equal, and equal to an fp32 fma chain
// over the rows in the documented order.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include "gpu_harness.h"
#include "producer_source.h"

namespace moejit_test {
namespace {

constexpr size_t kPoolElems = 320ull << 20;  // covers 4/3 x T=4096 x K=8 x (H=7168 + padding)
// moejit.h: a token-index token with more rows than this is summed in pieces of this many rows
// (kernel_templates/token_index_workspace.h, kPieceRows). Only the token index has such tokens
// (the fixed layouts stop at 64 slots).
constexpr int64_t kPieceRows = 128;
constexpr size_t kGatePool = 1ull << 22;
constexpr int64_t kGuardElems = 64;  // poison checked after the last output row

// Random values in [-1, 1], encoded in each dtype, on the host (for the reference) and on the
// device (as expert rows). Built once, shared by every test.
struct Pools {
  std::vector<uint8_t> host[3];
  void* device[3] = {};
  std::vector<float> gates_host;
  float* gates_device = nullptr;
  std::vector<uint8_t> extra_host[3];  // initial out contents for accumulate mode
};

const Pools& pools() {
  static Pools* p = [] {
    auto* pools = new Pools;
    std::vector<float> values(kPoolElems);
    const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> threads;
    for (unsigned w = 0; w < n_threads; ++w)
      threads.emplace_back([&, w] {
        const size_t begin = kPoolElems * w / n_threads, end = kPoolElems * (w + 1) / n_threads;
        Rng rng(1234 + w);
        for (size_t i = begin; i < end; ++i) values[i] = rng.uniform(-1.0f, 1.0f);
      });
    for (auto& t : threads) t.join();
    for (int d = 0; d < 3; ++d) {
      const auto dt = static_cast<moejit_dtype>(d);
      pools->host[d].resize(kPoolElems * static_cast<size_t>(dtype_bytes(dt)));
      threads.clear();
      for (unsigned w = 0; w < n_threads; ++w)
        threads.emplace_back([&, w, d, dt] {
          const size_t begin = kPoolElems * w / n_threads, end = kPoolElems * (w + 1) / n_threads;
          for (size_t i = begin; i < end; ++i) encode(pools->host[d].data(), dt, i, values[i]);
        });
      for (auto& t : threads) t.join();
      if (cudaMalloc(&pools->device[d], pools->host[d].size()) != cudaSuccess ||
          cudaMemcpy(pools->device[d], pools->host[d].data(), pools->host[d].size(),
                     cudaMemcpyHostToDevice) != cudaSuccess)
        throw std::runtime_error("cannot upload the random pools");
      // A different stretch of the same values serves as initial out contents.
      pools->extra_host[d].assign(pools->host[d].end() - (64ll << 20) * dtype_bytes(dt),
                                  pools->host[d].end());
    }
    Rng rng(99);
    pools->gates_host.resize(kGatePool);
    for (float& g : pools->gates_host) g = rng.uniform(0.0f, 1.0f);
    if (cudaMalloc(&pools->gates_device, kGatePool * 4) != cudaSuccess ||
        cudaMemcpy(pools->gates_device, pools->gates_host.data(), kGatePool * 4,
                   cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cannot upload the gates pool");
    return pools;
  }();
  return *p;
}

// A reference term of the bf16 pool: gate `gate` times element `element`.
double bf16_term(const Pools& p, size_t gate, size_t element) {
  return p.gates_host[gate] * static_cast<double>(decode(p.host[MOEJIT_DTYPE_BFLOAT16].data(),
                                                         MOEJIT_DTYPE_BFLOAT16, element));
}

struct Case {
  moejit_layout layout;
  moejit_dtype in, out;
  moejit_index_type idx;
  int64_t hidden, tokens, top_k;
  uint64_t seed;
  // Variations derived from the seed:
  bool gates = true, accumulate = false, random_routing = false, hot_token = false;
  // Token index: >= 0 gives token 0 exactly this many rows (none dropped) and the others to the
  // other tokens at random.
  int64_t hot_rows = -1;
  // Gather map: >= 0 gives the buffer exactly this many rows, which the map names at random
  // (repeats allowed) or drops: at most top_k of them make a one-token call's own kernel.
  int64_t gather_rows = -1;
  float scale = 1.0f;
  int64_t expert_pad = 0, out_pad = 0, expert_offset = 0, out_offset = 0;
  bool dependent_launch = false;  // args->dependent_launch (sm_90+: prefetch, then wait)
  // Gather map and token index: a fifth of the entries out of range in the ways the other cases do
  // not draw (odd_out_of_range), not only -1 and just past the end.
  bool odd_indices = false;
  // Gather map over expert-sorted rows: the percentage of slots that are -1 (one more is out of
  // range, also dropped). 87.5: a rank's partial combine under expert parallelism over 8 ranks.
  int64_t drop_percent = 5;
  // Token index: a skewed distribution of the T * K rows (issue 58's), then skew_drop percent of
  // them -1 (the other token-index variations off).
  enum Skew { kNoSkew, kOneToken, kTopPercent, kZipf } skew = kNoSkew;
  int64_t skew_drop = 0;

  std::string name() const {
    std::ostringstream s;
    s << layout_str(layout) << " " << dtype_str(in) << "->" << dtype_str(out) << " "
      << (idx == MOEJIT_INDEX_INT64 ? "int64" : "int32") << " H=" << hidden << " T=" << tokens
      << " K=" << top_k << " gates=" << gates << " acc=" << accumulate << " scale=" << scale
      << " pads=" << expert_pad << "/" << out_pad << " offsets=" << expert_offset << "/"
      << out_offset << " random_routing=" << random_routing << " hot_token=" << hot_token
      << " hot_rows=" << hot_rows << " gather_rows=" << gather_rows
      << " dependent=" << dependent_launch << " odd_indices=" << odd_indices
      << " drop_percent=" << drop_percent << " skew=" << skew << " skew_drop=" << skew_drop;
    return s.str();
  }
};

Case vary(Case c) {
  Rng r(c.seed);
  c.gates = r.below(5) != 0;
  c.accumulate = r.below(4) == 0;
  c.scale = r.below(3) == 0 ? 1.0f : r.uniform(0.25f, 2.5f);
  const int64_t pads[] = {0, 0, 8, 64, 3};
  c.expert_pad = pads[r.below(5)];
  c.out_pad = pads[r.below(5)];
  c.expert_offset = r.below(3) == 0 ? r.below(8) : 0;  // element-aligned, maybe not vector-aligned
  c.out_offset = r.below(3) == 0 ? r.below(8) : 0;
  c.random_routing = c.layout == MOEJIT_LAYOUT_TOKEN_INDEX && r.below(2) == 0;
  return c;
}

// Device scratch owned by one worker thread, grown on demand.
struct Scratch {
  void* out = nullptr;
  size_t out_bytes = 0;
  void* indices = nullptr;
  size_t indices_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;

  static void grow(void** p, size_t* have, size_t need) {
    if (need <= *have) return;
    if (*p) cudaFree(*p);
    *p = nullptr;
    if (cudaMalloc(p, need) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    *have = need;
  }
  ~Scratch() {
    if (out) cudaFree(out);
    if (indices) cudaFree(indices);
    if (workspace) cudaFree(workspace);
    if (stream) cudaStreamDestroy(stream);
  }
};

// An index value outside [0, limit) of a kind the other cases do not draw, for a slot or row that
// would have named `valid` (in range): negative other than -1, the bound itself, the type's
// extremes, and with int64 indices values whose low 32 bits are `valid` or that pass 2^31. moejit.h
// treats every one as -1; a kernel that compared or kept such a value in 32 bits would add
// `valid`'s row, and one that took it for an address would read out of bounds.
int64_t odd_out_of_range(moejit_index_type idx, int64_t limit, int64_t valid, Rng& rng) {
  const int64_t k32 = int64_t{1} << 32, k31 = int64_t{1} << 31;
  const int64_t values[] = {-2, -2 - valid, INT32_MIN, INT32_MAX, limit, limit + (int64_t{1} << 20),
                            // int64 only:
                            k32 + valid, valid - k32, k31 + valid, INT64_MIN, INT64_MAX,
                            INT64_MIN + valid};
  return values[rng.below(idx == MOEJIT_INDEX_INT64 ? 12 : 6)];
}

// The rows (and gate index) contributing to each token, as the public contract defines them.
struct Routing {
  int64_t rows = 0;
  std::vector<int64_t> index_values;  // what goes to the device (map or token_idx)
  std::vector<std::vector<std::pair<int64_t, int64_t>>> per_token;  // (row, gate index)
};

Routing make_routing(const Case& c, Rng& rng) {
  Routing r;
  const int64_t T = c.tokens, K = c.top_k;
  r.per_token.resize(static_cast<size_t>(T));
  if (c.layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
    r.rows = T * K;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) r.per_token[t].push_back({t * K + k, t * K + k});
    return r;
  }
  if (c.layout == MOEJIT_LAYOUT_GATHER_MAP && c.gather_rows >= 0) {
    r.rows = c.gather_rows;
    r.index_values.resize(static_cast<size_t>(T * K));
    for (int64_t slot = 0; slot < T * K; ++slot) {
      const int64_t roll = rng.below(10);
      int64_t row = roll == 0 || r.rows == 0 ? -1
                    : roll == 1              ? r.rows + rng.below(1000)  // out of range
                                             : rng.below(r.rows);
      if (c.odd_indices && roll >= 1 && roll <= 2 && r.rows > 0)
        row = odd_out_of_range(c.idx, r.rows, rng.below(r.rows), rng);
      r.index_values[slot] = row;
      if (row >= 0 && row < r.rows) r.per_token[slot / K].push_back({row, slot});
    }
    return r;
  }
  // Rows arrive expert-sorted: a random permutation of token-major order, plus unused rows.
  const int64_t used = T * K;
  r.rows = c.layout == MOEJIT_LAYOUT_GATHER_MAP ? used + used / 3 : used;
  std::vector<int64_t> perm(static_cast<size_t>(r.rows));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = r.rows - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  if (c.layout == MOEJIT_LAYOUT_GATHER_MAP) {
    r.index_values.resize(static_cast<size_t>(used));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        int64_t row = perm[t * K + k];
        const int64_t roll = rng.below(100);
        if (roll < c.drop_percent)
          row = -1;  // dropped slot
        else if (roll == c.drop_percent)
          row = r.rows + rng.below(1000);  // out of range: dropped too
        else if (c.odd_indices && roll < 25)
          row = odd_out_of_range(c.idx, r.rows, row, rng);
        r.index_values[t * K + k] = row;
        if (row >= 0 && row < r.rows) r.per_token[t].push_back({row, t * K + k});
      }
    return r;
  }
  // Token index: every row names a token (or -1). Balanced (each token K rows) or random.
  r.index_values.assign(static_cast<size_t>(r.rows), -1);
  if (c.skew != Case::kNoSkew) {
    const SkewedTokens skewed(T, c.skew == Case::kZipf, rng);
    for (int64_t i = 0; i < r.rows; ++i) {
      int64_t token;
      if (c.skew == Case::kOneToken)
        token = skewed.hottest();
      else if (c.skew == Case::kTopPercent)
        token = skewed.top_percent(i, r.rows, rng);
      else
        token = skewed.zipf(rng.uniform(0.0f, 1.0f));
      if (rng.below(100) < c.skew_drop) token = -1;
      r.index_values[perm[i]] = token;
    }
  }
  for (int64_t i = 0; i < r.rows && c.skew == Case::kNoSkew; ++i) {
    const int64_t row = perm[i];
    if (c.hot_rows >= 0) {
      r.index_values[row] = i < c.hot_rows ? 0 : 1 + rng.below(T - 1);
      continue;
    }
    int64_t token = c.random_routing ? rng.below(T) : i / K;
    if (c.hot_token && rng.below(2) == 0) token = 0;  // half of all rows to token 0
    const int64_t roll = rng.below(100);
    if (roll < 5)
      token = -1;
    else if (roll == 5)
      token = T + rng.below(10);  // out of range: dropped
    else if (c.odd_indices && roll < 25)
      token = odd_out_of_range(c.idx, T, token, rng);
    r.index_values[row] = token;
  }
  for (int64_t row = 0; row < r.rows; ++row) {  // ascending rows, the documented order
    const int64_t t = r.index_values[row];
    if (t >= 0 && t < T) r.per_token[t].push_back({row, row});
  }
  return r;
}

// Runs one case; returns "" or a description of the first problems found.
std::string run_case(const Case& c, moejit_runtime_t runtime, Scratch& s) {
  const Pools& p = pools();
  Rng rng(c.seed * 7 + 1);
  const Routing routing = make_routing(c, rng);
  const int64_t T = c.tokens, H = c.hidden;
  const int64_t e_stride = H + c.expert_pad, o_stride = H + c.out_pad;
  const int in_b = dtype_bytes(c.in), out_b = dtype_bytes(c.out);
  if (static_cast<size_t>(c.expert_offset + routing.rows * e_stride) > kPoolElems)
    return "case too large for the pool";
  const int64_t gate_offset = rng.below(1000);

  // Indices.
  const size_t idx_b = c.idx == MOEJIT_INDEX_INT64 ? 8 : 4;
  std::vector<uint8_t> idx_host(routing.index_values.size() * idx_b);
  for (size_t i = 0; i < routing.index_values.size(); ++i) {
    if (idx_b == 8) {
      const int64_t v = routing.index_values[i];
      std::memcpy(&idx_host[i * 8], &v, 8);
    } else {
      const int32_t v = static_cast<int32_t>(routing.index_values[i]);
      std::memcpy(&idx_host[i * 4], &v, 4);
    }
  }
  Scratch::grow(&s.indices, &s.indices_bytes, std::max<size_t>(idx_host.size(), 16));
  if (!idx_host.empty())
    cudaMemcpyAsync(s.indices, idx_host.data(), idx_host.size(), cudaMemcpyHostToDevice, s.stream);

  // Output: poison everywhere; in accumulate mode, random values inside the rows.
  const size_t out_elems = static_cast<size_t>(c.out_offset + T * o_stride + kGuardElems);
  std::vector<uint8_t> init(out_elems * out_b, 0xFF);
  if (c.accumulate)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(&init[(c.out_offset + t * o_stride) * out_b],
                  &p.extra_host[c.out][((t * 977) % 4096) * 7168 * out_b], H * out_b);
  Scratch::grow(&s.out, &s.out_bytes, init.size());

  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = c.layout;
  a.num_tokens = T;
  a.top_k = c.top_k;
  a.num_rows = routing.rows;
  a.hidden_dim = H;
  a.expert_hidden = static_cast<uint8_t*>(p.device[c.in]) + c.expert_offset * in_b;
  a.expert_dtype = c.in;
  a.expert_row_stride = e_stride;
  a.gates = c.gates ? p.gates_device + gate_offset : nullptr;
  a.indices = c.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : s.indices;
  a.index_type = c.idx;
  a.out = static_cast<uint8_t*>(s.out) + c.out_offset * out_b;
  a.out_dtype = c.out;
  a.out_row_stride = o_stride;
  a.scale = c.scale;
  a.accumulate = c.accumulate ? 1 : 0;
  a.dependent_launch = c.dependent_launch ? 1 : 0;
  size_t ws = 0;
  if (moejit_combine_workspace_size(&a, &ws) != MOEJIT_SUCCESS)
    return std::string("workspace size: ") + moejit_last_error_message();
  if (ws > 0) {
    Scratch::grow(&s.workspace, &s.workspace_bytes, ws);
    // Fill the workspace with garbage: the library must not depend on its contents.
    cudaMemsetAsync(s.workspace, 0xA5, ws, s.stream);
    a.workspace = s.workspace;
    a.workspace_bytes = ws;
  }

  std::vector<uint8_t> got[2];
  for (int run = 0; run < 2; ++run) {
    cudaMemcpyAsync(s.out, init.data(), init.size(), cudaMemcpyHostToDevice, s.stream);
    const moejit_status st = moejit_runtime_combine(runtime, &a, s.stream);
    if (st != MOEJIT_SUCCESS)
      return std::string(moejit_status_name(st)) + ": " + moejit_last_error_message();
    got[run].resize(init.size());
    cudaMemcpyAsync(got[run].data(), s.out, init.size(), cudaMemcpyDeviceToHost, s.stream);
    const cudaError_t err = cudaStreamSynchronize(s.stream);
    if (err != cudaSuccess) return std::string("CUDA error: ") + cudaGetErrorString(err);
  }
  if (got[0] != got[1]) return "two identical calls gave different bits (not deterministic)";

  // Check every element.
  std::ostringstream problems;
  int n_problems = 0;
  auto problem = [&](const std::string& what) {
    if (n_problems++ < 4) problems << what << "; ";
  };
  const uint8_t* expert = p.host[c.in].data() + c.expert_offset * in_b;
  const std::vector<uint8_t>& out = got[0];
  std::vector<double> ref(static_cast<size_t>(H)), mag(static_cast<size_t>(H));
  std::vector<float> chain(static_cast<size_t>(H)), piece(static_cast<size_t>(H));
  int chain_mismatches = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::fill(ref.begin(), ref.end(), 0.0);
    std::fill(mag.begin(), mag.end(), 0.0);
    std::fill(chain.begin(), chain.end(), 0.0f);
    std::fill(piece.begin(), piece.end(), 0.0f);
    int64_t in_piece = 0;
    for (const auto& [row, gi] : routing.per_token[t]) {
      const float g = c.gates ? p.gates_host[gate_offset + gi] : 1.0f;
      if (in_piece == kPieceRows) {  // moejit.h: past 128 rows, pieces summed in order
        for (int64_t h = 0; h < H; ++h) {
          chain[h] += piece[h];
          piece[h] = 0.0f;
        }
        in_piece = 0;
      }
      ++in_piece;
      for (int64_t h = 0; h < H; ++h) {
        const float x = decode(expert, c.in, static_cast<size_t>(row * e_stride + h));
        ref[h] += static_cast<double>(g) * x;
        mag[h] += std::fabs(static_cast<double>(g) * x);
        piece[h] = std::fmaf(g, x, piece[h]);
      }
    }
    for (int64_t h = 0; h < H; ++h) chain[h] += piece[h];
    const size_t row_start = static_cast<size_t>(c.out_offset + t * o_stride);
    for (int64_t h = 0; h < H; ++h) {
      double expected = c.scale * ref[h];
      double magnitude = std::fabs(c.scale) * mag[h];
      if (c.accumulate) {
        const double old = decode(init.data(), c.out, row_start + h);
        expected += old;
        magnitude += std::fabs(old);
      }
      const double value = decode(out.data(), c.out, row_start + h);
      // The documented order, exactly: one fp32 fma per row in per_token order (k order; the
      // token index: ascending rows, in pieces of 128 past that many), then scale * sum + old in
      // one fma, rounded once to the output type. Any other summation order (say, a list left in
      // atomic arrival order) shows up here in the last bits even where it stays within the
      // tolerance below.
      {
        const float old = c.accumulate ? decode(init.data(), c.out, row_start + h) : 0.0f;
        uint8_t want[4], have[4];
        encode(want, c.out, 0, std::fmaf(chain[h], c.scale, old));
        std::memcpy(have, &out[(row_start + h) * out_b], static_cast<size_t>(out_b));
        if (std::memcmp(want, have, static_cast<size_t>(out_b)) != 0 && chain_mismatches++ == 0) {
          std::ostringstream m;
          m << "out[" << t << "][" << h << "] = " << value << " is not the fp32 fma chain in "
            << "the documented order, " << decode(want, c.out, 0);
          problem(m.str());
        }
      }
      const double tol =
          tolerance(c.out, magnitude, expected, static_cast<int>(routing.per_token[t].size()));
      if (!(std::fabs(value - expected) <= tol)) {
        std::ostringstream m;
        m << "out[" << t << "][" << h << "] = " << value << ", expected " << expected
          << " (tolerance " << tol << ")";
        problem(m.str());
      }
    }
    for (int64_t h = H; h < o_stride; ++h)
      for (int b = 0; b < out_b; ++b)
        if (out[(row_start + h) * out_b + b] != 0xFF) {
          problem("padding of row " + std::to_string(t) + " was written");
          break;
        }
  }
  for (size_t i = 0; i < static_cast<size_t>(c.out_offset) * out_b; ++i)
    if (out[i] != 0xFF) {
      problem("memory before out was written");
      break;
    }
  for (size_t i = static_cast<size_t>(c.out_offset + T * o_stride) * out_b; i < out.size(); ++i)
    if (out[i] != 0xFF) {
      problem("memory after the last row was written");
      break;
    }
  if (n_problems > 0) problems << "(" << n_problems << " problems)";
  return problems.str();
}

// The tests' common call: bf16 rows into bf16 out, int32 indices, default strides; each test
// sets what else it needs (scale, workspace, ...).
moejit_combine_args bf16_args(moejit_layout layout, int64_t tokens, int64_t top_k, int64_t rows,
                              int64_t hidden, const void* expert, const float* gates,
                              const void* indices, void* out) {
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = layout;
  a.num_tokens = tokens;
  a.top_k = top_k;
  a.num_rows = rows;
  a.hidden_dim = hidden;
  a.expert_hidden = expert;
  a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.gates = gates;
  a.indices = indices;
  a.index_type = MOEJIT_INDEX_INT32;
  a.out = out;
  a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  return a;
}

// Sizes a's workspace and points a at *workspace, which it allocates while it is null (a test
// that calls again with the same shape reuses it; the caller frees it). Nothing for a layout that
// needs no workspace.
void attach_workspace(moejit_combine_args* a, void** workspace) {
  size_t bytes = 0;
  ASSERT_EQ(moejit_combine_workspace_size(a, &bytes), MOEJIT_SUCCESS)
      << moejit_last_error_message();
  if (bytes == 0) return;
  if (*workspace == nullptr) CUDA_OK(cudaMalloc(workspace, bytes));
  a->workspace = *workspace;
  a->workspace_bytes = bytes;
}

// Runs cases on `threads` worker threads (each with its own stream and scratch, all sharing one
// runtime: this also exercises concurrent compiles and lookups).
std::vector<std::string> run_cases(const std::vector<Case>& cases, moejit_runtime_t rt,
                                   unsigned threads) {
  return run_on_workers<Scratch>(cases, threads,
                                 [&](const Case& c, Scratch& s) { return run_case(c, rt, s); });
}

// Runs cases on a fresh memory-only runtime and reports every failure.
void expect_cases_pass(const std::vector<Case>& cases, int threads) {
  moejit_runtime_t rt = memory_only_runtime();
  const auto failures = run_cases(cases, rt, threads);
  for (const auto& f : failures) ADD_FAILURE() << f;
  moejit_runtime_destroy(rt);
}

// expect_cases_pass on every worker, the largest cases first so the workers finish together.
void expect_cases_pass_largest_first(std::vector<Case> cases) {
  std::stable_sort(cases.begin(), cases.end(), [](const Case& a, const Case& b) {
    return a.tokens * a.top_k * a.hidden > b.tokens * b.top_k * b.hidden;
  });
  expect_cases_pass(cases, worker_count());
}

// The n-th of the dtype pairs and index types taken in turn.
struct TypesInTurn {
  moejit_dtype in, out;
  moejit_index_type index;
};
TypesInTurn types_in_turn(int n) {
  return {static_cast<moejit_dtype>(n % 3), static_cast<moejit_dtype>(n / 3 % 3),
          static_cast<moejit_index_type>(n / 9 % 2)};
}

class CombineGpu : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_F(CombineGpu, FullMatrixAgainstFloat64Reference) {
  std::vector<Case> cases;
  uint64_t seed = 1;
  for (int layout = 0; layout < 3; ++layout)
    for (int in = 0; in < 3; ++in)
      for (int out = 0; out < 3; ++out)
        for (int idx = 0; idx < 2; ++idx) {
          if (layout == MOEJIT_LAYOUT_TOKEN_MAJOR && idx == 1) continue;
          for (int64_t hidden : {1, 7, 128, 2880, 4096, 7168})
            for (int64_t tokens : {0, 1, 33, 4096})
              for (int64_t top_k : {1, 2, 8})
                cases.push_back(
                    vary(Case{static_cast<moejit_layout>(layout), static_cast<moejit_dtype>(in),
                              static_cast<moejit_dtype>(out), static_cast<moejit_index_type>(idx),
                              hidden, tokens, top_k, seed++}));
        }
  // Big cases first so the workers finish together.
  std::stable_sort(cases.begin(), cases.end(), [](const Case& a, const Case& b) {
    return a.tokens * a.top_k * a.hidden > b.tokens * b.top_k * b.hidden;
  });
  moejit_runtime_t rt = memory_only_runtime();
  const auto failures = run_cases(cases, rt, worker_count());
  for (size_t i = 0; i < failures.size() && i < 40; ++i) ADD_FAILURE() << failures[i];
  EXPECT_EQ(failures.size(), 0u) << "of " << cases.size() << " cases";
  moejit_stats st;
  st.struct_size = sizeof(st);
  moejit_runtime_get_stats(rt, &st);
  std::printf("%zu cases, %llu compiles (%.1f s of NVRTC), %llu launches, %llu memory hits\n",
              cases.size(), static_cast<unsigned long long>(st.compiles), st.compile_seconds,
              static_cast<unsigned long long>(st.launches),
              static_cast<unsigned long long>(st.memory_hits));
  moejit_runtime_destroy(rt);
}

// More rows per token than one batch of eight: 9-16 in one batch of their own in the fixed layouts
// (combine_common.cuh, kWideBatch), 17 and 64 as a batch of eight and then two at a time; the token
// index holds eight and lists the rest. Decode, mid-size and prefill geometries, short rows and a
// partial tail vector, the dtype pairs and index types in turn, the matrix's variations, each
// checked against the fp32 chain bit for bit.
TEST_F(CombineGpu, TopKPastEightAgainstFloat64Reference) {
  const moejit_dtype types[][2] = {{MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16},
                                   {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32},
                                   {MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32}};
  std::vector<Case> cases;
  uint64_t seed = 7000;
  int n = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (int64_t top_k : {9, 12, 16, 17, 64})
      for (int64_t tokens : {1, 33, 300})
        for (int64_t hidden : {7, 2880, 7168}) {
          const auto& t = types[n % 3];
          const auto idx = static_cast<moejit_index_type>((n / 3) % 2);
          ++n;
          cases.push_back(vary(Case{static_cast<moejit_layout>(layout), t[0], t[1], idx, hidden,
                                    tokens, top_k, seed++}));
        }
  expect_cases_pass(cases, worker_count());
}

// Random shapes off the common grid: hidden sizes around powers of two and up to the maximum (tail
// vectors, one-element rows, rows of 2^16), 1 to 5000 tokens (decode, mid-size and prefill
// geometries, partial token groups), top_k 1 to 64 (one batch, the wide batch, the later rows two
// at a time), every dtype pair and index type, with the matrix's variations (gates, scale,
// accumulate, padded strides, misaligned pointers), dependent launches, and for the token index
// balanced, random, half-on-one-token or exactly-n-on-one-token routing; the gather map sometimes
// with a buffer of a few rows named at random (repeats, out-of-range entries). Each case checked
// bit for bit against the fp32 chain, its padding and guard region against poison.
TEST_F(CombineGpu, RandomUnusualShapesAgainstTheFp32Chain) {
  const int64_t hiddens[] = {1,    2,    3,    5,    8,    9,     15,    17,    31,   33,   63,
                             65,   100,  127,  129,  255,  257,   511,   513,   1000, 1023, 1025,
                             2049, 3000, 4097, 7169, 8191, 16385, 32767, 65535, 65536};
  const int64_t tokens[] = {1, 2, 3, 5, 16, 17, 63, 64, 65, 100, 129, 257, 600, 1000, 2500, 5000};
  const int64_t top_ks[] = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                            12, 13, 15, 16, 17, 20, 31, 33, 48, 64};
  Rng r(424242);
  std::vector<Case> cases;
  for (int i = 0; i < 600; ++i) {
    const auto layout = static_cast<moejit_layout>(r.below(3));
    const int64_t hidden = hiddens[r.below(std::size(hiddens))];
    const int64_t top_k = top_ks[r.below(std::size(top_ks))];
    int64_t t = tokens[r.below(std::size(tokens))];
    while (t > 1 && t * top_k * hidden > (int64_t{24} << 20)) t /= 2;  // keep the reference short
    Case c =
        vary(Case{layout, static_cast<moejit_dtype>(r.below(3)),
                  static_cast<moejit_dtype>(r.below(3)), static_cast<moejit_index_type>(r.below(2)),
                  hidden, t, top_k, static_cast<uint64_t>(90000 + i)});
    c.dependent_launch = r.below(3) == 0;
    if (layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
      const int64_t mode = r.below(4);
      c.random_routing = mode == 1;
      c.hot_token = mode == 2;
      if (mode == 3 && t >= 2) c.hot_rows = r.below(t * top_k + 1);
    } else if (layout == MOEJIT_LAYOUT_GATHER_MAP && r.below(4) == 0) {
      c.gather_rows = r.below(2 * top_k + 1);
    }
    cases.push_back(c);
  }
  expect_cases_pass_largest_first(std::move(cases));
}

// Skewed routing: one token receives far more rows than the workspace lists hold, so the combine
// takes its overflow path; the result must still match, bit for bit across calls.
TEST_F(CombineGpu, TokenIndexWithAHotToken) {
  std::vector<Case> cases;
  uint64_t seed = 5000;
  // Half of all rows go to token 0: T=64 x 8 rows puts ~256 rows on it against a 32-entry list.
  // T=4, 8 and 16 (32, 64 and 128 rows) take the single launch's small-call form, where every warp
  // reads all of token_idx and lists its token's rows a 16-entry window at a time, with ~20, ~40
  // and ~70 rows on token 0; T=17 (136 rows) the one-token-per-block scan, past its 32-entry list.
  for (moejit_dtype in : {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT32})
    for (moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64})
      for (int64_t tokens : {2, 4, 8, 16, 17, 64, 1000}) {
        Case c = vary(Case{MOEJIT_LAYOUT_TOKEN_INDEX, in, MOEJIT_DTYPE_BFLOAT16, idx, 2880, tokens,
                           8, seed++});
        c.random_routing = true;
        c.hot_token = true;
        cases.push_back(c);
      }
  expect_cases_pass(cases, 4);
}

// Token-index shapes (bf16) whose token 0 gets exactly n rows for each n in `hot`, the other rows
// spread over the other tokens; both index types, the other arguments varied.
struct HotTokenShape {
  int64_t hidden, tokens, top_k;
  std::vector<int64_t> hot;
};
std::vector<Case> hot_token_cases(const std::vector<HotTokenShape>& shapes, uint64_t seed,
                                  bool aligned_rows) {
  std::vector<Case> cases;
  for (const HotTokenShape& sh : shapes)
    for (moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64})
      for (int64_t n : sh.hot) {
        Case c = vary(Case{MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                           idx, sh.hidden, sh.tokens, sh.top_k, seed++});
        c.hot_rows = n;
        if (aligned_rows) c.expert_pad = c.out_pad = c.expert_offset = c.out_offset = 0;
        cases.push_back(c);
      }
  return cases;
}

// The single launch's small-call form (calls with at most 128 rows) lists a token's rows a window
// of list entries at a time (8 at K <= 4, 16 at K = 8) and scans token_idx again for each later
// window: token 0 gets exactly n rows, on and around the window edges and up to every row.
TEST_F(CombineGpu, SmallCallScanWindowsAHotTokensRows) {
  expect_cases_pass(hot_token_cases({{4096, 64, 2, {1, 7, 8, 9, 16, 17, 100, 128}},
                                     {2880, 16, 4, {7, 8, 9, 33, 64}},
                                     {7168, 16, 8, {15, 16, 17, 32, 33, 127, 128}},
                                     {7168, 9, 8, {16, 17, 72}}},
                                    6000, false),
                    4);
}

// The single launch with one token per block and more rows than the block has threads (once the
// slab form, now the shared-list scan): token 0 gets exactly n rows, on and around its list's
// capacity (16 at K = 2, 32 at K = 4 and 8) and past it, where whole warps walk token_idx
// (add_rows_by_ordered_walk), in pieces of 128 rows past that many (on and around 128, 256): up
// to every row of the call. Also a list longer than the block (128 entries, 64 threads: 40 rows
// per token on average, H = 512).
// KernelSpec.SlabListTestShapesTakeTheOneTokenBlockScan checks that these shapes take that form
// with those capacities, for 16-byte rows (other vector widths may change the geometry).
TEST_F(CombineGpu, SlabScanListsAHotTokensRows) {
  expect_cases_pass(
      hot_token_cases(
          {{7168, 17, 8, {16, 31, 32, 33, 136}},
           {7168, 64, 8, {17, 31, 32, 33, 48, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 512}},
           {4096, 256, 2, {8, 15, 16, 17, 32, 33, 100, 128, 129, 512}},
           {2880, 64, 4, {16, 31, 32, 33, 256}},
           {512, 4, 40, {40, 64, 65, 100, 128, 129, 160}}},
          6500, true),
      4);
}

// Past a token's list in the other geometries: token 0 gets exactly n rows, on and around the
// list's capacity (16 at K <= 2, 32 at K = 8), on and around a piece (128 rows) and past it. On the
// list path token_index_heavy ranks and sums the token's rows (token_index_heavy.cuh) whatever the
// combine's geometry: 128-thread groups loading rows through L1 (T8200 H2048, K = 1) and 64-thread
// groups (T1000 H2880, K = 8). The single launch walks token_idx: 32-thread groups, 16 tokens per
// block (T1536 H256, K = 2) in whole warps, 256 entries per step; groups narrower than a warp
// (add_rows_by_ordered_walk's per-thread walk, 8 entries per step): 8-thread groups (T1536 H64)
// and 4-thread groups with 128-entry lists (T100 H32, 20 rows per token on average: 64 tokens per
// block, so that the lists fit shared memory). KernelSpec.WalkTestShapesTakeTheirGroups checks
// those geometries.
TEST_F(CombineGpu, WalksPastAHotTokensList) {
  expect_cases_pass(hot_token_cases({{2048, 8200, 1, {16, 17, 100, 128, 129, 1000}},
                                     {2880, 1000, 8, {32, 33, 128, 129, 300, 8000}},
                                     {256, 1536, 2, {16, 17, 128, 129, 200, 3072}},
                                     {64, 1536, 2, {16, 17, 129, 200, 3072}},
                                     {32, 100, 20, {20, 100, 128, 129, 2000}}},
                                    6800, true),
                    4);
}

// Issue 58's awkward hidden sizes (1000, 1001, 2880, 5000, 7000, 7169), every layout, every dtype
// pair in turn, both index types in turn, at batch sizes past mid-size (the prefill geometry: four
// slots per thread for the 2- and 4-byte vectors of odd sizes) and at mid-size (H = 1000 at K = 8:
// 128-thread groups where a row is no whole number of lines), each in three alignments: buffers
// and strides aligned (odd sizes: 2-byte vectors), base pointers one and three elements off (the
// narrowest vectors), and odd sizes with strides padded to 16 bytes (wide vectors and a partial
// tail vector). Checked against the float64 reference and bit for bit against the fp32 chain.
TEST_F(CombineGpu, AwkwardHiddenSizesAtEveryAlignment) {
  std::vector<Case> cases;
  uint64_t seed = 5800;
  int n = 0;
  for (int layout = 0; layout < 3; ++layout)
    for (const int64_t hidden : {1000, 1001, 2880, 5000, 7000, 7169})
      for (const int64_t top_k : {2, 8})
        for (int alignment = 0; alignment < 3; ++alignment) {
          const TypesInTurn t = types_in_turn(n++);
          const auto idx = layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? MOEJIT_INDEX_INT32 : t.index;
          // About 2^24 row elements: past mid-size (T * vectors > 2^21) for the odd sizes' 2-byte
          // vectors, mid-size for H = 1000 at K = 8 (T = 2097).
          const int64_t tokens = std::max<int64_t>(64, (int64_t{1} << 24) / (top_k * hidden));
          Case c = vary(Case{static_cast<moejit_layout>(layout), t.in, t.out, idx, hidden, tokens,
                             top_k, seed++});
          c.expert_offset = alignment == 1 ? 1 : 0;
          c.out_offset = alignment == 1 ? 3 : 0;
          c.expert_pad = alignment == 2 ? (8 - hidden % 8) % 8 : 0;
          c.out_pad = alignment == 2 ? (8 - hidden % 8) % 8 : 0;
          cases.push_back(c);
        }
  expect_cases_pass_largest_first(std::move(cases));
}

// Issue 58's skewed routings of the token index: every row on one token; 1% of the tokens with half
// the rows; token popularity Zipf(1.2); each with 0% and 25% of the rows dropped. Small calls (the
// single launch: T64 K8, T16 K8, the original scatter-add shape T1536 K2 H128 fp32, T384 K8) and
// prefill calls (the list path: T4096 K8, T8192 K2), every dtype pair and both index types in
// turn, the matrix's variations (gates, scale, accumulate, padded strides, misaligned pointers);
// each checked against the float64 reference and bit for bit against the fp32 chain in pieces of
// 128 rows, twice (the two outputs bitwise equal).
TEST_F(CombineGpu, SkewedRoutingsAgainstFloat64Reference) {
  struct Shape {
    int64_t tokens, top_k, hidden;
  };
  const Shape shapes[] = {{64, 8, 7168},  {16, 8, 2880},   {1536, 2, 128},
                          {384, 8, 4096}, {4096, 8, 2048}, {8192, 2, 1024}};
  std::vector<Case> cases;
  uint64_t seed = 58000;
  int n = 0;
  for (const Shape& sh : shapes)
    for (const Case::Skew skew : {Case::kOneToken, Case::kTopPercent, Case::kZipf})
      for (const int64_t drop : {0, 25}) {
        const TypesInTurn t = types_in_turn(n++);
        Case c = vary(Case{MOEJIT_LAYOUT_TOKEN_INDEX, t.in, t.out, t.index, sh.hidden, sh.tokens,
                           sh.top_k, seed++});
        c.skew = skew;
        c.skew_drop = drop;
        cases.push_back(c);
      }
  expect_cases_pass_largest_first(std::move(cases));
}

// The gather map's mid-size calls with eight rows per token take eight 16-slot token groups per
// 128-thread block (combine_dispatch.cpp, choose_geometry; token-major two per 32-thread block):
// calls across the upper half of the mid-size range (T = 1170 / 1171 at H = 7168 in 16-byte
// vectors, 2047 / 2049 at H = 4096, 2^20 token x vector slots; with fp32 in 4-element vectors T =
// 585 / 600 and 1023 / 1025) and at its end (T = 2339, 2^21 slots), token counts that leave the
// last block partial, no slot -1 (one in a hundred out of range), 5% and 88% -1 (most tokens with
// one row or none: the case the wider blocks are for) and every slot -1, each dtype pair's vector
// width, both index types, the matrix's variations but with aligned, unpadded buffers so that the
// vector width, and with it the geometry, is the one named.
TEST_F(CombineGpu, GatherMapMidSizeBlocksWithMostSlotsDropped) {
  struct Types {
    moejit_dtype in, out;
    int64_t hidden, tokens[3];
  };
  const Types types[] = {
      {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, 7168, {1170, 1171, 2339}},
      {MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16, 4096, {2047, 2049, 4093}},
      {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_BFLOAT16, 7168, {585, 600, 1169}},
      {MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32, 4096, {1023, 1025, 2047}},
  };
  std::vector<Case> cases;
  uint64_t seed = 9100;
  int n = 0;
  for (const Types& t : types)
    for (int64_t tokens : t.tokens)
      for (int64_t drop : {0, 5, 88, 100}) {
        Case c = vary(Case{MOEJIT_LAYOUT_GATHER_MAP, t.in, t.out,
                           static_cast<moejit_index_type>(n++ % 2), t.hidden, tokens, 8, seed++});
        c.expert_pad = c.out_pad = c.expert_offset = c.out_offset = 0;
        c.drop_percent = drop;
        cases.push_back(c);
      }
  expect_cases_pass(cases, worker_count());
}

// moejit.h: an index outside its range is dropped like -1, whatever its value. The other cases
// draw -1 and values just past the end; here a fifth of the entries are negative other than -1,
// the bound itself, INT32_MIN / INT32_MAX, and with int64 indices values that pass 2^31, the int64
// extremes and values whose low 32 bits name a row or token in range (odd_out_of_range). Each
// kernel that reads indices in turn, both index types: the gather map's one-token kernel (T = 1, a
// few rows), its fixed kernel at decode (K = 8), with four slots per thread (K = 2 at prefill), on
// the mid-size 2-D grid (K = 8), with 9-16 rows in one batch (K = 12) and later rows two at a time
// (K = 17); the token index's one-token kernel (T = 1, 8 rows), the single launch's small-call form
// (T = 1 with 100 rows, T = 16 with K = 8) and one-token blocks past it (T = 1 with 300 rows,
// T = 64 with K = 8),
// its atomic scan of short rows (T = 1536, H = 64: 8-thread groups), and the list path with one row
// held (T = 8200, K = 1) and with eight (T = 4096, K = 8), balanced and random.
// A heavy token's sum is fixed by the input alone (moejit.h): the same rows give the same bits on
// the single launch (its walk past a list), on the list path (token_index_heavy), with another
// vector width (an output one element off 16 bytes: other modules, other geometry) and with
// another workspace (other garbage). 512 rows of H = 7168: token 0 gets 300 (three pieces), the
// others spread over tokens 1-63 or dropped; T = 64 takes the single launch, the same token_idx
// with T = 5000 (tokens 64 and up without rows) the list path. Rows 0-63 are compared bitwise
// across the four calls, the list path's other rows must be zero.
TEST_F(CombineGpu, HeavyTokenIsTheSameOnEveryPathAndGeometry) {
  const Pools& p = pools();
  const int64_t R = 512, H = 7168, hot = 300;
  Rng rng(5858);
  std::vector<int32_t> token_idx(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) token_idx[i] = static_cast<int32_t>(1 + rng.below(63));
  for (int64_t n = 0; n < hot;) {  // 300 distinct rows of token 0
    const int64_t r = rng.below(R);
    if (token_idx[r] != 0) {
      token_idx[r] = 0;
      ++n;
    }
  }
  for (int64_t i = 0; i < R; i += 17)
    if (token_idx[i] != 0) token_idx[i] = -1;  // some dropped
  void *indices, *out;
  void* workspaces[4] = {};
  const int64_t most_tokens = 5000;
  const size_t out_bytes = static_cast<size_t>((most_tokens * H + 8) * 2);
  CUDA_OK(cudaMalloc(&indices, static_cast<size_t>(R) * 4));
  CUDA_OK(
      cudaMemcpy(indices, token_idx.data(), static_cast<size_t>(R) * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc(&out, out_bytes));
  moejit_runtime_t rt = memory_only_runtime();
  struct Run {
    const char* what;
    int64_t tokens, out_offset;  // out_offset: elements past the 256-byte aligned buffer
    bool other_workspace;
  };
  const Run runs[] = {{"single launch, T = 64", 64, 0, false},
                      {"list path, T = 5000", most_tokens, 0, false},
                      {"list path, output one element off 16 bytes", most_tokens, 1, false},
                      {"list path, another workspace", most_tokens, 0, true}};
  std::vector<std::vector<uint16_t>> got;
  for (const Run& run : runs) {
    SCOPED_TRACE(run.what);
    void** ws = &workspaces[got.size()];  // a buffer of its own for each call
    uint16_t* o = static_cast<uint16_t*>(out) + run.out_offset;
    moejit_combine_args a = bf16_args(MOEJIT_LAYOUT_TOKEN_INDEX, run.tokens, 0, R, H,
                                      p.device[MOEJIT_DTYPE_BFLOAT16], p.gates_device, indices, o);
    a.scale = 0.75f;
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, ws));
    CUDA_OK(cudaMemset(a.workspace, run.other_workspace ? 0x5A : 0xA5, a.workspace_bytes));
    CUDA_OK(cudaMemset(out, 0xFF, out_bytes));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> rows(static_cast<size_t>(run.tokens * H));
    CUDA_OK(cudaMemcpy(rows.data(), o, rows.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = static_cast<size_t>(64 * H); i < rows.size(); ++i)
      if (rows[i] != 0) {
        ADD_FAILURE() << "element " << i << " of a token without rows is " << rows[i];
        break;
      }
    rows.resize(static_cast<size_t>(64 * H));
    got.push_back(std::move(rows));
  }
  for (size_t i = 1; i < got.size(); ++i)
    EXPECT_TRUE(got[i] == got[0]) << runs[i].what << " differs from " << runs[0].what;
  // And token 0 is right (the float64 reference, a bf16 rounding).
  for (int64_t h = 0; h < H; h += 61) {
    double ref = 0, mag = 0;
    for (int64_t r = 0; r < R; ++r)
      if (token_idx[r] == 0) {
        const double x = bf16_term(p, static_cast<size_t>(r), static_cast<size_t>(r * H + h));
        ref += x;
        mag += std::fabs(x);
      }
    ref *= 0.75;
    EXPECT_LE(std::fabs(bf16_to_float(got[0][h]) - ref),
              tolerance(MOEJIT_DTYPE_BFLOAT16, 0.75 * mag, ref, static_cast<int>(hot)))
        << "h = " << h;
  }
  moejit_runtime_destroy(rt);
  cudaFree(indices);
  cudaFree(out);
  for (void* ws : workspaces)
    if (ws) cudaFree(ws);
}

TEST_F(CombineGpu, OutOfRangeIndicesOfEveryKindAreDropped) {
  struct Shape {
    moejit_layout layout;
    int64_t hidden, tokens, top_k;
    bool random_routing;
    int64_t gather_rows;
  };
  const Shape shapes[] = {
      {MOEJIT_LAYOUT_GATHER_MAP, 7168, 1, 8, false, 6},
      {MOEJIT_LAYOUT_GATHER_MAP, 7168, 1, 8, false, -1},
      {MOEJIT_LAYOUT_GATHER_MAP, 4096, 4096, 2, false, -1},
      {MOEJIT_LAYOUT_GATHER_MAP, 7168, 300, 8, false, -1},
      {MOEJIT_LAYOUT_GATHER_MAP, 2880, 100, 12, false, -1},
      {MOEJIT_LAYOUT_GATHER_MAP, 1000, 33, 17, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 1, 8, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 2880, 1, 100, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 2880, 1, 300, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 16, 8, true, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 7168, 64, 8, true, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 64, 1536, 2, true, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 2048, 8200, 1, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 2880, 4096, 8, false, -1},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 2880, 4096, 8, true, -1},
  };
  std::vector<Case> cases;
  uint64_t seed = 8800;
  for (const Shape& sh : shapes)
    for (moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64}) {
      Case c = vary(Case{sh.layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, idx, sh.hidden,
                         sh.tokens, sh.top_k, seed++});
      c.random_routing = sh.random_routing;
      c.gather_rows = sh.gather_rows;
      c.odd_indices = true;
      cases.push_back(c);
    }
  expect_cases_pass(cases, 4);
}

// More rows than token_index_assign has threads (at most 4096 blocks of 256): each thread loads its
// first token_idx entry before waiting for the clear, and every later one in its grid-stride loop.
// 140000 tokens x 8 rows = 1,120,000 rows.
TEST_F(CombineGpu, TokenIndexListsPastOneGridOfRows) {
  std::vector<Case> cases;
  uint64_t seed = 7000;
  for (moejit_index_type idx : {MOEJIT_INDEX_INT32, MOEJIT_INDEX_INT64})
    for (bool random : {false, true}) {
      cases.push_back(Case{MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT32,
                           idx, 8, 140000, 8, seed++});
      cases.back().random_routing = random;
    }
  expect_cases_pass(cases, 2);
}

TEST_F(CombineGpu, EightThreadsOnDifferentShapesConcurrently) {
  const Case shapes[8] = {
      {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32,
       7168, 32, 8, 11},
      {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT64,
       4096, 64, 2, 12},
      {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32,
       128, 1536, 2, 13},
      {MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32,
       128, 1536, 2, 14},
      {MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT64,
       2880, 256, 4, 15},
      {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT16, MOEJIT_INDEX_INT32,
       2048, 512, 8, 16},
      {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT32,
       5120, 100, 1, 17},
      {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32,
       3584, 200, 8, 18},
  };
  // Each thread repeats its shape: the first calls race to compile, later ones hit.
  std::vector<Case> cases;
  for (int rep = 0; rep < 6; ++rep)
    for (const Case& c : shapes) {
      Case v = vary(c);
      v.seed = c.seed * 100 + static_cast<uint64_t>(rep);
      cases.push_back(v);
    }
  moejit_runtime_t rt = memory_only_runtime();
  const auto failures = run_cases(cases, rt, 8);
  for (const auto& f : failures) ADD_FAILURE() << f;
  moejit_stats st;
  st.struct_size = sizeof(st);
  moejit_runtime_get_stats(rt, &st);
  // Concurrent misses of one spec compile it once: at most one compile per distinct spec
  // (variations of alignment may add specs, never duplicates).
  EXPECT_LE(st.compiles, 8u * 4u);
  EXPECT_GT(st.memory_hits, 0u);
  moejit_runtime_destroy(rt);
}

// A warm call is one module-cache lookup and its launches, nothing else. The token-index list
// path (600 tokens x 8 rows: past the single launch's limit) launches clear, assign,
// token_index_heavy and combine, and finds the helpers' module through the combine's entry: still
// one lookup per call.
TEST_F(CombineGpu, WarmCallsOnlyLaunch) {
  moejit_runtime_t rt = memory_only_runtime();
  Scratch s;
  cudaStreamCreate(&s.stream);
  const struct {
    Case c;
    unsigned launches_per_call;
  } setups[] = {{{MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                  MOEJIT_INDEX_INT32, 4096, 64, 2, 21},
                 1},
                {{MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                  MOEJIT_INDEX_INT32, 1024, 600, 8, 22},
                 4}};
  for (const auto& setup : setups) {
    SCOPED_TRACE(layout_str(setup.c.layout));
    ASSERT_EQ(run_case(setup.c, rt, s), "");  // compiles and loads; two calls
    moejit_stats before, after;
    before.struct_size = after.struct_size = sizeof(moejit_stats);
    moejit_runtime_get_stats(rt, &before);
    ASSERT_EQ(run_case(setup.c, rt, s), "");  // two warm calls
    moejit_runtime_get_stats(rt, &after);
    EXPECT_EQ(after.compiles, before.compiles);
    EXPECT_EQ(after.memory_hits, before.memory_hits + 2);
    EXPECT_EQ(after.launches, before.launches + 2 * setup.launches_per_call);
  }
  moejit_runtime_destroy(rt);
}

// Capture into a CUDA graph once warm, change the inputs' contents, replay: the replay must give
// exactly what a direct call on the new inputs gives. Token index twice: 33 tokens take the
// single-launch kernel; 600 tokens (4800 rows, 38 per thread: past its limit) take clear -> assign
// -> heavy -> combine, chained by programmatic dependent launch on sm_90+, which the capture must
// keep.
TEST_F(CombineGpu, CudaGraphCaptureAndReplay) {
  const Pools& p = pools();
  moejit_runtime_t rt = memory_only_runtime();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The last two replay a routing with a hot token (half the rows on token 0) that the captured
  // call did not have: the single launch walks past its list, the list path's token_index_heavy
  // finds work it did not have at capture (all of it decided on the device).
  const struct {
    moejit_layout layout;
    int64_t tokens;
    bool hot_on_replay;
  } setups[] = {{MOEJIT_LAYOUT_GATHER_MAP, 33, false},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 33, false},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 600, false},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 64, true},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 4096, true}};
  for (const auto& setup : setups) {
    const moejit_layout layout = setup.layout;
    SCOPED_TRACE(std::string(layout_str(layout)) + " T=" + std::to_string(setup.tokens) +
                 (setup.hot_on_replay ? " hot token on replay" : ""));
    const int64_t T = setup.tokens, K = 8, H = 7168;
    Rng rng(4242);
    Case c{layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, H, T, K, 1};
    c.random_routing = layout == MOEJIT_LAYOUT_TOKEN_INDEX;
    const Routing first = make_routing(c, rng);
    c.hot_token = setup.hot_on_replay;
    const Routing second = make_routing(c, rng);
    const size_t idx_bytes = first.index_values.size() * 4;
    // Copies and poison on the test's stream: a non-blocking stream does not wait for the legacy
    // stream, where a cudaMemset (or a pageable copy's DMA) may still be running.
    auto upload = [&](void* dst, const Routing& r) {
      std::vector<int32_t> v(r.index_values.begin(), r.index_values.end());
      CUDA_OK(cudaMemcpyAsync(dst, v.data(), idx_bytes, cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
    };
    void *indices, *out, *out_direct, *workspace = nullptr;
    const size_t out_bytes = static_cast<size_t>(T * H * 2);
    CUDA_OK(cudaMalloc(&indices, idx_bytes));
    CUDA_OK(cudaMalloc(&out, out_bytes));
    CUDA_OK(cudaMalloc(&out_direct, out_bytes));
    moejit_combine_args a = bf16_args(layout, T, K, first.rows, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                                      p.gates_device, indices, out);
    a.scale = 1.5f;
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    upload(indices, first);
    ASSERT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_SUCCESS)  // warm: compile + load
        << moejit_last_error_message();
    CUDA_OK(cudaStreamSynchronize(stream));

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    upload(indices, second);  // new routing, same buffers
    CUDA_OK(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));  // replaying twice changes nothing
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> replayed(out_bytes), direct(out_bytes);
    CUDA_OK(cudaMemcpy(replayed.data(), out, out_bytes, cudaMemcpyDeviceToHost));

    a.out = out_direct;
    CUDA_OK(cudaMemsetAsync(out_direct, 0xFF, out_bytes, stream));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_SUCCESS);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(direct.data(), out_direct, out_bytes, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(replayed == direct) << "graph replay differs from a direct call";
    // And the direct call is right: spot-check token 0 against the reference.
    for (int64_t h = 0; h < H; h += 97) {
      double ref = 0, mag = 0;
      for (const auto& [row, gi] : second.per_token[0]) {
        const double x = bf16_term(p, gi, static_cast<size_t>(row * H + h));
        ref += x;
        mag += std::fabs(x);
      }
      ref *= 1.5;
      EXPECT_NEAR(decode(direct.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(h)), ref,
                  tolerance(MOEJIT_DTYPE_BFLOAT16, 1.5 * mag, ref,
                            static_cast<int>(second.per_token[0].size())));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(indices);
    cudaFree(out);
    cudaFree(out_direct);
    if (workspace) cudaFree(workspace);
  }
  cudaStreamDestroy(stream);
  moejit_runtime_destroy(rt);
}

// The bench's producer kernel (tools/bench/producer_source.h): it lets its dependents be scheduled
// at once, as PDL-aware producers do, and writes the combine's input rows only after a spin, so a
// dependent that read memory before its wait would find poisoned rows. Compiled with NVRTC for
// this device, launched through the runtime.
class Producer {
 public:
  Producer() {
    const char* source = moejit_bench::kProducerSource;
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    supported_ = major >= 9;  // griddepcontrol: sm_90 and newer
    if (!supported_) return;
    nvrtcProgram prog;
    if (nvrtcCreateProgram(&prog, source, "producer.cu", 0, nullptr, nullptr) != NVRTC_SUCCESS) {
      error_ = "nvrtcCreateProgram failed";
      return;
    }
    const std::string arch = "--gpu-architecture=sm_" + std::to_string(major * 10 + minor);
    const char* options[] = {arch.c_str(), "--std=c++17"};
    const nvrtcResult compiled = nvrtcCompileProgram(prog, 2, options);
    size_t size = 0;
    if (compiled != NVRTC_SUCCESS) {
      nvrtcGetProgramLogSize(prog, &size);
      std::string log(size, '\0');
      nvrtcGetProgramLog(prog, log.data());
      error_ = "producer did not compile: " + log;
    } else {
      nvrtcGetCUBINSize(prog, &size);
      cubin_.resize(size);
      nvrtcGetCUBIN(prog, cubin_.data());
    }
    nvrtcDestroyProgram(&prog);
    if (!error_.empty()) return;
    if (cudaLibraryLoadData(&library_, cubin_.data(), nullptr, nullptr, 0, nullptr, nullptr, 0) !=
            cudaSuccess ||
        cudaLibraryGetKernel(&kernel_, library_, "moejit_bench_produce") != cudaSuccess)
      error_ = "cannot load the producer";
  }
  ~Producer() {
    if (library_ != nullptr) cudaLibraryUnload(library_);
  }
  bool supported() const { return supported_; }
  const std::string& error() const { return error_; }
  // Copies `bytes` (a multiple of 16) from src to dst after spinning `microseconds`.
  cudaError_t launch(cudaStream_t stream, const void* src, void* dst, size_t bytes,
                     double microseconds) const {
    unsigned long long words = bytes / 16;
    unsigned long long ns = static_cast<unsigned long long>(microseconds * 1e3);
    void* args[] = {&src, &dst, &words, &ns};
    return cudaLaunchKernel(reinterpret_cast<const void*>(kernel_), dim3(264), dim3(256), args, 0,
                            stream);
  }

 private:
  bool supported_ = false;
  std::string error_;
  std::vector<char> cubin_;
  cudaLibrary_t library_ = nullptr;
  cudaKernel_t kernel_ = nullptr;
};

// The dependent-launch tests' fixture: the producer (the test skips before sm_90), a memory-only
// runtime and a non-blocking stream (a plain cudaMemcpy runs on the legacy stream, which it does
// not wait for), released however the test ends.
class DependentLaunchGpu : public CombineGpu {
 protected:
  void SetUp() override {
    CombineGpu::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    producer_ = std::make_unique<Producer>();
    if (!producer_->supported())
      GTEST_SKIP() << "programmatic dependent launch needs sm_90 or newer";
    ASSERT_TRUE(producer_->error().empty()) << producer_->error();
    rt_ = memory_only_runtime();
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (rt_ != nullptr) moejit_runtime_destroy(rt_);
  }

  std::unique_ptr<Producer> producer_;
  moejit_runtime_t rt_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// args.dependent_launch = 1: the call's first kernel may start while the previous kernel on the
// stream drains, and must still see everything that kernel wrote. The producer poisons nothing
// itself; the rows are poisoned (NaN) before it runs, it lets its dependents start at once and
// writes the real rows only after 30 us, so a combine kernel that touched memory before its wait
// would sum NaN. Every path: token-major and gather map at decode and prefill geometry, the token
// index's one-token kernel, single launch and list chain (whose clear must wait too). The result
// must be bitwise a plain call's, and so must a CUDA graph replay of the same pair.
TEST_F(DependentLaunchGpu, SeesThePreviousKernelsWrites) {
  const Pools& p = pools();
  const struct {
    moejit_layout layout;
    int64_t tokens, top_k;
    int64_t gather_rows = -1;  // 8 with T = 1: the gather map's one-token kernel
  } setups[] = {{MOEJIT_LAYOUT_TOKEN_MAJOR, 1, 8},   {MOEJIT_LAYOUT_TOKEN_MAJOR, 512, 2},
                {MOEJIT_LAYOUT_GATHER_MAP, 1, 8, 8}, {MOEJIT_LAYOUT_GATHER_MAP, 32, 8},
                {MOEJIT_LAYOUT_GATHER_MAP, 512, 8},  {MOEJIT_LAYOUT_TOKEN_INDEX, 1, 8},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 33, 8},  {MOEJIT_LAYOUT_TOKEN_INDEX, 600, 8}};
  for (const auto& setup : setups) {
    const moejit_layout layout = setup.layout;
    SCOPED_TRACE(std::string(layout_str(layout)) + " T=" + std::to_string(setup.tokens) + " K=" +
                 std::to_string(setup.top_k) + " rows=" + std::to_string(setup.gather_rows));
    const int64_t T = setup.tokens, K = setup.top_k, H = 7168;
    Rng rng(777);
    Case c{layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, H, T, K, 1};
    c.random_routing = layout == MOEJIT_LAYOUT_TOKEN_INDEX;
    c.gather_rows = setup.gather_rows;
    const Routing routing = make_routing(c, rng);
    const size_t idx_bytes = std::max<size_t>(routing.index_values.size(), 1) * 4;
    const size_t row_bytes = static_cast<size_t>(routing.rows * H * 2);
    const size_t out_bytes = static_cast<size_t>(T * H * 2);
    void *indices, *rows, *out, *workspace = nullptr;
    CUDA_OK(cudaMalloc(&indices, idx_bytes));
    CUDA_OK(cudaMalloc(&rows, row_bytes));
    CUDA_OK(cudaMalloc(&out, out_bytes));
    std::vector<int32_t> idx(routing.index_values.begin(), routing.index_values.end());
    // Copies on the test's stream (see DependentLaunchGpu).
    if (!idx.empty())
      CUDA_OK(
          cudaMemcpyAsync(indices, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, stream_));
    const void* src = p.device[MOEJIT_DTYPE_BFLOAT16];  // the producer copies the pool's first rows
    moejit_combine_args a = bf16_args(layout, T, K, routing.rows, H, rows, p.gates_device,
                                      layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : indices, out);
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    if (workspace)  // any contents
      CUDA_OK(cudaMemsetAsync(workspace, 0x7f, a.workspace_bytes, stream_));
    // The reference: a plain call on the real rows.
    CUDA_OK(cudaMemcpyAsync(rows, src, row_bytes, cudaMemcpyDeviceToDevice, stream_));
    ASSERT_EQ(moejit_runtime_combine(rt_, &a, stream_), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> expected(out_bytes), got(out_bytes);
    CUDA_OK(cudaMemcpy(expected.data(), out, out_bytes, cudaMemcpyDeviceToHost));

    // Where got differs from expected: how many bf16 elements, how many of them NaN (poison read),
    // and the first one.
    auto describe_difference = [&] {
      int64_t differ = 0, nan = 0, first = -1;
      for (size_t i = 0; i + 1 < out_bytes; i += 2)
        if (std::memcmp(&got[i], &expected[i], 2) != 0) {
          ++differ;
          if (first < 0) first = static_cast<int64_t>(i / 2);
          if (std::isnan(decode(got.data(), MOEJIT_DTYPE_BFLOAT16, i / 2))) ++nan;
        }
      return std::to_string(differ) + " elements differ (" + std::to_string(nan) +
             " NaN), the first at element " + std::to_string(first);
    };
    auto poison = [&] {
      CUDA_OK(cudaMemsetAsync(rows, 0xff, row_bytes, stream_));
      CUDA_OK(cudaMemsetAsync(out, 0xff, out_bytes, stream_));
      CUDA_OK(cudaStreamSynchronize(stream_));
    };
    // Poisoned rows and out, the producer, then the combine: out must be what the reference says.
    auto produce_and_combine = [&](const std::string& what) {
      poison();
      CUDA_OK(producer_->launch(stream_, src, rows, row_bytes, 30.0));
      ASSERT_EQ(moejit_runtime_combine(rt_, &a, stream_), MOEJIT_SUCCESS)
          << moejit_last_error_message();
      CUDA_OK(cudaStreamSynchronize(stream_));
      CUDA_OK(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
      EXPECT_TRUE(got == expected) << what << ": " << describe_difference();
    };
    // Control: the same sequence with a plain launch.
    produce_and_combine("plain launch after the producer");
    if (HasFatalFailure()) return;  // an ASSERT in the lambda ends only the lambda
    a.dependent_launch = 1;
    for (int round = 0; round < 3 && !HasFatalFailure(); ++round)
      produce_and_combine("round " + std::to_string(round));
    if (HasFatalFailure()) return;
    // The same pair captured in a graph: the programmatic edge must hold there too.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    CUDA_OK(producer_->launch(stream_, src, rows, row_bytes, 30.0));
    ASSERT_EQ(moejit_runtime_combine(rt_, &a, stream_), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    poison();
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    CUDA_OK(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(got == expected) << "graph replay: " << describe_difference();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(indices);
    cudaFree(rows);
    cudaFree(out);
    if (workspace) cudaFree(workspace);
  }
}

// A dropped gather-map slot (-1 or past num_rows) contributes nothing, whatever its gate holds:
// where the kernel adds a batch's rows without branches (top_k 5-16 at one slot per thread) an
// absent row must get weight 0, not its gate times zero (NaN * 0 is NaN); where it skips them
// (top_k <= 4) it must skip exactly the absent ones. T=1 and T=300; top_k 2 and 4 (skipped adds),
// 8 (one batch, branch-free) and 12 (later rows too).
TEST_F(CombineGpu, DroppedSlotsIgnoreNonFiniteGates) {
  const Pools& p = pools();
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t H = 7168, R = 4096;
  for (const int64_t T : {int64_t{1}, int64_t{300}}) {
    for (const int64_t K : {int64_t{2}, int64_t{4}, int64_t{8}, int64_t{12}}) {
      SCOPED_TRACE("T=" + std::to_string(T) + " K=" + std::to_string(K));
      Rng rng(static_cast<uint64_t>(T * 131 + K));
      std::vector<int32_t> map(static_cast<size_t>(T * K));
      std::vector<float> gates(map.size());
      for (size_t i = 0; i < map.size(); ++i) {
        const int64_t roll = rng.below(4);
        map[i] = roll == 0   ? -1
                 : roll == 1 ? static_cast<int32_t>(R + rng.below(100))
                             : static_cast<int32_t>(rng.below(R));
        gates[i] = roll == 0 ? NAN : roll == 1 ? INFINITY : rng.uniform(0.0f, 1.0f);
      }
      void *d_map, *d_gates, *d_out;
      const size_t out_bytes = static_cast<size_t>(T * H * 2);
      CUDA_OK(cudaMalloc(&d_map, map.size() * 4));
      CUDA_OK(cudaMalloc(&d_gates, gates.size() * 4));
      CUDA_OK(cudaMalloc(&d_out, out_bytes));
      CUDA_OK(cudaMemcpy(d_map, map.data(), map.size() * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_gates, gates.data(), gates.size() * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
      const moejit_combine_args a =
          bf16_args(MOEJIT_LAYOUT_GATHER_MAP, T, K, R, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                    static_cast<const float*>(d_gates), d_map, d_out);
      ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
          << moejit_last_error_message();
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> out(out_bytes);
      CUDA_OK(cudaMemcpy(out.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; h += t == 0 ? 1 : 61) {
          double ref = 0;
          for (int64_t k = 0; k < K; ++k) {
            const int32_t row = map[static_cast<size_t>(t * K + k)];
            if (row < 0 || row >= R) continue;
            ref += gates[static_cast<size_t>(t * K + k)] *
                   decode(p.host[MOEJIT_DTYPE_BFLOAT16].data(), MOEJIT_DTYPE_BFLOAT16,
                          static_cast<size_t>(row * H + h));
          }
          const double got =
              decode(out.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(t * H + h));
          if (!(std::fabs(got - ref) <= std::fabs(ref) / 128 + 1e-6)) {
            if (++bad <= 5)
              ADD_FAILURE() << "token " << t << " h " << h << ": " << got << " vs " << ref;
          }
        }
      EXPECT_EQ(bad, 0);
      cudaFree(d_map);
      cudaFree(d_gates);
      cudaFree(d_out);
    }
  }
  moejit_runtime_destroy(rt);
}

// A non-finite result (a NaN or infinite gate) has the same bits whichever vector width serves
// the call: the output aligned (pairs of elements converted together) or one element off (one at
// a time), 16-bit outputs (the bf16 conversion of one element rounded by hand once, and kept the
// NaN's payload where the paired conversion gives the canonical NaN).
TEST_F(CombineGpu, NonFiniteResultsHaveTheSameBitsAtEveryVectorWidth) {
  const Pools& p = pools();
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t T = 4, K = 2, R = T * K;
  std::vector<int32_t> map(static_cast<size_t>(R));
  std::iota(map.begin(), map.end(), 0);
  // Token 0: a NaN gate; 1: an infinite one; 2: -inf; 3: finite.
  const std::vector<float> gates = {NAN, 0.5f, INFINITY, 0.25f, -INFINITY, 1.0f, 0.5f, 0.5f};
  void *d_map, *d_gates, *d_out;
  CUDA_OK(cudaMalloc(&d_map, map.size() * 4));
  CUDA_OK(cudaMalloc(&d_gates, gates.size() * 4));
  CUDA_OK(cudaMemcpy(d_map, map.data(), map.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_gates, gates.data(), gates.size() * 4, cudaMemcpyHostToDevice));
  for (moejit_dtype out_dtype : {MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_FLOAT16}) {
    for (int64_t H : {int64_t{64}, int64_t{7168}}) {
      SCOPED_TRACE("out " + std::to_string(out_dtype) + " H=" + std::to_string(H));
      const size_t bytes = static_cast<size_t>(T * H * 2);
      CUDA_OK(cudaMalloc(&d_out, bytes + 16));
      std::vector<std::vector<uint8_t>> got;
      for (size_t offset : {size_t{0}, size_t{2}}) {  // bytes: one 2-byte element off
        void* out = static_cast<char*>(d_out) + offset;
        moejit_combine_args a =
            bf16_args(MOEJIT_LAYOUT_GATHER_MAP, T, K, R, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                      static_cast<const float*>(d_gates), d_map, out);
        a.out_dtype = out_dtype;
        ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
            << moejit_last_error_message();
        CUDA_OK(cudaDeviceSynchronize());
        got.emplace_back(bytes);
        CUDA_OK(cudaMemcpy(got.back().data(), out, bytes, cudaMemcpyDeviceToHost));
      }
      int64_t differ = 0;
      for (size_t i = 0; i < bytes; i += 2)
        if (std::memcmp(&got[0][i], &got[1][i], 2) != 0 && ++differ <= 3) {
          uint16_t x, y;
          std::memcpy(&x, &got[0][i], 2);
          std::memcpy(&y, &got[1][i], 2);
          ADD_FAILURE() << "token " << i / 2 / H << " element " << i / 2 % H << ": 0x" << std::hex
                        << x << " aligned, 0x" << y << " one element off";
        }
      EXPECT_EQ(differ, 0);
      // Token 0 is NaN throughout (the check above is not vacuous).
      const double first = decode(got[0].data(), out_dtype, 0);
      EXPECT_TRUE(std::isnan(first)) << first;
      cudaFree(d_out);
    }
  }
  cudaFree(d_map);
  cudaFree(d_gates);
  moejit_runtime_destroy(rt);
}

// *d = a new device copy of v (the caller frees it), complete on return: a cudaMemcpy from
// pageable memory may return before its DMA ends, on the legacy stream, which the tests'
// non-blocking streams do not wait for.
template <typename T>
void device_copy(const std::vector<T>& v, void** d) {
  CUDA_OK(cudaMalloc(d, v.size() * sizeof(T)));
  CUDA_OK(cudaMemcpy(*d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());
}

// The same with the routing as the previous kernel's output (a router or a sort just before the
// combine): the gather map or token_idx is zeroed (every entry naming row 0 or token 0, all in
// range) and the producer writes the real one only after 30 us. Before their wait the kernels may
// only ask L2 for the routing (prefetch_routing); the list chain's token_index_assign loads its
// first entry before its own wait, which is safe only because token_index_clear, whose every block
// waited for the producer, allows it. Each call must be bitwise a plain call on the real routing.
TEST_F(DependentLaunchGpu, SeesRoutingThePreviousKernelWrote) {
  const Pools& p = pools();
  const struct {
    moejit_layout layout;
    int64_t tokens;
  } setups[] = {{MOEJIT_LAYOUT_GATHER_MAP, 1},   {MOEJIT_LAYOUT_GATHER_MAP, 32},
                {MOEJIT_LAYOUT_GATHER_MAP, 512}, {MOEJIT_LAYOUT_TOKEN_INDEX, 1},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 33}, {MOEJIT_LAYOUT_TOKEN_INDEX, 600}};
  for (const auto& setup : setups) {
    SCOPED_TRACE(std::string(layout_str(setup.layout)) + " T=" + std::to_string(setup.tokens));
    const int64_t T = setup.tokens, K = 8, H = 4096;
    Rng rng(778);
    Case c{
        setup.layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, H, T, K, 1};
    c.random_routing = true;
    const Routing routing = make_routing(c, rng);
    std::vector<int32_t> idx(routing.index_values.begin(), routing.index_values.end());
    idx.resize((idx.size() + 3) / 4 * 4, -1);  // whole 16-byte words for the producer
    const size_t idx_bytes = idx.size() * 4, out_bytes = static_cast<size_t>(T * H * 2);
    void *indices, *real_indices, *out, *workspace = nullptr;
    ASSERT_NO_FATAL_FAILURE(device_copy(idx, &real_indices));
    ASSERT_NO_FATAL_FAILURE(device_copy(idx, &indices));
    CUDA_OK(cudaMalloc(&out, out_bytes));
    moejit_combine_args a =
        bf16_args(setup.layout, T, K, routing.rows, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                  p.gates_device, indices, out);
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    // The reference: a plain call on the real routing.
    ASSERT_EQ(moejit_runtime_combine(rt_, &a, stream_), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> expected(out_bytes), got(out_bytes);
    CUDA_OK(cudaMemcpy(expected.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    for (int round = 0; round < 4 && !HasFatalFailure(); ++round) {
      a.dependent_launch = round == 0 ? 0 : 1;  // round 0: the control, a plain launch
      CUDA_OK(cudaMemsetAsync(indices, 0, idx_bytes, stream_));
      CUDA_OK(cudaMemsetAsync(out, 0xff, out_bytes, stream_));
      CUDA_OK(cudaStreamSynchronize(stream_));
      CUDA_OK(producer_->launch(stream_, real_indices, indices, idx_bytes, 30.0));
      ASSERT_EQ(moejit_runtime_combine(rt_, &a, stream_), MOEJIT_SUCCESS)
          << moejit_last_error_message();
      CUDA_OK(cudaStreamSynchronize(stream_));
      CUDA_OK(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
      int64_t differ = 0;
      for (size_t i = 0; i < out_bytes; i += 2)
        differ += std::memcmp(&got[i], &expected[i], 2) != 0;
      EXPECT_EQ(differ, 0) << "round " << round << " (dependent_launch " << a.dependent_launch
                           << "): elements that differ from the plain call's";
    }
    for (void* q : {indices, real_indices, out, workspace})
      if (q) cudaFree(q);
  }
}

// Runs a one-token bf16 call (a.out: one row of a.hidden_dim elements) and compares its output
// with ref(h) within bf16's rounding. Returns how many elements differ (the first five reported),
// or -1 if the call failed.
int64_t one_token_mismatches(moejit_runtime_t rt, const moejit_combine_args& a,
                             const std::function<double(int64_t)>& ref) {
  if (moejit_runtime_combine(rt, &a, nullptr) != MOEJIT_SUCCESS) {
    ADD_FAILURE() << moejit_last_error_message();
    return -1;
  }
  const int64_t H = a.hidden_dim;
  std::vector<uint16_t> out(static_cast<size_t>(H));
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(out.data(), a.out, H * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
    ADD_FAILURE() << "CUDA error after the call";
    return -1;
  }
  int64_t bad = 0;
  for (int64_t h = 0; h < H; ++h) {
    const double want = ref(h);
    const double got = decode(out.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(h));
    if (!(std::fabs(got - want) <= std::fabs(want) / 128 + 1e-6) && ++bad <= 5)
      ADD_FAILURE() << "h " << h << ": " << got << " vs " << want;
  }
  return bad;
}

// One token: combine_one_token loads every row together with its token_idx entry and adds only
// those whose entry is 0. A dropped row (-1, or a token past T) is loaded too, so its data and its
// gate are NaN here: neither may reach the output. 65 rows take the scan instead (the same
// answer). The matrix checks the one-token kernel bit for bit against the fp32 chain.
TEST_F(CombineGpu, OneTokenSkipsDroppedRowsWhateverTheyHold) {
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t H = 7168;
  // Up to 64 rows: the one-token kernel (8-byte vectors in 128-thread blocks up to 2 rows:
  // one_token_index_spec); 65-128 the single launch's small-call form; 129 its shared-list scan.
  for (const int64_t R : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{8}, int64_t{13}, int64_t{64},
                          int64_t{65}, int64_t{128}, int64_t{129}}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Rng rng(static_cast<uint64_t>(R) * 977);
    std::vector<int32_t> token_idx(static_cast<size_t>(R));
    std::vector<float> gates(token_idx.size());
    std::vector<uint16_t> rows(static_cast<size_t>(R * H));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t roll = rng.below(3);
      // Row 0 always counts (so R = 1 adds something); else a third dropped, a third past T.
      token_idx[r] = r == 0 || roll == 2 ? 0 : roll == 0 ? -1 : static_cast<int32_t>(1 + r);
      const bool kept = token_idx[r] == 0;
      gates[r] = kept ? rng.uniform(0.0f, 1.0f) : (roll == 0 ? NAN : INFINITY);
      for (int64_t h = 0; h < H; ++h)
        encode(&rows[r * H], MOEJIT_DTYPE_BFLOAT16, h, kept ? rng.uniform(-1, 1) : NAN);
    }
    void *d_idx, *d_gates, *d_rows, *d_out, *d_ws = nullptr;
    ASSERT_NO_FATAL_FAILURE(device_copy(token_idx, &d_idx));
    ASSERT_NO_FATAL_FAILURE(device_copy(gates, &d_gates));
    ASSERT_NO_FATAL_FAILURE(device_copy(rows, &d_rows));
    CUDA_OK(cudaMalloc(&d_out, H * 2));
    CUDA_OK(cudaMemset(d_out, 0xFF, H * 2));
    // top_k 0: the token index does not use it.
    moejit_combine_args a = bf16_args(MOEJIT_LAYOUT_TOKEN_INDEX, 1, 0, R, H, d_rows,
                                      static_cast<const float*>(d_gates), d_idx, d_out);
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &d_ws));
    EXPECT_EQ(one_token_mismatches(rt, a,
                                   [&](int64_t h) {
                                     double ref = 0;
                                     for (int64_t r = 0; r < R; ++r)
                                       if (token_idx[r] == 0)
                                         ref +=
                                             gates[r] * decode(rows.data(), MOEJIT_DTYPE_BFLOAT16,
                                                               static_cast<size_t>(r * H + h));
                                     return ref;
                                   }),
              0);
    for (void* p : {d_idx, d_gates, d_rows, d_out, d_ws}) cudaFree(p);
  }
  moejit_runtime_destroy(rt);
}

// Gather map, one token with at most top_k rows (combine_one_token_map: every row loaded with the
// map, each slot's row picked from them): every dtype pair's kind, both index types, short rows and
// a partial tail vector, top_k 1 and 2 (8-byte vectors where a row fills the blocks:
// one_token_map_spec), 3 and 8, rows = top_k and fewer, slots that repeat a row or are dropped,
// and the matrix's variations (no gates, scale, accumulate, padded strides, misaligned pointers),
// each checked against the fp32 chain in slot order bit for bit.
TEST_F(CombineGpu, OneTokenGatherMapAgainstFloat64Reference) {
  const moejit_dtype types[][2] = {{MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16},
                                   {MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_FLOAT32},
                                   {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32},
                                   {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_BFLOAT16}};
  std::vector<Case> cases;
  uint64_t seed = 9000;
  for (const auto& t : types)
    for (int idx = 0; idx < 2; ++idx)
      for (int64_t hidden : {1, 7, 2880, 7168})
        for (int64_t top_k : {1, 2, 3, 8})
          for (int64_t rows : {top_k, top_k / 2}) {
            Case c = vary(Case{MOEJIT_LAYOUT_GATHER_MAP, t[0], t[1],
                               static_cast<moejit_index_type>(idx), hidden, 1, top_k, seed++});
            c.gather_rows = rows;
            cases.push_back(c);
          }
  expect_cases_pass(cases, worker_count());
}

// The gather map's one-token kernel loads every row of the buffer, named or not, and every slot's
// gate. Rows no slot names hold NaN here, and dropped slots (-1, past the rows) have NaN or
// infinite gates: none of it may reach the output. A slot may name a row another slot names too.
// 9 rows with top_k 8 take the fixed layouts' kernel (the same answer).
TEST_F(CombineGpu, OneTokenGatherMapIgnoresWhatNoSlotNames) {
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t H = 7168, K = 8;
  for (const int64_t R : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{8}, int64_t{9}}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Rng rng(static_cast<uint64_t>(R) * 131 + 7);
    std::vector<int32_t> map(static_cast<size_t>(K));
    std::vector<float> gates(map.size());
    std::vector<bool> named(static_cast<size_t>(R), false);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t roll = rng.below(4);
      // Slots 0 and 1 name row 0 when there is one (a repeated row); else a quarter dropped, a
      // quarter past the rows, half a row at random among the first half (so some rows stay
      // unnamed).
      int32_t row = -1;
      if (R > 0 && k < 2)
        row = 0;
      else if (R > 0 && roll >= 2)
        row = static_cast<int32_t>(rng.below((R + 1) / 2));
      else if (roll == 1)
        row = static_cast<int32_t>(R + rng.below(100));
      map[k] = row;
      const bool kept = row >= 0 && row < R;
      if (kept) named[row] = true;
      gates[k] = kept ? rng.uniform(0.0f, 1.0f) : (roll == 0 ? NAN : INFINITY);
    }
    std::vector<uint16_t> rows(static_cast<size_t>(std::max<int64_t>(R, 1) * H));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h)
        encode(&rows[r * H], MOEJIT_DTYPE_BFLOAT16, h, named[r] ? rng.uniform(-1, 1) : NAN);
    void *d_map, *d_gates, *d_rows, *d_out;
    ASSERT_NO_FATAL_FAILURE(device_copy(map, &d_map));
    ASSERT_NO_FATAL_FAILURE(device_copy(gates, &d_gates));
    ASSERT_NO_FATAL_FAILURE(device_copy(rows, &d_rows));
    CUDA_OK(cudaMalloc(&d_out, H * 2));
    CUDA_OK(cudaMemset(d_out, 0xFF, H * 2));
    const moejit_combine_args a = bf16_args(MOEJIT_LAYOUT_GATHER_MAP, 1, K, R, H, d_rows,
                                            static_cast<const float*>(d_gates), d_map, d_out);
    EXPECT_EQ(one_token_mismatches(rt, a,
                                   [&](int64_t h) {
                                     double ref = 0;
                                     for (int64_t k = 0; k < K; ++k)
                                       if (map[k] >= 0 && map[k] < R)
                                         ref +=
                                             gates[k] * decode(rows.data(), MOEJIT_DTYPE_BFLOAT16,
                                                               static_cast<size_t>(map[k] * H + h));
                                     return ref;
                                   }),
              0);
    for (void* p : {d_map, d_gates, d_rows, d_out}) cudaFree(p);
  }
  moejit_runtime_destroy(rt);
}

// R * H past 2^31 elements (and the expert buffer past 4 GiB): every address is 64-bit, the heavy
// tokens' too (1% of the tokens with half the rows).
TEST_F(CombineGpu, AddressesPastTwoToThe31) {
  const Pools& p = pools();
  const int64_t T = 37500, K = 8, H = 7168;  // R * H = 2,150,400,000 > 2^31
  const int64_t R = T * K;
  const size_t elems = static_cast<size_t>(R * H);
  ASSERT_GT(elems, size_t{1} << 31);
  void* expert = nullptr;
  const size_t pool_bytes = kPoolElems * 2;
  CUDA_OK(cudaMalloc(&expert, elems * 2));
  for (size_t off = 0; off < elems * 2; off += pool_bytes)  // element e holds pool[e % pool]
    CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(expert) + off, p.device[MOEJIT_DTYPE_BFLOAT16],
                       std::min(pool_bytes, elems * 2 - off), cudaMemcpyDeviceToDevice));
  void *out, *indices, *workspace = nullptr;
  CUDA_OK(cudaMalloc(&out, static_cast<size_t>(T * H * 2)));
  CUDA_OK(cudaMalloc(&indices, static_cast<size_t>(R * 4)));
  moejit_runtime_t rt = memory_only_runtime();
  // The token index twice: random routing, and 1% of the tokens with half the rows (the list
  // path's token_index_heavy, its ranked rows and pieces addressed past 2^31 elements too).
  const std::pair<moejit_layout, Case::Skew> passes[] = {
      {MOEJIT_LAYOUT_TOKEN_MAJOR, Case::kNoSkew},
      {MOEJIT_LAYOUT_GATHER_MAP, Case::kNoSkew},
      {MOEJIT_LAYOUT_TOKEN_INDEX, Case::kNoSkew},
      {MOEJIT_LAYOUT_TOKEN_INDEX, Case::kTopPercent}};
  for (const auto& [layout, skew] : passes) {
    SCOPED_TRACE(std::string(layout_str(layout)) + (skew != Case::kNoSkew ? " skewed" : ""));
    Rng rng(31);
    Case c{layout, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, H, T, K, 3};
    c.skew = skew;
    Routing routing = make_routing(c, rng);
    if (layout == MOEJIT_LAYOUT_GATHER_MAP) {  // keep rows inside the buffer (R rows, not 4R/3)
      routing.rows = R;
      for (int64_t t = 0; t < T; ++t) routing.per_token[t].clear();
      for (int64_t i = 0; i < T * K; ++i) {
        int64_t& v = routing.index_values[i];
        if (v >= R) v = -1;
        if (v >= 0) routing.per_token[i / K].push_back({v, i});
      }
    }
    std::vector<int32_t> idx(routing.index_values.begin(), routing.index_values.end());
    if (!idx.empty())
      CUDA_OK(cudaMemcpy(indices, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    moejit_combine_args a =
        bf16_args(layout, T, K, routing.rows, H, expert, p.gates_device, indices, out);
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    CUDA_OK(cudaMemset(out, 0xFF, static_cast<size_t>(T * H * 2)));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(static_cast<size_t>(T * H));
    CUDA_OK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    std::atomic<int64_t> bad{0};
    std::vector<std::thread> threads;
    const unsigned n = worker_count();
    for (unsigned w = 0; w < n; ++w)
      threads.emplace_back([&, w] {
        std::vector<double> ref(static_cast<size_t>(H)), mag(static_cast<size_t>(H));
        for (int64_t t = w; t < T; t += n) {
          std::fill(ref.begin(), ref.end(), 0.0);
          std::fill(mag.begin(), mag.end(), 0.0);
          for (const auto& [row, gi] : routing.per_token[t])
            for (int64_t h = 0; h < H; ++h) {
              const double x = decode(p.host[MOEJIT_DTYPE_BFLOAT16].data(), MOEJIT_DTYPE_BFLOAT16,
                                      static_cast<size_t>(row * H + h) % kPoolElems);
              ref[h] += p.gates_host[gi] * x;
              mag[h] += std::fabs(p.gates_host[gi] * x);
            }
          for (int64_t h = 0; h < H; ++h) {
            const double v = bf16_to_float(got[t * H + h]);
            if (!(std::fabs(v - ref[h]) <=
                  tolerance(MOEJIT_DTYPE_BFLOAT16, mag[h], ref[h],
                            static_cast<int>(routing.per_token[t].size()))))
              ++bad;
          }
        }
      });
    for (auto& th : threads) th.join();
    EXPECT_EQ(bad.load(), 0) << "elements outside the bf16 bound";
  }
  moejit_runtime_destroy(rt);
  cudaFree(expert);
  cudaFree(out);
  cudaFree(indices);
  if (workspace) cudaFree(workspace);
}

// Row strides of 2^31 + 64 elements (4 GiB + 128 bytes of bf16) in both buffers, so that row r
// starts past 2^32 bytes for r >= 1 and past 2^33 bytes for r >= 2: every kernel forms a row's
// address as row id x stride in 64 bits (a 32-bit product, or an int row id times an int stride,
// would wrap). Four rows of 64 elements, each path in turn: token-major and the gather map's
// fixed kernel (two tokens), the gather map's one-token kernel (one token, four rows for four
// slots), the token index's one-token kernel and its single launch (two tokens). Only the rows
// are written; each output row and 64 elements after it are checked, the rest never touched.
TEST_F(CombineGpu, RowStridesPastFourGiB) {
  const int64_t H = 64, R = 4, stride = (int64_t{1} << 31) + 64;
  const size_t row_bytes = static_cast<size_t>(stride) * 2;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < (R + 2) * row_bytes + (size_t{1} << 30))
    GTEST_SKIP() << "needs " << (R + 2) * row_bytes << " bytes of free device memory";
  void *expert, *out, *gates, *indices;
  CUDA_OK(cudaMalloc(&expert, R * row_bytes));
  CUDA_OK(cudaMalloc(&out, 2 * row_bytes));
  Rng rng(4242);
  std::vector<uint16_t> rows(static_cast<size_t>(R * H));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = float_to_bf16(rng.uniform(-1, 1));
  for (int64_t r = 0; r < R; ++r)
    CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(expert) + r * row_bytes, &rows[r * H], H * 2,
                       cudaMemcpyHostToDevice));
  const std::vector<float> gate_values = {0.5f, 0.25f, 2.0f, 0.125f};
  ASSERT_NO_FATAL_FAILURE(device_copy(gate_values, &gates));
  CUDA_OK(cudaMalloc(&indices, 64));
  moejit_runtime_t rt = memory_only_runtime();
  const struct {
    moejit_layout layout;
    int64_t tokens, top_k;
    std::vector<int32_t> index;  // gather map [T * K] or token_idx [R]
  } setups[] = {{MOEJIT_LAYOUT_TOKEN_MAJOR, 2, 2, {}},
                {MOEJIT_LAYOUT_GATHER_MAP, 2, 2, {3, 0, -1, 2}},
                {MOEJIT_LAYOUT_GATHER_MAP, 1, 4, {3, 1, 0, 2}},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 1, 0, {0, -1, 0, 0}},
                {MOEJIT_LAYOUT_TOKEN_INDEX, 2, 0, {1, 0, 1, -1}}};
  for (const auto& setup : setups) {
    SCOPED_TRACE(std::string(layout_str(setup.layout)) + " T=" + std::to_string(setup.tokens));
    const int64_t T = setup.tokens;
    // (row, gate index) of each token, in the documented order.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> per_token(static_cast<size_t>(T));
    if (setup.layout == MOEJIT_LAYOUT_TOKEN_MAJOR) {
      for (int64_t r = 0; r < R; ++r) per_token[r / setup.top_k].push_back({r, r});
    } else if (setup.layout == MOEJIT_LAYOUT_GATHER_MAP) {
      for (int64_t s = 0; s < T * setup.top_k; ++s)
        if (setup.index[s] >= 0) per_token[s / setup.top_k].push_back({setup.index[s], s});
    } else {
      for (int64_t r = 0; r < R; ++r)
        if (setup.index[r] >= 0) per_token[setup.index[r]].push_back({r, r});
    }
    if (!setup.index.empty())
      CUDA_OK(
          cudaMemcpy(indices, setup.index.data(), setup.index.size() * 4, cudaMemcpyHostToDevice));
    moejit_combine_args a =
        bf16_args(setup.layout, T, setup.top_k, R, H, expert, static_cast<const float*>(gates),
                  setup.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : indices, out);
    a.expert_row_stride = stride;
    a.out_row_stride = stride;
    void* workspace = nullptr;
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    for (int64_t t = 0; t < T; ++t)  // the row and the 64 elements after it
      CUDA_OK(cudaMemset(static_cast<uint8_t*>(out) + t * row_bytes, 0xFF, 2 * H * 2));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaDeviceSynchronize());
    for (int64_t t = 0; t < T; ++t) {
      std::vector<uint16_t> got(static_cast<size_t>(2 * H));
      CUDA_OK(cudaMemcpy(got.data(), static_cast<uint8_t*>(out) + t * row_bytes, 2 * H * 2,
                         cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t h = 0; h < H; ++h) {
        double ref = 0;
        for (const auto& [row, gi] : per_token[t])
          ref += gate_values[gi] * bf16_to_float(rows[row * H + h]);
        const double v = bf16_to_float(got[h]);
        if (!(std::fabs(v - ref) <= std::fabs(ref) / 128 + 1e-6) && ++bad <= 3)
          ADD_FAILURE() << "out[" << t << "][" << h << "] = " << v << ", expected " << ref;
      }
      EXPECT_EQ(bad, 0) << "token " << t;
      for (int64_t h = H; h < 2 * H; ++h)
        if (got[h] != 0xFFFF) {
          ADD_FAILURE() << "the padding after row " << t << " was written";
          break;
        }
    }
    if (workspace) cudaFree(workspace);
  }
  moejit_runtime_destroy(rt);
  for (void* q : {expert, out, gates, indices}) cudaFree(q);
}

// Driver API calls for the context tests, from libcuda.so.1 through dlopen, so that the test
// binary does not link libcuda (it must start, and skip, where there is none): a second context
// on a device and streams in it. The versioned names fix the signatures (cuda.h maps cuCtxCreate
// to 13.0's cuCtxCreate_v4, which takes creation parameters).
struct DriverCalls {
  CUresult (*ctx_create)(CUcontext*, unsigned, CUdevice) = nullptr;
  CUresult (*ctx_destroy)(CUcontext) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  // Memory of a context the test made, without the CUDA runtime's per-context state.
  CUresult (*mem_alloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*mem_free)(CUdeviceptr) = nullptr;
  CUresult (*copy_to_device)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*copy_to_host)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*memset_bytes)(CUdeviceptr, unsigned char, size_t) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  bool complete() const {
    return ctx_create && ctx_destroy && ctx_push && ctx_pop && stream_create && stream_destroy &&
           mem_alloc && mem_free && copy_to_device && copy_to_host && memset_bytes &&
           ctx_synchronize;
  }
};

DriverCalls driver_calls() {
  DriverCalls d;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open: the process uses it
  if (h == nullptr) return d;
  auto get = [h](const char* name, auto* f) {
    *f = reinterpret_cast<std::remove_pointer_t<decltype(f)>>(dlsym(h, name));
  };
  get("cuCtxCreate_v2", &d.ctx_create);
  get("cuCtxDestroy_v2", &d.ctx_destroy);
  get("cuCtxPushCurrent_v2", &d.ctx_push);
  get("cuCtxPopCurrent_v2", &d.ctx_pop);
  get("cuStreamCreate", &d.stream_create);
  get("cuStreamDestroy_v2", &d.stream_destroy);
  get("cuMemAlloc_v2", &d.mem_alloc);
  get("cuMemFree_v2", &d.mem_free);
  get("cuMemcpyHtoD_v2", &d.copy_to_device);
  get("cuMemcpyDtoH_v2", &d.copy_to_host);
  get("cuMemsetD8_v2", &d.memset_bytes);
  get("cuCtxSynchronize", &d.ctx_synchronize);
  return d;
}

// True if every byte of the device buffer is still 0xFF (the poison).
bool still_poisoned(const void* device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  return std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0xFF; });
}

// moejit launches in the calling thread's current context. A stream of another context (here one
// the test creates on the same device) makes the driver refuse the launch; the call must say so
// as an argument error naming the stream, launch nothing, and leave the runtime usable.
TEST_F(CombineGpu, AStreamOfAnotherContextIsRefused) {
  const Pools& p = pools();
  const DriverCalls drv = driver_calls();
  ASSERT_TRUE(drv.complete()) << "libcuda.so.1 lacks the context calls";
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t T = 33, K = 2, H = 4096;
  std::vector<int32_t> map(static_cast<size_t>(T * K));
  std::iota(map.begin(), map.end(), 0);
  void *d_map = nullptr, *out = nullptr;
  ASSERT_NO_FATAL_FAILURE(device_copy(map, &d_map));
  const size_t out_bytes = static_cast<size_t>(T * H * 2);
  CUDA_OK(cudaMalloc(&out, out_bytes));
  CUDA_OK(cudaMemset(out, 0xFF, out_bytes));
  const moejit_combine_args a =
      bf16_args(MOEJIT_LAYOUT_GATHER_MAP, T, K, T * K, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                p.gates_device, d_map, out);
  CUcontext other = nullptr, popped = nullptr;
  CUstream foreign = nullptr;
  const CUresult created = drv.ctx_create(&other, 0, 0);  // pushed: current until popped
  ASSERT_EQ(created, CUDA_SUCCESS) << "cuCtxCreate_v2 on device 0";
  const CUresult made = drv.stream_create(&foreign, CU_STREAM_NON_BLOCKING);
  ASSERT_EQ(drv.ctx_pop(&popped), CUDA_SUCCESS);
  ASSERT_EQ(made, CUDA_SUCCESS);
  EXPECT_EQ(moejit_runtime_combine(rt, &a, foreign), MOEJIT_ERROR_INVALID_ARGUMENT);
  const std::string message = moejit_last_error_message();
  std::printf("[ info     ] %s\n", message.c_str());
  for (const char* part : {"stream belongs to a CUDA context other than the calling thread's",
                           "the stream's: device 0; current: device 0", "cuCtxPushCurrent"})
    EXPECT_NE(message.find(part), std::string::npos)
        << "missing \"" << part << "\" in: " << message;
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(still_poisoned(out, out_bytes)) << "a refused call wrote out";
  // The current context's own stream: the same runtime runs the call.
  ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(static_cast<size_t>(T * H));
  CUDA_OK(cudaMemcpy(got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
  const std::vector<uint8_t>& rows = p.host[MOEJIT_DTYPE_BFLOAT16];
  for (int64_t i = 0; i < T * H; i += 97) {
    const int64_t t = i / H, h = i % H;
    double ref = 0, magnitude = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double term =
          p.gates_host[static_cast<size_t>(t * K + k)] *
          decode(rows.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>((t * K + k) * H + h));
      ref += term;
      magnitude += std::fabs(term);
    }
    const double value = decode(got.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(i));
    ASSERT_LE(std::fabs(value - ref), tolerance(MOEJIT_DTYPE_BFLOAT16, magnitude, ref, 2))
        << "out[" << t << "][" << h << "] = " << value << ", expected " << ref;
  }
  ASSERT_EQ(drv.ctx_push(other), CUDA_SUCCESS);
  drv.stream_destroy(foreign);
  drv.ctx_pop(&popped);
  drv.ctx_destroy(other);
  cudaFree(d_map);
  cudaFree(out);
  moejit_runtime_destroy(rt);
}

// Two GPUs in one process (an engine's tensor or expert parallelism on threads): one runtime
// serves both, with each device's modules loaded in its own context. A stream of device 1 while
// device 0 is current is refused naming both devices. Then one thread per device runs the same
// calls at once, on its own copy of the inputs: every output must be bitwise what device 0 gave
// for the call alone (same architecture, same kernels), which is checked against the float64
// reference.
TEST_F(CombineGpu, TwoDevicesShareOneRuntime) {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two GPUs; this machine has " << devices;
  const Pools& p = pools();
  moejit_runtime_t rt = memory_only_runtime();
  {
    cudaStream_t on_device_1 = nullptr;
    CUDA_OK(cudaSetDevice(1));
    CUDA_OK(cudaStreamCreateWithFlags(&on_device_1, cudaStreamNonBlocking));
    CUDA_OK(cudaSetDevice(0));
    const int64_t T = 4, K = 2, H = 256;
    void* out = nullptr;
    CUDA_OK(cudaMalloc(&out, static_cast<size_t>(T * H * 2)));
    CUDA_OK(cudaMemset(out, 0xFF, static_cast<size_t>(T * H * 2)));
    const moejit_combine_args a =
        bf16_args(MOEJIT_LAYOUT_TOKEN_MAJOR, T, K, T * K, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                  p.gates_device, nullptr, out);
    EXPECT_EQ(moejit_runtime_combine(rt, &a, on_device_1), MOEJIT_ERROR_INVALID_ARGUMENT);
    const std::string message = moejit_last_error_message();
    for (const char* part : {"the stream's: device 1; current: device 0", "cudaSetDevice(1)"})
      EXPECT_NE(message.find(part), std::string::npos)
          << "missing \"" << part << "\" in: " << message;
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(still_poisoned(out, static_cast<size_t>(T * H * 2)));
    cudaFree(out);
    CUDA_OK(cudaSetDevice(1));
    cudaStreamDestroy(on_device_1);
    CUDA_OK(cudaSetDevice(0));
  }
  struct Setup {
    moejit_layout layout;
    int64_t tokens, top_k, hidden;
  };
  const std::vector<Setup> setups = {
      {MOEJIT_LAYOUT_TOKEN_MAJOR, 1, 8, 7168}, {MOEJIT_LAYOUT_TOKEN_MAJOR, 4096, 2, 4096},
      {MOEJIT_LAYOUT_GATHER_MAP, 33, 8, 4096}, {MOEJIT_LAYOUT_GATHER_MAP, 2048, 4, 2880},
      {MOEJIT_LAYOUT_TOKEN_INDEX, 1, 8, 7168}, {MOEJIT_LAYOUT_TOKEN_INDEX, 600, 8, 2880}};
  std::vector<Routing> routings;
  for (size_t i = 0; i < setups.size(); ++i) {
    const Setup& s = setups[i];
    Case c{s.layout,
           MOEJIT_DTYPE_BFLOAT16,
           MOEJIT_DTYPE_BFLOAT16,
           MOEJIT_INDEX_INT32,
           s.hidden,
           s.tokens,
           s.top_k,
           500 + i};
    c.random_routing = s.layout == MOEJIT_LAYOUT_TOKEN_INDEX;
    Rng rng(c.seed);
    routings.push_back(make_routing(c, rng));
  }
  // Runs every setup `rounds` times on `device` with inputs of its own; the first round's outputs
  // go to *first, later rounds' must equal `want` (if given). Returns "" or what went wrong.
  auto run_on = [&](int device, int rounds, const std::vector<std::vector<uint8_t>>* want,
                    std::vector<std::vector<uint8_t>>* first) -> std::string {
    if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess)
      return "cannot select device " + std::to_string(device);
    std::vector<void*> buffers;
    auto alloc = [&](size_t bytes) {
      void* q = nullptr;
      if (cudaMalloc(&q, std::max<size_t>(bytes, 16)) != cudaSuccess) return q;
      buffers.push_back(q);
      return q;
    };
    cudaStream_t stream = nullptr;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    std::string error;
    for (int round = 0; round < rounds && error.empty(); ++round)
      for (size_t i = 0; i < setups.size() && error.empty(); ++i) {
        const Setup& s = setups[i];
        const Routing& r = routings[i];
        const size_t row_bytes = static_cast<size_t>(r.rows * s.hidden * 2);
        const size_t gate_count = static_cast<size_t>(std::max(r.rows, s.tokens * s.top_k));
        const size_t out_bytes = static_cast<size_t>(s.tokens * s.hidden * 2);
        std::vector<int32_t> idx(r.index_values.begin(), r.index_values.end());
        void* rows = alloc(row_bytes);
        void* gates = alloc(gate_count * 4);
        void* indices = alloc(idx.size() * 4);
        void* out = alloc(out_bytes);
        if (rows == nullptr || gates == nullptr || indices == nullptr || out == nullptr) {
          error = "cudaMalloc failed on device " + std::to_string(device);
          break;
        }
        // On the call's stream: a non-blocking stream does not wait for the legacy one, where a
        // plain cudaMemset would still be running.
        cudaMemcpyAsync(rows, p.host[MOEJIT_DTYPE_BFLOAT16].data(), row_bytes,
                        cudaMemcpyHostToDevice, stream);
        cudaMemcpyAsync(gates, p.gates_host.data(), gate_count * 4, cudaMemcpyHostToDevice, stream);
        if (!idx.empty())
          cudaMemcpyAsync(indices, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, stream);
        cudaMemsetAsync(out, 0xFF, out_bytes, stream);
        moejit_combine_args a = bf16_args(
            s.layout, s.tokens, s.top_k, r.rows, s.hidden, rows, static_cast<const float*>(gates),
            s.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : indices, out);
        size_t ws = 0;
        moejit_combine_workspace_size(&a, &ws);
        if (ws > 0) {
          a.workspace = alloc(ws);
          a.workspace_bytes = ws;
        }
        if (moejit_runtime_combine(rt, &a, stream) != MOEJIT_SUCCESS) {
          error = "device " + std::to_string(device) + ": " + moejit_last_error_message();
          break;
        }
        std::vector<uint8_t> got(out_bytes);
        cudaMemcpyAsync(got.data(), out, out_bytes, cudaMemcpyDeviceToHost, stream);
        if (cudaStreamSynchronize(stream) != cudaSuccess)
          error =
              "device " + std::to_string(device) + ": " + cudaGetErrorString(cudaGetLastError());
        else if (round == 0 && first != nullptr)
          first->push_back(std::move(got));
        else if (want != nullptr && got != (*want)[i])
          error = "device " + std::to_string(device) + " round " + std::to_string(round) +
                  ": setup " + std::to_string(i) + " differs from device 0's call alone";
        for (void* q : buffers) cudaFree(q);
        buffers.clear();
      }
    for (void* q : buffers) cudaFree(q);
    cudaStreamDestroy(stream);
    return error;
  };
  std::vector<std::vector<uint8_t>> alone;
  const std::string alone_error = run_on(0, 1, nullptr, &alone);
  ASSERT_TRUE(alone_error.empty()) << alone_error;
  ASSERT_EQ(alone.size(), setups.size());
  // Device 0's outputs against the float64 reference (every 31st element).
  const std::vector<uint8_t>& host_rows = p.host[MOEJIT_DTYPE_BFLOAT16];
  for (size_t i = 0; i < setups.size(); ++i) {
    const Setup& s = setups[i];
    int64_t bad = 0;
    for (int64_t e = 0; e < s.tokens * s.hidden; e += 31) {
      const int64_t t = e / s.hidden, h = e % s.hidden;
      double ref = 0, magnitude = 0;
      for (const auto& [row, gi] : routings[i].per_token[static_cast<size_t>(t)]) {
        const double term =
            p.gates_host[static_cast<size_t>(gi)] * decode(host_rows.data(), MOEJIT_DTYPE_BFLOAT16,
                                                           static_cast<size_t>(row * s.hidden + h));
        ref += term;
        magnitude += std::fabs(term);
      }
      const double value = decode(alone[i].data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(e));
      const int terms = static_cast<int>(routings[i].per_token[static_cast<size_t>(t)].size());
      if (!(std::fabs(value - ref) <= tolerance(MOEJIT_DTYPE_BFLOAT16, magnitude, ref, terms)) &&
          bad++ < 3)
        ADD_FAILURE() << "setup " << i << " out[" << t << "][" << h << "] = " << value
                      << ", expected " << ref;
    }
  }
  std::string errors[2];
  std::thread second([&] { errors[1] = run_on(1, 4, &alone, nullptr); });
  errors[0] = run_on(0, 4, &alone, nullptr);
  second.join();
  EXPECT_TRUE(errors[0].empty()) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
  CUDA_OK(cudaSetDevice(0));
  moejit_stats stats{};
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(moejit_runtime_get_stats(rt, &stats), MOEJIT_SUCCESS);
  // The modules were built once (memory-only runtime: no disk), then loaded per context.
  std::printf("[ info     ] compiles %llu, memory hits %llu, launches %llu\n",
              static_cast<unsigned long long>(stats.compiles),
              static_cast<unsigned long long>(stats.memory_hits),
              static_cast<unsigned long long>(stats.launches));
  moejit_runtime_destroy(rt);
}

// A shape's first call inside a stream capture: the compile runs on the host and the module
// loads in the middle of the capture, which the driver allows in every capture mode (driver 580:
// global, thread-local and relaxed all captured and replayed). The replay must equal a direct
// call bitwise. Token index: the one-token kernel, the single launch, and the clear -> assign ->
// heavy -> combine chain with its workspace; each in a runtime of its own, so every call is its
// shape's first.
TEST_F(CombineGpu, AShapesFirstCallMayBeCaptured) {
  const Pools& p = pools();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const struct {
    cudaStreamCaptureMode mode;
    const char* mode_name;
    int64_t tokens;
  } setups[] = {{cudaStreamCaptureModeGlobal, "global", 1},
                {cudaStreamCaptureModeGlobal, "global", 33},
                {cudaStreamCaptureModeGlobal, "global", 600},
                {cudaStreamCaptureModeThreadLocal, "thread-local", 600},
                {cudaStreamCaptureModeRelaxed, "relaxed", 600}};
  for (const auto& setup : setups) {
    SCOPED_TRACE(std::string(setup.mode_name) + " T=" + std::to_string(setup.tokens));
    const int64_t T = setup.tokens, K = 8, H = 2880;
    Rng rng(31);
    Case c{MOEJIT_LAYOUT_TOKEN_INDEX,
           MOEJIT_DTYPE_BFLOAT16,
           MOEJIT_DTYPE_BFLOAT16,
           MOEJIT_INDEX_INT32,
           H,
           T,
           K,
           1};
    c.random_routing = true;
    const Routing routing = make_routing(c, rng);
    std::vector<int32_t> idx(routing.index_values.begin(), routing.index_values.end());
    void *indices = nullptr, *out = nullptr, *workspace = nullptr;
    ASSERT_NO_FATAL_FAILURE(device_copy(idx, &indices));
    const size_t out_bytes = static_cast<size_t>(T * H * 2);
    CUDA_OK(cudaMalloc(&out, out_bytes));
    moejit_combine_args a =
        bf16_args(MOEJIT_LAYOUT_TOKEN_INDEX, T, K, routing.rows, H, p.device[MOEJIT_DTYPE_BFLOAT16],
                  p.gates_device, indices, out);
    ASSERT_NO_FATAL_FAILURE(attach_workspace(&a, &workspace));
    moejit_runtime_t rt = memory_only_runtime();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, setup.mode));
    const moejit_status captured = moejit_runtime_combine(rt, &a, stream);
    const std::string message = captured == MOEJIT_SUCCESS ? "" : moejit_last_error_message();
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    ASSERT_EQ(captured, MOEJIT_SUCCESS) << message;
    moejit_stats stats{};
    stats.struct_size = sizeof(stats);
    ASSERT_EQ(moejit_runtime_get_stats(rt, &stats), MOEJIT_SUCCESS);
    EXPECT_GE(stats.compiles, 1u) << "the captured call was not the shape's first";
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> replayed(out_bytes), direct(out_bytes);
    CUDA_OK(cudaMemcpy(replayed.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
    ASSERT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(direct.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(replayed == direct) << "the replay differs from a direct call";
    EXPECT_FALSE(still_poisoned(out, out_bytes));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    moejit_runtime_destroy(rt);
    for (void* q : {indices, out, workspace})
      if (q) cudaFree(q);
  }
  cudaStreamDestroy(stream);
}
// Contexts come and go (a framework's tests, a driver-API engine that recreates its context): a
// module loaded in a destroyed context must never be served to a later one, even when the driver
// hands the new context the same handle (the runtime keys modules by cuCtxGetId, unique for the
// process). Three rounds of create -> inputs -> call -> destroy on device 0, one runtime: every
// round must compute the float64 reference's result, and load its module again. The runtime keeps
// the records of the last context only (stats.loaded_modules).
TEST_F(CombineGpu, AModuleOfADestroyedContextIsNeverServedAgain) {
  const Pools& p = pools();  // host values only: device memory dies with each context
  const DriverCalls drv = driver_calls();
  ASSERT_TRUE(drv.complete()) << "libcuda.so.1 lacks the context calls";
  moejit_runtime_t rt = memory_only_runtime();
  const int64_t T = 33, K = 2, H = 4096;
  const size_t row_bytes = static_cast<size_t>(T * K * H * 2), out_bytes = T * H * 2;
  std::vector<CUcontext> handles;
  uint64_t memory_hits_before = 0;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    CUcontext ctx = nullptr, popped = nullptr;
    ASSERT_EQ(drv.ctx_create(&ctx, 0, 0), CUDA_SUCCESS);  // current until popped
    handles.push_back(ctx);
    // The driver API for this context's memory: the CUDA runtime keeps state per context and is
    // not what this test is about.
    CUdeviceptr rows = 0, gates = 0, out = 0;
    std::vector<uint16_t> got(static_cast<size_t>(T * H));
    moejit_status st = MOEJIT_ERROR_INTERNAL;
    std::string message;
    CUresult err = drv.mem_alloc(&rows, row_bytes);
    if (err == CUDA_SUCCESS) err = drv.mem_alloc(&gates, static_cast<size_t>(T * K * 4));
    if (err == CUDA_SUCCESS) err = drv.mem_alloc(&out, out_bytes);
    if (err == CUDA_SUCCESS)
      err = drv.copy_to_device(rows, p.host[MOEJIT_DTYPE_BFLOAT16].data(), row_bytes);
    if (err == CUDA_SUCCESS)
      err = drv.copy_to_device(gates, p.gates_host.data(), static_cast<size_t>(T * K * 4));
    if (err == CUDA_SUCCESS) err = drv.memset_bytes(out, 0xFF, out_bytes);
    if (err == CUDA_SUCCESS) {
      const moejit_combine_args a =
          bf16_args(MOEJIT_LAYOUT_TOKEN_MAJOR, T, K, T * K, H, reinterpret_cast<const void*>(rows),
                    reinterpret_cast<const float*>(gates), nullptr, reinterpret_cast<void*>(out));
      st = moejit_runtime_combine(rt, &a, nullptr);
      if (st != MOEJIT_SUCCESS) message = moejit_last_error_message();
      err = drv.ctx_synchronize();
      if (err == CUDA_SUCCESS) err = drv.copy_to_host(got.data(), out, out_bytes);
    }
    for (CUdeviceptr q : {rows, gates, out})
      if (q) drv.mem_free(q);
    drv.ctx_pop(&popped);
    drv.ctx_destroy(ctx);
    ASSERT_EQ(err, CUDA_SUCCESS) << "CUresult " << err;
    ASSERT_EQ(st, MOEJIT_SUCCESS) << message;
    moejit_stats stats{};
    stats.struct_size = sizeof(stats);
    ASSERT_EQ(moejit_runtime_get_stats(rt, &stats), MOEJIT_SUCCESS);
    EXPECT_EQ(stats.memory_hits, memory_hits_before)
        << "a new context was served a module loaded in an earlier one";
    memory_hits_before = stats.memory_hits;
    // This round's context (destroyed above, not yet forgotten); the earlier rounds' were
    // forgotten when this one was first used.
    EXPECT_EQ(stats.loaded_modules, 1u) << "the modules of earlier, destroyed contexts are held";
    int64_t bad = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      const int64_t t = i / H, h = i % H;
      double ref = 0, magnitude = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double term = p.gates_host[static_cast<size_t>(t * K + k)] *
                            decode(p.host[MOEJIT_DTYPE_BFLOAT16].data(), MOEJIT_DTYPE_BFLOAT16,
                                   static_cast<size_t>((t * K + k) * H + h));
        ref += term;
        magnitude += std::fabs(term);
      }
      const double value = decode(got.data(), MOEJIT_DTYPE_BFLOAT16, static_cast<size_t>(i));
      if (!(std::fabs(value - ref) <= tolerance(MOEJIT_DTYPE_BFLOAT16, magnitude, ref, 2)) &&
          bad++ < 3)
        ADD_FAILURE() << "out[" << t << "][" << h << "] = " << value << ", expected " << ref;
    }
  }
  const bool reused = handles[1] == handles[0] || handles[2] == handles[1];
  std::printf("[ info     ] context handles %p %p %p (%s)\n", static_cast<void*>(handles[0]),
              static_cast<void*>(handles[1]), static_cast<void*>(handles[2]),
              reused ? "a handle was reused" : "all distinct");
  moejit_runtime_destroy(rt);
}

}  // namespace
}  // namespace moejit_test
