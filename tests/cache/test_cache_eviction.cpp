// Bounded growth: after a publish the least recently used entries go until the cache is under
// its cap, but never the entry just written, an entry young enough to be mid-replacement, or one
// whose key another process holds the build lock of. A full disk evicts too. The scan behind it
// is not repeated at every write.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "cache_admin.h"
#include "cache_entry.h"
#include "cache_files.h"
#include "cache_key.h"
#include "cache_test_util.h"
#include "entry_samples.h"
#include "file_cache.h"
#include "kernel_store.h"

namespace moejit {
namespace {

namespace fs = std::filesystem;
using Source = KernelStore::Source;

class CacheEviction : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_ / "cache";
    Stats s;
    KernelStore none(test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED), s);
    for (int i = 0; i < 5; ++i)
      keys_.push_back(cache_key(none.request_for(test::small_spec(i), test::test_target())));
  }
  Source obtain(int i, uint64_t max_bytes) {
    Stats s;
    KernelStore store(test::cache_settings(dir_, MOEJIT_CACHE_MODE_READ_WRITE, max_bytes), s);
    Source source;
    store.obtain(test::small_spec(i), test::test_target(), &source);
    return source;
  }
  std::string path(int i) { return cache_entry_path(dir_, keys_[static_cast<size_t>(i)]); }
  // Pretends entry i was last used `age` seconds ago.
  void age(int i, long seconds) {
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= seconds;
    t[1] = t[0];
    ASSERT_EQ(utimensat(AT_FDCWD, path(i).c_str(), t, 0), 0);
  }
  uint64_t total() { return verify_cache_dir(dir_, false).bytes; }

  test::ScratchDir scratch_;
  std::string dir_;
  std::vector<std::string> keys_;
};

TEST_F(CacheEviction, KeepsTheCapByLastUse) {
  for (int i = 0; i < 5; ++i) ASSERT_EQ(obtain(i, 1ull << 30), Source::kCompiled);
  std::vector<uint64_t> size;
  for (int i = 0; i < 5; ++i) size.push_back(fs::file_size(path(i)));
  fs::remove(path(4));                                 // published again below, under a cap
  for (int i = 0; i < 4; ++i) age(i, 1000 - 100 * i);  // 0 oldest ... 3 newest
  // A hit is a use: entry 0 becomes the most recently used.
  ASSERT_EQ(obtain(0, 1ull << 30), Source::kDisk);
  struct stat st {};
  ASSERT_EQ(stat(path(0).c_str(), &st), 0);
  EXPECT_LT(time(nullptr) - st.st_mtime, 100) << "a hit refreshes the last use";
  for (int i = 1; i < 4; ++i) age(i, 1000 - 100 * i);

  // Room for 0, 3 and 4 but not one more: publishing 4 must evict exactly the two least
  // recently used, 1 and 2.
  const uint64_t cap = size[0] + size[3] + size[4] + std::min(size[1], size[2]) - 1;
  ASSERT_EQ(obtain(4, cap), Source::kCompiled);
  EXPECT_LE(total(), cap);
  EXPECT_TRUE(fs::exists(path(4))) << "the entry just written";
  EXPECT_TRUE(fs::exists(path(0))) << "recently used";
  EXPECT_TRUE(fs::exists(path(3)));
  EXPECT_FALSE(fs::exists(path(1)));
  EXPECT_FALSE(fs::exists(path(2)));
  EXPECT_EQ(verify_cache_dir(dir_, false).invalid.size(), 0u);
}

