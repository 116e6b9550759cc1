// moejit-precompile: fills libmoejit's kernel cache ahead of time, on any machine (no GPU or
// driver needed), so that serving processes in read-only or no-compile mode never compile.
//
// It goes through the same KernelStore, cache key and atomic publish path as the runtime: what it
// writes is exactly what moe_combine() looks up.
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moejit_internal.h"
#include "precompile_inputs.h"

namespace moejit {
namespace precompile {
namespace {

using nlohmann::json;

// Exit codes, documented in --help. Fixed: scripts test them.
constexpr int kExitOk = 0;
constexpr int kExitCompileFailed = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitCacheUnusable = 3;
constexpr int kExitInvalidEntries = 4;

// A failure that ends the run with a given exit code and message.
struct Fatal {
  int code;
  std::string message;
};

struct Options {
  std::vector<std::string> model_configs;
  std::vector<int> hidden;
  std::vector<int> top_k;
  std::vector<std::string> dtypes;
  std::string out_dtype;
  std::vector<std::string> layouts;
  std::vector<std::string> index_types;
  std::vector<std::string> epilogues;
  std::vector<std::string> manifests;
  std::string arch;
  std::string cache_dir;
  std::string cache_key_file;
  unsigned jobs = 0;
  bool quiet = false;
  bool dry_run = false;
  bool json = false;
  bool verify = false;
  bool repair = false;
  bool readable_by_all = false;
};

const char* kFooter = R"(Inputs (any mix; every source adds shapes):
  --model-config reads hidden_size, the top-k field (num_experts_per_tok, moe_top_k, moe_topk,
  moe_k, num_experts_per_token or experts_per_token, or one per layer, all equal; else a plain
  top_k, usually the sampling setting, only next to an expert count: num_experts,
  num_local_experts, n_routed_experts or moe_num_experts) and torch_dtype / dtype, at the top
  level or in a nested config such as text_config (DBRX: d_model, and the top-k in an object
  beside it, ffn_config). --dtype overrides the config's dtype. With rms_norm_eps the model's
  calls may fuse the residual add and the next layer's RMSNorm (moejit.h, "The epilogue"), and
  with fp8 activations (quantization_config.quant_method "fp8") the fp8 output too: a config's
  shapes expand to the epilogues none and norm (and norm-fp8), unless --epilogue says which.
  --hidden and --topk give extra shapes (every combination); they need --dtype.
  --epilogue none,residual,norm,norm-fp8 (comma list; default: from the config, else none): the
  residual and the norm weight in the shape's dtype, norm-fp8 with an fp8 e4m3 output.
  --manifest: one line per specialization, '#' starts a comment. Either an exact spec in the
  KernelSpec::describe() format that --dry-run prints:
    layout=gather_map in=bf16 out=bf16 idx=int32 H=7168 vec=8 K=8 tpt=128 tpb=1 upt=1 cap=0
  (a token-index single-launch module ends in " scan=1", its small-call form in
  " scan=1 small_scan=1", a one-token module (token index, gather map) in " one_token=1";
  the list helpers' module is "layout=token_index idx=int32 helpers=1"), or a shape, expanded
  like --hidden/--topk (layout, index_type and epilogue take comma lists and default to
  --layout / --index-type / --epilogue; dtype defaults to --dtype;
  out_dtype to --out-dtype, else the dtype):
    hidden=7168 topk=8 dtype=bf16 out_dtype=bf16 layout=gather_map,token_index index_type=int32
    hidden=7168 topk=8 dtype=bf16 epilogue=none,norm-fp8
  Shapes expand to what moe_combine() requests for 256-byte-aligned, unpadded buffers; for the
  token_index layout, top-k stands for the expected rows per token.

Targets: --arch sm_90,sm_100 (or 90; compute_90 for PTX) or 'all' (every arch of the local NVRTC
from sm_70 up). Without --arch: the GPU of device 0; with no GPU, --arch is required.

Exit codes:
  0  every requested kernel is servable by the runtime from this cache, as this user: its entry
     passes the runtime's own checks (owner and mode, checksums, the MAC when a cache key is
     given) when the run ends (--verify: every entry valid)
  1  a compilation failed (the NVRTC log is printed)
  2  bad input or usage: unreadable file, invalid JSON, missing field, unknown dtype, unsupported
     arch, no GPU and no --arch, a cache key file that breaks its rule
  3  the cache directory is unusable (cannot be created or written, or one the runtime refuses:
     a symlink, not owned by this user or root, writable by group or others), or a kernel is not
     servable from it: its entry did not land, the runtime would refuse it (each one is listed
     with the reason), or it was evicted before the run ended (a cache size cap,
     MOEJIT_CACHE_MAX_BYTES, smaller than the set being precompiled),
     or --readable-by-all could not change a part of it
  4  --verify found invalid entries (without --repair, or some could not be removed)

Cache key: --cache-key-file (else MOEJIT_CACHE_KEY_FILE) names the cache's secret key, as the
runtime's; entries are then written with a MAC under it, and --verify checks it (docs/cache.md).
)";

std::vector<int> supported_archs() {
  return nvrtc_supported_archs();
}

std::vector<Target> choose_targets(const Options& o) {
  if (!o.arch.empty()) return parse_archs(o.arch, supported_archs());
  std::string why;
  try {
    const DriverApi& d = driver();
    int count = 0;
    CUresult r = d.cuDeviceGetCount(&count);
    if (r == CUDA_SUCCESS && count > 0) {
      CUdevice dev = 0;
      int major = 0, minor = 0;
      check_cuda(d.cuDeviceGet(&dev, 0), "cuDeviceGet");
      check_cuda(d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                 "cuDeviceGetAttribute");
      check_cuda(d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                 "cuDeviceGetAttribute");
      // The runtime's own rule: the GPU's cubin, or PTX of the newest arch for a newer GPU.
      return {target_for_device(major * 10 + minor)};
    }
    why = r == CUDA_SUCCESS ? "the driver reports no CUDA device"
                            : describe_cuda_error("cuDeviceGetCount", r);
  } catch (const Error& e) {
    if (e.status() == MOEJIT_ERROR_UNSUPPORTED) throw InputError(e.what());
    why = e.what();
  }
  throw InputError("no GPU to take the target from (" + why +
                   "): pass --arch, e.g. --arch sm_90, a list, or 'all'; the local NVRTC "
                   "supports: " +
                   arch_list(supported_archs()));
}

std::vector<KernelSpec> collect_specs(const Options& o) {
  std::optional<moejit_dtype> dtype_override;
  std::vector<moejit_dtype> dtypes;
  for (const std::string& d : o.dtypes) dtypes.push_back(parse_dtype(d, "--dtype"));
  if (dtypes.size() == 1) dtype_override = dtypes[0];
  std::optional<moejit_dtype> out_dtype;
  if (!o.out_dtype.empty()) out_dtype = parse_dtype(o.out_dtype, "--out-dtype");

  ManifestDefaults defaults;
  defaults.dtype = dtype_override;
  defaults.out_dtype = out_dtype;
  if (!o.layouts.empty()) {
    defaults.layouts.clear();
    for (const std::string& l : o.layouts) defaults.layouts.push_back(parse_layout(l, "--layout"));
  }
  if (!o.index_types.empty()) {
    defaults.index_types.clear();
    for (const std::string& t : o.index_types)
      defaults.index_types.push_back(parse_index_type(t, "--index-type"));
  }

  std::optional<std::vector<Epilogue>> epilogues;
  if (!o.epilogues.empty()) {
    epilogues.emplace();
    for (const std::string& e : o.epilogues) epilogues->push_back(parse_epilogue(e, "--epilogue"));
    defaults.epilogues = *epilogues;
  }

  std::vector<KernelSpec> specs;
  auto expand_dtypes = [&](Shape shape, const std::vector<moejit_dtype>& list,
                           const std::vector<Epilogue>& shape_epilogues) {
    for (moejit_dtype d : list)
      for (Epilogue e : shape_epilogues) {
        shape.dtype = d;
        shape.out_dtype = out_dtype.value_or(d);
        shape.epilogue = e;
        expand_shape(shape, defaults.layouts, defaults.index_types, &specs);
      }
  };

  for (const std::string& path : o.model_configs) {
    const ModelConfig cfg = read_model_config(path);
    Shape shape;
    shape.hidden = cfg.hidden;
    shape.top_k = cfg.top_k;
    shape.origin = path;
    const std::vector<Epilogue> model_epilogues = epilogues.value_or(config_epilogues(cfg));
    if (!dtypes.empty()) {
      expand_dtypes(shape, dtypes, model_epilogues);
    } else if (cfg.dtype) {
      moejit_dtype d;
      try {
        d = parse_dtype(*cfg.dtype, path + ": field " + cfg.dtype_field);
      } catch (const InputError& e) {
        // A quantized checkpoint's weight dtype (float8, int4...) is not what its expert outputs
        // are: say how to give those.
        throw InputError(std::string(e.what()) +
                         "; pass --dtype with the dtype of the expert outputs the combine reads");
      }
      expand_dtypes(shape, {d}, model_epilogues);
    } else {
      throw InputError(path + ": missing field torch_dtype (or dtype) next to " + cfg.hidden_field +
                       "; pass --dtype");
    }
  }

  if (o.hidden.empty() != o.top_k.empty())
    throw InputError(o.hidden.empty() ? "--topk needs --hidden" : "--hidden needs --topk");
  if (!o.hidden.empty() && dtypes.empty())
    throw InputError("--hidden/--topk need --dtype (fp32, fp16 or bf16)");
  for (int h : o.hidden)
    for (int k : o.top_k) {
      Shape shape;
      shape.hidden = h;
      shape.top_k = k;
      shape.origin = "--hidden " + std::to_string(h) + " --topk " + std::to_string(k);
      expand_dtypes(shape, dtypes, defaults.epilogues);
    }

  for (const std::string& path : o.manifests) {
    if (dtypes.size() > 1)
      throw InputError("--manifest takes at most one --dtype (the default of its shape lines)");
    read_manifest(path, defaults, &specs);
  }
  if (specs.empty())
    throw InputError(
        "nothing to compile: give --model-config, --hidden with --topk, or --manifest "
        "(see --help)");
  return specs;
}

// Progress on stderr: one self-overwriting line on a terminal, erased at the end; otherwise a line
// per kernel compiled (CI logs). A kernel found in the cache prints nothing of its own: a second
// run over a warm cache prints its one-line summary only.
class Progress {
 public:
  Progress(size_t total, bool quiet)
      : total_(total), quiet_(quiet), tty_(isatty(STDERR_FILENO) != 0) {}

