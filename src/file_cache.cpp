#include "file_cache.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "cache_admin.h"
#include "cache_entry.h"
#include "cache_files.h"
#include "key_lock.h"
#include "logging.h"

namespace moejit {

namespace test_hooks {
std::atomic<void (*)()> before_rename{nullptr};
}  // namespace test_hooks

namespace {

// An entry younger than this is never evicted: it may have just replaced an older one, and its
// writer may still be about to use it.
constexpr double kMinEvictAgeSeconds = 10;
// A process rescans the cache at most this long after its last scan (other processes write too),
// and sooner only when its own count passes the cap.
constexpr double kRescanSeconds = 60;
// Eviction brings the cache down to this share of its cap, so that the next writes do not each
// pass the cap and rescan.
constexpr double kEvictToShareOfCap = 0.9;
// A write that found the disk full frees at least this share of the cache (and at least the
// entry's own size) before it is tried again.
constexpr double kFreeShareWhenFull = 0.1;

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Too recent to evict: it may have just replaced an older entry that a process is about to load.
// A last use further in the future than that (a clock set wrong, another host's on a network file
// system) does not count as recent: such an entry would never be evicted, and the cap not hold.
bool young(const struct timespec& mtime) {
  const double age = seconds_since(mtime);
  return age < kMinEvictAgeSeconds && age > -kMinEvictAgeSeconds;
}

bool out_of_space(int err) {
  return err == ENOSPC || err == EDQUOT;
}

// Why writing `bytes` bytes into a new file would pass this process's file size limit ("" if it
// would not). Past the limit the kernel sends SIGXFSZ, whose default action kills the process.
std::string file_size_limit_exceeded(size_t bytes) {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY ||
      static_cast<uint64_t>(bytes) <= static_cast<uint64_t>(limit.rlim_cur))
    return std::string();
  return "the entry (" + std::to_string(bytes) +
         " bytes) is larger than this process's file size limit (RLIMIT_FSIZE, " +
         std::to_string(limit.rlim_cur) + " bytes)";
}

// Blocks SIGXFSZ on this thread while it writes: should the file size limit drop below the entry
// between the check and the write, the write fails with EFBIG instead of the process dying. The
// signal that write raised is then taken off this thread's pending set before it is unblocked.
class NoSigxfsz {
 public:
  NoSigxfsz() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGXFSZ);
    blocked_ = pthread_sigmask(SIG_BLOCK, &set_, &old_) == 0;
  }
  ~NoSigxfsz() {
    if (!blocked_) return;
    sigset_t pending;
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGXFSZ) == 1) {
      const struct timespec none {};
      sigtimedwait(&set_, nullptr, &none);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoSigxfsz(const NoSigxfsz&) = delete;
  NoSigxfsz& operator=(const NoSigxfsz&) = delete;

 private:
  sigset_t set_, old_;
  bool blocked_ = false;
};

// Writes all of data; the errno of the failure, or 0.
int write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

class FileCache final : public DiskCache {
 public:
  FileCache(const Settings& settings, OpenedCache cache, bool writable, Stats& stats)
      : dir_(settings.cache_dir),
        root_(std::move(cache.root)),
        writable_(writable),
        max_bytes_(settings.cache_max_bytes),
        lock_timeout_(settings.cache_lock_timeout_seconds),
        mac_key_(settings.cache_mac_key),
        host_(host_tag()),
        stats_(stats) {
    rules_.mac_key = mac_key_.get();
    rules_.nvrtc_version = nvrtc_version();
    rules_.touch = writable_;
  }

