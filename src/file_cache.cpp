#include "file_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_entry.h"
#include "cache_key.h"
#include "key_lock.h"
#include "logging.h"

namespace moejit {
namespace {

const char kEntrySuffix[] = ".moejit";
const char kLockSuffix[] = ".lock";
const char kTempSuffix[] = ".tmp";
// An entry younger than this is never evicted: it may have just replaced an older one, and its
// writer may still be about to use it.
constexpr double kMinEvictAgeSeconds = 10;
// Temp and lock files of writers that died are swept after this long even when we cannot tell
// whether their writer is alive (another host or pid namespace sharing the directory).
constexpr double kStaleSeconds = 600;
// A hit refreshes the entry's mtime (its last use, for eviction) at most this often.
constexpr double kTouchIntervalSeconds = 60;
constexpr double kDefaultLockTimeoutSeconds = 60;

std::string version_dir_name() {
  return "v" + std::to_string(kCacheFormatVersion);
}
std::string error_text() {
  return std::strerror(errno);
}

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

double seconds_since(const struct timespec& t) {
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - t.tv_sec) +
         static_cast<double>(now.tv_nsec - t.tv_nsec) * 1e-9;
}

// Too recent to evict: it may have just replaced an older entry that a process is about to load.
// A last use further in the future than that (a clock set wrong, another host's on a network file
// system) does not count as recent: such an entry would never be evicted, and the cap not hold.
bool young(const struct timespec& mtime) {
  const double age = seconds_since(mtime);
  return age < kMinEvictAgeSeconds && age > -kMinEvictAgeSeconds;
}

// Root may own what we trust: it can write anywhere anyway. Anyone else who could write the
// directory or entry could plant a binary that we would load into the GPU.
// "0755": a mode as chmod writes it.
std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

std::string untrusted_reason(const struct stat& st, bool check_owner) {
  const uid_t me = geteuid();
  if (check_owner && st.st_uid != me && st.st_uid != 0)
    return "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(me) + ")";
  if ((st.st_mode & 022) != 0)
    return "is writable by group or others (mode " + mode_text(st.st_mode) + ")";
  return std::string();
}

// Opens the directory `name` under at without following a symlink there, creating it (0700) when
// create is set, and checks that nobody else can write it. Empty Fd and *why on failure;
// *missing tells a plain absence apart.
Fd open_dir(int at, const std::string& name, bool create, std::string* why,
            bool* missing = nullptr) {
  if (missing != nullptr) *missing = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    Fd fd(openat(at, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (fd) {
      struct stat st {};
      if (fstat(fd.get(), &st) != 0) {
        *why = "\"" + name + "\" cannot be examined: " + error_text();
        return Fd();
      }
      const std::string bad = untrusted_reason(st, true);
      if (!bad.empty()) {
        *why = "\"" + name + "\" " + bad;
        return Fd();
      }
      return fd;
    }
    const int err = errno;
    struct stat st {};
    if (fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      if (S_ISLNK(st.st_mode)) {
        *why = "\"" + name + "\" is a symbolic link (cache directories are never followed)";
        return Fd();
      }
      if (!S_ISDIR(st.st_mode)) {
        *why = "\"" + name + "\" exists and is not a directory";
        return Fd();
      }
    }
    if (err != ENOENT || !create || attempt > 0) {
      if (missing != nullptr) *missing = err == ENOENT;
      *why = "\"" + name + "\" cannot be opened: " + std::strerror(err);
      return Fd();
    }
    if (mkdirat(at, name.c_str(), 0700) != 0 && errno != EEXIST) {
      *why = "\"" + name + "\" cannot be created: " + error_text();
      return Fd();
    }
  }
  return Fd();
}

// The user's cache directory. Creates it, and at most its parent (the ~/.cache case), when
// create is set: a typo deep in a path should not conjure a tree of directories.
Fd open_cache_root(std::string dir, bool create, std::string* why, bool* missing) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // "x/" would follow a symlink x
  Fd fd = open_dir(AT_FDCWD, dir, create, why, missing);
  if (fd || !create) return fd;
  const size_t slash = dir.rfind('/');
  if (slash == std::string::npos || slash == 0) return fd;
  const std::string parent = dir.substr(0, slash);
  if (mkdir(parent.c_str(), 0700) != 0 && errno != EEXIST) return fd;  // keeps the first reason
  return open_dir(AT_FDCWD, dir, create, why, missing);
}

