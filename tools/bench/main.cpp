// moejit-bench: the combine on every BENCHMARKS.md shape and layout, against the floors measured
// in the same run (copy ceiling, empty kernel), plus the JIT costs (--jit). See
// tools/bench/README.md for the method and the output format.
//
// Exit codes: 0 success, 1 environment or CUDA failure (also no GPU found, after saying so: nothing
// was measured; except with --jit-only, whose compile figures need no GPU), 2 bad command line, 3 a
// case failed its check (NaN or Inf in the output, an error over the bound, a token over its own,
// non-deterministic output, or moe_combine returned an error).
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bench_data.h"
#include "combine_bench.h"
#include "helper_kernels.h"
#include "jit_bench.h"
#include "json_writer.h"
#include "moejit/moejit.h"
#include "moejit_internal.h"
#include "skew_bench.h"

namespace moejit_bench {
namespace {

constexpr int kExitEnvironment = 1, kExitUsage = 2, kExitCheckFailed = 3;

struct Options {
  std::vector<Shape> cases;  // from --case; empty: the built-in list
  bool all = false;          // --all: the built-in list as well as --case shapes
  bool quick = false;
  bool extra = true;  // the other models' shapes
  bool jit = false;
  bool jit_only = false;
  bool pipeline = false;  // decode steps in a CUDA graph, plain vs programmatic dependent launch
  bool skew = false;      // --skew: skewed token_index routings (skew_bench.h)
  std::vector<Shape> skew_shapes;  // from --skew-case; empty: default_skew_shapes()
  bool awkward_h = false;          // --awkward-h: awkward_h_cases()
  bool drop_given = false;         // --drop on the command line (--skew's second drop rate)
  std::vector<moejit_layout> layouts;
  // --drop without --layout: token-major left out of the default layouts (it cannot express a
  // dropped slot), and the run says so.
  bool token_major_skipped = false;
  std::string json_path;
  BenchSettings bench;
};

void usage(FILE* to) {
  std::fprintf(
      to,
      "usage: moejit-bench [options]\n"
      "  --case T,K,H,dtype[,out_dtype]  run this shape (repeatable); dtype fp32|fp16|bf16.\n"
      "                                  With --case, --skew or --awkward-h only those run,\n"
      "                                  unless --all;\n"
      "                                  T 1..2^40, K 1..64, H 1..65536, buffers <= 64 GiB\n"
      "  --all                           with --case: also run the built-in shapes\n"
      "  --layout L[,L...]               token_major | gather_map | token_index (default all)\n"
      "  --quick                         a short subset, 50 timed runs each\n"
      "  --no-extra                      skip the shapes of other models (Qwen3-235B, ...)\n"
      "  --no-l2-warm                    skip the L2-warm timing\n"
      "  --reps N                        timed runs per figure, 1..1000000 (default 200, 100 if\n"
      "                                  > 64 MB)\n"
      "  --warmup N                      untimed runs first, 0..100000 (default 10)\n"
      "  --check-tokens N                float64 reference on at most N tokens (default: all)\n"
      "  --seed N                        input seed\n"
      "  --drop P                        drop P%% of each case's T*K routing slots, 0..90 (an\n"
      "                                  integer or a decimal such as 12.5; default 0): gather\n"
      "                                  map and token_idx -1, the rows left unreferenced;\n"
      "                                  gates kept, not renormalized (as most engines' capacity\n"
      "                                  dropping). token_major cannot express it: left out, or\n"
      "                                  refused if --layout names it. Minimal bytes leave the\n"
      "                                  dropped rows out: (R-dropped)*H*in + R*8 + T*H*out\n"
      "  --jit                           also measure compile, disk-cache and launch costs\n"
      "  --jit-only                      only the JIT figures\n"
      "  --pipeline                      also time decode-sized cases (T <= 64) as steps of a\n"
      "                                  CUDA graph after a producer kernel: plain launches vs\n"
      "                                  args.dependent_launch = 1\n"
      "  --skew                          skewed token_index routings of the same T*K rows (one\n"
      "                                  token with all; 1%% of tokens with half; Zipf(1.2);\n"
      "                                  token 0 with R/512..R/2 rows, the rest at random), each\n"
      "                                  divided by the uniform routing's time (K rows per\n"
      "                                  token); with 0%% and 25%% of rows dropped (--drop P:\n"
      "                                  P%% instead of 25%%)\n"
      "  --skew-case T,K,H,dtype[,out]   a shape for --skew (repeatable; implies --skew; default\n"
      "                                  T4096 K8 H7168 bf16 and T8192 K2 H4096 bf16)\n"
      "  --awkward-h                     H 1000, 1001, 2880, 5000, 7000, 7169 at T6000 K8 in\n"
      "                                  fp32, fp16 and bf16 (at least 64 MB moved each)\n"
      "  --json PATH                     write every figure as JSON\n"
      "Exit: 0 ok, 1 CUDA/environment failure or no GPU found (--jit-only: 0, the compile\n"
      "figures need no GPU), 2 usage, 3 a check failed.\n");
}

std::vector<Shape> builtin_cases(bool quick, bool extra) {
  const auto bf16 = MOEJIT_DTYPE_BFLOAT16, fp16 = MOEJIT_DTYPE_FLOAT16, fp32 = MOEJIT_DTYPE_FLOAT32;
  auto shape = [](int64_t t, int64_t k, int64_t h, moejit_dtype dt, const char* label) {
    Shape s;
    s.tokens = t;
    s.top_k = k;
    s.hidden = h;
    s.in_dtype = s.out_dtype = dt;
    s.label = label;
    return s;
  };
  if (quick)
    return {shape(1536, 2, 128, fp32, "original scatter-add problem"),
            shape(1, 8, 7168, bf16, "DeepSeek-V3 decode"),
            shape(4096, 8, 7168, bf16, "DeepSeek-V3 prefill"),
            shape(8192, 2, 4096, bf16, "Mixtral-8x7B prefill")};
  std::vector<Shape> list = {
      shape(1536, 2, 128, fp32, "original scatter-add problem"),
      shape(1, 8, 7168, bf16, "DeepSeek-V3 decode"),
      shape(32, 8, 7168, bf16, "DeepSeek-V3 decode"),
      shape(64, 2, 4096, bf16, "Mixtral-8x7B decode"),
      shape(4096, 8, 7168, bf16, "DeepSeek-V3 prefill"),
      shape(4096, 8, 7168, fp16, "DeepSeek-V3 prefill"),
      shape(8192, 2, 4096, bf16, "Mixtral-8x7B prefill"),
      shape(8192, 2, 4096, fp32, "Mixtral-8x7B prefill"),
      shape(16384, 8, 2048, bf16, "Qwen3-30B-A3B prefill"),
      shape(4096, 4, 2880, bf16, "gpt-oss-120b prefill"),
  };
  if (extra) {
    list.push_back(shape(4096, 8, 4096, bf16, "Qwen3-235B prefill"));
    list.push_back(shape(4096, 1, 5120, bf16, "Llama-4 prefill"));
    list.push_back(shape(4096, 4, 6144, bf16, "DBRX prefill"));
    list.push_back(shape(4096, 8, 3584, bf16, "Qwen2-57B prefill"));
  }
  return list;
}

// Issue 58's awkward hidden sizes (not multiples of the vector tile) at every dtype, at T=6000 K=8
// (its example): 108 MB moved at H=1000 in 16-bit dtypes, past the 64 MB its target asks for.
std::vector<Shape> awkward_h_cases() {
  std::vector<Shape> list;
  for (int64_t h : {1000, 1001, 2880, 5000, 7000, 7169})
    for (moejit_dtype dt : {MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16}) {
      Shape s;
      s.tokens = 6000;
      s.top_k = 8;
      s.hidden = h;
      s.in_dtype = s.out_dtype = dt;
      s.label = "awkward H";
      list.push_back(s);
    }
  return list;
}

// The fields of text between the separators, empty ones included ("a," is "a" and "", "" is one
// empty field). std::getline dropped a trailing empty field: "--case 1,8,7168,bf16," and
// "--layout ''" were accepted (the latter ran every layout).
std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t end; (end = text.find(sep, begin)) != std::string::npos; begin = end + 1)
    parts.push_back(text.substr(begin, end - begin));
  parts.push_back(text.substr(begin));
  return parts;
}

