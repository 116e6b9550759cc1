// moejit-demo: one real MoE combine at DeepSeek-V3 prefill size (T=4096 tokens, top_k=8,
// hidden=7168, bf16, rows expert-sorted with a gather map), checked against a float64 CPU
// reference, timed with CUDA events. Without a GPU it compiles (and caches) the kernels it would
// use for sm_90 and says plainly that no GPU was found.
//
//   moejit-demo [--tokens T] [--topk K] [--hidden H] [--layout token_major|gather_map|token_index]
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
};

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
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

// Host memory the demo holds at once: the rows (bf16), gates, permutation and indices (4 bytes per
// row each), row_of and gate_of (8 each), and the output (bf16). The device holds less.
double host_bytes(const Options& o) {
  const double t = static_cast<double>(o.tokens), r = t * static_cast<double>(o.top_k),
               h = static_cast<double>(o.hidden);
  return 2.0 * r * h + 28.0 * r + 2.0 * t * h;
}

// Larger shapes are refused: their buffers would not fit a host or a GPU of today.
constexpr double kMaxBytes = 64.0 * (1ull << 30);

const char* kUsage =
    "usage: moejit-demo [--tokens T] [--topk K] [--hidden H] "
    "[--layout token_major|gather_map|token_index]\n"
    "  T 1..2^40 (T*K at most 2^31-1, buffers at most 64 GiB), K 1..64, H 1..65536\n";

// Returns false (after printing why) on a bad command line; sets *help for -h / --help.
bool parse(int argc, char** argv, Options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      *help = true;
      return true;
    }
    if (a != "--tokens" && a != "--topk" && a != "--hidden" && a != "--layout") {
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
      "Compiling the kernels a %s combine at T=%lld K=%lld H=%lld bf16 would use, for "
      "sm_90, without running them.\n",
      moejit::layout_name(o.layout), static_cast<long long>(o.tokens),
      static_cast<long long>(o.top_k), static_cast<long long>(o.hidden));
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
    a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
    a.gates = static_cast<const float*>(fake(2));
    a.indices = o.layout == MOEJIT_LAYOUT_TOKEN_MAJOR ? nullptr : fake(3);
    a.out = fake(4);
    a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
    a.workspace_bytes = moejit::combine_workspace_bytes(&a);
    if (a.workspace_bytes > 0) a.workspace = fake(5);
    const moejit::CombinePlan plan = moejit::plan_combine(&a);
    std::vector<moejit::KernelSpec> specs = {plan.spec};
    if (plan.list_helpers()) specs.push_back(plan.spec.helpers_spec());
    for (const moejit::KernelSpec& spec : specs) {
      const auto start = std::chrono::steady_clock::now();
      moejit::KernelStore::Source source;
      const auto module = store.obtain(spec, moejit::Target{90, false}, &source);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      std::printf("  %s\n  -> %zu-byte sm_90 cubin, %s in %.1f ms (cache: %s, %s)\n",
                  spec.describe().c_str(), module->image.size(),
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
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::string why = std::string("the CUDA runtime says: ") +
                      (probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices");
    // Without any driver the runtime reports an "insufficient" driver version: say that none
    // could be loaded instead, as the library does.
    try {
      moejit::driver();
    } catch (const moejit::Error& e) {
      why = e.what();
      if (!why.empty() && why.back() == '.') why.pop_back();
    }
    return compile_only(o, why);
  }

  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const int64_t T = o.tokens, K = o.top_k, H = o.hidden, R = T * K;
  std::printf(
      "GPU: %s (sm_%d%d). Combine: %s layout, T=%lld tokens, top_k=%lld, hidden=%lld, "
      "bf16 in/out, fp32 gates.\n",
      prop.name, prop.major, prop.minor, moejit::layout_name(o.layout), static_cast<long long>(T),
      static_cast<long long>(K), static_cast<long long>(H));

  // Random inputs; rows expert-sorted = a random permutation of token-major order.
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f), unit(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(R * H));
  for (auto& v : x) v = float_to_bf16(uni(rng));
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
  check_cuda(cudaMalloc(&d_x, x.size() * 2), "cudaMalloc(rows)");
  check_cuda(cudaMalloc(&d_gates, gates.size() * 4), "cudaMalloc(gates)");
  check_cuda(cudaMalloc(&d_out, static_cast<size_t>(T * H * 2)), "cudaMalloc(out)");
  check_cuda(cudaMalloc(&d_flush, flush_bytes), "cudaMalloc(L2 flush buffer)");
  check_cuda(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy(rows)");
  check_cuda(cudaMemcpy(d_gates, gates.data(), gates.size() * 4, cudaMemcpyHostToDevice),
             "cudaMemcpy(gates)");
  if (!indices.empty()) {
    check_cuda(cudaMalloc(&d_idx, indices.size() * 4), "cudaMalloc(indices)");
    check_cuda(cudaMemcpy(d_idx, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice),
               "cudaMemcpy(indices)");
  }
  // poison: NaN everywhere
  check_cuda(cudaMemset(d_out, 0xFF, static_cast<size_t>(T * H * 2)), "cudaMemset(out)");

  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = o.layout;
  a.num_tokens = T;
  a.top_k = K;
  a.num_rows = R;
  a.hidden_dim = H;
  a.expert_hidden = d_x;
  a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.gates = d_gates;
  a.indices = d_idx;
  a.out = d_out;
  a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
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

  // Check every output element against a float64 reference.
  std::vector<uint16_t> out(static_cast<size_t>(T * H));
  check_cuda(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost),
             "cudaMemcpy(out)");
  double err2 = 0, ref2 = 0, worst = 0;
  {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    std::vector<double> e2(n), r2(n), w(n);
    std::vector<std::thread> threads;
    for (unsigned t_id = 0; t_id < n; ++t_id)
      threads.emplace_back([&, t_id] {
        std::vector<double> ref(static_cast<size_t>(H));
        for (int64_t t = t_id; t < T; t += n) {
          std::fill(ref.begin(), ref.end(), 0.0);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t slot = t * K + k, row = row_of[slot];
            const double g = gates[gate_of[slot]];
            for (int64_t h = 0; h < H; ++h) ref[h] += g * bf16_to_float(x[row * H + h]);
          }
          for (int64_t h = 0; h < H; ++h) {
            const double v = bf16_to_float(out[t * H + h]), d = v - ref[h];
            e2[t_id] += d * d;
            r2[t_id] += ref[h] * ref[h];
            const double rel = std::fabs(d) / (std::fabs(ref[h]) + 1e-3);
            w[t_id] = std::isnan(v) ? INFINITY : std::max(w[t_id], rel);
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
  const double rel_err = std::sqrt(err2 / ref2);
  const bool ok = rel_err < 4e-3 && worst < 1e-2;

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
  const double bytes = static_cast<double>(R * H * 2 + R * 8 + T * H * 2);
  moejit_stats s;
  s.struct_size = sizeof(s);
  moejit_runtime_get_stats(nullptr, &s);
  std::printf(
      "first call (compile or cache load + launch): %.1f ms; compiles %llu, disk hits %llu\n",
      first_ms, static_cast<unsigned long long>(s.compiles),
      static_cast<unsigned long long>(s.disk_hits));
  std::printf("check vs float64 reference: relative L2 error %.2e, worst element %.2e -> %s\n",
              rel_err, worst, ok ? "PASS" : "FAIL");
  std::printf(
      "time: median %.1f us over 50 runs (L2 flushed); effective bandwidth %.0f GB/s "
      "(%.1f MB moved at minimum)\n",
      us, bytes / us * 1e-3, bytes * 1e-6);
  return ok ? 0 : 1;
}
