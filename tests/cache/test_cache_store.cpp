// The disk cache under the kernel store, with real (host-only) NVRTC compiles: every damaged
// entry is a counted, warned miss followed by a good entry; modes; directory faults and the
// security checks fall back to memory with one warning and never a wrong hit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_admin.h"
#include "cache_entry.h"
#include "cache_files.h"
#include "cache_key.h"
#include "cache_test_util.h"
#include "entry_samples.h"
#include "error.h"
#include "file_cache.h"
#include "kernel_store.h"

namespace moejit {
namespace {

using Source = KernelStore::Source;
namespace fs = std::filesystem;

class CacheStore : public ::testing::Test {
 protected:
  void SetUp() override {
    warnings_ = &test::WarningCounter::install();
    warnings_->reset();
    dir_ = scratch_ / "cache";
  }
  // Obtains spec i through a fresh store (a fresh process, as far as the cache can tell).
  Source obtain(int i, Stats* stats, moejit_cache_mode mode = MOEJIT_CACHE_MODE_READ_WRITE) {
    KernelStore store(test::cache_settings(dir_, mode), *stats);
    Source source;
    auto module = store.obtain(test::small_spec(i), test::test_target(), &source);
    EXPECT_FALSE(module->image.empty());
    return source;
  }
  std::string key_of(int i) {
    Stats s;
    KernelStore store(test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED), s);
    return cache_key(store.request_for(test::small_spec(i), test::test_target()));
  }
  std::string entry_of(int i) { return cache_entry_path(dir_, key_of(i)); }

  test::ScratchDir scratch_;
  std::string dir_;
  test::WarningCounter* warnings_ = nullptr;
};

TEST_F(CacheStore, ColdCompilesWarmLoads) {
  Stats cold, warm;
  EXPECT_EQ(obtain(0, &cold), Source::kCompiled);
  EXPECT_EQ(cold.compiles.load(), 1u);
  EXPECT_EQ(obtain(0, &warm), Source::kDisk);
  EXPECT_EQ(warm.compiles.load(), 0u);
  EXPECT_EQ(warm.disk_hits.load(), 1u);
  EXPECT_EQ(cold.disk_errors.load() + warm.disk_errors.load(), 0u);
  EXPECT_EQ(warnings_->warnings(), 0);

  // Layout and permissions: <dir>/v2/<ab>/<key>.moejit, directories 0700, entry 0600.
  const std::string entry = entry_of(0);
  EXPECT_TRUE(fs::is_regular_file(entry)) << entry;
  struct stat st {};
  ASSERT_EQ(stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat(fs::path(entry).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat(entry.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(test::files_under(dir_).size(), 1u) << "no temp or lock file left behind";

  const CacheVerifyReport report = verify_cache_dir(dir_, false);
  EXPECT_EQ(report.entries, 1u);
  EXPECT_EQ(report.valid, 1u);
  EXPECT_EQ(report.bytes, fs::file_size(entry));
}

// Each damaged entry: a miss that counts a disk error and warns once, a compile that replaces
// the entry, and then a good hit.
TEST_F(CacheStore, DamagedEntriesAreMissesThenReplaced) {
  Stats first;
  ASSERT_EQ(obtain(0, &first), Source::kCompiled);
  const std::string path = entry_of(0);
  const std::string good = test::read_file(path);
  ASSERT_GT(good.size(), kCacheEntryHeaderBytes);
  auto reseal = [](std::string b) {
    test::reseal(&b);
    return b;
  };
  CompiledModule module;
  std::string why;
  ASSERT_TRUE(parse_cache_entry(good, key_of(0), &module, &why)) << why;

  std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"truncated to 1", good.substr(0, 1)},
      {"truncated to 40", good.substr(0, 40)},
      {"truncated to header", good.substr(0, kCacheEntryHeaderBytes)},
      {"truncated to half", good.substr(0, good.size() / 2)},
      {"truncated by one", good.substr(0, good.size() - 1)},
      {"garbage", std::string(good.size(), '\xa5')},
      {"wrong key", encode_cache_entry(key_of(1), module)},
      {"future format version", encode_cache_entry(key_of(0), module, kCacheFormatVersion + 1)},
  };
  std::string flipped = good;
  flipped[20] = static_cast<char>(flipped[20] ^ 1);
  cases.emplace_back("flipped header byte", flipped);
  flipped = good;
  flipped[good.size() - 100] = static_cast<char>(flipped[good.size() - 100] ^ 1);
  cases.emplace_back("flipped payload byte", flipped);
  std::string huge = good;
  for (int i = 0; i < 8; ++i) huge[48 + static_cast<size_t>(i)] = i == 7 ? '\x3f' : '\xff';
  cases.emplace_back("huge length field", reseal(huge));
  CompiledModule other_nvrtc = module;
  other_nvrtc.nvrtc_version = "9.9";
  cases.emplace_back("built by another NVRTC", encode_cache_entry(key_of(0), other_nvrtc));

  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    test::write_file(path, bytes);
    warnings_->reset();
    Stats miss, hit;
    EXPECT_EQ(obtain(0, &miss), Source::kCompiled);
    EXPECT_EQ(miss.compiles.load(), 1u);
    EXPECT_GE(miss.disk_errors.load(), 1u);
    EXPECT_EQ(warnings_->warnings(), 1) << "one warning per damaged entry";
    EXPECT_NE(warnings_->last().find(path), std::string::npos) << warnings_->last();
    EXPECT_EQ(obtain(0, &hit), Source::kDisk) << "the damaged entry was replaced";
    EXPECT_EQ(hit.disk_errors.load(), 0u);
    EXPECT_EQ(test::read_file(path), good) << "the same build gives the same bytes";
  }
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);
}