// Whether path can be written as --json's file: checked before the run, which takes minutes;
// the write at its end failed with exit code 1 and lost every figure.
bool json_path_writable(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return false;
  std::error_code ec;
  const fs::path file(path);
  if (fs::is_directory(file, ec)) return false;
  if (fs::exists(file, ec)) return access(path.c_str(), W_OK) == 0;
  const fs::path dir = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  return fs::is_directory(dir, ec) && access(dir.c_str(), W_OK | X_OK) == 0;
}

// A decimal integer in min..max; false for anything else (empty, a sign, spaces, trailing text,
// overflow). strtoll alone would take " +8" as 8.
bool parse_int(const std::string& text, int64_t min, int64_t max, int64_t* value) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE || *end != '\0' || v < min || v > max) return false;
  *value = v;
  return true;
}

// Largest --drop: past it most tokens get no row at all at small K, and a case times the writing
// of an empty output more than a combine.
constexpr double kMaxDropPercent = 90.0;

// A percentage in 0..max written as digits, optionally a point and more digits ("12", "12.5");
// false for anything else (a sign, an exponent, spaces, "nan", a bare point).
bool parse_percent(const std::string& text, double max, double* value) {
  const size_t point = text.find('.');
  const std::string whole = text.substr(0, point);
  const std::string fraction = point == std::string::npos ? "0" : text.substr(point + 1);
  for (const std::string& digits : {whole, fraction})
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  const double v = std::strtod(text.c_str(), nullptr);
  if (!(v <= max)) return false;
  *value = v;
  return true;
}