TEST_F(CacheEviction, NeverDeletesAnEntryBeingReplacedOrJustWritten) {
  for (int i = 0; i < 3; ++i) ASSERT_EQ(obtain(i, 1ull << 30), Source::kCompiled);
  age(0, 1000);
  age(1, 1000);
  age(2, 5);  // five seconds old: still under the minimum eviction age (10 s)
  // Entry 2 is young (as if it had just replaced an older one); entry 1 is being rebuilt by
  // "another process", which holds its build lock.
  Stats s;
  auto other = open_disk_cache(test::cache_settings(dir_), s);
  ASSERT_NE(other, nullptr);
  std::unique_ptr<KeyLock> held = other->lock(keys_[1]);
  ASSERT_NE(held, nullptr);

  ASSERT_EQ(obtain(3, 1), Source::kCompiled);  // a cap nothing fits under
  EXPECT_FALSE(fs::exists(path(0))) << "old and unlocked: evicted";
  EXPECT_TRUE(fs::exists(path(1))) << "locked by its builder";
  EXPECT_TRUE(fs::exists(path(2))) << "younger than the minimum eviction age";
  EXPECT_TRUE(fs::exists(path(3))) << "just written";

  held.reset();
  ASSERT_EQ(obtain(4, 1), Source::kCompiled);
  EXPECT_FALSE(fs::exists(path(1))) << "evictable once its lock is released";
}

// A last use far in the future (a wrong clock, another host's over a network file system) is not
// "too young to evict": such an entry would stay forever and the cap would not hold. One a few
// seconds ahead (clock skew) is still protected.
TEST_F(CacheEviction, AnEntryUsedInTheFutureIsStillEvicted) {
  for (int i = 0; i < 3; ++i) ASSERT_EQ(obtain(i, 1ull << 30), Source::kCompiled);
  age(0, -100000);  // a day ahead
  age(1, -2);       // two seconds ahead
  age(2, 1000);
  ASSERT_EQ(obtain(3, 1), Source::kCompiled);  // a cap nothing fits under
  EXPECT_FALSE(fs::exists(path(0))) << "a last use a day ahead: evicted";
  EXPECT_TRUE(fs::exists(path(1))) << "within the skew of the minimum eviction age";
  EXPECT_FALSE(fs::exists(path(2)));
  EXPECT_TRUE(fs::exists(path(3))) << "just written";
}

TEST_F(CacheEviction, SweepsTempFilesOfDeadWriters) {
  ASSERT_EQ(obtain(0, 1ull << 30), Source::kCompiled);
  const fs::path shard = fs::path(path(0)).parent_path();
  // A dead writer on another host: only its age tells; a live one (us) must be left alone.
  const std::string stale = (shard / ("." + keys_[0] + ".999999.deadbeef.0.tmp")).string();
  const std::string fresh = (shard / ("." + keys_[0] + ".999999.deadbeef.1.tmp")).string();
  const std::string stale_lock = (shard / (keys_[0] + ".lock")).string();
  test::write_file(stale, "partial");
  test::write_file(fresh, "partial");
  test::write_file(stale_lock, "");
  struct timespec old[2];
  clock_gettime(CLOCK_REALTIME, &old[0]);
  old[0].tv_sec -= 3600;
  old[1] = old[0];
  utimensat(AT_FDCWD, stale.c_str(), old, 0);
  utimensat(AT_FDCWD, stale_lock.c_str(), old, 0);
  ASSERT_EQ(obtain(1, 1ull << 30), Source::kCompiled);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(stale_lock));
  EXPECT_TRUE(fs::exists(fresh)) << "may belong to a live writer elsewhere";
}

// Nothing a user wrote is lost: the sweep and the eviction remove only files named as the cache
// names its own (entries, temp files and lock files of a cache key), however old and whatever the
// cap, never another file someone put in the cache directory, v1 or a shard directory.
TEST_F(CacheEviction, NeverDeletesFilesThatAreNotTheCaches) {
  ASSERT_EQ(obtain(0, 1ull << 30), Source::kCompiled);
  age(0, 1000);
  const std::string shard = fs::path(path(0)).parent_path().string();
  const std::string v1 = fs::path(shard).parent_path().string();
  const std::vector<std::string> user_files = {
      dir_ + "/notes.txt",
      v1 + "/notes.txt",
      shard + "/notes.txt",
      shard + "/build.lock",
      shard + "/notes.moejit",
      shard + "/.notes.1.x.0.tmp",
      shard + "/x" + keys_[0] + ".1.deadbeef.0.tmp",  // a temp file's name but for the dot
      shard + "/" + keys_[0] + ".moejit.bak",
  };
  struct timespec old[2];
  clock_gettime(CLOCK_REALTIME, &old[0]);
  old[0].tv_sec -= 3600;
  old[1] = old[0];
  for (const std::string& f : user_files) {
    test::write_file(f, "a user's file");
    ASSERT_EQ(utimensat(AT_FDCWD, f.c_str(), old, 0), 0) << f;
  }
  ASSERT_EQ(obtain(1, 1), Source::kCompiled);  // a cap nothing fits under: sweeps and evicts
  EXPECT_FALSE(fs::exists(path(0))) << "the old entry was evicted";
  for (const std::string& f : user_files) {
    EXPECT_TRUE(fs::exists(f)) << f << " was deleted";
    EXPECT_EQ(test::read_file(f), "a user's file") << f;
  }
}

