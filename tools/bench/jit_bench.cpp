#include "jit_bench.h"

#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "moejit/moejit.h"
#include "moejit_internal.h"

namespace moejit_bench {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// CPU time of this process (every thread: NVRTC compiles on the calling one).
double process_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

moejit::Settings settings_without_disk() {
  moejit::Settings s;
  s.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  s.cache_dir.clear();
  return s;
}

// The specializations compiled cold, in this order. The first is the DeepSeek-V3 shape, the most
// likely first call of a real process; then one module of each other kind: the token index's
// list-path combine, its single-launch kernel for a decode-sized call (the shared-list scan, then
// the small-call form that calls of at most 128 rows take), a short fp32 row, the token index's
// list helpers (compiled once per index type, whatever the shape) and its one-token kernel
// (single-sequence decode).
std::vector<moejit::KernelSpec> cold_specs() {
  const moejit::KernelSpec mixtral_list =
      moejit::spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                             MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 2, 256);
  const moejit::KernelSpec deepseek_decode_list =
      moejit::spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                             MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256, 1);
  const moejit::KernelSpec deepseek_single = moejit::single_launch_spec(deepseek_decode_list, 1);
  return {
      moejit::spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                             MOEJIT_INDEX_INT32, 7168, 8, 256),
      mixtral_list,
      deepseek_single,
      moejit::single_launch_for_rows(deepseek_single, 1),
      moejit::spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                             MOEJIT_INDEX_INT32, 128, 2, 256),
      moejit::list_helpers_spec(mixtral_list.index_bytes),
      moejit::one_token_index_spec(deepseek_decode_list),
  };
}

// A private directory for the disk-cache figure, removed afterwards. Not the user's cache: the
// figure must start from an empty directory and must not disturb a real cache.
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") +
                          "/moejit-bench-cache-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp(" + pattern + ") failed");
    path = buf.data();
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

double median_load_ms(const moejit::CompiledModule& module, int reps) {
  const moejit::DriverApi& d = moejit::driver();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CUmodule m = nullptr;
    const auto start = Clock::now();
    moejit::check_cuda(d.cuModuleLoadData(&m, module.image.data()), "cuModuleLoadData");
    for (const std::string& name : module.lowered_names) {
      CUfunction f = nullptr;
      moejit::check_cuda(d.cuModuleGetFunction(&f, m, name.c_str()), "cuModuleGetFunction");
    }
    ms.push_back(ms_since(start));
    moejit::check_cuda(d.cuModuleUnload(m), "cuModuleUnload");
  }
  return median(ms);
}

// Combine arguments for bf16 rows and output, fp32 gates and int32 indices in these buffers.
moejit_combine_args bf16_args(moejit_layout layout, int64_t tokens, int64_t top_k, int64_t rows,
                              int64_t hidden, const DeviceBuffer& expert, const DeviceBuffer& gates,
                              const DeviceBuffer& indices, const DeviceBuffer& out) {
  moejit_combine_args args;
  moejit_combine_args_init(&args);
  args.layout = layout;
  args.num_tokens = tokens;
  args.top_k = top_k;
  args.num_rows = rows;
  args.hidden_dim = hidden;
  args.expert_hidden = expert.get();
  args.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  args.gates = static_cast<const float*>(gates.get());
  args.indices = indices.get();
  args.index_type = MOEJIT_INDEX_INT32;
  args.out = out.get();
  args.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  return args;
}

// Device buffers of one small (decode) gather-map case: launch cost dominates its kernel.
struct SmallCase {
  static constexpr int64_t kTokens = 1, kTopK = 8, kHidden = 7168;
  DeviceBuffer expert{kTokens * kTopK * kHidden * 2}, gates{kTokens * kTopK * 4},
      map{kTokens * kTopK * 4}, out{kTokens * kHidden * 2};
  moejit_combine_args args;

  SmallCase() {
    // Not zeros (BENCHMARKS.md's rule); the values do not matter for launch timing.
    BENCH_CUDA(cudaMemset(expert.get(), 0x3c, expert.bytes()));
    BENCH_CUDA(cudaMemset(gates.get(), 0x3e, gates.bytes()));
    std::vector<int32_t> rows(kTokens * kTopK);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(rows.size() - 1 - i);
    map.upload(rows.data(), rows.size() * sizeof(int32_t));
    args = bf16_args(MOEJIT_LAYOUT_GATHER_MAP, kTokens, kTopK, kTokens * kTopK, kHidden, expert,
                     gates, map, out);
  }
};

// Device buffers of a token-index call on the list path (too many rows per block for the single
// launch): its first call needs the combine module and the list helpers' module.
struct ListPathCase {
  static constexpr int64_t kTokens = 2048, kTopK = 8, kHidden = 2048;
  static constexpr int64_t kRows = kTokens * kTopK;
  DeviceBuffer expert{kRows * kHidden * 2}, gates{kRows * 4}, token_idx{kRows * 4},
      out{kTokens * kHidden * 2}, workspace;
  moejit_combine_args args;

