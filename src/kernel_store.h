// KernelStore: (KernelSpec, Target) -> compiled module, through the disk cache and NVRTC. Needs
// no GPU (tools/precompile uses it directly). Each (spec, target) is compiled at most once per
// store even when many threads ask at the same moment: the first compiles, the others wait for
// its result. Across processes sharing a disk cache, a per-key lock (with a timeout) lets one
// compile while the others wait for its entry: load -> lock -> load again -> compile -> store.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "disk_cache.h"
#include "kernel_sources.h"
#include "kernel_spec.h"
#include "nvrtc_compiler.h"
#include "settings.h"
#include "stats.h"

namespace moejit {

class KernelStore {
 public:
  KernelStore(const Settings& settings, Stats& stats);
  ~KernelStore();

  // The module for spec on target: memory, else the disk cache, else NVRTC (and publish), unless
  // the cache is in no-compile mode (Error MOEJIT_ERROR_NOT_CACHED). Throws Error on failure.
  std::shared_ptr<const CompiledModule> obtain(const KernelSpec& spec, const Target& target);

  // Where obtain() found its answer, for tools: looked up without compiling.
  enum class Source { kMemory, kDisk, kCompiled };
  std::shared_ptr<const CompiledModule> obtain(const KernelSpec& spec, const Target& target,
                                               Source* source);

  // Forgets the module of spec on target, in memory and on disk: the driver refused to load it,
  // so the next obtain() rebuilds it (a loadable-looking but broken entry must not stick).
  void invalidate(const KernelSpec& spec, const Target& target);

  // The exact NVRTC request (and so the cache key) for spec on target.
  CompileRequest request_for(const KernelSpec& spec, const Target& target) const;

  const Settings& settings() const { return settings_; }
  bool has_disk_cache() const { return disk_ != nullptr; }

 private:
  std::shared_ptr<const CompiledModule> build(const KernelSpec& spec, const Target& target,
                                              Source* source);

  const bool nvrtc_asked_;  // first: before the disk cache asks for NVRTC's version
  const Settings settings_;
  Stats& stats_;
  const TemplateSet templates_;
  std::unique_ptr<DiskCache> disk_;

  // Guards modules_ only; builds run outside it, each behind its own shared_future.
  std::mutex mutex_;
  struct Built {
    std::shared_future<std::shared_ptr<const CompiledModule>> module;
    Source source;
  };
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Built>> modules_;
};

}  // namespace moejit