// "12.5" for 12.5, "10" for 10: how the output names a --drop value.
std::string percent_text(double percent) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", percent);
  return text;
}

// Host memory a case holds at once (make_inputs: the rows twice, token-major and sorted; the
// gates twice, the gather map, token_idx and the permutation, 4 bytes per row each; the output
// downloaded twice); the device holds less (the rows once, the routing, the output).
double case_host_bytes(const Shape& s) {
  const double r = static_cast<double>(s.rows()), t = static_cast<double>(s.tokens),
               h = static_cast<double>(s.hidden);
  return 2.0 * r * h * dtype_bytes(s.in_dtype) + 20.0 * r + 2.0 * t * h * dtype_bytes(s.out_dtype);
}

// Timed and untimed runs per figure, at most.
constexpr int64_t kMaxReps = 1000000;
constexpr int64_t kMaxWarmup = 100000;

// Larger cases are refused: their buffers would not fit a host or a GPU of today.
constexpr double kMaxCaseBytes = 64.0 * (1ull << 30);

// Parses --case's value into *s; false after printing why.
// option: the option's name for the messages (--case, --skew-case).
bool parse_case(const std::string& v, Shape* s, const char* option = "--case") {
  const std::vector<std::string> f = split(v, ',');
  if (f.size() != 4 && f.size() != 5) {
    std::fprintf(stderr,
                 "moejit-bench: %s %s: expected T,K,H,dtype[,out_dtype] (dtype "
                 "fp32|fp16|bf16)\n",
                 option, v.c_str());
    return false;
  }
  struct Field {
    const char* name;
    int64_t max;
    int64_t* value;
  };
  const Field fields[] = {{"T", MOEJIT_MAX_NUM_TOKENS, &s->tokens},
                          {"K", MOEJIT_MAX_TOP_K, &s->top_k},
                          {"H", MOEJIT_MAX_HIDDEN_DIM, &s->hidden}};
  for (size_t i = 0; i < 3; ++i)
    if (!parse_int(f[i], 1, fields[i].max, fields[i].value)) {
      std::fprintf(stderr, "moejit-bench: %s %s: %s = '%s' must be an integer in 1..%lld\n", option,
                   v.c_str(), fields[i].name, f[i].c_str(), static_cast<long long>(fields[i].max));
      return false;
    }
  for (size_t i = 3; i < f.size(); ++i) {
    moejit_dtype* dtype = i == 3 ? &s->in_dtype : &s->out_dtype;
    if (!parse_dtype(f[i], dtype)) {
      std::fprintf(stderr, "moejit-bench: %s %s: %s = '%s' must be fp32, fp16 or bf16\n", option,
                   v.c_str(), i == 3 ? "dtype" : "out_dtype", f[i].c_str());
      return false;
    }
  }
  if (f.size() == 4) s->out_dtype = s->in_dtype;
  // The bench's routing is int32 (gather map, token_idx, the permutation): R = T*K rows at most
  // INT32_MAX. T <= 2^40 and K <= 64: the product cannot overflow.
  if (s->rows() > INT32_MAX) {
    std::fprintf(stderr,
                 "moejit-bench: %s %s: T*K = %lld rows; the bench's int32 routing allows at "
                 "most %d\n",
                 option, v.c_str(), static_cast<long long>(s->rows()), INT32_MAX);
    return false;
  }
  const double bytes = case_host_bytes(*s);
  if (bytes > kMaxCaseBytes) {
    std::fprintf(stderr,
                 "moejit-bench: %s %s: its buffers need about %.1f GiB of host memory (the "
                 "rows twice, the routing, the output); at most %.0f GiB is allowed\n",
                 option, v.c_str(), bytes / (1ull << 30), kMaxCaseBytes / (1ull << 30));
    return false;
  }
  return true;
}

