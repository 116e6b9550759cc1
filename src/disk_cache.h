// The seam between the kernel store and a persistent cache of compiled modules. The store asks
// load() before compiling, takes lock() and asks load() again, compiles, and offers the result to
// store(). Implementations must treat every fault (I/O, corruption, permissions) as a miss, never
// as an error of the caller, and never throw out of load, lock, store or invalidate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nvrtc_compiler.h"
#include "settings.h"
#include "stats.h"

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

// The disk cache the settings ask for, or nullptr when it is disabled or unusable (after one
// warning). Never throws for I/O reasons.
std::unique_ptr<DiskCache> open_disk_cache(const Settings& settings, Stats& stats);

// Where the entry for key lives under cache directory dir:
// <dir>/v<format version>/<first two hex digits of key>/<key>.moejit
std::string cache_entry_path(const std::string& dir, const std::string& key);

// For tools (moejit-precompile --verify): every entry file under dir, validated as the runtime
// would (regular file, not a symlink, not writable by others, header, checksums, metadata, key
// echo equal to the file name). With repair, invalid entries are deleted. The cache directory
// and v1 must pass the runtime's checks (not a symlink, owned by this user or root, not writable
// by group or others); otherwise error says why and nothing is examined or removed. A shard
// directory that fails those checks is listed in invalid_paths and nothing in it is removed. An
// absent directory is an empty cache. Never throws.
struct CacheVerifyReport {
  size_t entries = 0;
  size_t valid = 0;
  std::vector<std::string> invalid_paths;
  size_t removed = 0;
  uint64_t bytes = 0;  // the sizes of the valid entries
  std::string error;   // why the runtime would refuse the directory; empty when usable
};
CacheVerifyReport verify_cache_dir(const std::string& dir, bool repair);

// For tools (moejit-precompile --readable-by-all): lets every user read the cache under dir, for a
// cache warmed by one user (root building a container image) and served by another in read-only
// or no-compile mode; the runtime creates everything 0700 / 0600. Adds read permission (search
// too, for directories) for group and others to the cache directory, v1, its shards and the
// entry files named like a key (regular files only). Never adds write permission (the runtime
// would then refuse the cache), never follows a symlink, touches no other file. The cache directory
// and v1 must pass the runtime's checks, as for verify_cache_dir. Never throws.
struct CacheReadableReport {
  size_t directories = 0;            // readable by all afterwards
  size_t entries = 0;                // likewise
  std::vector<std::string> failed;   // "path: why", for what could not be made readable
  std::vector<std::string> blocked;  // directories above dir that others cannot search
  std::string error;                 // why the cache directory cannot be used at all
};
CacheReadableReport make_cache_readable_by_all(const std::string& dir);

}  // namespace moejit