TEST_F(CacheStore, VerifyReportsAndRepairs) {
  Stats s;
  obtain(0, &s);
  obtain(1, &s);
  obtain(2, &s);
  const std::string bad = entry_of(1);
  test::write_file(bad, test::read_file(bad).substr(0, 100));
  // A valid entry under another key's name is invalid too (key echo vs file name).
  const std::string misnamed =
      cache_entry_path(dir_, key_of(1).substr(0, 2) + std::string(30, 'f'));
  fs::copy_file(entry_of(0), misnamed);
  CacheVerifyReport report = verify_cache_dir(dir_, false);
  EXPECT_EQ(report.entries, 4u);
  EXPECT_EQ(report.valid, 2u);
  EXPECT_EQ(report.invalid.size(), 2u);
  EXPECT_EQ(report.removed, 0u);
  EXPECT_TRUE(report.error.empty()) << report.error;
  // The bytes are those of the valid entries only.
  EXPECT_EQ(report.bytes, fs::file_size(entry_of(0)) + fs::file_size(entry_of(2)));
  report = verify_cache_dir(dir_, true);
  EXPECT_EQ(report.removed, 2u);
  EXPECT_FALSE(fs::exists(bad));
  report = verify_cache_dir(dir_, false);
  EXPECT_EQ(report.entries, 2u);
  EXPECT_EQ(report.valid, 2u);
  EXPECT_EQ(verify_cache_dir(scratch_ / "nothing-here", false).entries, 0u);
  EXPECT_TRUE(verify_cache_dir(scratch_ / "nothing-here", false).error.empty());
}

// The runtime looks for an entry only in the shard directory its key names (<ab>/<key>.moejit): a
// valid entry copied into another shard is never served, so verify calls it invalid (and repair
// removes it).
TEST_F(CacheStore, VerifyCallsAnEntryInAnotherShardInvalid) {
  Stats s;
  obtain(0, &s);
  const std::string key = key_of(0);
  const std::string other_shard = key[0] == '0' ? "1f" : "0f";
  const fs::path shard = fs::path(dir_) / ("v" + std::to_string(kCacheFormatVersion)) / other_shard;
  ASSERT_TRUE(fs::create_directory(shard));
  ASSERT_EQ(chmod(shard.c_str(), 0700), 0);
  const fs::path stray = shard / (key + ".moejit");
  fs::copy_file(entry_of(0), stray);
  CacheVerifyReport report = verify_cache_dir(dir_, false);
  EXPECT_EQ(report.entries, 2u);
  EXPECT_EQ(report.valid, 1u);
  ASSERT_EQ(report.invalid.size(), 1u);
  EXPECT_EQ(fs::path(report.invalid[0].path), stray);
  report = verify_cache_dir(dir_, true);
  EXPECT_EQ(report.removed, 1u);
  EXPECT_FALSE(fs::exists(stray));
  EXPECT_TRUE(fs::exists(entry_of(0)));
}

