// Bounded growth: after a publish the least recently used entries go until the cache is under
// its cap, but never the entry just written, an entry young enough to be mid-replacement, or one
// whose key another process holds the build lock of.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <time.h>

#include "cache_admin.h"
#include "cache_files.h"
#include "cache_key.h"
#include "cache_test_util.h"
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

}  // namespace
}  // namespace moejit