// A fresh open file description of a directory (readdir on a dup'd fd would share its offset with
// other threads listing the same directory).
std::vector<std::string> list_dir(int dir_fd) {
  std::vector<std::string> names;
  const int fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return names;
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    close(fd);
    return names;
  }
  while (const struct dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}
bool is_shard_name(const std::string& s) {
  return s.size() == 2 && is_cache_key(s + std::string(30, '0'));
}

enum class ReadResult { kOk, kMissing, kInvalid };

// Reads and validates the entry `key` in shard directory shard_fd. *bytes gets the file size
// whenever it could be examined.
ReadResult read_entry(int shard_fd, const std::string& key, bool check_owner, bool touch,
                      CompiledModule* module, std::string* why, struct stat* seen) {
  const std::string name = key + kEntrySuffix;
  struct stat ignored {};
  if (seen == nullptr) seen = &ignored;
  *seen = {};
  // O_NOFOLLOW: a symlink planted at the entry's name is refused even if it points at a valid
  // entry. O_NONBLOCK: a FIFO planted there must not hang the open.
  Fd fd(openat(shard_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd) {
    if (errno == ENOENT) return ReadResult::kMissing;
    *why = errno == ELOOP ? std::string("is a symbolic link (not followed)") : error_text();
    fstatat(shard_fd, name.c_str(), seen, AT_SYMLINK_NOFOLLOW);
    return ReadResult::kInvalid;
  }
  struct stat& st = *seen;
  if (fstat(fd.get(), &st) != 0) {
    *why = error_text();
    return ReadResult::kInvalid;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = "is not a regular file";
    return ReadResult::kInvalid;
  }
  *why = untrusted_reason(st, check_owner);
  if (!why->empty()) return ReadResult::kInvalid;
  if (static_cast<uint64_t>(st.st_size) > kCacheEntryMaxBytes + kCacheEntryHeaderBytes) {
    *why = "is implausibly large (" + std::to_string(st.st_size) + " bytes)";
    return ReadResult::kInvalid;
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = read(fd.get(), &data[got], data.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = "read failed: " + error_text();
      return ReadResult::kInvalid;
    }
    if (n == 0) break;  // shrank under us: the length check below rejects it
    got += static_cast<size_t>(n);
  }
  data.resize(got);
  if (!parse_cache_entry(data, key, module, why)) return ReadResult::kInvalid;
  if (touch && seconds_since(st.st_mtim) > kTouchIntervalSeconds)
    futimens(fd.get(), nullptr);  // last use, for eviction; best effort
  return ReadResult::kOk;
}

bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Names the host and the pid namespace: a temp file's pid is only checked for a writer with the
// same tag. Containers on one host can share a hostname (host networking) and a cache volume, and
// a pid from another pid namespace names nobody here: with the hostname alone, a live writer
// there looked dead, and its temp file was swept from under it. A writer with another tag is
// judged by its file's age alone (kStaleSeconds), like one on another host.
std::string host_tag() {
  char name[256] = {};
  std::string id = gethostname(name, sizeof(name) - 1) == 0 ? name : "nohost";
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);  // "pid:[4026531836]"
  if (n > 0) id.append("\n").append(ns, static_cast<size_t>(n));
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%08llx",
                static_cast<unsigned long long>(XXH3_64bits(id.data(), id.size()) & 0xffffffffu));
  return buf;
}