  // A job found failed after every job finished (its entry refused or evicted since): the error.
  void failed_later(const std::string& what, const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::fprintf(stderr, "FAILED %s:\n%s\n", what.c_str(), error.c_str());
  }

  void done(const std::string& what, const std::string& status, double seconds,
            const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished_;
    if (status == "compiled") ++compiled_;
    if (status == "cached") ++cached_;
    if (!error.empty()) ++failed_;
    if (!error.empty()) {
      if (tty_ && !quiet_) std::fprintf(stderr, "\r\033[K");
      std::fprintf(stderr, "FAILED %s:\n%s\n", what.c_str(), error.c_str());
    }
    if (quiet_) return;
    if (tty_) {
      char counts[160];
      std::snprintf(counts, sizeof(counts), "[%zu/%zu] compiled %zu, cached %zu, failed %zu",
                    finished_, total_, compiled_, cached_, failed_);
      // One line that fits the terminal: a wrapped line could not be overwritten by '\r'. The
      // summary replaces it at the end.
      std::string line = std::string(counts) + "  (" + what + ")";
      struct winsize ws {};
      const size_t width =
          ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 10 ? ws.ws_col : 80;
      if (line.size() >= width) line = line.substr(0, width - 4) + "...";
      std::fprintf(stderr, "\r\033[K%s", finished_ == total_ ? "" : line.c_str());
    } else if (status == "compiled") {
      std::fprintf(stderr, "[%zu/%zu] compiled %s (%.2f s)\n", finished_, total_, what.c_str(),
                   seconds);
    }
    std::fflush(stderr);
  }