  std::optional<CompiledModule> load(const std::string& key) override {
    try {
      if (!is_cache_key(key)) return std::nullopt;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        if (rejected_.count(key) != 0) return std::nullopt;
      }
      CompiledModule module;
      std::string why;
      struct stat seen {};
      switch (check_entry(root_.get(), key, rules_, &module, &why, &seen)) {
        case EntryCheck::kMissing:
          return std::nullopt;
        case EntryCheck::kInvalid:
          entry_fault(key, why, &seen);
          return std::nullopt;
        case EntryCheck::kOk:
          return module;
      }
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
      const std::string bytes = encode_cache_entry(key, module, -1, mac_key_.get());
      std::string why = file_size_limit_exceeded(bytes.size());
      if (!why.empty()) return write_fault(why);
      Fd shard = open_dir(root_.get(), key.substr(0, 2), true, &why);
      if (!shard) return write_fault("directory " + why);
      int err = publish(shard.get(), key, bytes, &why);
      if (out_of_space(err) && make_room(bytes.size(), key) > 0)
        err = publish(shard.get(), key, bytes, &why);
      if (err != 0) return write_fault(why);
      {
        std::lock_guard<std::mutex> guard(mutex_);
        rejected_.erase(key);
      }
      keep_under_cap(key, bytes.size());
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
  // The errno of the step that failed (with *why), or 0.
  int publish(int shard_fd, const std::string& key, const std::string& bytes, std::string* why) {
    static std::atomic<unsigned long long> counter{0};
    const std::string temp = "." + key + "." + std::to_string(getpid()) + "." + host_ + "." +
                             std::to_string(counter.fetch_add(1)) + kTempSuffix;
    Fd fd(
        openat(shard_fd, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) {
      const int err = errno;
      *why = "cannot create " + temp + ": " + error_text(err);
      return err;
    }
    const char* step = nullptr;
    int err = 0;
    {
      NoSigxfsz no_sigxfsz;
      if ((err = write_all(fd.get(), bytes)) != 0)
        step = "write";
      else if (fsync(fd.get()) != 0)
        step = "fsync", err = errno;
      else if (close(fd.release()) != 0)
        step = "close", err = errno;
    }
    if (step == nullptr) {
      if (void (*hook)() = test_hooks::before_rename.load()) hook();
      if (renameat(shard_fd, temp.c_str(), shard_fd, (key + kEntrySuffix).c_str()) != 0)
        step = "rename", err = errno;
    }
    if (step != nullptr) {
      *why = std::string(step) + " of " + temp + " failed: " + error_text(err);
      unlinkat(shard_fd, temp.c_str(), 0);
      return err;
    }
    fsync(shard_fd);  // durability of the rename; the entry is complete either way
    return 0;
  }

  // After a publish of `bytes` bytes under just_written: rescans (sweeping what dead writers left)
  // when this process's count passes the cap, or its last scan is a minute old, or it never
  // scanned; then evicts down to 90% of the cap if the cache is over it.
  void keep_under_cap(const std::string& just_written, size_t bytes) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      counted_bytes_ += bytes;
      const bool due = last_scan_ < 0 || counted_bytes_ > max_bytes_ ||
                       monotonic_seconds() - last_scan_ > kRescanSeconds;
      if (!due || scanning_) return;
      scanning_ = true;
    }
    uint64_t total = 0;
    try {
      CacheScan scan = scan_cache(root_.get(), host_);
      total = scan.bytes;
      if (total > max_bytes_) {
        const uint64_t target =
            static_cast<uint64_t>(static_cast<double>(max_bytes_) * kEvictToShareOfCap);
        const Evicted e = evict(&scan.entries, just_written, total - std::min(total, target));
        total -= std::min(total, e.bytes);
        if (e.count > 0)
          logger().info(
              "disk cache {}: evicted {} least recently used entries ({} bytes) to stay under {} "
              "bytes",
              dir_, e.count, e.bytes, max_bytes_);
      }
    } catch (...) {
    }
    std::lock_guard<std::mutex> guard(mutex_);
    counted_bytes_ = total;
    last_scan_ = monotonic_seconds();
    scanning_ = false;
  }

  // A write of `needed` bytes for key found the disk full: evicts least recently used entries
  // until at least max(needed, 10% of the cache) is free. Returns the bytes freed.
  uint64_t make_room(size_t needed, const std::string& key) {
    try {
      CacheScan scan = scan_cache(root_.get(), host_);
      const uint64_t goal = std::max<uint64_t>(
          needed, static_cast<uint64_t>(static_cast<double>(scan.bytes) * kFreeShareWhenFull));
      const Evicted e = evict(&scan.entries, key, goal);
      if (e.count > 0)
        logger().info(
            "disk cache {}: the disk is full; evicted {} least recently used entries ({} bytes) "
            "to make room",
            dir_, e.count, e.bytes);
      std::lock_guard<std::mutex> guard(mutex_);
      counted_bytes_ = scan.bytes - std::min(scan.bytes, e.bytes);
      last_scan_ = monotonic_seconds();
      return e.bytes;
    } catch (...) {
      return 0;
    }
  }