  ListPathCase() {
    BENCH_CUDA(cudaMemset(expert.get(), 0x3c, expert.bytes()));
    BENCH_CUDA(cudaMemset(gates.get(), 0x3e, gates.bytes()));
    std::vector<int32_t> tokens(kRows);
    for (size_t r = 0; r < tokens.size(); ++r) tokens[r] = static_cast<int32_t>(r % kTokens);
    token_idx.upload(tokens.data(), tokens.size() * sizeof(int32_t));
    args = bf16_args(MOEJIT_LAYOUT_TOKEN_INDEX, kTokens, 0, kRows, kHidden, expert, gates,
                     token_idx, out);
    size_t bytes = 0;
    if (moejit_combine_workspace_size(&args, &bytes) != MOEJIT_SUCCESS)
      throw std::runtime_error(std::string("moejit_combine_workspace_size: ") +
                               moejit_last_error_message());
    workspace = DeviceBuffer(bytes);
    args.workspace = workspace.get();
    args.workspace_bytes = bytes;
  }
};

void check_status(moejit_status status, const char* call) {
  if (status != MOEJIT_SUCCESS)
    throw std::runtime_error(std::string(call) + ": " + moejit_status_name(status) + ": " +
                             moejit_last_error_message());
}

// Host microseconds per call of two enqueue functions, measured in alternating batches (A B B A,
// repeated) so that drift in the host's speed hits both alike: the median over `batches` batches
// of `per_batch` calls each. The stream is drained between batches (outside the clock) so the
// launch queue never fills: a full queue would make the host wait for the GPU and time the
// kernels instead of the enqueue. (Timed one after the other, the difference moved between -0.2
// and +1.06 us across H200 runs of the same code.)
template <typename EnqueueA, typename EnqueueB>
void host_us_per_call(cudaStream_t stream, int batches, int per_batch, EnqueueA a, EnqueueB b,
                      double* a_us, double* b_us) {
  for (int i = 0; i < per_batch; ++i) {  // warm-up batch of each
    a();
    b();
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> times[2];
  auto timed_batch = [&](int which) {
    const auto start = Clock::now();
    if (which == 0)
      for (int i = 0; i < per_batch; ++i) a();
    else
      for (int i = 0; i < per_batch; ++i) b();
    times[which].push_back(ms_since(start) * 1e3 / per_batch);
    BENCH_CUDA(cudaStreamSynchronize(stream));
  };
  for (int k = 0; k < batches; ++k) {
    const int first = (k % 4 == 0 || k % 4 == 3) ? 0 : 1;
    timed_batch(first);
    timed_batch(1 - first);
  }
  *a_us = median(times[0]);
  *b_us = median(times[1]);
}

}  // namespace

void disable_compute_cache_for_jit(JitFigures* figures) {
  if (const char* v = std::getenv("CUDA_CACHE_DISABLE")) {
    figures->compute_cache = std::string("CUDA_CACHE_DISABLE=") + v + " (from the environment)";
    return;
  }
  setenv("CUDA_CACHE_DISABLE", "1", 1);
  figures->compute_cache = "CUDA_CACHE_DISABLE=1 (set by moejit-bench: every compile is cold)";
}