 private:
  std::mutex mutex_;
  const size_t total_;
  const bool quiet_;
  const bool tty_;
  size_t finished_ = 0, compiled_ = 0, cached_ = 0, failed_ = 0;
};

struct JobResult {
  // compiled | cached | failed | not_written | unservable | evicted | missing (dry run)
  std::string status;
  std::string key;
  std::string error;
  uint64_t bytes = 0;        // written by this run
  uint64_t entry_bytes = 0;  // the entry's size once this job had it (compiled or cached)
  double seconds = 0;
};

struct Job {
  KernelSpec spec;
  Target target;
};

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// What the runtime checks of an entry it loads (check_entry()), but the refresh of its last use.
EntryRules rules_of(const Settings& settings) {
  EntryRules rules;
  rules.mac_key = settings.cache_mac_key.get();
  rules.nvrtc_version = nvrtc_version();
  return rules;
}

std::string not_served(const std::string& path, const std::string& why) {
  return "the runtime would not serve " + path + ": " + why;
}

// Whether the runtime, as this user, would serve key's entry from the cache.
struct Servable {
  EntryCheck check = EntryCheck::kMissing;
  std::string error;   // for kInvalid: what the runtime would say, with the entry's path
  uint64_t bytes = 0;  // the entry's size, when servable
};
Servable servable(const Settings& settings, const std::string& key) {
  Servable s;
  const ServableReport r = check_servable(settings.cache_dir, {key}, rules_of(settings));
  const std::string path = cache_entry_path(settings.cache_dir, key);
  if (!r.error.empty()) {
    s.check = EntryCheck::kInvalid;
    s.error = not_served(path, "the cache directory " + r.error);
    return s;
  }
  s.check = r.results.at(0);
  if (s.check == EntryCheck::kInvalid) s.error = not_served(path, r.why.at(0));
  struct stat st;
  if (s.check == EntryCheck::kOk && ::stat(path.c_str(), &st) == 0)
    s.bytes = static_cast<uint64_t>(st.st_size);
  return s;
}

Settings cache_settings(const Options& o, moejit_cache_mode mode) {
  moejit_runtime_options ro;
  moejit_runtime_options_init(&ro);
  ro.cache_mode = mode;
  if (!o.cache_dir.empty()) ro.cache_dir = o.cache_dir.c_str();
  if (!o.cache_key_file.empty()) ro.cache_key_file = o.cache_key_file.c_str();
  Settings s = resolve_settings(&ro);
  if (s.cache_dir.empty())
    throw Fatal{kExitCacheUnusable,
                "no cache directory: neither --cache-dir, MOEJIT_CACHE_DIR, XDG_CACHE_HOME nor "
                "HOME is set"};
  return s;
}

json job_json(const Job& job, const JobResult& r) {
  json j{{"spec", job.spec.describe()},
         {"target", job.target.name()},
         {"key", r.key},
         {"status", r.status}};
  if (r.bytes != 0) j["bytes"] = r.bytes;
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

int run_verify(const Options& o) {
  const Settings s = cache_settings(o, MOEJIT_CACHE_MODE_READ_WRITE);
  struct stat st {};
  if (::lstat(s.cache_dir.c_str(), &st) != 0 && errno == ENOENT)
    throw Fatal{kExitCacheUnusable, "cache directory \"" + s.cache_dir + "\" does not exist"};
  const CacheVerifyReport r = verify_cache_dir(s.cache_dir, o.repair, s.cache_mac_key.get());
  // A directory the runtime would refuse (a symlink, not a directory, another user's, writable by
  // group or others): its entries were neither examined nor removed.
  if (!r.error.empty())
    throw Fatal{kExitCacheUnusable, "cache directory \"" + s.cache_dir + "\" is unusable: " +
                                        r.error + " (the runtime would not use it)"};
  const size_t left = r.invalid.size() - std::min(r.removed, r.invalid.size());
  if (o.json) {
    json invalid = json::array();
    for (const InvalidEntry& e : r.invalid) {
      json j{{"path", e.path}, {"why", e.why}, {"removed", e.removed}};
      if (!e.not_removed.empty()) j["not_removed"] = e.not_removed;
      invalid.push_back(j);
    }
    std::cout << json{{"cache_dir", s.cache_dir}, {"authenticated", s.cache_mac_key != nullptr},
                      {"entries", r.entries},     {"valid", r.valid},
                      {"invalid", invalid},       {"removed", r.removed},
                      {"bytes", r.bytes}}
                     .dump(2)
              << "\n";
  } else {
    for (const InvalidEntry& e : r.invalid) {
      if (e.removed)
        std::cout << "removed invalid entry " << e.path << ": " << e.why << "\n";
      else if (o.repair)
        std::cout << "invalid entry " << e.path << ": " << e.why << "; not removed: "
                  << (e.not_removed.empty() ? "a directory is fixed by hand" : e.not_removed)
                  << "\n";
      else
        std::cout << "invalid entry " << e.path << ": " << e.why << "\n";
    }
    if (!o.quiet)
      std::cout << "moejit-precompile --verify: " << s.cache_dir << ": " << r.entries
                << " entries, " << r.valid << " valid"
                << (s.cache_mac_key != nullptr ? " (authenticated)" : "") << ", "
                << r.invalid.size() << " invalid, " << r.removed << " removed, " << r.bytes
                << " bytes valid\n";
  }
  if (!o.repair && !r.invalid.empty() && !o.quiet && !o.json)
    std::cerr << "run again with --repair to remove the invalid entries\n";
  if (o.repair && left != 0) std::cerr << left << " invalid entries could not be removed\n";
  return (o.repair ? left == 0 : r.invalid.empty()) ? kExitOk : kExitInvalidEntries;
}

int run_precompile(const Options& o) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<KernelSpec> specs = collect_specs(o);
  const std::vector<Target> targets = choose_targets(o);
  std::vector<Job> jobs;
  for (const Target& t : targets)
    for (const KernelSpec& s : specs) jobs.push_back(Job{s, t});

  Stats stats;
  // The dry run only looks (no-compile mode never writes), and a directory that does not exist
  // yet is not even opened, so the dry run creates nothing: nothing is cached there anyway.
  Settings settings =
      cache_settings(o, o.dry_run ? MOEJIT_CACHE_MODE_NO_COMPILE : MOEJIT_CACHE_MODE_READ_WRITE);
  if (o.dry_run && !is_directory(settings.cache_dir))
    settings.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  std::unique_ptr<KernelStore> store;
  try {
    store = std::make_unique<KernelStore>(settings, stats);
  } catch (const Error& e) {
    throw InputError(e.what());  // e.g. an unreadable MOEJIT_TEMPLATE_DIR
  }
  if (!o.dry_run && !store->has_disk_cache())
    throw Fatal{
        kExitCacheUnusable,
        "cache directory \"" + settings.cache_dir +
            "\" is unusable: it must be a directory this user can create and write, "
            "owned by this user and not writable by group or others (see the warning above)"};

  std::vector<JobResult> results(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i)
    results[i].key = cache_key(store->request_for(jobs[i].spec, jobs[i].target));

  if (o.dry_run) {
    const bool can_look = store->has_disk_cache();
    size_t cached = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      bool hit = false;
      if (can_look) {
        try {
          KernelStore::Source source;
          store->obtain(jobs[i].spec, jobs[i].target, &source);
          hit = true;
        } catch (const Error&) {
          // Not cached (or an invalid entry, which the runtime also treats as a miss).
        }
      }
      results[i].status = hit ? "cached" : "missing";
      cached += hit ? 1 : 0;
      if (!o.json)
        std::cout << jobs[i].target.name() << "  " << jobs[i].spec.describe()
                  << "  key=" << results[i].key << "  " << results[i].status << "\n";
    }
    if (o.json) {
      json list = json::array();
      for (size_t i = 0; i < jobs.size(); ++i) list.push_back(job_json(jobs[i], results[i]));
      std::cout
          << json{{"dry_run", true},  {"cache_dir", settings.cache_dir}, {"total", jobs.size()},
                  {"cached", cached}, {"missing", jobs.size() - cached}, {"jobs", list}}
                 .dump(2)
          << "\n";
    } else if (!o.quiet) {
      std::cout << "moejit-precompile --dry-run: " << jobs.size() << " specializations, " << cached
                << " already cached, " << jobs.size() - cached << " to compile ("
                << settings.cache_dir << ")\n";
    }
    return kExitOk;
  }

