// The disk cache's files, and the rules for trusting them:
//
//   <dir>/v2/<ab>/<key>.moejit      one entry per key (cache_entry.h), ab = the key's first two
//                                   hex digits; v2 = v<kCacheFormatVersion>
//   <dir>/v2/<ab>/<key>.lock        per-key build lock (key_lock.h), removed by its holder
//   <dir>/v2/<ab>/.<key>.<pid>.<host>.<n>.tmp   an entry being written
//
// Directories are opened without following a symlink at their own name, and trusted only if owned
// by this user (or root) and not writable by group or others. check_entry() is the one test an
// entry must pass to be served: the runtime's load and the tools (verify, precompile's final
// check) all call it, so a tool never calls valid what the runtime would refuse.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "entry_mac.h"
#include "nvrtc_compiler.h"

namespace moejit {

extern const char kEntrySuffix[];  // ".moejit"
extern const char kLockSuffix[];   // ".lock"
extern const char kTempSuffix[];   // ".tmp"

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset();

 private:
  int fd_ = -1;
};

// "v2": the directory of this format version's entries.
std::string version_dir_name();
// <dir>/v<format version>/<first two hex digits of key>/<key>.moejit
std::string cache_entry_path(const std::string& dir, const std::string& key);

// Seconds from t (a file time, CLOCK_REALTIME) to now; negative for a time in the future.
double seconds_since(const struct timespec& t);

// "0755": a mode as chmod writes it.
std::string mode_text(mode_t mode);
// strerror(err) as a string.
std::string error_text(int err);

// Why a directory or entry with these attributes is not trusted ("" when it is): not owned by this
// user or root, or writable by group or others. Root may own what we trust: it can write anywhere
// anyway. Anyone else who could write the directory or entry could plant a binary that we would
// load into the GPU.
std::string untrusted_reason(const struct stat& st);

// Opens the directory `name` under at without following a symlink there, creating it (0700) when
// create is set, and checks that it is trusted. Empty Fd and *why on failure; *missing tells a
// plain absence apart.
Fd open_dir(int at, const std::string& name, bool create, std::string* why,
            bool* missing = nullptr);

// The cache directory dir and its version directory, opened as the runtime opens them: root is
// empty on failure, with why; missing tells a plain absence. With create, the cache directory (and
// at most its parent, the ~/.cache case) and the version directory are created when absent.
struct OpenedCache {
  Fd top;   // dir
  Fd root;  // dir/v2
  std::string why;
  bool missing = false;
};
OpenedCache open_cache(const std::string& dir, bool create);

// The names in a directory (no "." or ".."), through a fresh open file description.
std::vector<std::string> list_dir(int dir_fd);

bool ends_with(const std::string& s, const char* suffix);
// "ab": two lowercase hex digits.
bool is_shard_name(const std::string& s);
// The key of an entry's file name ("<key>.moejit"), or "" for any other name.
std::string entry_key_of(const std::string& file_name);

// The <host> of temp file names: a hash of the hostname and the pid namespace. A temp file's pid is
// only checked for a writer with the same tag: containers on one host can share a hostname (host
// networking) and a cache volume, and a pid from another pid namespace names nobody here.
std::string host_tag();

// ".<key>.<pid>.<host>.<n>.tmp": the pid and host let a sweep tell a dead writer's leftovers.
struct TempName {
  long pid = 0;
  std::string host;
};
bool parse_temp_name(const std::string& name, TempName* out);

// What an entry must satisfy beyond its own integrity.
struct EntryRules {
  // Set: the entry must be authenticated under this key (a cache key file is configured).
  const MacKey* mac_key = nullptr;
  // Not empty: the entry must have been built by this NVRTC version. The runtime and precompile
  // ask for keys computed with their NVRTC, so an entry claiming another one was not written by
  // us; verify does not know which NVRTC a key was computed with, and leaves it empty.
  std::string nvrtc_version;
  // Refresh the entry's last use (its mtime, for eviction) when it is older than a minute.
  bool touch = false;
};

enum class EntryCheck { kOk, kMissing, kInvalid };

// The entry of key in shard directory shard_fd (opened with open_dir, so trusted): a regular file,
// not a symlink, trusted (untrusted_reason), of plausible size, a complete entry for key
// (parse_cache_entry) and satisfying rules. On kInvalid, *why says why; *seen (optional) gets the
// file's attributes whenever they could be read. module may be null.
EntryCheck check_entry_in_shard(int shard_fd, const std::string& key, const EntryRules& rules,
                                CompiledModule* module, std::string* why,
                                struct stat* seen = nullptr);

// The same from the version directory root_fd: opens key's shard under the runtime's checks
// first. A missing shard is kMissing; a refused one kInvalid, with why "its directory ...".
EntryCheck check_entry(int root_fd, const std::string& key, const EntryRules& rules,
                       CompiledModule* module, std::string* why, struct stat* seen = nullptr);

}  // namespace moejit