void measure_cold_compiles(const moejit::Target& target, JitFigures* figures) {
  figures->target = target.name();
  figures->nvrtc_version = moejit::nvrtc_version();
  // A fresh store per compile with the disk cache off: obtain() can only compile.
  auto compile_ms = [&](const moejit::KernelSpec& spec, size_t* image_bytes,
                        double* cpu_ms = nullptr) {
    moejit::Stats stats;
    moejit::KernelStore store(settings_without_disk(), stats);
    const double cpu_start = process_cpu_ms();
    const auto start = Clock::now();
    const auto module = store.obtain(spec, target);
    const double ms = ms_since(start);
    if (cpu_ms != nullptr) *cpu_ms = process_cpu_ms() - cpu_start;
    *image_bytes = module->image.size();
    return ms;
  };
  // Every spec's first compile first (in order: the first is the process's first), then the
  // repeats.
  const std::vector<moejit::KernelSpec> specs = cold_specs();
  for (const moejit::KernelSpec& spec : specs) {
    CompileFigure f;
    f.spec = spec.describe();
    f.ms = compile_ms(spec, &f.image_bytes);
    figures->cold.push_back(f);
  }
  std::vector<std::vector<double>> later(specs.size()), later_cpu(specs.size());
  for (int r = 0; r < kLaterCompiles; ++r)  // rounds over the specs: drift hits each alike
    for (size_t i = 0; i < specs.size(); ++i) {
      size_t ignored = 0;
      double cpu = 0.0;
      later[i].push_back(compile_ms(specs[i], &ignored, &cpu));
      later_cpu[i].push_back(cpu);
    }
  for (size_t i = 0; i < specs.size(); ++i) {
    figures->cold[i].later_median_ms = median(later[i]);
    figures->cold[i].later_min_ms = *std::min_element(later[i].begin(), later[i].end());
    figures->cold[i].later_cpu_median_ms = median(later_cpu[i]);
  }
  // A first list-path call needs two modules; the library builds the helpers on a second thread
  // while it builds the combine (ModuleCache::load). Both orders on fresh stores, alternating.
  const moejit::KernelSpec list_spec =
      moejit::spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                             MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256);
  figures->pair_spec = list_spec.describe();
  std::vector<double> serial, concurrent;
  for (int r = 0; r < kLaterCompiles; ++r)
    for (const bool together : {false, true}) {
      moejit::Stats stats;
      moejit::KernelStore store(settings_without_disk(), stats);
      const auto start = Clock::now();
      if (together) {
        auto helpers = std::async(std::launch::async, [&] {
          return store.obtain(moejit::list_helpers_spec(list_spec.index_bytes), target);
        });
        store.obtain(list_spec, target);
        helpers.get();
      } else {
        store.obtain(list_spec, target);
        store.obtain(moejit::list_helpers_spec(list_spec.index_bytes), target);
      }
      (together ? concurrent : serial).push_back(ms_since(start));
    }
  figures->pair_serial_ms = median(serial);
  figures->pair_concurrent_ms = median(concurrent);
}

void measure_disk_cache(const moejit::Target& target, bool gpu, JitFigures* figures) {
  const moejit::KernelSpec spec = cold_specs().front();
  TempDir dir;
  moejit::Settings settings;
  settings.cache_dir = dir.path;
  settings.cache_mode = MOEJIT_CACHE_MODE_READ_WRITE;

  std::shared_ptr<const moejit::CompiledModule> module;
  {
    moejit::Stats stats;
    moejit::KernelStore writer(settings, stats);
    module = writer.obtain(spec, target);  // compiles and publishes to the directory
    if (!writer.has_disk_cache()) {
      figures->disk_note =
          "disk cache unavailable: open_disk_cache() returned no cache in this build";
    }
  }
  if (figures->disk_note.empty()) {
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      moejit::Stats stats;
      moejit::KernelStore reader(settings, stats);
      moejit::KernelStore::Source source = moejit::KernelStore::Source::kCompiled;
      const auto start = Clock::now();
      const auto hit = reader.obtain(spec, target, &source);
      const double elapsed = ms_since(start);
      if (source != moejit::KernelStore::Source::kDisk || stats.disk_hits.load() != 1) {
        figures->disk_note =
            "disk cache unavailable: a fresh store on the directory just written "
            "compiled instead of hitting (disk_hits " +
            std::to_string(stats.disk_hits.load()) + ", disk_errors " +
            std::to_string(stats.disk_errors.load()) + ")";
        break;
      }
      if (hit->image != module->image) {
        figures->disk_note = "disk cache returned an image different from the one compiled";
        break;
      }
      ms.push_back(elapsed);
    }
    if (figures->disk_note.empty()) {
      figures->disk_available = true;
      figures->disk_hit_ms = median(ms);
      figures->disk_note = "median of 5 fresh stores on one directory";
    }
  }
  if (gpu) {
    figures->module_load_ms = median_load_ms(*module, 20);
    figures->module_load_measured = true;
  }
}