double lock_timeout_seconds() {
  const char* text = std::getenv("MOEJIT_CACHE_LOCK_TIMEOUT");
  if (text == nullptr || *text == '\0') return kDefaultLockTimeoutSeconds;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0) || v > 86400) {
    logger().warn("MOEJIT_CACHE_LOCK_TIMEOUT={} is not a number of seconds in [0, 86400]; using {}",
                  text, kDefaultLockTimeoutSeconds);
    return kDefaultLockTimeoutSeconds;
  }
  return v;
}

// ".<key>.<pid>.<host>.<n>.tmp": the pid and host let a sweep tell a dead writer's leftovers.
struct TempName {
  long pid = 0;
  std::string host;
};
bool parse_temp_name(const std::string& name, TempName* out) {
  if (name.size() < 2 || name[0] != '.' || !ends_with(name, kTempSuffix)) return false;
  std::vector<std::string> parts;
  size_t start = 1;
  for (size_t dot; (dot = name.find('.', start)) != std::string::npos; start = dot + 1)
    parts.push_back(name.substr(start, dot - start));
  if (parts.size() != 4 || !is_cache_key(parts[0])) return false;
  char* end = nullptr;
  out->pid = std::strtol(parts[1].c_str(), &end, 10);
  out->host = parts[2];
  return end != parts[1].c_str() && *end == '\0' && out->pid > 0;
}

class FileCache final : public DiskCache {
 public:
  FileCache(std::string dir, Fd root, bool writable, uint64_t max_bytes, Stats& stats)
      : dir_(std::move(dir)),
        root_(std::move(root)),
        writable_(writable),
        max_bytes_(max_bytes),
        lock_timeout_(lock_timeout_seconds()),
        host_(host_tag()),
        stats_(stats) {}