  // NVRTC is thread-safe and each job is independent: a pool of workers takes the next job.
  unsigned workers = o.jobs != 0 ? o.jobs : std::max(1u, std::thread::hardware_concurrency());
  workers = static_cast<unsigned>(std::min<size_t>(workers, jobs.size()));
  Progress progress(jobs.size(), o.quiet);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < jobs.size(); i = next.fetch_add(1)) {
      const Job& job = jobs[i];
      JobResult& r = results[i];
      const auto t0 = std::chrono::steady_clock::now();
      try {
        KernelStore::Source source = KernelStore::Source::kCompiled;
        store->obtain(job.spec, job.target, &source);
        r.status = source == KernelStore::Source::kCompiled ? "compiled" : "cached";
        // The store never fails for I/O: look at the entry as the runtime would, so that a write
        // that failed (full disk, file size limit, permissions) or an entry the runtime would
        // refuse (another user's, a shard others can write) is reported, not a silent cold start.
        const Servable now = servable(settings, r.key);
        r.entry_bytes = now.bytes;
        if (source == KernelStore::Source::kCompiled) r.bytes = now.bytes;
        if (now.check == EntryCheck::kMissing && source == KernelStore::Source::kCompiled) {
          r.status = "not_written";
          r.error = "compiled, but no cache entry appeared at " +
                    cache_entry_path(settings.cache_dir, r.key) +
                    " (disk full, file size limit, cache size cap (MOEJIT_CACHE_MAX_BYTES), or "
                    "permissions: see the warning above)";
        } else if (now.check != EntryCheck::kOk) {
          r.status = "unservable";
          r.error = now.error;
        }
      } catch (const std::exception& e) {
        r.status = "failed";
        r.error = e.what();
      }
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      progress.done(job.target.name() + " " + job.spec.describe(), r.status, r.seconds, r.error);
    }
  };
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();

  // After every entry has landed, so that the whole set is covered; on every run, so that a run
  // over a cache another one filled (0700 / 0600) opens it up too.
  CacheReadableReport readable;
  if (o.readable_by_all) {
    readable = make_cache_readable_by_all(settings.cache_dir);
    if (!readable.error.empty())
      std::cerr << "moejit-precompile: error: --readable-by-all: " << readable.error << "\n";
    for (const std::string& f : readable.failed)
      std::cerr << "moejit-precompile: error: --readable-by-all: " << f << "\n";
    for (const std::string& b : readable.blocked)
      std::cerr << "moejit-precompile: warning: --readable-by-all: other users cannot search " << b
                << ", so they cannot reach the cache under it\n";
  }

  // Each store evicts least recently used entries while the cache is over its size cap, and a hit
  // does not always refresh an entry's last use: with a cap smaller than the set, later jobs of
  // this run can evict entries that earlier ones compiled or found. Look at every entry again
  // now, as the runtime would load it: exit status 0 means that every kernel is servable when
  // the run ends.
  uint64_t set_bytes = 0;
  for (const JobResult& r : results) set_bytes += r.entry_bytes;
  std::vector<std::string> keys;
  for (const JobResult& r : results) keys.push_back(r.key);
  const ServableReport final_check = check_servable(settings.cache_dir, keys, rules_of(settings));
  for (size_t i = 0; i < jobs.size(); ++i) {
    JobResult& r = results[i];
    if (r.status != "compiled" && r.status != "cached") continue;
    const EntryCheck check =
        final_check.error.empty() ? final_check.results[i] : EntryCheck::kInvalid;
    if (check == EntryCheck::kOk) continue;
    const std::string path = cache_entry_path(settings.cache_dir, r.key);
    if (check == EntryCheck::kMissing) {
      r.error = std::string(r.status == "compiled" ? "compiled" : "found in the cache") +
                ", but evicted before the run ended (" + path +
                " is gone): the cache size cap (MOEJIT_CACHE_MAX_BYTES or cache_max_bytes, " +
                std::to_string(settings.cache_max_bytes) +
                " bytes) is smaller than the set being precompiled (at least " +
                std::to_string(set_bytes) +
                " bytes); raise MOEJIT_CACHE_MAX_BYTES to at least that";
      r.status = "evicted";
    } else {
      r.error =
          not_served(path, final_check.error.empty() ? final_check.why[i]
                                                     : "the cache directory " + final_check.error);
      r.status = "unservable";
    }
    progress.failed_later(jobs[i].target.name() + " " + jobs[i].spec.describe(), r.error);
  }

  size_t compiled = 0, cached = 0, failed = 0, unservable = 0, evicted = 0;
  uint64_t bytes = 0;
  for (const JobResult& r : results) {
    compiled += r.status == "compiled";
    cached += r.status == "cached";
    failed += r.status == "failed";
    unservable += r.status == "not_written" || r.status == "unservable";
    evicted += r.status == "evicted";
    bytes += r.bytes;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::ostringstream summary;
  summary << "moejit-precompile: " << jobs.size() << " kernels (" << specs.size()
          << " specializations x " << targets.size()
          << (targets.size() == 1 ? " target" : " targets") << "): " << compiled << " compiled, "
          << cached << " already cached, " << failed + unservable + evicted << " failed";
  if (unservable != 0)
    summary << " (" << unservable << " not servable by the runtime from the cache: listed above)";
  if (evicted != 0) summary << " (" << evicted << " evicted by the cache size cap)";
  summary << ", " << bytes << " bytes written, " << std::fixed;
  summary.precision(2);
  summary << seconds << " s (cache " << settings.cache_dir
          << (settings.cache_mac_key != nullptr ? ", authenticated" : "") << ")";
  const bool readable_ok = readable.error.empty() && readable.failed.empty();
  if (o.readable_by_all && readable_ok)
    summary << "; readable by all users: " << readable.directories << " directories, "
            << readable.entries << " entries";
  if (o.json) {
    json list = json::array();
    std::vector<std::string> target_names;
    for (const Target& t : targets) target_names.push_back(t.name());
    for (size_t i = 0; i < jobs.size(); ++i) list.push_back(job_json(jobs[i], results[i]));
    std::cout << json{{"cache_dir", settings.cache_dir},
                      {"authenticated", settings.cache_mac_key != nullptr},
                      {"targets", target_names},
                      {"total", jobs.size()},
                      {"compiled", compiled},
                      {"cached", cached},
                      {"failed", failed + unservable + evicted},
                      {"unservable", unservable},
                      {"evicted", evicted},
                      {"bytes_written", bytes},
                      {"seconds", seconds},
                      {"readable_by_all", o.readable_by_all
                                              ? json{{"directories", readable.directories},
                                                     {"entries", readable.entries},
                                                     {"failed", readable.failed},
                                                     {"blocked", readable.blocked}}
                                              : json(nullptr)},
                      {"jobs", list}}
                     .dump(2)
              << "\n";
    if (!o.quiet) std::cerr << summary.str() << "\n";
  } else if (!o.quiet) {
    std::cout << summary.str() << "\n";
  }
  if (failed != 0) return kExitCompileFailed;
  if (unservable != 0 || evicted != 0 || !readable_ok) return kExitCacheUnusable;
  return kExitOk;
}

