#include "cache_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_entry.h"
#include "cache_key.h"

namespace moejit {

const char kEntrySuffix[] = ".moejit";
const char kLockSuffix[] = ".lock";
const char kTempSuffix[] = ".tmp";

namespace {

// A hit refreshes the entry's mtime (its last use, for eviction) at most this often.
constexpr double kTouchIntervalSeconds = 60;

// The user's cache directory. Creates it, and at most its parent (the ~/.cache case), when
// create is set: a typo deep in a path should not conjure a tree of directories. Symlinks in the
// path above it are followed, as every program follows them (docs/cache.md).
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

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

double seconds_since(const struct timespec& t) {
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - t.tv_sec) +
         static_cast<double>(now.tv_nsec - t.tv_nsec) * 1e-9;
}

std::string version_dir_name() {
  return "v" + std::to_string(kCacheFormatVersion);
}

std::string cache_entry_path(const std::string& dir, const std::string& key) {
  return dir + "/" + version_dir_name() + "/" + key.substr(0, 2) + "/" + key + kEntrySuffix;
}

std::string mode_text(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

std::string error_text(int err) {
  return std::strerror(err);
}

std::string untrusted_reason(const struct stat& st) {
  const uid_t me = geteuid();
  if (st.st_uid != me && st.st_uid != 0)
    return "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(me) + ")";
  if ((st.st_mode & 022) != 0)
    return "is writable by group or others (mode " + mode_text(st.st_mode) + ")";
  return std::string();
}

Fd open_dir(int at, const std::string& name, bool create, std::string* why, bool* missing) {
  if (missing != nullptr) *missing = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    Fd fd(openat(at, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (fd) {
      struct stat st {};
      if (fstat(fd.get(), &st) != 0) {
        *why = "\"" + name + "\" cannot be examined: " + error_text(errno);
        return Fd();
      }
      const std::string bad = untrusted_reason(st);
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
      *why = "\"" + name + "\" cannot be opened: " + error_text(err);
      return Fd();
    }
    if (mkdirat(at, name.c_str(), 0700) != 0 && errno != EEXIST) {
      *why = "\"" + name + "\" cannot be created: " + error_text(errno);
      return Fd();
    }
  }
  return Fd();
}

OpenedCache open_cache(const std::string& dir, bool create) {
  OpenedCache c;
  c.top = open_cache_root(dir, create, &c.why, &c.missing);
  if (c.top) c.root = open_dir(c.top.get(), version_dir_name(), create, &c.why, &c.missing);
  return c;
}

// A fresh open file description of the directory: readdir on a dup'd fd would share its offset
// with other threads listing the same directory.
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

std::string entry_key_of(const std::string& file_name) {
  if (!ends_with(file_name, kEntrySuffix)) return std::string();
  std::string key = file_name.substr(0, file_name.size() - std::strlen(kEntrySuffix));
  return is_cache_key(key) ? key : std::string();
}

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

EntryCheck check_entry_in_shard(int shard_fd, const std::string& key, const EntryRules& rules,
                                CompiledModule* module, std::string* why, struct stat* seen) {
  const std::string name = key + kEntrySuffix;
  struct stat ignored {};
  if (seen == nullptr) seen = &ignored;
  *seen = {};
  // O_NOFOLLOW: a symlink planted at the entry's name is refused even if it points at a valid
  // entry. O_NONBLOCK: a FIFO planted there must not hang the open.
  Fd fd(openat(shard_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd) {
    const int err = errno;
    if (err == ENOENT) return EntryCheck::kMissing;
    *why = err == ELOOP ? std::string("is a symbolic link (not followed)") : error_text(err);
    fstatat(shard_fd, name.c_str(), seen, AT_SYMLINK_NOFOLLOW);
    return EntryCheck::kInvalid;
  }
  struct stat& st = *seen;
  if (fstat(fd.get(), &st) != 0) {
    *why = error_text(errno);
    return EntryCheck::kInvalid;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = "is not a regular file";
    return EntryCheck::kInvalid;
  }
  *why = untrusted_reason(st);
  if (!why->empty()) return EntryCheck::kInvalid;
  if (static_cast<uint64_t>(st.st_size) > kCacheEntryMaxBytes + kCacheEntryHeaderBytes) {
    *why = "is implausibly large (" + std::to_string(st.st_size) + " bytes)";
    return EntryCheck::kInvalid;
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = read(fd.get(), &data[got], data.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = "read failed: " + error_text(errno);
      return EntryCheck::kInvalid;
    }
    if (n == 0) break;  // shrank under us: the length check rejects it
    got += static_cast<size_t>(n);
  }
  data.resize(got);
  CompiledModule parsed;
  if (!parse_cache_entry(data, key, &parsed, why, rules.mac_key)) return EntryCheck::kInvalid;
  if (!rules.nvrtc_version.empty() && parsed.nvrtc_version != rules.nvrtc_version) {
    *why = "it was built by NVRTC " + parsed.nvrtc_version;
    return EntryCheck::kInvalid;
  }
  if (rules.touch && seconds_since(st.st_mtim) > kTouchIntervalSeconds)
    futimens(fd.get(), nullptr);  // last use, for eviction; best effort
  if (module != nullptr) *module = std::move(parsed);
  return EntryCheck::kOk;
}

EntryCheck check_entry(int root_fd, const std::string& key, const EntryRules& rules,
                       CompiledModule* module, std::string* why, struct stat* seen) {
  if (seen != nullptr) *seen = {};
  if (!is_cache_key(key)) {
    *why = "is not named by a cache key";
    return EntryCheck::kInvalid;
  }
  bool missing = false;
  Fd shard = open_dir(root_fd, key.substr(0, 2), false, why, &missing);
  if (!shard) {
    if (missing) return EntryCheck::kMissing;
    *why = "its directory " + *why;
    return EntryCheck::kInvalid;
  }
  return check_entry_in_shard(shard.get(), key, rules, module, why, seen);
}

}  // namespace moejit