  std::optional<CompiledModule> load(const std::string& key) override {
    try {
      if (!is_cache_key(key)) return std::nullopt;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        if (rejected_.count(key) != 0) return std::nullopt;
      }
      std::string why;
      bool missing = false;
      Fd shard = open_dir(root_.get(), key.substr(0, 2), false, &why, &missing);
      if (!shard) {
        if (!missing) entry_fault(key, "its directory " + why);
        return std::nullopt;
      }
      CompiledModule module;
      struct stat seen {};
      switch (read_entry(shard.get(), key, true, writable_, &module, &why, &seen)) {
        case ReadResult::kMissing:
          return std::nullopt;
        case ReadResult::kInvalid:
          entry_fault(key, why, &seen);
          return std::nullopt;
        case ReadResult::kOk:
          break;
      }
      // The key covers the NVRTC version; an entry claiming another one was not written by us.
      if (module.nvrtc_version != nvrtc_version()) {
        entry_fault(key, "it was built by NVRTC " + module.nvrtc_version, &seen);
        return std::nullopt;
      }
      return module;
    } catch (const std::exception& e) {
      entry_fault(key, e.what());
    } catch (...) {
      entry_fault(key, "unknown error");
    }
    return std::nullopt;
  }

  void store(const std::string& key, const CompiledModule& module) override {
    if (!writable_ || !is_cache_key(key)) return;
    try {
      std::string why;
      Fd shard = open_dir(root_.get(), key.substr(0, 2), true, &why);
      if (!shard) return write_fault("directory " + why);
      if (!publish(shard.get(), key, encode_cache_entry(key, module), &why))
        return write_fault(why);
      {
        std::lock_guard<std::mutex> guard(mutex_);
        rejected_.erase(key);
      }
      evict_and_sweep(key);
    } catch (const std::exception& e) {
      write_fault(e.what());
    } catch (...) {
      write_fault("unknown error");
    }
  }

  std::unique_ptr<KeyLock> lock(const std::string& key) override {
    if (!writable_ || !is_cache_key(key)) return nullptr;
    try {
      std::string why;
      Fd shard = open_dir(root_.get(), key.substr(0, 2), true, &why);
      if (!shard) return nullptr;  // store() will report it
      bool timed_out = false;
      auto held =
          FileKeyLock::acquire(shard.get(), key + kLockSuffix, lock_timeout_, &timed_out, &why);
      if (timed_out)
        logger().warn(
            "waited {:.0f} s for another process to build cache entry {}; building it here "
            "(MOEJIT_CACHE_LOCK_TIMEOUT sets the wait)",
            lock_timeout_, cache_entry_path(dir_, key));
      else if (held == nullptr)
        logger().debug("no build lock for {}: {}", key, why);
      return held;
    } catch (...) {
      return nullptr;
    }
  }

  void invalidate(const std::string& key) override {
    if (!is_cache_key(key)) return;
    try {
      bool removed = false;
      if (writable_) {
        std::string why;
        Fd shard = open_dir(root_.get(), key.substr(0, 2), false, &why);
        removed = shard &&
                  (unlinkat(shard.get(), (key + kEntrySuffix).c_str(), 0) == 0 || errno == ENOENT);
      }
      std::lock_guard<std::mutex> guard(mutex_);
      if (!removed) rejected_.insert(key);  // read-only: at least stop serving it here
      logger().info("disk cache entry {} invalidated", cache_entry_path(dir_, key));
    } catch (...) {
    }
  }

 private:
  // Write, fsync, close, rename, fsync the directory: only a complete entry ever has the name.
  bool publish(int shard_fd, const std::string& key, const std::string& bytes, std::string* why) {
    static std::atomic<unsigned long long> counter{0};
    const std::string temp = "." + key + "." + std::to_string(getpid()) + "." + host_ + "." +
                             std::to_string(counter.fetch_add(1)) + kTempSuffix;
    Fd fd(
        openat(shard_fd, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) {
      *why = "cannot create " + temp + ": " + error_text();
      return false;
    }
    const char* step = nullptr;
    if (!write_all(fd.get(), bytes))
      step = "write";
    else if (fsync(fd.get()) != 0)
      step = "fsync";
    else if (close(fd.release()) != 0)
      step = "close";
    if (step == nullptr) {
      // Test hook: stop with the complete temp file written but not yet renamed, so a test can
      // kill the writer exactly here.
      if (const char* pause_here = std::getenv("MOEJIT_TEST_PAUSE_BEFORE_RENAME"))
        if (*pause_here != '\0')
          for (;;) pause();
      if (renameat(shard_fd, temp.c_str(), shard_fd, (key + kEntrySuffix).c_str()) != 0)
        step = "rename";
    }
    if (step != nullptr) {
      *why = std::string(step) + " of " + temp + " failed: " + error_text();
      unlinkat(shard_fd, temp.c_str(), 0);
      return false;
    }
    fsync(shard_fd);  // durability of the rename; the entry is complete either way
    return true;
  }

  // After a publish: drop temp files of dead writers and stale lock files, and evict the least
  // recently used entries while the cache is over its cap.
  void evict_and_sweep(const std::string& just_written) {
    struct Entry {
      std::string shard, key;
      uint64_t bytes;
      struct timespec mtime;
      ino_t ino;
    };
    std::vector<Entry> entries;
    uint64_t total = 0;
    for (const std::string& shard_name : list_dir(root_.get())) {
      if (!is_shard_name(shard_name)) continue;
      std::string why;
      Fd shard = open_dir(root_.get(), shard_name, false, &why);
      if (!shard) continue;
      for (const std::string& name : list_dir(shard.get())) {
        struct stat st {};
        if (fstatat(shard.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        const double age = seconds_since(st.st_mtim);
        TempName temp;
        if (ends_with(name, kEntrySuffix) && S_ISREG(st.st_mode)) {
          const std::string key = name.substr(0, name.size() - std::strlen(kEntrySuffix));
          if (!is_cache_key(key)) continue;
          entries.push_back(
              {shard_name, key, static_cast<uint64_t>(st.st_size), st.st_mtim, st.st_ino});
          total += static_cast<uint64_t>(st.st_size);
        } else if (parse_temp_name(name, &temp)) {
          const bool dead =
              temp.host == host_ && kill(static_cast<pid_t>(temp.pid), 0) != 0 && errno == ESRCH;
          if (dead || age > kStaleSeconds) {
            unlinkat(shard.get(), name.c_str(), 0);
            logger().debug("removed {}/{} left by a writer that died", shard_name, name);
          }
        } else if (ends_with(name, kLockSuffix) && age > kStaleSeconds &&
                   is_cache_key(name.substr(0, name.size() - std::strlen(kLockSuffix)))) {
          // A key's lock only (any other file is not ours). Only removable while nobody holds
          // it; acquiring and releasing it unlinks it.
          bool timed_out = false;
          FileKeyLock::acquire(shard.get(), name, 0, &timed_out, &why);
        }
      }
    }
    if (total <= max_bytes_) return;
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec
                                              : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    size_t evicted = 0;
    uint64_t freed = 0;
    for (const Entry& e : entries) {
      if (total <= max_bytes_) break;
      if (e.key == just_written || young(e.mtime)) continue;
      std::string why;
      Fd shard = open_dir(root_.get(), e.shard, false, &why);
      if (!shard) continue;
      // Whoever is building or replacing this key holds its lock: never delete under them.
      bool timed_out = false;
      auto held = FileKeyLock::acquire(shard.get(), e.key + kLockSuffix, 0, &timed_out, &why);
      if (held == nullptr) continue;
      const std::string name = e.key + kEntrySuffix;
      struct stat now {};
      if (fstatat(shard.get(), name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (now.st_ino != e.ino || now.st_mtim.tv_sec != e.mtime.tv_sec ||
          now.st_mtim.tv_nsec != e.mtime.tv_nsec)
        continue;  // replaced or used since the scan
      if (unlinkat(shard.get(), name.c_str(), 0) == 0 || errno == ENOENT) {
        total -= std::min(total, e.bytes);
        freed += e.bytes;
        ++evicted;
      }
    }
    if (evicted > 0)
      logger().info(
          "disk cache {}: evicted {} least recently used entries ({} bytes) to stay "
          "under {} bytes",
          dir_, evicted, freed, max_bytes_);
  }

  // A bad entry is a miss (the store recompiles and replaces it); warn once per entry. The store
  // looks twice (before and after taking the build lock): the same bad file, recognized by its
  // identity, is counted once.
  void entry_fault(const std::string& key, const std::string& why,
                   const struct stat* seen = nullptr) {
    bool first = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      first = warned_entries_.insert(key).second;
      if (seen != nullptr && seen->st_ino != 0) {
        const FileId id{seen->st_dev, seen->st_ino, seen->st_size, seen->st_mtim.tv_sec,
                        seen->st_mtim.tv_nsec};
        auto [it, fresh] = faulted_.emplace(key, id);
        if (!fresh && it->second == id) return;
        it->second = id;
      }
    }
    stats_.disk_errors.fetch_add(1, std::memory_order_relaxed);
    const std::string path = cache_entry_path(dir_, key);
    if (first)
      logger().warn("ignoring disk cache entry {}: {}; it will be rebuilt{}", path, why,
                    writable_ ? " and replaced" : " in memory");
    else
      logger().debug("ignoring disk cache entry {} again: {}", path, why);
  }

  // A failed write loses nothing but time: the module stays in memory. Warn once per cache.
  void write_fault(const std::string& why) {
    stats_.disk_errors.fetch_add(1, std::memory_order_relaxed);
    bool first = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      first = !warned_write_;
      warned_write_ = true;
    }
    if (first)
      logger().warn(
          "cannot write to the disk cache at \"{}\" ({}); compiled kernels are kept in "
          "memory (further write failures are logged at debug level)",
          dir_, why);
    else
      logger().debug("cannot write to the disk cache at \"{}\": {}", dir_, why);
  }

  const std::string dir_;
  const Fd root_;  // <dir>/v1, opened once: later path swaps cannot redirect us
  const bool writable_;
  const uint64_t max_bytes_;
  const double lock_timeout_;
  const std::string host_;
  Stats& stats_;

  struct FileId {
    dev_t dev;
    ino_t ino;
    off_t size;
    time_t sec;
    long nsec;
    bool operator==(const FileId& o) const {
      return dev == o.dev && ino == o.ino && size == o.size && sec == o.sec && nsec == o.nsec;
    }
  };

  std::mutex mutex_;  // guards the four below
  std::set<std::string> warned_entries_;
  std::map<std::string, FileId> faulted_;  // the last bad file seen per key
  bool warned_write_ = false;
  std::set<std::string> rejected_;
};

}  // namespace

std::unique_ptr<DiskCache> open_file_cache(const std::string& dir, bool writable,
                                           uint64_t max_bytes, Stats& stats) {
  try {
    if (dir.empty()) {
      logger().info(
          "no cache directory (MOEJIT_CACHE_DIR and HOME unset, XDG_CACHE_HOME unset or not "
          "absolute): "
          "kernels are compiled and kept in memory only");
      return nullptr;
    }
    auto refuse = [&](const std::string& why) -> std::unique_ptr<DiskCache> {
      stats.disk_errors.fetch_add(1, std::memory_order_relaxed);
      logger().warn(
          "not using the disk cache at \"{}\": {}; kernels are compiled and kept in "
          "memory only",
          dir, why);
      return nullptr;
    };
    std::string why;
    bool missing = false;
    Fd top = open_cache_root(dir, writable, &why, &missing);
    if (!top) return refuse(why);
    Fd root = open_dir(top.get(), version_dir_name(), writable, &why, &missing);
    if (!root) return refuse(why);
    if (writable && faccessat(root.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
      stats.disk_errors.fetch_add(1, std::memory_order_relaxed);
      logger().warn(
          "the disk cache at \"{}\" is not writable ({}): serving the kernels it holds, "
          "keeping new ones in memory",
          dir, error_text());
      writable = false;
    }
    return std::make_unique<FileCache>(dir, std::move(root), writable, max_bytes, stats);
  } catch (...) {
    return nullptr;
  }
}

std::string cache_entry_path(const std::string& dir, const std::string& key) {
  return dir + "/" + version_dir_name() + "/" + key.substr(0, 2) + "/" + key + kEntrySuffix;
}

namespace {

// For the tools: an existing cache directory and its v1, both under the runtime's checks;
// nothing is created. root is empty on failure, with why; missing tells a plain absence.
struct ExistingCache {
  Fd top;
  Fd root;
  std::string why;
  bool missing = false;
};
ExistingCache open_existing_cache(const std::string& dir) {
  ExistingCache c;
  c.top = open_cache_root(dir, false, &c.why, &c.missing);
  if (c.top) c.root = open_dir(c.top.get(), version_dir_name(), false, &c.why, &c.missing);
  return c;
}

}  // namespace

CacheVerifyReport verify_cache_dir(const std::string& dir, bool repair) {
  CacheVerifyReport report;
  try {
    const std::string root_path = dir + "/" + version_dir_name();
    // The cache directory and v1 pass the runtime's checks (no symlink, owned by this user or
    // root, not writable by group or others) or nothing is examined: a cache the runtime refuses
    // is not called valid, and repair never deletes through a symlink. An absent one is empty.
    const ExistingCache cache = open_existing_cache(dir);
    if (!cache.root) {
      if (!cache.missing) report.error = cache.why;
      return report;
    }
    const Fd& root = cache.root;
    std::string refused;
    for (const std::string& shard_name : list_dir(root.get())) {
      if (!is_shard_name(shard_name)) continue;
      // The runtime's checks here too: the runtime loads nothing from a shard that is a symlink
      // or writable by group or others (and cannot replace what is there), so its entries are
      // not valid. The shard is reported, never repaired: that is a permission or a link to fix
      // by hand, and nothing is deleted through it.
      bool shard_missing = false;
      Fd shard = open_dir(root.get(), shard_name, false, &refused, &shard_missing);
      if (!shard) {
        if (!shard_missing) report.invalid_paths.push_back(root_path + "/" + shard_name);
        continue;
      }
      for (const std::string& name : list_dir(shard.get())) {
        if (!ends_with(name, kEntrySuffix)) continue;
        ++report.entries;
        const std::string key = name.substr(0, name.size() - std::strlen(kEntrySuffix));
        std::string why;
        struct stat st {};
        // The owner is not checked: the tool may run as another user than the cache's; the
        // runtime checks it.
        const bool valid =
            is_cache_key(key) && key.compare(0, 2, shard_name) == 0 &&
            read_entry(shard.get(), key, false, false, nullptr, &why, &st) == ReadResult::kOk;
        if (valid) {
          ++report.valid;
          report.bytes += static_cast<uint64_t>(st.st_size);  // the file that was validated
          continue;
        }
        report.invalid_paths.push_back(root_path + "/" + shard_name + "/" + name);
        if (repair && unlinkat(shard.get(), name.c_str(), 0) == 0) ++report.removed;
      }
    }
  } catch (...) {
  }
  return report;
}

namespace {

// Adds bits to the mode of the file open at fd unless it has them. fchmod needs this user to own
// it (or root); a failure says why.
bool add_mode_bits(int fd, mode_t bits, std::string* why) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = error_text();
    return false;
  }
  if ((st.st_mode & bits) == bits) return true;
  if (fchmod(fd, (st.st_mode & 07777) | bits) != 0) {
    *why = "cannot change its mode: " + error_text();
    return false;
  }
  return true;
}

}  // namespace

