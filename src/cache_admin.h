// Operations on a whole cache directory: the scan that eviction works from (sweeping dead writers'
// leftovers on the way), and the tools' verify / repair, servability check and readable-by-all.
// Every entry is judged by check_entry() (cache_files.h), the runtime's own test. Never throws.
#pragma once

#include <sys/types.h>
#include <time.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cache_files.h"
#include "entry_mac.h"

namespace moejit {

// ---- the scan ------------------------------------------------------------------------------

struct ScannedEntry {
  std::string shard, key;
  uint64_t bytes = 0;
  struct timespec mtime {};  // its last use
  ino_t ino = 0;
};
struct CacheScan {
  std::vector<ScannedEntry> entries;  // every file named like an entry, in trusted shards
  uint64_t bytes = 0;                 // their sizes
  size_t swept = 0;                   // leftovers removed
};

// Lists the entries under the version directory root_fd (one fstatat per file: no entry is read),
// and sweeps what writers left: temp files of writers that died (same host_tag, pid gone) or that
// are older than 10 minutes, and lock files nobody holds that are older than that. Touches no file
// that is not named as the cache names its own.
CacheScan scan_cache(int root_fd, const std::string& host);

// ---- tools --------------------------------------------------------------------------------

struct InvalidEntry {
  std::string path;
  std::string why;          // what check_entry() found
  bool removed = false;     // by repair
  std::string not_removed;  // why repair could not remove it ("" if it did, or did not try)
};

// For moejit-precompile --verify: every entry file under dir, judged by check_entry() as this user
// runs it (owner and mode included; authenticated under mac_key when one is given; the NVRTC
// version is not compared, since an entry of another NVRTC serves the processes that run it). With
// repair, invalid entries are deleted. The cache directory and its version directory must pass
// the runtime's checks (not a symlink, owned by this user or root, not writable by group or
// others); otherwise error says why and nothing is examined or removed. A shard directory that
// fails them is listed as invalid (path = the shard) and nothing in it is removed. An absent
// directory is an empty cache; missing tells it apart.
struct CacheVerifyReport {
  size_t entries = 0;
  size_t valid = 0;
  std::vector<InvalidEntry> invalid;
  size_t removed = 0;
  uint64_t bytes = 0;    // the sizes of the valid entries
  std::string error;     // why the runtime would refuse the directory; empty when usable
  bool missing = false;  // dir does not exist
};
CacheVerifyReport verify_cache_dir(const std::string& dir, bool repair,
                                   const MacKey* mac_key = nullptr);

// For moejit-precompile's exit status: for each key, whether the runtime would serve its entry from
// dir as this user (check_entry() with rules), without writing anything. error is set (and the
// results left empty) when the runtime would not use the directory at all.
struct ServableReport {
  std::string error;
  std::vector<EntryCheck> results;  // one per key
  std::vector<std::string> why;     // one per key: the reason for kInvalid
};
ServableReport check_servable(const std::string& dir, const std::vector<std::string>& keys,
                              const EntryRules& rules);

// For moejit-precompile --readable-by-all: lets every user read the cache under dir, for a cache
// warmed by one user (root building a container image) and served by another in read-only or
// no-compile mode; the runtime creates everything 0700 / 0600. Adds read permission (search too,
// for directories) for group and others to the cache directory, its version directory, its shards
// and the entry files named like a key (regular files only). Never adds write permission (the
// runtime would then refuse the cache), never follows a symlink, touches no other file. The cache
// directory and its version directory must pass the runtime's checks, as for verify_cache_dir.
struct CacheReadableReport {
  size_t directories = 0;            // readable by all afterwards
  size_t entries = 0;                // likewise
  std::vector<std::string> failed;   // "path: why", for what could not be made readable
  std::vector<std::string> blocked;  // directories above dir that others cannot search
  std::string error;                 // why the cache directory cannot be used at all
};
CacheReadableReport make_cache_readable_by_all(const std::string& dir);

}  // namespace moejit
