// The seam between the kernel store and a persistent cache of compiled modules. The store asks
// load() before compiling, takes lock() and asks load() again, compiles, and offers the result to
// store(). Implementations must treat every fault (I/O, corruption, permissions) as a miss, never
// as an error of the caller, and never throw out of load, lock, store or invalidate. The one
// implementation is the directory of files in file_cache.h (open_disk_cache()).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "nvrtc_compiler.h"

namespace moejit {

// Held while one process compiles and publishes a key, so that others cold-starting on the same
// key wait for its entry instead of compiling it again. Released by destruction. Only an
// optimization: correctness never depends on it.
class KeyLock {
 public:
  virtual ~KeyLock() = default;
};

class DiskCache {
 public:
  virtual ~DiskCache() = default;
  // The module stored under key, fully validated; nullopt on a miss or any fault.
  virtual std::optional<CompiledModule> load(const std::string& key) = 0;
  // Publishes module under key (atomically, or not at all). Never throws.
  virtual void store(const std::string& key, const CompiledModule& module) = 0;
  // Waits (bounded) for exclusive right to build key; nullptr when there is nothing to wait for
  // (read-only cache, lock unavailable, or the wait timed out: the caller then builds anyway).
  virtual std::unique_ptr<KeyLock> lock(const std::string& /*key*/) { return nullptr; }
  // Forgets the entry under key (e.g. the driver rejected its image): later loads miss until a
  // fresh entry is stored.
  virtual void invalidate(const std::string& /*key*/) {}
};

}  // namespace moejit
