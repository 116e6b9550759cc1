// moejit-demo: one real MoE combine at DeepSeek-V3 prefill size (T=4096 tokens, top_k=8,
// hidden=7168, bf16, rows expert-sorted with a gather map), checked against a float64 CPU
// reference, timed with CUDA events. Without a GPU it compiles (and caches) the kernels it would
// use for sm_90 and says plainly why no GPU can be used. `moejit-demo --help` lists the options.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moejit/moejit.h"
#include "moejit_internal.h"

namespace {

struct Options {
  int64_t tokens = 4096, top_k = 8, hidden = 7168;
  moejit_layout layout = MOEJIT_LAYOUT_GATHER_MAP;
  moejit_dtype dtype = MOEJIT_DTYPE_BFLOAT16;      // the expert rows
  moejit_dtype out_dtype = MOEJIT_DTYPE_BFLOAT16;  // the output
  bool out_dtype_given = false;                    // else: the same as dtype
};

const char* dtype_text(moejit_dtype d) {
  return d == MOEJIT_DTYPE_FLOAT32 ? "fp32" : d == MOEJIT_DTYPE_FLOAT16 ? "fp16" : "bf16";
}
const char* layout_words(moejit_layout l) {
  return l == MOEJIT_LAYOUT_TOKEN_MAJOR  ? "token-major rows [T, K, H]"
         : l == MOEJIT_LAYOUT_GATHER_MAP ? "expert-sorted rows with a gather map [T, K]"
                                         : "expert-sorted rows with a token index [R]";
}
size_t dtype_bytes(moejit_dtype d) {
  return d == MOEJIT_DTYPE_FLOAT32 ? 4 : 2;
}

// One element of a buffer of dtype d, rounded to nearest even (fp16 through the compiler's
// _Float16, IEEE conversions; bf16 by hand: the top half of an fp32, rounded).
void encode(std::vector<uint8_t>& buffer, moejit_dtype d, size_t i, float v) {
  uint8_t* at = buffer.data() + i * dtype_bytes(d);
  if (d == MOEJIT_DTYPE_FLOAT32) {
    std::memcpy(at, &v, 4);
  } else if (d == MOEJIT_DTYPE_FLOAT16) {
    const _Float16 h = static_cast<_Float16>(v);
    std::memcpy(at, &h, 2);
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(at, &h, 2);
  }
}
float decode(const std::vector<uint8_t>& buffer, moejit_dtype d, size_t i) {
  const uint8_t* at = buffer.data() + i * dtype_bytes(d);
  float v;
  if (d == MOEJIT_DTYPE_FLOAT32) {
    std::memcpy(&v, at, 4);
  } else if (d == MOEJIT_DTYPE_FLOAT16) {
    _Float16 h;
    std::memcpy(&h, at, 2);
    v = static_cast<float>(h);
  } else {
    uint16_t h;
    std::memcpy(&h, at, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    std::memcpy(&v, &u, 4);
  }
  return v;
}

bool parse_dtype(const std::string& text, moejit_dtype* d) {
  if (text == "fp32" || text == "float32") {
    *d = MOEJIT_DTYPE_FLOAT32;
  } else if (text == "fp16" || text == "float16" || text == "half") {
    *d = MOEJIT_DTYPE_FLOAT16;
  } else if (text == "bf16" || text == "bfloat16") {
    *d = MOEJIT_DTYPE_BFLOAT16;
  } else {
    return false;
  }
  return true;
}

// A decimal integer in min..max; false for anything else (empty, a sign, spaces, trailing text,
// overflow). strtoll alone would take " +8" as 8.
bool parse_int(const char* text, int64_t min, int64_t max, int64_t* value) {
  if (*text == '\0' || std::strspn(text, "0123456789") != std::strlen(text)) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (errno == ERANGE || *end != '\0' || v < min || v > max) return false;
  *value = v;
  return true;
}

// Host memory the demo holds at once: the rows, gates, permutation and indices (4 bytes per row
// each), row_of and gate_of (8 each), and the output. The device holds less.
double host_bytes(const Options& o) {
  const double t = static_cast<double>(o.tokens), r = t * static_cast<double>(o.top_k),
               h = static_cast<double>(o.hidden);
  return static_cast<double>(dtype_bytes(o.dtype)) * r * h + 28.0 * r +
         static_cast<double>(dtype_bytes(o.out_dtype)) * t * h;
}

// Larger shapes are refused: their buffers would not fit a host or a GPU of today.
constexpr double kMaxBytes = 64.0 * (1ull << 30);

const char* kUsage =
    "usage: moejit-demo [options]\n"
    "One MoE combine, out[t, :] = sum over the rows r of token t of gate[r] * rows[r, :],\n"
    "checked against a float64 CPU reference and timed (median of 50 runs, L2 flushed).\n"
    "Without a GPU it compiles the kernels the call needs, for sm_90, and says why no GPU\n"
    "can be used. The defaults are DeepSeek-V3's prefill.\n"
    "\n"
    "  --tokens T      tokens, 1..2^40 (default 4096)\n"
    "  --topk K        rows per token (top_k), 1..64 (default 8)\n"
    "  --hidden H      hidden size, 1..65536 (default 7168)\n"
    "  --layout L      how the rows are routed (default gather_map):\n"
    "                    token_major  rows in token order, [T, K, H]\n"
    "                    gather_map   rows expert-sorted, a [T, K] map to each slot's row\n"
    "                    token_index  rows expert-sorted, each row's token in token_idx [R]\n"
    "  --dtype D       the rows' dtype: fp32, fp16 or bf16 (float32, float16/half, bfloat16;\n"
    "                  default bf16); gates are fp32\n"
    "  --out-dtype D   the output's dtype, the same choices (default: --dtype)\n"
    "  -h, --help      this text\n"
    "T*K is at most 2^31-1 (the demo's int32 routing) and the buffers at most 64 GiB.\n"
    "Environment: MOEJIT_CACHE_DIR, MOEJIT_CACHE_MODE, MOEJIT_LOG_LEVEL (docs/usage.md).\n"
    "Exit: 0 the check passed (or no GPU: the kernels compiled), 1 it failed or a call\n"
    "failed, 2 bad command line.\n";

// Returns false (after printing why) on a bad command line; sets *help for -h / --help.
bool parse(int argc, char** argv, Options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      *help = true;
      return true;
    }
    if (a != "--tokens" && a != "--topk" && a != "--hidden" && a != "--layout" && a != "--dtype" &&
        a != "--out-dtype") {
      std::fprintf(stderr, "moejit-demo: unknown option %s\n", a.c_str());
      return false;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "moejit-demo: %s needs a value\n", a.c_str());
      return false;
    }
    const char* v = argv[++i];
    int64_t* field = a == "--tokens"   ? &o->tokens
                     : a == "--topk"   ? &o->top_k
                     : a == "--hidden" ? &o->hidden
                                       : nullptr;
    if (field != nullptr) {
      const int64_t max = a == "--tokens" ? MOEJIT_MAX_NUM_TOKENS
                          : a == "--topk" ? MOEJIT_MAX_TOP_K
                                          : MOEJIT_MAX_HIDDEN_DIM;
      if (!parse_int(v, 1, max, field)) {
        std::fprintf(stderr, "moejit-demo: %s %s: expected an integer in 1..%lld\n", a.c_str(), v,
                     static_cast<long long>(max));
        return false;
      }
    } else if (a == "--dtype" || a == "--out-dtype") {
      moejit_dtype* d = a == "--dtype" ? &o->dtype : &o->out_dtype;
      if (!parse_dtype(v, d)) {
        std::fprintf(stderr,
                     "moejit-demo: %s %s: expected fp32, fp16 or bf16 (float32, float16, half, "
                     "bfloat16)\n",
                     a.c_str(), v);
        return false;
      }
      if (a == "--out-dtype") o->out_dtype_given = true;
    } else {  // --layout
      const std::string l = v;
      if (l == "token_major") {
        o->layout = MOEJIT_LAYOUT_TOKEN_MAJOR;
      } else if (l == "gather_map") {
        o->layout = MOEJIT_LAYOUT_GATHER_MAP;
      } else if (l == "token_index") {
        o->layout = MOEJIT_LAYOUT_TOKEN_INDEX;
      } else {
        std::fprintf(stderr,
                     "moejit-demo: --layout %s: expected token_major, gather_map or token_index\n",
                     v);
        return false;
      }
    }
  }
  if (!o->out_dtype_given) o->out_dtype = o->dtype;
  // The demo's routing is int32: R = T*K rows at most INT32_MAX (T <= 2^40 and K <= 64: no
  // overflow).
  if (o->tokens * o->top_k > INT32_MAX) {
    std::fprintf(stderr,
                 "moejit-demo: --tokens %lld --topk %lld: %lld rows; the demo's int32 routing "
                 "allows at most %d\n",
                 static_cast<long long>(o->tokens), static_cast<long long>(o->top_k),
                 static_cast<long long>(o->tokens * o->top_k), INT32_MAX);
    return false;
  }
  if (host_bytes(*o) > kMaxBytes) {
    std::fprintf(stderr,
                 "moejit-demo: T=%lld K=%lld H=%lld needs about %.1f GiB of host memory; at most "
                 "%.0f GiB is allowed\n",
                 static_cast<long long>(o->tokens), static_cast<long long>(o->top_k),
                 static_cast<long long>(o->hidden), host_bytes(*o) / (1ull << 30),
                 kMaxBytes / (1ull << 30));
    return false;
  }
  return true;
}

