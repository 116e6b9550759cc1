// The seam between the kernel store and a persistent cache of compiled modules. The store asks
// load() before compiling and offers every fresh compile to store(). Implementations must treat
// every fault (I/O, corruption, permissions) as a miss, never as an error of the caller.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "nvrtc_compiler.h"
#include "settings.h"
#include "stats.h"

namespace moejit {

class DiskCache {
 public:
  virtual ~DiskCache() = default;
  // The module stored under key, fully validated; nullopt on a miss or any fault.
  virtual std::optional<CompiledModule> load(const std::string& key) = 0;
  // Publishes module under key (atomically, or not at all). Never throws.
  virtual void store(const std::string& key, const CompiledModule& module) = 0;
};

// The disk cache the settings ask for, or nullptr when it is disabled or unusable (after one
// warning). Never throws for I/O reasons.
std::unique_ptr<DiskCache> open_disk_cache(const Settings& settings, Stats& stats);

}  // namespace moejit