CacheReadableReport make_cache_readable_by_all(const std::string& dir) {
  CacheReadableReport report;
  try {
    const std::string root_path = dir + "/" + version_dir_name();
    const ExistingCache cache = open_existing_cache(dir);
    if (!cache.root) {
      report.error =
          cache.missing ? "\"" + dir + "\" holds no cache (" + cache.why + ")" : cache.why;
      return report;
    }
    const Fd &top = cache.top, &root = cache.root;
    std::string refused;
    auto widen = [&](int fd, mode_t bits, const std::string& path, size_t* count) {
      std::string why;
      if (add_mode_bits(fd, bits, &why))
        ++*count;
      else
        report.failed.push_back(path + ": " + why);
    };
    widen(top.get(), 0055, dir, &report.directories);
    widen(root.get(), 0055, root_path, &report.directories);
    for (const std::string& shard_name : list_dir(root.get())) {
      if (!is_shard_name(shard_name)) continue;
      const std::string shard_path = root_path + "/" + shard_name;
      Fd shard = open_dir(root.get(), shard_name, false, &refused);
      if (!shard) {
        report.failed.push_back(shard_path + ": " + refused);
        continue;
      }
      widen(shard.get(), 0055, shard_path, &report.directories);
      for (const std::string& name : list_dir(shard.get())) {
        if (!ends_with(name, kEntrySuffix) ||
            !is_cache_key(name.substr(0, name.size() - std::strlen(kEntrySuffix))))
          continue;
        const std::string path = shard_path + "/" + name;
        // As read_entry opens it: a symlink is not followed, a FIFO does not block. Neither is an
        // entry the runtime would load (--verify reports them): left as they are.
        Fd entry(openat(shard.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
        struct stat st {};
        if (!entry && errno == ELOOP) continue;
        if (!entry || fstat(entry.get(), &st) != 0)
          report.failed.push_back(path + ": " + error_text());
        else if (S_ISREG(st.st_mode))
          widen(entry.get(), 0044, path, &report.entries);
      }
    }
    // A reader also needs to search every directory on the way there: reported, not changed
    // (those are not the cache's).
    std::string above = std::filesystem::absolute(dir).lexically_normal().string();
    while (above.size() > 1 && above.back() == '/') above.pop_back();
    for (size_t slash = above.rfind('/'); slash != std::string::npos && slash > 0;
         slash = above.rfind('/')) {
      above.resize(slash);
      struct stat st {};
      if (stat(above.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & S_IXOTH) == 0)
        report.blocked.push_back(above + " (mode " + mode_text(st.st_mode) + ")");
    }
  } catch (...) {
  }
  return report;
}

}  // namespace moejit