// verify applies the runtime's directory checks to the cache directory and v1: a directory the
// runtime refuses is reported, and repair never deletes anything through a symlink.
TEST_F(CacheStore, VerifyRefusesUnsafeDirectoriesAndNeverFollowsSymlinks) {
  Stats s;
  obtain(0, &s);
  // Junk outside the cache, laid out as a version directory.
  const std::string elsewhere = scratch_ / "elsewhere";
  const std::string junk = elsewhere + "/ab/ab" + std::string(30, '0') + ".moejit";
  fs::create_directories(elsewhere + "/ab");
  test::write_file(junk, "junk, not an entry");
  auto expect_refused = [&](const std::string& dir, const std::string& reason) {
    for (bool repair : {false, true}) {
      const CacheVerifyReport r = verify_cache_dir(dir, repair);
      EXPECT_NE(r.error.find(reason), std::string::npos) << dir << ": " << r.error;
      EXPECT_EQ(r.entries, 0u) << dir;
      EXPECT_EQ(r.valid, 0u) << dir;
      EXPECT_EQ(r.removed, 0u) << dir;
      EXPECT_TRUE(r.invalid.empty()) << dir;
    }
    EXPECT_TRUE(fs::exists(junk));
    EXPECT_TRUE(fs::exists(entry_of(0)));
  };

  // <dir>/v2 a symlink to the junk.
  const std::string linked_v1 = scratch_ / "linked-v1";
  fs::create_directory(linked_v1);
  chmod(linked_v1.c_str(), 0700);
  fs::create_directory_symlink(elsewhere, linked_v1 + "/" + version_dir_name());
  expect_refused(linked_v1, "symbolic link");
  expect_refused(linked_v1 + "/", "symbolic link");

  // The cache directory itself a symlink (to a good cache), with or without a trailing slash.
  const std::string linked_dir = scratch_ / "linked-dir";
  fs::create_directory_symlink(dir_, linked_dir);
  expect_refused(linked_dir, "symbolic link");
  expect_refused(linked_dir + "/", "symbolic link");

  // Writable by group or others: the cache directory, then v1.
  const std::string v1 = fs::path(entry_of(0)).parent_path().parent_path().string();
  for (const std::string& d : {dir_, v1}) {
    ASSERT_EQ(chmod(d.c_str(), 0770), 0);
    expect_refused(dir_, "writable by group or others");
    ASSERT_EQ(chmod(d.c_str(), 0700), 0);
  }
  const CacheVerifyReport good = verify_cache_dir(dir_, true);
  EXPECT_TRUE(good.error.empty()) << good.error;
  EXPECT_EQ(good.valid, 1u);
}

// A shard directory the runtime refuses (writable by group or others, or a symlink) hides its
// entries from every load: verify must not call them valid (a cache it passes could still miss
// everything there in no-compile mode), and repair deletes nothing in it or through it.
TEST_F(CacheStore, VerifyReportsShardDirectoriesTheRuntimeRefuses) {
  Stats s;
  obtain(0, &s);
  const std::string entry = entry_of(0);
  const std::string shard = fs::path(entry).parent_path().string();
  auto expect_refused = [&](const std::string& entry_now) {
    for (bool repair : {false, true}) {
      const CacheVerifyReport r = verify_cache_dir(dir_, repair);
      EXPECT_TRUE(r.error.empty()) << r.error;
      EXPECT_EQ(r.valid, 0u);
      EXPECT_EQ(r.bytes, 0u);
      EXPECT_EQ(r.removed, 0u);
      ASSERT_EQ(r.invalid.size(), 1u);
      EXPECT_EQ(r.invalid[0].path, shard);
      EXPECT_TRUE(fs::exists(entry_now));
    }
    Stats miss;
    EXPECT_EQ(obtain(0, &miss), Source::kCompiled) << "the runtime refuses it as well";
  };

  ASSERT_EQ(chmod(shard.c_str(), 0770), 0);
  expect_refused(entry);
  ASSERT_EQ(chmod(shard.c_str(), 0700), 0);
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);

  const std::string moved = scratch_ / "shard";
  fs::rename(shard, moved);
  fs::create_directory_symlink(moved, shard);
  expect_refused(moved + "/" + fs::path(entry).filename().string());
}