// A failed CUDA runtime call or library call: say which and exit 1.
void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "moejit-demo: %s failed: %s: %s\n", what, cudaGetErrorName(e),
               cudaGetErrorString(e));
  std::exit(1);
}
void check_status(moejit_status st, const char* what) {
  if (st == MOEJIT_SUCCESS) return;
  std::fprintf(stderr, "moejit-demo: %s failed: %s: %s\n", what, moejit_status_name(st),
               moejit_last_error_message());
  std::exit(1);
}

// The median; of an even count, the mean of the two middle values (as moejit-bench's).
double median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2]
                    : 0.5 * (static_cast<double>(values[n / 2 - 1]) + values[n / 2]);
}

// No GPU: compile what a call at this shape would need, for the H200's sm_90, through the same
// store (and disk cache) the runtime uses.
int compile_only(const Options& o, const std::string& why) {
  std::printf("No GPU found (%s).\n", why.c_str());
  std::printf(
      "Compiling, for sm_90 (H100/H200) and without running them, the kernels of a combine of\n"
      "%lld tokens x %lld rows each (%s), hidden size %lld, %s rows -> %s output:\n",
      static_cast<long long>(o.tokens), static_cast<long long>(o.top_k), layout_words(o.layout),
      static_cast<long long>(o.hidden), dtype_text(o.dtype), dtype_text(o.out_dtype));
  try {
    moejit::Stats stats;
    moejit::KernelStore store(moejit::resolve_settings(nullptr), stats);
    // The plan a real call at this shape makes (plan_combine reads no device memory and needs no
    // GPU), on stand-in addresses aligned like fresh allocations: the combine's module, and for
    // the token index's list path also the list helpers' module, as ModuleCache loads them.
    moejit_combine_args a;
    moejit_combine_args_init(&a);
    auto fake = [](uintptr_t n) { return reinterpret_cast<void*>(n << 32); };
    a.layout = o.layout;
    a.num_tokens = o.tokens;
    a.top_k = o.top_k;
    a.num_rows = o.tokens * o.top_k;
    a.hidden_dim = o.hidden;
    a.expert_hidden = fake(1);
    a.expert_dtype = o.dtype;
    a.gates = static_cast<const float*>(fake(2));
    a.indices = o.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : fake(3);
    a.out = fake(4);
    a.out_dtype = o.out_dtype;
    a.workspace_bytes = moejit::combine_workspace_bytes(&a);
    if (a.workspace_bytes > 0) a.workspace = fake(5);
    const moejit::CombinePlan plan = moejit::plan_combine(&a);
    struct Module {
      moejit::KernelSpec spec;
      const char* what;
    };
    std::vector<Module> modules = {{plan.spec, "the combine kernel"}};
    if (const auto before = moejit::companion_module(plan.spec))
      modules.push_back({*before, "the token index's list-building kernels"});
    for (const Module& m : modules) {
      const auto start = std::chrono::steady_clock::now();
      moejit::KernelStore::Source source;
      const auto module = store.obtain(m.spec, moejit::Target{90, false}, &source);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      std::printf("  %s: %zu-byte sm_90 cubin, %s in %.1f ms (cache: %s, %s)\n", m.what,
                  module->image.size(),
                  source == moejit::KernelStore::Source::kDisk ? "loaded from the disk cache"
                                                               : "compiled with NVRTC",
                  ms,
                  store.settings().cache_dir.empty() ? "none" : store.settings().cache_dir.c_str(),
                  store.has_disk_cache() ? "on disk" : "memory only");
    }
    std::printf(
        "Kernels compile here; run this on a machine with an NVIDIA GPU to execute and "
        "time them.\n");
    return 0;
  } catch (const moejit::Error& e) {
    // Not only compiles fail here: in no-compile mode a kernel missing from the cache does.
    std::fprintf(stderr, "no kernel for this shape (%s): %s\n", moejit_status_name(e.status()),
                 e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "no kernel for this shape: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bool help = false;
  if (!parse(argc, argv, &o, &help)) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  // The driver's own answer first (the probe the library and the GPU tests share): the CUDA runtime
  // calls a missing driver an "insufficient" one. Then the runtime's, which the demo uses.
  const moejit::DriverProbe probe = moejit::probe_driver();
  if (probe.status != MOEJIT_SUCCESS) {
    std::string why = probe.message;
    if (!why.empty() && why.back() == '.') why.pop_back();
    return compile_only(o, why);
  }
  int devices = 0;
  const cudaError_t runtime_probe = cudaGetDeviceCount(&devices);
  if (runtime_probe != cudaSuccess || devices == 0)
    return compile_only(
        o, std::string("the CUDA runtime says: ") +
               (runtime_probe != cudaSuccess ? cudaGetErrorString(runtime_probe) : "0 devices"));

  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const int64_t T = o.tokens, K = o.top_k, H = o.hidden, R = T * K;
  std::printf(
      "GPU: %s (sm_%d%d). Combine of %lld tokens x %lld rows each (%s), hidden size %lld, %s "
      "rows -> %s output, fp32 gates.\n",
      prop.name, prop.major, prop.minor, static_cast<long long>(T), static_cast<long long>(K),
      layout_words(o.layout), static_cast<long long>(H), dtype_text(o.dtype),
      dtype_text(o.out_dtype));

  // Random inputs; rows expert-sorted = a random permutation of token-major order.
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f), unit(0.0f, 1.0f);
  const size_t in_bytes = dtype_bytes(o.dtype), out_bytes = dtype_bytes(o.out_dtype);
  std::vector<uint8_t> x(static_cast<size_t>(R * H) * in_bytes);
  for (size_t i = 0; i < static_cast<size_t>(R * H); ++i) encode(x, o.dtype, i, uni(rng));
  std::vector<float> gates(static_cast<size_t>(R));
  for (auto& g : gates) g = unit(rng);
  std::vector<int32_t> perm(static_cast<size_t>(R));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> indices;  // gather map [T*K], or token_idx [R]
  std::vector<int64_t> row_of(static_cast<size_t>(R)), gate_of(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) {  // slot i = (t, k) of token-major order
    row_of[i] = o.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? i : perm[i];
    gate_of[i] = o.layout == MOEJIT_LAYOUT_TOKEN_INDEX ? row_of[i] : i;
  }
  if (o.layout == MOEJIT_LAYOUT_GATHER_MAP) indices.assign(perm.begin(), perm.end());
  if (o.layout == MOEJIT_LAYOUT_TOKEN_INDEX) {
    indices.resize(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) indices[perm[i]] = static_cast<int32_t>(i / K);
  }

  void *d_x, *d_out, *d_idx = nullptr, *d_ws = nullptr, *d_flush;
  float* d_gates;
  const size_t flush_bytes = 256u << 20;
  check_cuda(cudaMalloc(&d_x, x.size()), "cudaMalloc(rows)");
  check_cuda(cudaMalloc(&d_gates, gates.size() * 4), "cudaMalloc(gates)");
  check_cuda(cudaMalloc(&d_out, static_cast<size_t>(T * H) * out_bytes), "cudaMalloc(out)");
  check_cuda(cudaMalloc(&d_flush, flush_bytes), "cudaMalloc(L2 flush buffer)");
  check_cuda(cudaMemcpy(d_x, x.data(), x.size(), cudaMemcpyHostToDevice), "cudaMemcpy(rows)");
  check_cuda(cudaMemcpy(d_gates, gates.data(), gates.size() * 4, cudaMemcpyHostToDevice),
             "cudaMemcpy(gates)");
  if (!indices.empty()) {
    check_cuda(cudaMalloc(&d_idx, indices.size() * 4), "cudaMalloc(indices)");
    check_cuda(cudaMemcpy(d_idx, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice),
               "cudaMemcpy(indices)");
  }
  // poison: NaN everywhere
  check_cuda(cudaMemset(d_out, 0xFF, static_cast<size_t>(T * H) * out_bytes), "cudaMemset(out)");

  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = o.layout;
  a.num_tokens = T;
  a.top_k = K;
  a.num_rows = R;
  a.hidden_dim = H;
  a.expert_hidden = d_x;
  a.expert_dtype = o.dtype;
  a.gates = d_gates;
  a.indices = d_idx;
  a.out = d_out;
  a.out_dtype = o.out_dtype;
  size_t ws = 0;
  check_status(moejit_combine_workspace_size(&a, &ws), "moejit_combine_workspace_size");
  if (ws) {
    check_cuda(cudaMalloc(&d_ws, ws), "cudaMalloc(workspace)");
    a.workspace = d_ws;
    a.workspace_bytes = ws;
  }
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");

  const auto t0 = std::chrono::steady_clock::now();
  moejit_status st = moe_combine(&a, stream);
  const double first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  check_status(st, "moe_combine");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  // Check every output element against a float64 reference. The kernels accumulate in fp32 and
  // round once to the output type, so an element may differ by a few fp32 ulps of the sum of its
  // terms' magnitudes plus one ulp of the output type: "worst" is the largest error as a fraction
  // of that bound (NaN, an unwritten element of the poisoned output, counts as infinite).
  std::vector<uint8_t> out(static_cast<size_t>(T * H) * out_bytes);
  check_cuda(cudaMemcpy(out.data(), d_out, out.size(), cudaMemcpyDeviceToHost), "cudaMemcpy(out)");
  const double out_ulp = o.out_dtype == MOEJIT_DTYPE_BFLOAT16  ? std::ldexp(1.0, -8)
                         : o.out_dtype == MOEJIT_DTYPE_FLOAT16 ? std::ldexp(1.0, -10)
                                                               : std::ldexp(1.0, -23);
  // fp16's subnormals are spaced 2^-24 apart: near zero the rounding is that, not relative.
  const double out_abs = o.out_dtype == MOEJIT_DTYPE_FLOAT16 ? std::ldexp(1.0, -24) : 0.0;
  const double fp32_sum = std::ldexp(1.0, -23) * static_cast<double>(K + 2);
  double err2 = 0, ref2 = 0, worst = 0;
  {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    std::vector<double> e2(n), r2(n), w(n);
    std::vector<std::thread> threads;
    for (unsigned t_id = 0; t_id < n; ++t_id)
      threads.emplace_back([&, t_id] {
        std::vector<double> ref(static_cast<size_t>(H)), magnitude(static_cast<size_t>(H));
        for (int64_t t = t_id; t < T; t += n) {
          std::fill(ref.begin(), ref.end(), 0.0);
          std::fill(magnitude.begin(), magnitude.end(), 0.0);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t slot = t * K + k, row = row_of[slot];
            const double g = gates[gate_of[slot]];
            for (int64_t h = 0; h < H; ++h) {
              const double term = g * decode(x, o.dtype, static_cast<size_t>(row * H + h));
              ref[h] += term;
              magnitude[h] += std::fabs(term);
            }
          }
          for (int64_t h = 0; h < H; ++h) {
            const double v = decode(out, o.out_dtype, static_cast<size_t>(t * H + h)),
                         d = v - ref[h];
            e2[t_id] += d * d;
            r2[t_id] += ref[h] * ref[h];
            const double bound =
                fp32_sum * magnitude[h] + out_ulp * std::fabs(ref[h]) + out_abs + 1e-30;
            w[t_id] = std::isnan(v) ? INFINITY : std::max(w[t_id], std::fabs(d) / bound);
          }
        }
      });
    for (auto& th : threads) th.join();
    for (unsigned i = 0; i < n; ++i) {
      err2 += e2[i];
      ref2 += r2[i];
      worst = std::max(worst, w[i]);
    }
  }
  // The relative L2 error is about a third of one rounding of the output type.
  const double rel_err = std::sqrt(err2 / ref2);
  const double max_rel_err = o.out_dtype == MOEJIT_DTYPE_BFLOAT16  ? 4e-3
                             : o.out_dtype == MOEJIT_DTYPE_FLOAT16 ? 1e-3
                                                                   : 1e-5;
  const bool ok = rel_err < max_rel_err && worst <= 1.0;

  // Time: median of 50 runs, L2 flushed between runs (the expert rows come from HBM).
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> times;
  for (int i = 0; i < 55; ++i) {
    check_cuda(cudaMemsetAsync(d_flush, i, flush_bytes, stream), "cudaMemsetAsync(L2 flush)");
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    check_status(moe_combine(&a, stream), "moe_combine (timed)");
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= 5) times.push_back(ms);
  }
  const double us = median(times) * 1e3;
  const double bytes = static_cast<double>(R * H) * static_cast<double>(in_bytes) +
                       static_cast<double>(R * 8) +
                       static_cast<double>(T * H) * static_cast<double>(out_bytes);
  moejit_stats s;
  s.struct_size = sizeof(s);
  moejit_runtime_get_stats(nullptr, &s);
  std::printf(
      "first call (compile or cache load + launch): %.1f ms; compiles %llu, disk hits %llu\n",
      first_ms, static_cast<unsigned long long>(s.compiles),
      static_cast<unsigned long long>(s.disk_hits));
  std::printf(
      "check vs float64 reference: relative L2 error %.2e, worst element at %.2f of its bound "
      "-> %s\n",
      rel_err, worst, ok ? "PASS" : "FAIL");
  std::printf(
      "time: median %.1f us over 50 runs (L2 flushed); effective bandwidth %.0f GB/s "
      "(%.1f MB moved at minimum)\n",
      us, bytes / us * 1e-3, bytes * 1e-6);
  return ok ? 0 : 1;
}
