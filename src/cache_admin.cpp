#include "cache_admin.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "cache_entry.h"
#include "key_lock.h"
#include "logging.h"

namespace moejit {
namespace {

// Temp and lock files of writers that died are swept after this long even when we cannot tell
// whether their writer is alive (another host or pid namespace sharing the directory).
constexpr double kStaleSeconds = 600;

// Removes name from shard if it is a leftover of a writer: true if it was one (removed or not).
bool sweep_leftover(int shard_fd, const std::string& shard_name, const std::string& name,
                    const struct stat& st, const std::string& host, size_t* swept) {
  const double age = seconds_since(st.st_mtim);
  TempName temp;
  if (parse_temp_name(name, &temp)) {
    const bool dead =
        temp.host == host && kill(static_cast<pid_t>(temp.pid), 0) != 0 && errno == ESRCH;
    if ((dead || age > kStaleSeconds) && unlinkat(shard_fd, name.c_str(), 0) == 0) {
      ++*swept;
      logger().debug("removed {}/{} left by a writer that died", shard_name, name);
    }
    return true;
  }
  if (ends_with(name, kLockSuffix) &&
      is_cache_key(name.substr(0, name.size() - std::strlen(kLockSuffix)))) {
    // A key's lock only (any other file is not ours). Only removable while nobody holds it;
    // acquiring and releasing it unlinks it.
    if (age > kStaleSeconds) {
      bool timed_out = false;
      std::string why;
      if (FileKeyLock::acquire(shard_fd, name, 0, &timed_out, &why) != nullptr) ++*swept;
    }
    return true;
  }
  return false;
}

InvalidEntry invalid(std::string path, std::string why) {
  InvalidEntry e;
  e.path = std::move(path);
  e.why = std::move(why);
  return e;
}

// Adds bits to the mode of the file open at fd unless it has them. fchmod needs this user to own
// it (or root); a failure says why.
bool add_mode_bits(int fd, mode_t bits, std::string* why) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = error_text(errno);
    return false;
  }
  if ((st.st_mode & bits) == bits) return true;
  if (fchmod(fd, (st.st_mode & 07777) | bits) != 0) {
    *why = "cannot change its mode: " + error_text(errno);
    return false;
  }
  return true;
}

}  // namespace

CacheScan scan_cache(int root_fd, const std::string& host) {
  CacheScan scan;
  try {
    for (const std::string& shard_name : list_dir(root_fd)) {
      if (!is_shard_name(shard_name)) continue;
      std::string why;
      Fd shard = open_dir(root_fd, shard_name, false, &why);
      if (!shard) continue;
      for (const std::string& name : list_dir(shard.get())) {
        struct stat st {};
        if (fstatat(shard.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        const std::string key = entry_key_of(name);
        if (!key.empty()) {
          if (!S_ISREG(st.st_mode)) continue;
          scan.entries.push_back(
              {shard_name, key, static_cast<uint64_t>(st.st_size), st.st_mtim, st.st_ino});
          scan.bytes += static_cast<uint64_t>(st.st_size);
          continue;
        }
        sweep_leftover(shard.get(), shard_name, name, st, host, &scan.swept);
      }
    }
  } catch (...) {
  }
  return scan;
}

CacheVerifyReport verify_cache_dir(const std::string& dir, bool repair, const MacKey* mac_key) {
  CacheVerifyReport report;
  try {
    const std::string root_path = dir + "/" + version_dir_name();
    // The cache directory and its version directory pass the runtime's checks (no symlink, owned
    // by this user or root, not writable by group or others) or nothing is examined: a cache the
    // runtime refuses is not called valid, and repair never deletes through a symlink.
    const OpenedCache cache = open_cache(dir, false);
    if (!cache.root) {
      report.missing = cache.missing;
      if (!cache.missing) report.error = cache.why;
      return report;
    }
    EntryRules rules;
    rules.mac_key = mac_key;
    for (const std::string& shard_name : list_dir(cache.root.get())) {
      if (!is_shard_name(shard_name)) continue;
      // The runtime loads nothing from a shard that is a symlink, another user's or writable by
      // group or others (and cannot replace what is there), so its entries are not valid. The
      // shard is reported, never repaired: that is a permission or a link to fix by hand, and
      // nothing is deleted through it.
      std::string refused;
      bool shard_missing = false;
      Fd shard = open_dir(cache.root.get(), shard_name, false, &refused, &shard_missing);
      if (!shard) {
        if (!shard_missing)
          report.invalid.push_back(
              invalid(root_path + "/" + shard_name, "the directory " + refused));
        continue;
      }
      for (const std::string& name : list_dir(shard.get())) {
        if (!ends_with(name, kEntrySuffix)) continue;
        ++report.entries;
        const std::string key = name.substr(0, name.size() - std::strlen(kEntrySuffix));
        std::string why;
        struct stat st {};
        EntryCheck check = EntryCheck::kInvalid;
        // Where the runtime would look for it: a valid entry in another shard is never served.
        if (!is_cache_key(key))
          why = "its name is not a cache key";
        else if (key.compare(0, 2, shard_name) != 0)
          why = "it is in shard " + shard_name + ", where the runtime never looks for its key";
        else
          check = check_entry_in_shard(shard.get(), key, rules, nullptr, &why, &st);
        if (check == EntryCheck::kMissing) {  // removed since the listing
          --report.entries;
          continue;
        }
        if (check == EntryCheck::kOk) {
          ++report.valid;
          report.bytes += static_cast<uint64_t>(st.st_size);  // the file that was validated
          continue;
        }
        InvalidEntry bad = invalid(root_path + "/" + shard_name + "/" + name, why);
        if (repair) {
          const int err = unlinkat(shard.get(), name.c_str(), 0) == 0 ? 0 : errno;
          if (err == 0 || err == ENOENT) {
            bad.removed = true;
            ++report.removed;
          } else {
            bad.not_removed = error_text(err);
          }
        }
        report.invalid.push_back(std::move(bad));
      }
    }
  } catch (...) {
  }
  return report;
}

ServableReport check_servable(const std::string& dir, const std::vector<std::string>& keys,
                              const EntryRules& rules) {
  ServableReport report;
  try {
    const OpenedCache cache = open_cache(dir, false);
    if (!cache.root) {
      report.error = cache.why;
      return report;
    }
    for (const std::string& key : keys) {
      std::string why;
      report.results.push_back(check_entry(cache.root.get(), key, rules, nullptr, &why));
      report.why.push_back(report.results.back() == EntryCheck::kInvalid ? why : std::string());
    }
  } catch (...) {
    report.error = "the cache could not be examined";
  }
  return report;
}

CacheReadableReport make_cache_readable_by_all(const std::string& dir) {
  CacheReadableReport report;
  try {
    const std::string root_path = dir + "/" + version_dir_name();
    const OpenedCache cache = open_cache(dir, false);
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
        if (entry_key_of(name).empty()) continue;
        const std::string path = shard_path + "/" + name;
        // As check_entry opens it: a symlink is not followed, a FIFO does not block. Neither is an
        // entry the runtime would load (--verify reports them): left as they are.
        Fd entry(openat(shard.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
        const int open_error = errno;
        struct stat st {};
        if (!entry && open_error == ELOOP) continue;
        if (!entry) {
          report.failed.push_back(path + ": " + error_text(open_error));
        } else if (fstat(entry.get(), &st) != 0) {
          const int stat_error = errno;
          report.failed.push_back(path + ": " + error_text(stat_error));
        } else if (S_ISREG(st.st_mode)) {
          widen(entry.get(), 0044, path, &report.entries);
        }
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