// The scan that eviction works from lists every file of the cache; a process repeats it only when
// its count of the cache's bytes passes the cap, or a minute after its last one, not at every
// write. Shown by what the scan also does: a dead writer's temp file planted after a process's
// first write is still there after its second write, and swept by another process's first one.
TEST_F(CacheEviction, AWriteUnderTheCapDoesNotRescan) {
  CompiledModule m = test::sample_module();
  m.nvrtc_version = nvrtc_version();
  Stats s;
  auto cache = open_disk_cache(test::cache_settings(dir_), s);
  ASSERT_NE(cache, nullptr);
  cache->store(keys_[0], m);  // the first write of this process scans
  ASSERT_TRUE(fs::exists(path(0)));
  const fs::path shard = fs::path(path(0)).parent_path();
  const std::string stale = (shard / ("." + keys_[0] + ".999999.deadbeef.0.tmp")).string();
  test::write_file(stale, "partial");
  struct timespec old[2];
  clock_gettime(CLOCK_REALTIME, &old[0]);
  old[0].tv_sec -= 3600;
  old[1] = old[0];
  ASSERT_EQ(utimensat(AT_FDCWD, stale.c_str(), old, 0), 0);
  cache->store(keys_[1], m);
  EXPECT_TRUE(fs::exists(path(1)));
  EXPECT_TRUE(fs::exists(stale)) << "the second write scanned the whole cache again";
  auto other = open_disk_cache(test::cache_settings(dir_), s);
  other->store(keys_[2], m);
  EXPECT_FALSE(fs::exists(stale)) << "another process's first write sweeps it";
}

// The scan's cost at 10,000 entries (printed, not asserted: speed is for benchmarks), with the cost
// of a write that scans (a process's first) and of one that does not.
TEST_F(CacheEviction, ScanOfTenThousandEntries) {
  constexpr int kEntries = 10000;
  CompiledModule m = test::sample_module();
  m.nvrtc_version = nvrtc_version();
  const std::string root = dir_ + "/" + version_dir_name();
  fs::create_directories(root);
  for (const std::string& d : {dir_, root}) chmod(d.c_str(), 0700);
  uint64_t bytes = 0;
  for (int i = 0; i < kEntries; ++i) {
    char key[33];
    std::snprintf(key, sizeof(key), "%08x%024x", static_cast<unsigned>(i) * 2654435761u, i);
    const std::string shard = root + "/" + std::string(key, 2);
    if (!fs::exists(shard)) {
      fs::create_directory(shard);
      chmod(shard.c_str(), 0700);
    }
    const std::string entry = encode_cache_entry(key, m);
    test::write_file(shard + "/" + key + ".moejit", entry);
    bytes += entry.size();
  }
  const Fd root_fd(open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(root_fd);
  std::vector<double> ms;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    const CacheScan scan = scan_cache(root_fd.get(), host_tag());
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
    ASSERT_EQ(scan.entries.size(), static_cast<size_t>(kEntries));
    ASSERT_EQ(scan.bytes, bytes);
  }
  std::sort(ms.begin(), ms.end());
  Stats s;
  auto cache = open_disk_cache(test::cache_settings(dir_), s);
  auto timed_store = [&](int i) {
    const auto start = std::chrono::steady_clock::now();
    cache->store(keys_[static_cast<size_t>(i)], m);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  };
  const double scanning = timed_store(0), plain = timed_store(1);
  std::printf(
      "[ info ] scan of %d entries (%llu bytes): median %.1f ms (min %.1f, max %.1f of 5); a "
      "write that scans %.1f ms, one that does not %.2f ms\n",
      kEntries, static_cast<unsigned long long>(bytes), ms[2], ms[0], ms[4], scanning, plain);
  RecordProperty("scan_ms", std::to_string(ms[2]));
}