// Returns false (after printing why) on a bad command line.
bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&](std::string* v) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "moejit-bench: %s needs a value\n", a.c_str());
        return false;
      }
      *v = argv[++i];
      return true;
    };
    std::string v;
    int64_t n = 0;
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--case") {
      if (!next(&v)) return false;
      Shape s;
      if (!parse_case(v, &s)) return false;
      o->cases.push_back(s);
    } else if (a == "--layout") {
      if (!next(&v)) return false;
      for (const std::string& name : split(v, ',')) {
        moejit_layout l;
        if (!parse_layout(name, &l)) {
          std::fprintf(stderr,
                       "moejit-bench: --layout %s: '%s' is not token_major, gather_map or "
                       "token_index\n",
                       v.c_str(), name.c_str());
          return false;
        }
        o->layouts.push_back(l);
      }
    } else if (a == "--all") {
      o->all = true;
    } else if (a == "--quick") {
      o->quick = true;
    } else if (a == "--no-extra") {
      o->extra = false;
    } else if (a == "--no-l2-warm") {
      o->bench.l2_warm = false;
    } else if (a == "--jit") {
      o->jit = true;
    } else if (a == "--jit-only") {
      o->jit = o->jit_only = true;
    } else if (a == "--pipeline") {
      o->pipeline = true;
    } else if (a == "--skew") {
      o->skew = true;
    } else if (a == "--skew-case") {
      if (!next(&v)) return false;
      Shape s;
      if (!parse_case(v, &s, "--skew-case")) return false;
      o->skew_shapes.push_back(s);
      o->skew = true;
    } else if (a == "--awkward-h") {
      o->awkward_h = true;
    } else if (a == "--json") {
      if (!next(&o->json_path)) return false;
      if (!json_path_writable(o->json_path)) {
        std::fprintf(stderr, "moejit-bench: --json '%s': cannot write a file there\n",
                     o->json_path.c_str());
        return false;
      }
    } else if (a == "--reps" || a == "--warmup" || a == "--check-tokens" || a == "--seed") {
      // --reps and --warmup are capped so that a run ends (a million timed runs of the largest
      // shape take about 10 minutes per figure); --check-tokens and --seed take any
      // non-negative int64.
      const int64_t min = a == "--reps" ? 1 : (a == "--check-tokens" ? 2 : 0);
      const int64_t max = a == "--reps" ? kMaxReps : (a == "--warmup" ? kMaxWarmup : INT64_MAX);
      if (!next(&v)) return false;
      if (!parse_int(v, min, max, &n)) {
        std::fprintf(stderr, "moejit-bench: %s %s: expected an integer in %lld..%lld\n", a.c_str(),
                     v.c_str(), static_cast<long long>(min), static_cast<long long>(max));
        return false;
      }
      if (a == "--reps") o->bench.reps = static_cast<int>(n);
      if (a == "--warmup") o->bench.warmup = static_cast<int>(n);
      if (a == "--check-tokens") o->bench.check_tokens = n;
      if (a == "--seed") o->bench.seed = static_cast<uint64_t>(n);
    } else if (a == "--drop") {
      if (!next(&v)) return false;
      o->drop_given = true;
      if (!parse_percent(v, kMaxDropPercent, &o->bench.drop_percent)) {
        std::fprintf(stderr,
                     "moejit-bench: --drop %s: expected a percentage in 0..%g (an integer or a "
                     "decimal such as 12.5)\n",
                     v.c_str(), kMaxDropPercent);
        return false;
      }
    } else {
      std::fprintf(stderr, "moejit-bench: unknown option %s\n", a.c_str());
      usage(stderr);
      return false;
    }
  }
  // A token-major buffer holds a row for every slot: it cannot run inputs with dropped slots.
  // Named in --layout, that is a contradiction to refuse (not a request to ignore silently); by
  // default, the layout is left out and run() says so.
  const bool dropping = o->bench.drop_percent > 0;
  if (dropping && std::find(o->layouts.begin(), o->layouts.end(), MOEJIT_LAYOUT_TOKEN_MAJOR) !=
                      o->layouts.end()) {
    std::fprintf(stderr,
                 "moejit-bench: --layout token_major with --drop %s: a token-major buffer has a "
                 "row for every slot and cannot mark one dropped; leave token_major out of "
                 "--layout (without --layout, --drop runs gather_map and token_index)\n",
                 percent_text(o->bench.drop_percent).c_str());
    return false;
  }
  if (dropping && o->layouts.empty()) {
    o->layouts = {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX};
    o->token_major_skipped = true;
  }
  if (o->layouts.empty())
    o->layouts = {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX};
  if (o->quick && o->bench.reps == 0) o->bench.reps = 50;
  const bool chosen = !o->cases.empty() || o->skew || o->awkward_h;
  if (o->awkward_h) {
    const std::vector<Shape> awkward = awkward_h_cases();
    o->cases.insert(o->cases.end(), awkward.begin(), awkward.end());
  }
  if (!chosen || o->all) {
    const std::vector<Shape> builtin = builtin_cases(o->quick, o->extra);
    o->cases.insert(o->cases.end(), builtin.begin(), builtin.end());
  }
  if (o->skew && o->skew_shapes.empty()) o->skew_shapes = default_skew_shapes(o->quick);
  return true;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Measured once per run: the copy ceiling and the empty kernel, timed like the combine.