  struct Evicted {
    size_t count = 0;
    uint64_t bytes = 0;
  };

  // Deletes the least recently used of entries until `goal` bytes are freed, never the entry of
  // `keep`, a young one, or one whose build lock someone holds (it is being built or replaced).
  Evicted evict(std::vector<ScannedEntry>* entries, const std::string& keep, uint64_t goal) {
    std::sort(entries->begin(), entries->end(), [](const ScannedEntry& a, const ScannedEntry& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec
                                              : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    Evicted done;
    for (const ScannedEntry& e : *entries) {
      if (done.bytes >= goal) break;
      if (e.key == keep || young(e.mtime)) continue;
      std::string why;
      Fd shard = open_dir(root_.get(), e.shard, false, &why);
      if (!shard) continue;
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
        done.bytes += e.bytes;
        ++done.count;
      }
    }
    return done;
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
  const Fd root_;  // <dir>/v2, opened once: later path swaps cannot redirect us
  const bool writable_;
  const uint64_t max_bytes_;
  const double lock_timeout_;
  const std::shared_ptr<const MacKey> mac_key_;
  const std::string host_;
  EntryRules rules_;  // set once in the constructor
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

  std::mutex mutex_;  // guards everything below
  std::set<std::string> warned_entries_;
  std::map<std::string, FileId> faulted_;  // the last bad file seen per key
  bool warned_write_ = false;
  std::set<std::string> rejected_;
  uint64_t counted_bytes_ = 0;  // the cache's bytes at the last scan, plus those written since
  double last_scan_ = -1;       // monotonic seconds; -1: never scanned
  bool scanning_ = false;       // one scan at a time per cache
};

std::unique_ptr<DiskCache> open_file_cache(const Settings& settings, bool writable, Stats& stats) {
  const std::string& dir = settings.cache_dir;
  if (dir.empty()) {
    logger().info(
        "no cache directory (MOEJIT_CACHE_DIR and HOME unset, XDG_CACHE_HOME unset or not "
        "absolute): kernels are compiled and kept in memory only");
    return nullptr;
  }
  auto refuse = [&](const std::string& why) -> std::unique_ptr<DiskCache> {
    stats.disk_errors.fetch_add(1, std::memory_order_relaxed);
    logger().warn(
        "not using the disk cache at \"{}\": {}; kernels are compiled and kept in memory only", dir,
        why);
    return nullptr;
  };
  OpenedCache cache = open_cache(dir, writable);
  if (!cache.root) return refuse(cache.why);
  if (writable && faccessat(cache.root.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
    // Kept before anything else runs: the logger's first use checks whether stderr is a
    // terminal, which leaves ENOTTY in errno.
    const int err = errno;
    stats.disk_errors.fetch_add(1, std::memory_order_relaxed);
    logger().warn(
        "the disk cache at \"{}\" is not writable ({}): serving the kernels it holds, keeping new "
        "ones in memory",
        dir, error_text(err));
    writable = false;
  }
  return std::make_unique<FileCache>(settings, std::move(cache), writable, stats);
}

}  // namespace

std::unique_ptr<DiskCache> open_disk_cache(const Settings& settings, Stats& stats) {
  try {
    switch (settings.cache_mode) {
      case MOEJIT_CACHE_MODE_DISABLED:
        return nullptr;
      // no-compile serves hits only, like read-only: it must never create or write anything.
      case MOEJIT_CACHE_MODE_READ_ONLY:
      case MOEJIT_CACHE_MODE_NO_COMPILE:
        return open_file_cache(settings, false, stats);
      default:
        return open_file_cache(settings, true, stats);
    }
  } catch (...) {
    return nullptr;
  }
}

}  // namespace moejit