namespace {

// In a child process: mounts a small tmpfs (in a mount namespace of its own), fills it, and checks
// that a write that finds it full evicts least recently used entries and lands. Returns 0, 77
// (skip) or 1, with the reason on out.
int full_disk_case(const std::string& scratch, const std::vector<std::string>& keys, FILE* out) {
  if (unshare(CLONE_NEWNS) != 0) {
    std::fprintf(out,
                 "cannot make a mount namespace for a small tmpfs (unshare(CLONE_NEWNS): %s; "
                 "it needs root or CAP_SYS_ADMIN)",
                 std::strerror(errno));
    return 77;
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    std::fprintf(out, "cannot make the mounts private: %s", std::strerror(errno));
    return 77;
  }
  const std::string fsdir = scratch + "/small-fs";
  mkdir(fsdir.c_str(), 0700);
  if (mount("tmpfs", fsdir.c_str(), "tmpfs", 0, "size=128k,mode=0700") != 0) {
    std::fprintf(out, "cannot mount a tmpfs: %s", std::strerror(errno));
    return 77;
  }
  const std::string dir = fsdir + "/cache";
  auto obtain = [&](int i, Stats* s) {
    KernelStore store(test::cache_settings(dir), *s);
    KernelStore::Source source;
    store.obtain(test::small_spec(i), test::test_target(), &source);
    return source;
  };
  Stats warm;
  for (int i = 0; i < 3; ++i) obtain(i, &warm);
  for (int i = 0; i < 3; ++i) {
    const std::string entry = cache_entry_path(dir, keys[static_cast<size_t>(i)]);
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= 1000 - 100 * i;  // 0 least recently used
    t[1] = t[0];
    if (utimensat(AT_FDCWD, entry.c_str(), t, 0) != 0) {
      std::fprintf(out, "entry %d was not written before the disk filled: %s", i, entry.c_str());
      return 1;
    }
  }
  // Someone else's file takes the rest of the disk.
  {
    const int fd = open((fsdir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const std::string block(4096, 'x');
    while (write(fd, block.data(), block.size()) > 0) {
    }
    close(fd);
  }
  Stats full;
  obtain(3, &full);
  const std::string written = cache_entry_path(dir, keys[3]);
  const CacheVerifyReport r = verify_cache_dir(dir, false);
  if (!fs::exists(written) || r.valid != r.entries) {
    std::fprintf(out, "the write on a full disk did not land (%s %s; %zu of %zu entries valid)",
                 written.c_str(), fs::exists(written) ? "exists" : "is missing", r.valid,
                 r.entries);
    return 1;
  }
  if (fs::exists(cache_entry_path(dir, keys[0]))) {
    std::fprintf(out, "the least recently used entry was not the one evicted");
    return 1;
  }
  if (full.disk_errors.load() != 0) {
    std::fprintf(out, "%llu disk errors counted for a write that landed",
                 static_cast<unsigned long long>(full.disk_errors.load()));
    return 1;
  }
  std::fprintf(out, "%zu entries after the eviction", r.entries);
  return 0;
}

}  // namespace

// A write that fails for lack of space (a real full file system: a 128 KiB tmpfs, not a file size
// limit) evicts least recently used entries and is tried again, so that a cache that filled its
// disk does not stop taking entries for good. Needs a mount namespace (root or CAP_SYS_ADMIN);
// skipped with the reason where the test may not mount.
TEST_F(CacheEviction, AWriteOnAFullDiskEvictsAndLands) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[0]);
    FILE* out = fdopen(pipe_fds[1], "w");
    const int rc = full_disk_case(scratch_.path(), keys_, out);
    std::fclose(out);
    _exit(rc);
  }
  close(pipe_fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = read(pipe_fds[0], buf, sizeof(buf))) > 0;)
    said.append(buf, static_cast<size_t>(n));
  close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << said;
  EXPECT_EQ(WEXITSTATUS(status), 0) << said;
  std::printf("[ info ] %s\n", said.c_str());
}

}  // namespace
}  // namespace moejit