Floors measure_floors(Timer& timer, const HelperKernels& helpers) {
  Floors f;
  {
    // 1 GiB each way: far past the L2, long enough (~0.5 ms) that launch cost is noise.
    constexpr size_t kBytes = size_t{1} << 30;
    DeviceBuffer src(kBytes), dst(kBytes);
    BENCH_CUDA(cudaMemset(src.get(), 0x5a, kBytes));
    const double us = timer.median_us(
        [&] {
          BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), kBytes, cudaMemcpyDeviceToDevice,
                                     timer.stream()));
        },
        3, 20, CacheState::kFlushed);
    f.copy_ceiling_gbps = 2.0 * static_cast<double>(kBytes) / (us * 1e-6) / 1e9;
  }
  const auto empty = [&] { helpers.launch_empty(timer.stream()); };
  f.empty_kernel_us = timer.median_us(empty, 10, 200, CacheState::kFlushed);
  f.empty_kernel_parity_split_us = timer.last_parity_split_us();
  f.empty_kernel_warm_us = timer.median_us(empty, 10, 200, CacheState::kWarm);
  return f;
}

// The shape column names the drop rate with --drop, so that no row of such a run passes for a
// figure of the record: fewer rows are read, and its minimal bytes leave them out.
std::string case_text(const Shape& shape, double drop_percent) {
  const std::string text = shape.describe();
  return drop_percent > 0 ? text + " drop " + percent_text(drop_percent) + "%" : text;
}
int case_width(double drop_percent) {
  return drop_percent > 0 ? 34 : 22;
}

void print_header(double drop_percent) {
  // copy_us: a device-to-device copy of the same bytes (see CaseResult::same_size_copy_us).
  // %adj: of the launch-adjusted floor, bytes at the ceiling + one empty kernel (BENCHMARKS.md's
  // reading of the 95% target for prefill shapes whose bytes-only floor is under about 60 us).
  // odd-even: median of the odd flushed runs minus the even ones (Timer: every other flushed run
  // takes 0.6-0.75 us longer on the H200).
  std::printf("%-12s %-*s %10s %10s %8s %7s %7s %8s %9s %9s %10s  %s\n", "layout",
              case_width(drop_percent), "shape", "median_us", "l2warm_us", "GB/s", "%ceil", "%adj",
              "x_empty", "copy_us", "rel_err", "odd-even", "check");
}

void print_result(const CaseResult& r) {
  const std::string shape = case_text(r.shape, r.drop_percent);
  const int width = case_width(r.drop_percent);
  if (!r.error.empty()) {
    std::printf("%-12s %-*s FAILED: %s\n", layout_text(r.layout), width, shape.c_str(),
                r.error.c_str());
    return;
  }
  std::string check = r.correct ? "ok" : "FAIL";
  const CheckResult& c = r.check;
  if (c.nonfinite > 0) check += " (" + std::to_string(c.nonfinite) + " NaN or Inf)";
  if (c.bad_tokens > 0)
    check += " (" + std::to_string(c.bad_tokens) + " of " + std::to_string(c.checked_tokens) +
             " tokens over their bound, the first " + std::to_string(c.first_bad_token) + ")";
  if (!(c.rel_err <= c.bound)) {
    char text[64];
    std::snprintf(text, sizeof text, " (rel_err over %.2e)", c.bound);
    check += text;
  }
  if (!r.deterministic) check += " (output changed between runs)";
  std::printf("%-12s %-*s %10.2f %10.2f %8.0f %6.1f%% %6.1f%% %8.2f %9.2f %9.2e %+10.2f  %s\n",
              layout_text(r.layout), width, shape.c_str(), r.median_us, r.l2_warm_us, r.gbps,
              r.pct_ceiling, r.pct_floor_with_launch, r.ratio_empty, r.same_size_copy_us,
              r.check.rel_err, r.parity_split_us, check.c_str());
}

void print_pipeline(const std::vector<PipelineResult>& results, double drop_percent) {
  std::printf(
      "\nDecode steps in a CUDA graph (--pipeline): a producer kernel that writes the rows and "
      "allows its dependents at once, then the combine; us per step added to the producer's "
      "(2 us spin + copy), 100 steps, median of 15 replays; *_ev: the routing evicted from L2 "
      "before each step (a 256 MB read before the producer), as after a real step's expert "
      "GEMMs\n");
  const int width = case_width(drop_percent);
  std::printf("%-12s %-*s %9s %9s %7s %9s %9s %9s %9s %7s %9s  %s\n", "layout", width, "shape",
              "producer", "plain", "PDL", "saved", "empty", "empty_PDL", "plain_ev", "PDL_ev",
              "saved_ev", "check");
  for (const PipelineResult& r : results) {
    const std::string shape = case_text(r.shape, r.drop_percent);
    if (!r.skipped.empty()) {
      std::printf("%-12s %-*s pipeline: skipped (%s)\n", layout_text(r.layout), width,
                  shape.c_str(), r.skipped.c_str());
      continue;
    }
    if (!r.error.empty()) {
      std::printf("%-12s %-*s FAILED: %s\n", layout_text(r.layout), width, shape.c_str(),
                  r.error.c_str());
      continue;
    }
    std::printf(
        "%-12s %-*s %9.2f %9.2f %7.2f %9.2f %9.2f %9.2f %9.2f %7.2f %9.2f  %s\n",
        layout_text(r.layout), width, shape.c_str(), r.producer_plain_us, r.combine_plain_us,
        r.combine_dependent_us, r.combine_plain_us - r.combine_dependent_us, r.empty_plain_us,
        r.empty_dependent_us, r.combine_plain_evicted_us, r.combine_dependent_evicted_us,
        r.combine_plain_evicted_us - r.combine_dependent_evicted_us, r.correct ? "ok" : "FAIL");
  }
}