TEST_F(CacheStore, ReadOnlyModeServesHitsAndWritesNothing) {
  Stats s;
  // Missing directory: not created.
  EXPECT_EQ(obtain(0, &s, MOEJIT_CACHE_MODE_READ_ONLY), Source::kCompiled);
  EXPECT_FALSE(fs::exists(dir_));
  obtain(0, &s);  // warm one entry read-write
  const auto before = test::files_under(dir_);
  Stats ro;
  EXPECT_EQ(obtain(0, &ro, MOEJIT_CACHE_MODE_READ_ONLY), Source::kDisk);
  EXPECT_EQ(obtain(1, &ro, MOEJIT_CACHE_MODE_READ_ONLY), Source::kCompiled);
  EXPECT_EQ(test::files_under(dir_), before) << "read-only wrote something";
  EXPECT_EQ(ro.disk_errors.load(), 0u);
}

TEST_F(CacheStore, NoCompileModeServesHitsAndRefusesMisses) {
  Stats s;
  {
    // Like read-only, it never creates or writes anything: a missing directory stays missing.
    KernelStore missing(test::cache_settings(dir_, MOEJIT_CACHE_MODE_NO_COMPILE), s);
    EXPECT_FALSE(missing.has_disk_cache());
    EXPECT_FALSE(fs::exists(dir_));
  }
  obtain(0, &s);
  Stats nc;
  EXPECT_EQ(obtain(0, &nc, MOEJIT_CACHE_MODE_NO_COMPILE), Source::kDisk);
  KernelStore store(test::cache_settings(dir_, MOEJIT_CACHE_MODE_NO_COMPILE), nc);
  try {
    store.obtain(test::small_spec(1), test::test_target());
    FAIL() << "a miss in no-compile mode must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_NOT_CACHED);
    // A deployment that did warm its cache, with another release or toolkit, misses every key:
    // the message names the spec (a manifest line) and the versions an entry must be built with.
    const std::string message = e.what();
    EXPECT_NE(message.find(test::small_spec(1).describe()), std::string::npos) << message;
    EXPECT_NE(message.find(std::string("moejit-precompile (that spec works as a --manifest line) "
                                       "of libmoejit ") +
                           moejit_version_string() + " running with NVRTC " + nvrtc_version()),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(nc.compiles.load(), 0u);
  EXPECT_FALSE(fs::exists(entry_of(1)));
  // A hit does not refresh the entry's last use either (a read-write hit does, after a minute).
  struct timespec old[2];
  clock_gettime(CLOCK_REALTIME, &old[0]);
  old[0].tv_sec -= 3600;
  old[0].tv_nsec = 0;
  old[1] = old[0];
  ASSERT_EQ(utimensat(AT_FDCWD, entry_of(0).c_str(), old, 0), 0);
  Stats again;
  EXPECT_EQ(obtain(0, &again, MOEJIT_CACHE_MODE_NO_COMPILE), Source::kDisk);
  struct stat st {};
  ASSERT_EQ(stat(entry_of(0).c_str(), &st), 0);
  EXPECT_EQ(st.st_mtim.tv_sec, old[0].tv_sec) << "a no-compile hit wrote the entry's mtime";
}

TEST_F(CacheStore, DisabledModeTouchesNoDisk) {
  Stats s;
  KernelStore store(test::cache_settings(dir_, MOEJIT_CACHE_MODE_DISABLED), s);
  EXPECT_FALSE(store.has_disk_cache());
  store.obtain(test::small_spec(0), test::test_target());
  EXPECT_FALSE(fs::exists(dir_));
  EXPECT_EQ(warnings_->warnings(), 0);
}

TEST_F(CacheStore, CreatesTheDirectoryAndOneMissingParent) {
  dir_ = scratch_ / "dot-cache/moejit";  // like ~/.cache/moejit on a fresh home
  Stats s;
  EXPECT_EQ(obtain(0, &s), Source::kCompiled);
  EXPECT_TRUE(fs::is_regular_file(entry_of(0)));
  EXPECT_EQ(warnings_->warnings(), 0);
  // Both created 0700, the parent too (docs/cache.md: a fresh ~/.cache is not opened to others).
  struct stat st {};
  ASSERT_EQ(stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat(fs::path(dir_).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// Falls back to memory with exactly one warning and one counted disk error, compiles fine, and
// writes nothing.
void expect_memory_fallback(const std::string& dir, test::WarningCounter* warnings,
                            const char* reason_part) {
  warnings->reset();
  Stats s;
  KernelStore store(test::cache_settings(dir), s);
  EXPECT_FALSE(store.has_disk_cache());
  KernelStore::Source source;
  EXPECT_NO_THROW(store.obtain(test::small_spec(0), test::test_target(), &source));
  EXPECT_EQ(source, KernelStore::Source::kCompiled);
  EXPECT_EQ(warnings->warnings(), 1);
  EXPECT_NE(warnings->last().find(reason_part), std::string::npos) << warnings->last();
  EXPECT_EQ(s.disk_errors.load(), 1u);
}

TEST_F(CacheStore, MissingParentsFallBackToMemory) {
  dir_ = scratch_ / "no/such/parents/moejit";
  expect_memory_fallback(dir_, warnings_, "No such file");
  EXPECT_FALSE(fs::exists(scratch_ / "no"));
}

TEST_F(CacheStore, PathThatIsAFileFallsBackToMemory) {
  test::write_file(dir_, "not a directory");
  expect_memory_fallback(dir_, warnings_, "not a directory");
  EXPECT_EQ(test::read_file(dir_), "not a directory");
}

TEST_F(CacheStore, VersionDirThatIsAFileFallsBackToMemory) {
  fs::create_directory(dir_);
  chmod(dir_.c_str(), 0700);
  test::write_file(dir_ + "/" + version_dir_name(), "");
  expect_memory_fallback(dir_, warnings_, "not a directory");
}

TEST_F(CacheStore, WorldOrGroupWritableDirectoryIsRefused) {
  Stats s;
  obtain(0, &s);
  for (mode_t mode : {0777, 0770, 0702}) {
    chmod(dir_.c_str(), mode);
    expect_memory_fallback(dir_, warnings_, "writable by group or others");
  }
  chmod(dir_.c_str(), 0700);
  chmod((dir_ + "/" + version_dir_name()).c_str(), 0777);
  expect_memory_fallback(dir_, warnings_, "writable by group or others");
}

TEST_F(CacheStore, ForeignOwnedDirectoryIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another uid";
  Stats s;
  obtain(0, &s);
  ASSERT_EQ(chown(dir_.c_str(), 65534, 65534), 0);
  expect_memory_fallback(dir_, warnings_, "owned by uid 65534");
}

TEST_F(CacheStore, SymlinkedCacheDirectoryIsRefused) {
  const std::string real = scratch_ / "real";
  dir_ = real;
  Stats s;
  obtain(0, &s);
  const std::string link = scratch_ / "link";
  fs::create_directory_symlink(real, link);
  expect_memory_fallback(link, warnings_, "symbolic link");
  expect_memory_fallback(link + "/", warnings_, "symbolic link");
}

TEST_F(CacheStore, SymlinkedEntryIsNotFollowed) {
  Stats s;
  obtain(0, &s);
  const std::string entry = entry_of(0);
  // A valid entry for the very key, reached through a symlink: still refused.
  const std::string elsewhere = scratch_ / "planted.moejit";
  fs::rename(entry, elsewhere);
  fs::create_symlink(elsewhere, entry);
  const std::string planted = test::read_file(elsewhere);
  Stats miss;
  EXPECT_EQ(obtain(0, &miss), Source::kCompiled);
  EXPECT_EQ(miss.disk_errors.load(), 1u);
  EXPECT_EQ(warnings_->warnings(), 1);
  EXPECT_NE(warnings_->last().find("symbolic link"), std::string::npos) << warnings_->last();
  EXPECT_FALSE(fs::is_symlink(entry)) << "the link was replaced, not written through";
  EXPECT_EQ(test::read_file(elsewhere), planted);
  Stats hit;
  EXPECT_EQ(obtain(0, &hit), Source::kDisk);
}

TEST_F(CacheStore, SymlinkedShardDirectoryIsRefused) {
  Stats s;
  obtain(0, &s);
  const fs::path shard = fs::path(entry_of(0)).parent_path();
  const std::string moved = scratch_ / "shard";
  fs::rename(shard, moved);
  fs::create_directory_symlink(moved, shard);
  Stats miss;
  EXPECT_EQ(obtain(0, &miss), Source::kCompiled);
  EXPECT_GE(miss.disk_errors.load(), 1u);
  EXPECT_GE(warnings_->warnings(), 1);
}

TEST_F(CacheStore, EntryWritableByOthersOrForeignOwnedIsRefused) {
  Stats s;
  obtain(0, &s);
  const std::string entry = entry_of(0);
  chmod(entry.c_str(), 0666);
  Stats miss;
  EXPECT_EQ(obtain(0, &miss), Source::kCompiled);
  EXPECT_EQ(miss.disk_errors.load(), 1u);
  Stats hit;
  EXPECT_EQ(obtain(0, &hit), Source::kDisk) << "replaced by a private entry";
  if (geteuid() == 0) {
    ASSERT_EQ(chown(entry.c_str(), 65534, 65534), 0);
    Stats foreign;
    EXPECT_EQ(obtain(0, &foreign), Source::kCompiled);
    EXPECT_EQ(foreign.disk_errors.load(), 1u);
  }
}

TEST_F(CacheStore, InvalidateDropsAnEntry) {
  Stats s;
  obtain(0, &s);
  auto cache = open_disk_cache(test::cache_settings(dir_), s);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->load(key_of(0)).has_value());
  cache->invalidate(key_of(0));
  EXPECT_FALSE(cache->load(key_of(0)).has_value());
  EXPECT_FALSE(fs::exists(entry_of(0)));
  // Read-only: the file stays, this cache stops serving it.
  obtain(0, &s);
  auto ro = open_disk_cache(test::cache_settings(dir_, MOEJIT_CACHE_MODE_READ_ONLY), s);
  ASSERT_NE(ro, nullptr);
  ro->invalidate(key_of(0));
  EXPECT_FALSE(ro->load(key_of(0)).has_value());
  EXPECT_TRUE(fs::exists(entry_of(0)));
  EXPECT_EQ(ro->lock(key_of(0)), nullptr) << "read-only caches hand out no build lock";
}

// Every byte NVRTC reads must be in the key. NVRTC searches the working directory for a quoted
// include that is not one of the named headers; such a file would change the binary without
// changing the key (an edit to it served the old cubin). It must be a compile error instead.
TEST_F(CacheStore, AnIncludeOutsideTheTemplatesIsNotReadFromTheWorkingDirectory) {
  const std::string templates = scratch_ / "templates", work = scratch_ / "work";
  fs::create_directories(templates);
  fs::create_directories(work);
  for (const auto& [name, bytes] : load_templates("", "template_dir"))
    test::write_file(templates + "/" + name, name == "combine_params.h"
                                                 ? "#include \"moejit_probe.inc\"\n" + bytes
                                                 : bytes);
  test::write_file(work + "/moejit_probe.inc", "#define MOEJIT_PROBE 1\n");

  Settings settings = test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED);
  settings.template_dir = templates;
  Stats s;
  KernelStore store(settings, s);
  const fs::path cwd = fs::current_path();
  fs::current_path(work);
  try {
    store.obtain(test::small_spec(0), test::test_target());
    ADD_FAILURE() << "moejit_probe.inc was read from the working directory";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_COMPILE);
    EXPECT_NE(std::string(e.what()).find("moejit_probe.inc"), std::string::npos) << e.what();
  }
  fs::current_path(cwd);
}

// A template the override directory names but that cannot be read is reported as such, by name
// (it was skipped and then called missing). A directory stands in for an unreadable file: the
// tests may run as root, who reads any file.
TEST_F(CacheStore, AnUnreadableTemplateIsNamed) {
  const std::string templates = scratch_ / "templates";
  fs::create_directories(templates);
  for (const auto& [name, bytes] : load_templates("", "template_dir"))
    if (name != "combine.cuh") test::write_file(templates + "/" + name, bytes);
  fs::create_directories(templates + "/combine.cuh");
  try {
    load_templates(templates, "MOEJIT_TEMPLATE_DIR");
    ADD_FAILURE() << "a directory named combine.cuh was taken as a template";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("combine.cuh could not be read"), std::string::npos)
        << e.what();
  }
  // An empty file is read, as empty: an extra header may have nothing in it yet.
  fs::remove(templates + "/combine.cuh");
  test::write_file(templates + "/combine.cuh", load_templates("", "template_dir")["combine.cuh"]);
  test::write_file(templates + "/extra.h", "");
  const TemplateSet set = load_templates(templates, "MOEJIT_TEMPLATE_DIR");
  ASSERT_EQ(set.count("extra.h"), 1u);
  EXPECT_EQ(set.at("extra.h"), "");
}

// The default directory: $XDG_CACHE_HOME/moejit only for an absolute XDG_CACHE_HOME (the XDG
// spec calls a relative one invalid); a relative one must not put the cache under the working
// directory.
TEST_F(CacheStore, ARelativeXdgCacheHomeIsIgnored) {
  // Put back afterwards: the other tests of this binary may run in this process.
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* name : {"MOEJIT_CACHE_DIR", "HOME", "XDG_CACHE_HOME"}) {
    const char* v = std::getenv(name);
    saved.emplace_back(name, v != nullptr ? std::optional<std::string>(v) : std::nullopt);
  }
  ::unsetenv("MOEJIT_CACHE_DIR");
  ::setenv("HOME", "/home/moejit-test", 1);
  ::setenv("XDG_CACHE_HOME", "/var/cache/moejit-test", 1);
  EXPECT_EQ(resolve_settings(nullptr).cache_dir, "/var/cache/moejit-test/moejit");
  ::setenv("XDG_CACHE_HOME", "relative/cache", 1);
  EXPECT_EQ(resolve_settings(nullptr).cache_dir, "/home/moejit-test/.cache/moejit");
  for (const auto& [name, value] : saved) {
    if (value)
      ::setenv(name.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
}

// moejit_runtime_options: a field left at zero / NULL takes the environment's value, an empty
// string as well (as an empty variable counts as unset); a field that is set wins.
TEST_F(CacheStore, OptionsFallBackToTheEnvironmentOnlyWhereUnset) {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* name : {"MOEJIT_CACHE_DIR", "MOEJIT_CACHE_MAX_BYTES"}) {
    const char* v = std::getenv(name);
    saved.emplace_back(name, v != nullptr ? std::optional<std::string>(v) : std::nullopt);
  }
  ::setenv("MOEJIT_CACHE_DIR", "/var/cache/moejit-from-env", 1);
  ::setenv("MOEJIT_CACHE_MAX_BYTES", "12345", 1);
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_dir = "";
  Settings s = resolve_settings(&o);
  EXPECT_EQ(s.cache_dir, "/var/cache/moejit-from-env");
  EXPECT_EQ(s.cache_max_bytes, 12345u);
  o.cache_dir = "/var/cache/moejit-from-options";
  o.cache_max_bytes = 678;
  s = resolve_settings(&o);
  EXPECT_EQ(s.cache_dir, "/var/cache/moejit-from-options");
  EXPECT_EQ(s.cache_max_bytes, 678u);
  for (const auto& [name, value] : saved) {
    if (value)
      ::setenv(name.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
}

// With a cache key, only entries authenticated under it are served: one written without a key,
// with another key, or forged (another cubin, both checksums recomputed, as anyone who can write
// the cache can) is a miss with a warning naming the entry, rebuilt and replaced by an
// authenticated one; in no-compile mode it is MOEJIT_ERROR_NOT_CACHED. Without a key, an
// authenticated entry serves as any other.
TEST_F(CacheStore, WithACacheKeyOnlyAuthenticatedEntriesAreServed) {
  const auto key = test::sample_mac_key('k');
  auto with_key = [&](const std::shared_ptr<const MacKey>& k,
                      moejit_cache_mode mode = MOEJIT_CACHE_MODE_READ_WRITE) {
    Settings settings = test::cache_settings(dir_, mode);
    settings.cache_mac_key = k;
    return settings;
  };
  auto obtain_with = [&](const Settings& settings, Stats* stats) {
    KernelStore store(settings, *stats);
    Source source;
    store.obtain(test::small_spec(0), test::test_target(), &source);
    return source;
  };
  const std::string path = entry_of(0);
  std::string why;
  auto expect_rebuilt = [&](const char* reason) {
    SCOPED_TRACE(reason);
    warnings_->reset();
    Stats miss, hit;
    EXPECT_EQ(obtain_with(with_key(key), &miss), Source::kCompiled);
    EXPECT_EQ(miss.disk_errors.load(), 1u);
    EXPECT_EQ(warnings_->warnings(), 1);
    EXPECT_NE(warnings_->last().find(path), std::string::npos) << warnings_->last();
    EXPECT_NE(warnings_->last().find(reason), std::string::npos) << warnings_->last();
    EXPECT_TRUE(parse_cache_entry(test::read_file(path), key_of(0), nullptr, &why, key.get()))
        << "replaced by an authenticated entry: " << why;
    EXPECT_EQ(obtain_with(with_key(key), &hit), Source::kDisk);
  };

  Stats plain;
  ASSERT_EQ(obtain(0, &plain), Source::kCompiled);  // written without a key
  expect_rebuilt("carries no MAC");
  const std::string authenticated = test::read_file(path);

  Stats other;
  test::write_file(path, "");
  ASSERT_EQ(obtain_with(with_key(test::sample_mac_key('o')), &other), Source::kCompiled);
  expect_rebuilt("its MAC does not match the cache key in test-key");

  std::string forged = authenticated;
  const size_t image = forged.find(
      "\x7f"
      "ELF");
  ASSERT_NE(image, std::string::npos);
  forged[image + 64] = static_cast<char>(forged[image + 64] ^ 1);
  test::reseal(&forged);
  test::write_file(path, forged);
  Stats unkeyed;
  EXPECT_EQ(obtain(0, &unkeyed), Source::kDisk) << "without a key the checksums cannot tell";
  expect_rebuilt("its MAC does not match");

  // No-compile mode: an entry it may not trust is not cached, as far as it is concerned.
  test::write_file(path, forged);
  Stats nc;
  KernelStore store(with_key(key, MOEJIT_CACHE_MODE_NO_COMPILE), nc);
  try {
    store.obtain(test::small_spec(0), test::test_target());
    ADD_FAILURE() << "a forged entry was served in no-compile mode";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), MOEJIT_ERROR_NOT_CACHED) << e.what();
  }
  EXPECT_EQ(nc.compiles.load(), 0u);
  EXPECT_EQ(test::read_file(path), forged) << "no-compile mode writes nothing";

  // verify checks the MAC when given the key, and only then.
  test::write_file(path, authenticated);
  EXPECT_EQ(verify_cache_dir(dir_, false, key.get()).valid, 1u);
  EXPECT_EQ(verify_cache_dir(dir_, false, test::sample_mac_key('o').get()).valid, 0u);
  test::write_file(path, forged);
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);
  const CacheVerifyReport r = verify_cache_dir(dir_, false, key.get());
  ASSERT_EQ(r.invalid.size(), 1u);
  EXPECT_NE(r.invalid[0].why.find("MAC does not match"), std::string::npos) << r.invalid[0].why;
}