int main_impl(int argc, char** argv) {
  Options o;
  CLI::App app{
      "moejit-precompile: compile libmoejit's combine kernels into its on-disk cache ahead of\n"
      "time (no GPU needed), so serving never compiles.",
      "moejit-precompile"};
  app.footer(kFooter);
  app.add_option("--model-config", o.model_configs, "Hugging Face config.json of the model")
      ->type_name("PATH");
  app.add_option("--hidden", o.hidden, "hidden sizes (comma list)")->delimiter(',');
  app.add_option("--topk", o.top_k, "top-k values (comma list)")->delimiter(',');
  app.add_option("--dtype", o.dtypes, "fp32|fp16|bf16 (aliases float32, float16, half, bfloat16)")
      ->delimiter(',');
  app.add_option("--out-dtype", o.out_dtype, "output dtype (default: the same as --dtype)");
  app.add_option("--layout", o.layouts, "token_major|gather_map|token_index (default: all three)")
      ->delimiter(',');
  app.add_option("--index-type", o.index_types, "int32|int64 (default: both)")->delimiter(',');
  app.add_option("--epilogue", o.epilogues,
                 "none|residual|norm|norm-fp8 (comma list; default: from the model config, else "
                 "none)")
      ->delimiter(',');
  app.add_option("--manifest", o.manifests, "file of specializations or shapes, one per line")
      ->type_name("PATH");
  app.add_option("--arch", o.arch, "sm_80,sm_90,... or all (default: the GPU present)");
  app.add_option("--cache-dir", o.cache_dir,
                 "cache directory (default: as the library, e.g. ~/.cache/moejit)")
      ->type_name("DIR");
  app.add_option("--cache-key-file", o.cache_key_file,
                 "the cache's secret key (default: MOEJIT_CACHE_KEY_FILE): entries are written "
                 "with a MAC under it, and --verify checks it; a file owned by this user, mode "
                 "0600 or 0400, 16 to 4096 bytes")
      ->type_name("PATH");
  app.add_option("-j,--jobs", o.jobs,
                 "parallel compilations (default: number of cores); --verify compiles nothing and "
                 "ignores it")
      ->check(CLI::Range(1u, 1024u));
  app.add_flag("-q,--quiet", o.quiet, "no progress and no summary (errors are still printed)");
  app.add_flag("-n,--dry-run", o.dry_run,
               "list each spec, target, cache key, cached or not; compile nothing");
  app.add_flag("--json", o.json, "print a machine-readable summary to stdout");
  auto* verify = app.add_flag("--verify", o.verify,
                              "check every entry of the cache directory and report invalid ones");
  app.add_flag("--repair", o.repair, "with --verify: remove the invalid entries")->needs(verify);
  app.add_flag("--readable-by-all", o.readable_by_all,
               "let every user read the cache (directories 0755, entries 0644, never writable "
               "by others), for a cache warmed by one user (root, building an image) and served "
               "by another");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitBadInput;
  }

  try {
    if (o.verify) {
      // Refused rather than ignored: none of them narrows what --verify checks.
      if (!o.model_configs.empty() || !o.hidden.empty() || !o.top_k.empty() || !o.dtypes.empty() ||
          !o.out_dtype.empty() || !o.layouts.empty() || !o.index_types.empty() ||
          !o.epilogues.empty() || !o.manifests.empty() || !o.arch.empty() || o.dry_run ||
          o.readable_by_all)
        throw InputError(
            "--verify checks every entry of the cache directory; it takes no model inputs, "
            "shapes, --layout, --index-type, --epilogue, --arch, --dry-run or --readable-by-all");
      return run_verify(o);
    }
    if (o.dry_run && o.readable_by_all)
      throw InputError(
          "--readable-by-all changes the cache's permissions; --dry-run changes "
          "nothing: give one of them");
    return run_precompile(o);
  } catch (const InputError& e) {
    std::cerr << "moejit-precompile: error: " << e.what() << "\n";
    return kExitBadInput;
  } catch (const Fatal& f) {
    std::cerr << "moejit-precompile: error: " << f.message << "\n";
    return f.code;
  } catch (const Error& e) {
    // Library errors before any compile (settings from the environment, NVRTC missing).
    std::cerr << "moejit-precompile: error: " << e.what() << "\n";
    return e.status() == MOEJIT_ERROR_INVALID_ARGUMENT ? kExitBadInput : kExitCompileFailed;
  } catch (const std::exception& e) {
    std::cerr << "moejit-precompile: error: " << e.what() << "\n";
    return kExitCompileFailed;
  }
}

}  // namespace
}  // namespace precompile
}  // namespace moejit

int main(int argc, char** argv) {
  return moejit::precompile::main_impl(argc, argv);
}