// The members that name a case: its layout, shape and dropped slots (--drop; the exact count is
// round(drop_percent% of T*K)). The same keys in "cases" and "pipeline".
void write_case_shape(JsonWriter& j, const Shape& shape, moejit_layout layout, double drop_percent,
                      int64_t dropped_slots) {
  j.member("layout", layout_text(layout));
  j.member("T", shape.tokens);
  j.member("K", shape.top_k);
  j.member("H", shape.hidden);
  j.member("in_dtype", dtype_text(shape.in_dtype));
  j.member("out_dtype", dtype_text(shape.out_dtype));
  j.member("drop_percent", drop_percent);
  j.member("dropped_slots", dropped_slots);
}

void write_json(const std::string& path, const std::string& device, const Floors& floors,
                const std::vector<CaseResult>& results, const JitFigures* jit,
                const std::string& error, const std::vector<PipelineResult>& pipeline = {},
                const std::vector<SkewResult>& skew = {}) {
  JsonWriter j;
  j.begin_object();
  j.member("tool", "moejit-bench");
  j.member("library_version", moejit_version_string());
  j.member("date", utc_now());
  j.member("device", device);
  if (!error.empty()) j.member("error", error);
  j.member("method",
           "CUDA events around each run; median; L2 flushed by a 256 MB memset "
           "between runs (parity_split_us: median of the odd runs minus the even ones); "
           "l2_warm_us: a GPU spin instead, no flush; minimal bytes = R*H*in + R*8 + T*H*out");
  j.member("copy_ceiling_gbps", floors.copy_ceiling_gbps);
  j.member("empty_kernel_us", floors.empty_kernel_us);
  j.member("empty_kernel_l2_warm_us", floors.empty_kernel_warm_us);
  j.member("empty_kernel_parity_split_us", floors.empty_kernel_parity_split_us);
  j.key("cases").begin_array();
  for (const CaseResult& r : results) {
    j.begin_object();
    j.member("label", r.shape.label);
    write_case_shape(j, r.shape, r.layout, r.drop_percent, r.dropped_slots);
    // An integer (exact below 2^53): "%.6g" kept 6 digits (528744448 was written 528744000).
    j.member("minimal_bytes", static_cast<int64_t>(r.shape.minimal_bytes(r.dropped_slots)));
    if (!r.error.empty()) {
      j.member("error", r.error);
    } else {
      write_case_timing(j, r);
      j.member("ratio_empty", r.ratio_empty);
      j.member("same_size_copy_us", r.same_size_copy_us);
      j.member("pct_ceiling_same_size_copy", r.same_size_copy_pct_ceiling);
      j.member("pct_floor_with_launch_same_size_copy", r.same_size_copy_pct_floor_with_launch);
      write_case_check(j, r);
    }
    j.end_object();
  }
  j.end_array();
  if (jit != nullptr) {
    j.key("jit").begin_object();
    j.member("target", jit->target);
    j.member("nvrtc_version", jit->nvrtc_version);
    j.member("compute_cache", jit->compute_cache);
    j.key("cold_compiles").begin_array();
    for (const CompileFigure& c : jit->cold) {
      j.begin_object();
      j.member("spec", c.spec);
      j.member("ms", c.ms);
      j.member("later_median_ms", c.later_median_ms);
      j.member("later_min_ms", c.later_min_ms);
      j.member("later_cpu_median_ms", c.later_cpu_median_ms);
      j.member("image_bytes", static_cast<uint64_t>(c.image_bytes));
      j.end_object();
    }
    j.end_array();
    j.member("pair_spec", jit->pair_spec);
    j.member("pair_serial_ms", jit->pair_serial_ms);
    j.member("pair_concurrent_ms", jit->pair_concurrent_ms);
    j.member("disk_cache_available", jit->disk_available);
    j.member("disk_cache_note", jit->disk_note);
    if (jit->disk_available)
      j.member("disk_hit_ms", jit->disk_hit_ms);
    else
      j.key("disk_hit_ms").null();
    if (jit->module_load_measured)
      j.member("module_load_ms", jit->module_load_ms);
    else
      j.key("module_load_ms").null();  // no GPU: not measured
    j.member("first_call_ms", jit->first_call_ms);
    j.member("second_call_us", jit->second_call_us);
    j.member("first_call_token_index_case", jit->first_call_token_index_case);
    j.member("first_call_token_index_ms", jit->first_call_token_index_ms);
    j.member("host_case", jit->host_case);
    j.member("host_calls", jit->host_calls);
    j.member("moe_combine_host_us", jit->moe_combine_host_us);
    j.member("bare_launch_host_us", jit->bare_launch_host_us);
    j.member("host_overhead_us", jit->moe_combine_host_us - jit->bare_launch_host_us);
    j.end_object();
  }
  if (!pipeline.empty()) {
    j.key("pipeline").begin_array();
    for (const PipelineResult& r : pipeline) {
      j.begin_object();
      write_case_shape(j, r.shape, r.layout, r.drop_percent, r.dropped_slots);
      if (!r.skipped.empty()) {
        j.member("skipped", r.skipped);
      } else if (!r.error.empty()) {
        j.member("error", r.error);
      } else {
        j.member("producer_us", r.producer_plain_us);
        j.member("producer_dependent_us", r.producer_dependent_us);
        j.member("combine_plain_us", r.combine_plain_us);
        j.member("combine_dependent_us", r.combine_dependent_us);
        j.member("empty_plain_us", r.empty_plain_us);
        j.member("empty_dependent_us", r.empty_dependent_us);
        j.member("combine_plain_evicted_us", r.combine_plain_evicted_us);
        j.member("combine_dependent_evicted_us", r.combine_dependent_evicted_us);
        j.member("correct", r.correct);
      }
      j.end_object();
    }
    j.end_array();
  }
  if (!skew.empty()) write_skew_json(j, skew);
  moejit_stats stats;
  stats.struct_size = sizeof(stats);
  if (!error.empty() || moejit_runtime_get_stats(nullptr, &stats) != MOEJIT_SUCCESS) {
    j.key("default_runtime_stats").null();
  } else {
    j.key("default_runtime_stats").begin_object();
    j.member("compiles", stats.compiles);
    j.member("memory_hits", stats.memory_hits);
    j.member("disk_hits", stats.disk_hits);
    j.member("disk_errors", stats.disk_errors);
    j.member("launches", stats.launches);
    j.member("compile_seconds", stats.compile_seconds);
    j.end_object();
  }
  j.end_object();
  std::ofstream out(path);
  out << j.str() << "\n";
  // Closed before the check: the buffered bytes reach the file only then, and a full disk failed
  // after "wrote" had been printed (and the exit code said 0).
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path);
  std::printf("wrote %s\n", path.c_str());
}

