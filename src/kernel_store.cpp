#include "kernel_store.h"

#include <chrono>

#include "cache_key.h"
#include "error.h"
#include "file_cache.h"
#include "fork_guard.h"
#include "logging.h"

namespace moejit {

namespace {

// NVRTC's version and architectures are asked once per process (and kept): asked first here,
// inside the fork gate, so that no fork happens in the middle of that.
bool ask_nvrtc_in_fork_gate() {
  ForkGateScope gate;
  nvrtc_version();
  nvrtc_supported_archs();
  return true;
}

}  // namespace

KernelStore::KernelStore(const Settings& settings, Stats& stats)
    : nvrtc_asked_(ask_nvrtc_in_fork_gate()),
      settings_(settings),
      stats_(stats),
      templates_(load_templates(settings.template_dir, settings.template_dir_setting)),
      disk_(open_disk_cache(settings, stats)) {}

KernelStore::~KernelStore() = default;

CompileRequest KernelStore::request_for(const KernelSpec& spec, const Target& target) const {
  CompileRequest r;
  r.program_name = "moejit_combine.cu";
  r.source = spec.source();
  r.headers = templates_;
  r.options = compile_options(target);
  r.name_expressions = spec.name_expressions();
  r.target = target;
  return r;
}

void KernelStore::invalidate(const KernelSpec& spec, const Target& target) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    modules_.erase(std::make_pair(spec.describe(), target.name()));
  }
  if (disk_ != nullptr) disk_->invalidate(cache_key(request_for(spec, target)));
}

std::shared_ptr<const CompiledModule> KernelStore::obtain(const KernelSpec& spec,
                                                          const Target& target) {
  Source ignored;
  return obtain(spec, target, &ignored);
}

std::shared_ptr<const CompiledModule> KernelStore::obtain(const KernelSpec& spec,
                                                          const Target& target, Source* source) {
  const auto key = std::make_pair(spec.describe(), target.name());
  std::shared_ptr<Built> built;
  bool owner = false;
  std::promise<std::shared_ptr<const CompiledModule>> promise;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = modules_.find(key);
    if (it == modules_.end()) {
      built = std::make_shared<Built>();
      built->module = promise.get_future().share();
      built->source = Source::kCompiled;
      modules_.emplace(key, built);
      owner = true;
    } else {
      built = it->second;
    }
  }
  if (!owner) {
    *source = Source::kMemory;
    return built->module.get();  // rethrows the owner's error, if it failed
  }
  try {
    Source found = Source::kCompiled;
    auto module = build(spec, target, &found);
    promise.set_value(module);
    *source = found;
    return module;
  } catch (...) {
    // Forget the failed attempt so a later call retries (the cache may have been warmed since),
    // and hand the error to the threads waiting on this one. Only this attempt: an invalidate()
    // meanwhile may have let another thread start a build of its own under the key.
    promise.set_exception(std::current_exception());
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = modules_.find(key);
    if (it != modules_.end() && it->second == built) modules_.erase(it);
    throw;
  }
}

std::shared_ptr<const CompiledModule> KernelStore::build(const KernelSpec& spec,
                                                         const Target& target, Source* source) {
  const CompileRequest request = request_for(spec, target);
  const std::string key = cache_key(request);
  if (disk_ != nullptr) {
    if (std::optional<CompiledModule> hit = disk_->load(key)) {
      stats_.disk_hits.fetch_add(1, std::memory_order_relaxed);
      logger().debug("disk cache hit {} for {} on {}", key, spec.describe(), target.name());
      *source = Source::kDisk;
      return std::make_shared<const CompiledModule>(std::move(*hit));
    }
  }
  // The library and NVRTC versions are part of the key: a cache warmed with the moejit-precompile
  // of another release, or under another toolkit, has entries for none of this process's kernels.
  if (settings_.cache_mode == MOEJIT_CACHE_MODE_NO_COMPILE)
    throw Error(MOEJIT_ERROR_NOT_CACHED,
                "kernel " + spec.describe() + " for " + target.name() + " (key " + key +
                    ") is not in the cache at \"" + settings_.cache_dir +
                    "\" and the cache is in no-compile mode: warm it with moejit-precompile (that "
                    "spec works as a --manifest line) of libmoejit " +
                    moejit_version_string() + " running with NVRTC " + nvrtc_version() +
                    ", as this process does: entries of another version match no key");

  // Other processes may be cold-starting on the same key: wait (bounded) for whoever builds it
  // first, then look again before compiling. Read-only caches hand out no lock.
  std::unique_ptr<KeyLock> build_lock;
  if (disk_ != nullptr && settings_.cache_mode == MOEJIT_CACHE_MODE_READ_WRITE) {
    build_lock = disk_->lock(key);
    if (build_lock != nullptr) {
      if (std::optional<CompiledModule> hit = disk_->load(key)) {
        stats_.disk_hits.fetch_add(1, std::memory_order_relaxed);
        logger().debug("disk cache hit {} for {} on {} (built by another process)", key,
                       spec.describe(), target.name());
        *source = Source::kDisk;
        return std::make_shared<const CompiledModule>(std::move(*hit));
      }
    }
  }

  // A compile that fails counts as one too: it took NVRTC's time like any other.
  const auto start = std::chrono::steady_clock::now();
  auto count_compile = [&] {
    const auto nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - start)
                           .count();
    stats_.compiles.fetch_add(1, std::memory_order_relaxed);
    stats_.compile_nanoseconds.fetch_add(static_cast<uint64_t>(nanos), std::memory_order_relaxed);
    return nanos;
  };
  std::shared_ptr<CompiledModule> module;
  try {
    // fork() waits for the compile: NVRTC forked in the middle of one can hang the child.
    ForkGateScope gate;
    module = std::make_shared<CompiledModule>(compile(request));
  } catch (...) {
    count_compile();
    throw;
  }
  const auto nanos = count_compile();
  logger().info("compiled {} for {} in {:.1f} ms ({} bytes)", spec.describe(), target.name(),
                static_cast<double>(nanos) * 1e-6, module->image.size());
  if (!module->log.empty()) logger().debug("NVRTC log for {}:\n{}", spec.describe(), module->log);
  if (disk_ != nullptr && settings_.cache_mode == MOEJIT_CACHE_MODE_READ_WRITE)
    disk_->store(key, *module);
  *source = Source::kCompiled;
  return module;  // build_lock is released here, after the entry is published
}

}  // namespace moejit