// --verify runs as a tool, often as another user than the runtime that serves the cache: it judges
// the entries as the runtime running as this user would, owner included. An entry another user
// owns is refused by the runtime, so it is not valid (root may own entries: it can write anywhere
// anyway).
TEST_F(CacheStore, VerifyCallsAnotherUsersEntryInvalid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an entry to another uid";
  Stats s;
  obtain(0, &s);
  ASSERT_EQ(chown(entry_of(0).c_str(), 65534, 65534), 0);
  const CacheVerifyReport r = verify_cache_dir(dir_, false);
  EXPECT_EQ(r.valid, 0u);
  ASSERT_EQ(r.invalid.size(), 1u);
  EXPECT_NE(r.invalid[0].why.find("is owned by uid 65534"), std::string::npos) << r.invalid[0].why;
  Stats miss;
  EXPECT_EQ(obtain(0, &miss), Source::kCompiled) << "the runtime refuses it too";
}

// Only the cache directory, its version directory and its shards must not be symlinks: a symlink
// in a directory above the cache (a home on another volume, /home -> /data/home) is followed, as
// every program follows it, and docs/cache.md says so.
TEST_F(CacheStore, ASymlinkAboveTheCacheDirectoryIsFollowed) {
  const std::string real = scratch_ / "volume";
  fs::create_directories(real);
  const std::string link = scratch_ / "home";
  fs::create_directory_symlink(real, link);
  dir_ = link + "/cache";
  Stats cold, warm;
  EXPECT_EQ(obtain(0, &cold), Source::kCompiled);
  EXPECT_EQ(obtain(0, &warm), Source::kDisk);
  EXPECT_EQ(cold.disk_errors.load() + warm.disk_errors.load(), 0u);
  EXPECT_TRUE(fs::exists(real + "/cache/" + version_dir_name()));
}

TEST_F(CacheStore, NonKeysNeverBecomePaths) {
  Stats s;
  auto cache = open_disk_cache(test::cache_settings(dir_), s);
  ASSERT_NE(cache, nullptr);
  EXPECT_FALSE(cache->load("../../etc/passwd").has_value());
  cache->store("../escape", CompiledModule{});
  EXPECT_FALSE(fs::exists(dir_ + "/escape.moejit"));
  EXPECT_EQ(cache->lock("zz"), nullptr);
}

}  // namespace
}  // namespace moejit