// What --drop does to this run, before anything else is printed.
void print_drop_notice(const Options& o) {
  if (o.bench.drop_percent <= 0) return;
  const std::string p = percent_text(o.bench.drop_percent);
  std::printf(
      "drop %s%%: %s%% of each case's T*K routing slots dropped (JSON dropped_slots: how many), "
      "gates not renormalized; minimal bytes (GB/s, %%, copy_us) leave the dropped rows out: "
      "(R - dropped)*H*in + R*8 + T*H*out. Not figures for the record\n",
      p.c_str(), p.c_str());
  if (o.token_major_skipped)
    std::printf("token_major: skipped in every case (--drop %s: it cannot mark a slot dropped)\n",
                p.c_str());
}

// Empty if a GPU is usable, else why not: the driver's own answer first (the probe the library
// and the GPU tests share), since the CUDA runtime calls a missing driver an "insufficient" one;
// then the runtime's, which the benchmark uses for memory, copies and events.
std::string no_gpu_reason() {
  const moejit::DriverProbe probe = moejit::probe_driver();
  if (probe.status != MOEJIT_SUCCESS) {
    std::string why = probe.message;
    if (!why.empty() && why.back() == '.') why.pop_back();  // it ends inside parentheses here
    return why;
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess)
    return std::string("the CUDA runtime says: ") + cudaGetErrorName(err) + ": " +
           cudaGetErrorString(err);
  return devices > 0 ? "" : "the CUDA runtime sees no device";
}