void measure_calls(cudaStream_t stream, JitFigures* figures) {
  SmallCase c;
  const CUstream cu_stream = stream;  // cudaStream_t and CUstream are the same type

  // First call on a fresh runtime (NVRTC is already warm in this process: this is the cost of
  // compiling one more shape, loading it and launching, as a long-running server sees it).
  using Runtime = std::unique_ptr<moejit_runtime, decltype(&moejit_runtime_destroy)>;
  auto fresh_runtime = [] {
    moejit_runtime_options options;
    moejit_runtime_options_init(&options);
    options.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
    moejit_runtime_t runtime = nullptr;
    check_status(moejit_runtime_create(&options, &runtime), "moejit_runtime_create");
    return Runtime(runtime, &moejit_runtime_destroy);
  };
  auto timed_call_ms = [&](moejit_runtime_t runtime, const moejit_combine_args& args) {
    const auto start = Clock::now();
    check_status(moejit_runtime_combine(runtime, &args, stream), "moejit_runtime_combine");
    BENCH_CUDA(cudaStreamSynchronize(stream));
    return ms_since(start);
  };
  {
    const Runtime runtime = fresh_runtime();
    figures->first_call_ms = timed_call_ms(runtime.get(), c.args);
    figures->second_call_us = timed_call_ms(runtime.get(), c.args) * 1e3;
  }
  {
    const ListPathCase list_case;
    const Runtime runtime = fresh_runtime();
    figures->first_call_token_index_case = "token_index T" + std::to_string(ListPathCase::kTokens) +
                                           " K" + std::to_string(ListPathCase::kTopK) + " H" +
                                           std::to_string(ListPathCase::kHidden) +
                                           " bf16 (list path)";
    figures->first_call_token_index_ms = timed_call_ms(runtime.get(), list_case.args);
  }

  // Host overhead: the public entry point vs the same kernel launched bare.
  constexpr int kBatches = 100, kPerBatch = 100;
  figures->host_case = "gather_map T1 K8 H7168 bf16";
  figures->host_calls = kBatches * kPerBatch;
  check_status(moe_combine(&c.args, stream), "moe_combine");  // compiled and loaded before timing
  moejit::Stats stats;
  moejit::KernelStore store(settings_without_disk(), stats);
  moejit::ModuleCache modules(store, stats);
  const moejit::CombinePlan plan = moejit::plan_combine(&c.args);
  const moejit::LoadedKernels& kernels = modules.get(plan.spec);
  moejit::CombineParams params = plan.params;
  void* kernel_args[] = {&params};
  const moejit::DriverApi& d = moejit::driver();
  const auto threads = static_cast<unsigned>(plan.spec.block_threads());
  host_us_per_call(
      stream, kBatches, kPerBatch,
      [&] { check_status(moe_combine(&c.args, stream), "moe_combine"); },
      [&] {
        moejit::check_cuda(d.cuLaunchKernel(kernels.functions[moejit::kCombineKernel],
                                            plan.combine_grid_x, plan.combine_grid_y, 1, threads, 1,
                                            1, 0, cu_stream, kernel_args, nullptr),
                           "cuLaunchKernel(combine)");
      },
      &figures->moe_combine_host_us, &figures->bare_launch_host_us);
}

void print_jit(const JitFigures& f) {
  std::printf("\nJIT figures (target %s, NVRTC %s; compute cache: %s)\n", f.target.c_str(),
              f.nvrtc_version.c_str(), f.compute_cache.c_str());
  for (size_t i = 0; i < f.cold.size(); ++i)
    std::printf(
        "  cold compile %s: %8.1f ms, again (median / min of %d): %6.1f / %6.1f ms, CPU %6.1f "
        "ms  (%zu-byte image)  %s\n",
        i == 0 ? "(first in process)" : "(later, different)", f.cold[i].ms, kLaterCompiles,
        f.cold[i].later_median_ms, f.cold[i].later_min_ms, f.cold[i].later_cpu_median_ms,
        f.cold[i].image_bytes, f.cold[i].spec.c_str());
  std::printf(
      "  list-path combine + list helpers (%s), fresh stores, median of %d: one after the other "
      "%.1f ms, concurrently (as a first call builds them) %.1f ms\n",
      f.pair_spec.c_str(), kLaterCompiles, f.pair_serial_ms, f.pair_concurrent_ms);
  if (f.disk_available && f.module_load_measured)
    std::printf(
        "  disk-cache hit (read + validate): %.3f ms; + cuModuleLoadData %.3f ms = %.3f ms"
        " (%s)\n",
        f.disk_hit_ms, f.module_load_ms, f.disk_hit_ms + f.module_load_ms, f.disk_note.c_str());
  else if (f.disk_available)
    std::printf(
        "  disk-cache hit (read + validate): %.3f ms; + cuModuleLoadData n/a (no GPU) (%s)\n",
        f.disk_hit_ms, f.disk_note.c_str());
  else
    std::printf("  %s\n", f.disk_note.c_str());
  if (f.module_load_measured)
    std::printf("  cuModuleLoadData + cuModuleGetFunction: %.3f ms (median of 20)\n",
                f.module_load_ms);
  if (f.host_calls > 0) {
    std::printf(
        "  first call, fresh runtime, cache off (compile + load + launch + sync): "
        "%.1f ms; next call + sync: %.1f us\n",
        f.first_call_ms, f.second_call_us);
    std::printf("  first call, fresh runtime, cache off, %s (two modules): %.1f ms\n",
                f.first_call_token_index_case.c_str(), f.first_call_token_index_ms);
    std::printf(
        "  host time per enqueue (%s, %d calls each, alternating batches, median): "
        "moe_combine %.2f us, bare cuLaunchKernel %.2f us, library overhead %+.2f us\n",
        f.host_case.c_str(), f.host_calls, f.moe_combine_host_us, f.bare_launch_host_us,
        f.moe_combine_host_us - f.bare_launch_host_us);
  }
}

}  // namespace moejit_bench