int run(const Options& o) {
  print_drop_notice(o);
  JitFigures jit;
  if (o.jit) disable_compute_cache_for_jit(&jit);  // before CUDA or NVRTC reads the environment
  const std::string why = no_gpu_reason();
  if (!why.empty()) {
    std::printf("moejit-bench: no GPU found (%s); nothing to measure.\n", why.c_str());
    if (o.jit) {
      // Compiling needs no GPU: report what can be measured here, for sm_90 (the H200).
      std::printf("Compile-only JIT figures for sm_90 (module load and launch need a GPU):\n");
      measure_cold_compiles(moejit::target_for_device(90), &jit);
      measure_disk_cache(moejit::target_for_device(90), false, &jit);
      print_jit(jit);
      const HelperKernels helpers(moejit::target_for_device(90), false);
      std::printf("  helper kernels (empty, spin): compiled in %.1f ms\n", helpers.compile_ms());
    }
    if (!o.json_path.empty())
      write_json(o.json_path, "", Floors{}, {}, o.jit ? &jit : nullptr, "no GPU found: " + why);
    // --jit-only asked for the compile figures, which need no GPU; anything else measured nothing.
    return o.jit_only ? 0 : kExitEnvironment;
  }

  BENCH_CUDA(cudaSetDevice(0));
  BENCH_CUDA(cudaFree(nullptr));  // creates the primary context and makes it current here
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const std::string device = prop.name;
  const moejit::Target target = moejit::target_for_device(prop.major * 10 + prop.minor);
  std::printf("moejit-bench %s on %s (sm_%d%d, %s), %s\n", moejit_version_string(), device.c_str(),
              prop.major, prop.minor, target.name().c_str(), utc_now().c_str());

  if (o.jit) measure_cold_compiles(target, &jit);  // before anything else uses NVRTC

  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const HelperKernels helpers(target, true);
  Timer timer(stream, [&](cudaStream_t s, double us) { helpers.launch_spin(s, us); });

  Floors floors;
  std::vector<CaseResult> results;
  std::vector<SkewResult> skew;
  bool all_correct = true;
  if (!o.jit_only) {
    floors = measure_floors(timer, helpers);
    std::printf(
        "copy ceiling %.0f GB/s (1 GiB device-to-device, read + written); empty kernel "
        "%.2f us (L2 flushed; odd - even runs %+.2f us), %.2f us (warm)\n\n",
        floors.copy_ceiling_gbps, floors.empty_kernel_us, floors.empty_kernel_parity_split_us,
        floors.empty_kernel_warm_us);
    print_header(o.bench.drop_percent);
    for (const Shape& shape : o.cases) {
      for (const CaseResult& r : run_case(shape, o.layouts, o.bench, floors, timer)) {
        print_result(r);
        std::fflush(stdout);
        all_correct = all_correct && r.error.empty() && r.correct;
        results.push_back(r);
      }
    }
    if (o.skew) {
      // The second drop rate: --drop's, else issue 58's 25%.
      const double drop = o.drop_given ? o.bench.drop_percent : 25.0;
      print_skew_header();
      for (const Shape& shape : o.skew_shapes) {
        const std::vector<SkewResult> part =
            run_skew(shape, drop, o.bench, floors, timer, [&](const SkewResult& r) {
              print_skew_result(r);
              std::fflush(stdout);
              all_correct = all_correct && r.run.error.empty() && r.run.correct;
            });
        skew.insert(skew.end(), part.begin(), part.end());
      }
    }
  }

  std::vector<PipelineResult> pipeline;
  if (o.pipeline) {
    for (const Shape& shape : o.cases)
      if (shape.tokens <= 64)
        for (const PipelineResult& r : run_pipeline(shape, o.layouts, o.bench, helpers, stream)) {
          if (r.skipped.empty()) all_correct = all_correct && r.error.empty() && r.correct;
          pipeline.push_back(r);
        }
    print_pipeline(pipeline, o.bench.drop_percent);
  }

  if (o.jit) {
    measure_disk_cache(target, true, &jit);
    measure_calls(stream, &jit);
    print_jit(jit);
  }

  if (!results.empty()) {
    // The summary again, last, so the end of the output carries it.
    std::printf("\nSummary (copy ceiling %.0f GB/s, empty kernel %.2f us):\n",
                floors.copy_ceiling_gbps, floors.empty_kernel_us);
    print_header(o.bench.drop_percent);
    for (const CaseResult& r : results) print_result(r);
  }
  if (!skew.empty()) {
    print_skew_header();
    for (const SkewResult& r : skew) print_skew_result(r);
  }
  if (!o.json_path.empty())
    write_json(o.json_path, device, floors, results, o.jit ? &jit : nullptr, "", pipeline, skew);
  if (!pipeline.empty()) print_pipeline(pipeline, o.bench.drop_percent);  // last, with the summary
  BENCH_CUDA(cudaStreamDestroy(stream));
  if (!all_correct) {
    std::printf("moejit-bench: at least one case FAILED its check (see above)\n");
    return kExitCheckFailed;
  }
  return 0;
}

}  // namespace
}  // namespace moejit_bench

int main(int argc, char** argv) {
  using namespace moejit_bench;
  Options options;
  if (!parse(argc, argv, &options)) return kExitUsage;
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moejit-bench: %s\n", e.what());
    return kExitEnvironment;
  }
}
