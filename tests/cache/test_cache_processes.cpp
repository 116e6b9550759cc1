// The disk cache between processes (each a cache_worker with its own KernelStore): cold starts
// racing on the same keys, a writer killed between write and rename, a stuck lock holder, and the
// faults that need another uid or a file size limit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "cache_admin.h"
#include "cache_files.h"
#include "cache_key.h"
#include "cache_test_util.h"
#include "file_cache.h"
#include "kernel_store.h"
#include "key_lock.h"
#include "worker_process.h"

namespace moejit {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

class CacheProcesses : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = scratch_ / "cache"; }
  std::string key_of(int i) {
    Stats s;
    KernelStore none(test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED), s);
    return cache_key(none.request_for(test::small_spec(i), test::test_target()));
  }
  std::vector<std::string> args(std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"--dir", dir_};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  std::vector<std::string> temp_files() {
    std::vector<std::string> out;
    for (const std::string& f : test::files_under(dir_))
      if (f.size() > 4 && f.compare(f.size() - 4, 4, ".tmp") == 0) out.push_back(f);
    return out;
  }
  // Starts a writer that stops after writing its temp file, before the rename, and waits until
  // it got there.
  test::Worker start_paused_writer() {
    test::Worker w = test::start_worker(args(), {"MOEJIT_TEST_PAUSE_BEFORE_RENAME=1"});
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (temp_files().empty() && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return w;
  }

  test::ScratchDir scratch_;
  std::string dir_;
};

TEST_F(CacheProcesses, ManyProcessesAndThreadsColdStartOnTheSameKeys) {
  constexpr int kProcesses = 8, kThreads = 4, kKeys = 3;
  std::vector<test::Worker> workers;
  for (int p = 0; p < kProcesses; ++p)
    workers.push_back(test::start_worker(
        args({"--threads", std::to_string(kThreads), "--keys", std::to_string(kKeys)})));
  long long compiles = 0, disk_hits = 0;
  for (const test::Worker& w : workers) {
    const test::WorkerResult r = test::finish_worker(w);
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_EQ(r["failed"], 0);
    EXPECT_EQ(r["disk_errors"], 0);
    EXPECT_EQ(r["warnings"], 0);
    compiles += r["compiles"];
    disk_hits += r["disk_hits"];
  }
  const CacheVerifyReport report = verify_cache_dir(dir_, false);
  EXPECT_EQ(report.entries, static_cast<size_t>(kKeys));
  EXPECT_EQ(report.valid, static_cast<size_t>(kKeys));
  for (int k = 0; k < kKeys; ++k) EXPECT_TRUE(fs::exists(cache_entry_path(dir_, key_of(k))));
  EXPECT_TRUE(temp_files().empty());
  // Every process needs every key once (its threads share one store): each key is compiled by
  // one process and loaded from disk by the others, thanks to the per-key build lock.
  std::printf("[ info ] %d processes x %d threads, %d keys: %lld compiles, %lld disk hits\n",
              kProcesses, kThreads, kKeys, compiles, disk_hits);
  RecordProperty("compiles", static_cast<int>(compiles));
  EXPECT_EQ(compiles, kKeys);
  EXPECT_EQ(compiles + disk_hits, kProcesses * kKeys);
}

TEST_F(CacheProcesses, WriterKilledBeforeRenameLeavesNoEntryAndNoStuckLock) {
  test::Worker writer = start_paused_writer();
  ASSERT_FALSE(temp_files().empty()) << "the writer never reached the rename";
  kill(writer.pid, SIGKILL);
  const test::WorkerResult killed = test::finish_worker(writer);
  EXPECT_FALSE(killed.exited);

  const std::string entry = cache_entry_path(dir_, key_of(0));
  EXPECT_FALSE(fs::exists(entry)) << "only a rename publishes";
  EXPECT_EQ(verify_cache_dir(dir_, false).entries, 0u);

  // The kernel dropped the dead writer's flock: the next process neither waits for the lock
  // timeout (60 s by default) nor reads anything partial.
  const auto start = Clock::now();
  const test::WorkerResult next = test::run_worker(args());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(next.exit_code, 0);
  EXPECT_EQ(next["compiles"], 1);
  EXPECT_EQ(next["disk_errors"], 0);
  EXPECT_LT(seconds, 20.0);
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);
  EXPECT_TRUE(temp_files().empty()) << "the dead writer's temp file was swept";
}

TEST_F(CacheProcesses, StuckLockHolderDelaysOthersOnlyUntilTheTimeout) {
  test::Worker stuck = start_paused_writer();
  ASSERT_FALSE(temp_files().empty());
  const auto start = Clock::now();
  const test::WorkerResult other = test::run_worker(args(), {"MOEJIT_CACHE_LOCK_TIMEOUT=1"});
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(other.exit_code, 0);
  EXPECT_EQ(other["compiles"], 1);
  EXPECT_EQ(other["warnings"], 1) << "the timed-out wait is reported";
  EXPECT_GE(seconds, 1.0);
  EXPECT_LT(seconds, 20.0);
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);
  kill(stuck.pid, SIGKILL);
  test::finish_worker(stuck);
  EXPECT_EQ(verify_cache_dir(dir_, false).valid, 1u);
}

// A holder that forked (a Python worker pool started by fork, say) leaves its child a copy of the
// locked descriptor: after the holder releases the lock (unlinks the file, then closes it) that
// inode stays locked until the child closes its copy. A waiter already polling that file must
// notice that the name has moved on and lock the new file, not wait for the child or the timeout.
TEST_F(CacheProcesses, AForkedChildsCopyOfAReleasedLockHoldsNobody) {
  fs::create_directories(dir_);
  const int dir_fd = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(dir_fd, 0);
  bool timed_out = false;
  std::string why;
  std::unique_ptr<FileKeyLock> held = FileKeyLock::acquire(dir_fd, "k.lock", 0, &timed_out, &why);
  ASSERT_NE(held, nullptr) << why;
  const pid_t child = fork();  // before any thread of this test starts
  if (child == 0) {
    sleep(20);  // holds its copy of the locked descriptor
    _exit(0);
  }
  ASSERT_GT(child, 0);
  std::unique_ptr<FileKeyLock> got;
  double waited = 0;
  std::thread waiter([&] {
    const auto start = Clock::now();
    bool waiter_timed_out = false;
    std::string waiter_why;
    got = FileKeyLock::acquire(dir_fd, "k.lock", 60, &waiter_timed_out, &waiter_why);
    waited = std::chrono::duration<double>(Clock::now() - start).count();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the waiter polls the held file
  held.reset();
  waiter.join();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_NE(got, nullptr);
  EXPECT_LT(waited, 5.0) << "the waiter waited for the forked child's copy of the lock";
  got.reset();
  close(dir_fd);
}

// Makes the cache read-only for the worker: as root, whom permission bits do not stop, by handing
// it to an unprivileged uid that the worker then runs as (extra gets --uid).
void make_read_only(const std::string& dir, std::vector<std::string>* extra) {
  if (geteuid() == 0) {
    for (auto& e : fs::recursive_directory_iterator(dir))
      ASSERT_EQ(lchown(e.path().c_str(), 65534, 65534), 0);
    ASSERT_EQ(lchown(dir.c_str(), 65534, 65534), 0);
    extra->insert(extra->end(), {"--uid", "65534"});
  }
  for (auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_directory()) chmod(e.path().c_str(), 0500);
  chmod(dir.c_str(), 0500);
}

// The warning names the reason the directory is not writable (EACCES here), not the errno that
// the logger's own first use left behind (its terminal check's ENOTTY, "Inappropriate ioctl for
// device"). The worker leaves the logger to be created by that warning, as a host process would.
TEST_F(CacheProcesses, TheNotWritableWarningNamesItsOwnReason) {
  ASSERT_EQ(test::run_worker(args()).exit_code, 0);
  std::vector<std::string> extra = {"--count-warnings", "0"};
  make_read_only(dir_, &extra);
  const std::string log = scratch_ / "stderr.txt";
  const test::WorkerResult r = test::run_worker(args(extra), {}, log);
  EXPECT_EQ(r.exit_code, 0);
  const std::string said = test::read_file(log);
  EXPECT_NE(said.find("is not writable (Permission denied)"), std::string::npos) << said;
  EXPECT_EQ(said.find("Inappropriate ioctl"), std::string::npos) << said;
}

TEST_F(CacheProcesses, ReadOnlyDirectoryServesHitsAndWritesNothing) {
  ASSERT_EQ(test::run_worker(args()).exit_code, 0);  // warm key 0
  std::vector<std::string> extra = {"--keys", "2"};
  make_read_only(dir_, &extra);
  const auto before = test::files_under(dir_);
  const test::WorkerResult r = test::run_worker(args(extra));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r["has_disk_cache"], 1);
  EXPECT_EQ(r["disk_hits"], 1);
  EXPECT_EQ(r["compiles"], 1);
  EXPECT_EQ(r["warnings"], 1) << "one warning: not writable";
  EXPECT_EQ(test::files_under(dir_), before);
}

// A file size limit (RLIMIT_FSIZE) below an entry's size: a write past it raises SIGXFSZ, whose
// default action kills the process. The library must never be killed by its cache: the write is
// not attempted, the compile still serves, and nothing is left behind. (The worker keeps SIGXFSZ's
// default action, as a host process would.)
TEST_F(CacheProcesses, AFileSizeLimitFailsTheWriteNotTheProcess) {
  const test::WorkerResult r = test::run_worker(args({"--fsize", "1024", "--keys", "2"}));
  EXPECT_TRUE(r.exited) << "killed by a signal (SIGXFSZ)";
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r["compiles"], 2);
  EXPECT_GE(r["disk_errors"], 2);
  EXPECT_EQ(r["warnings"], 1) << "write failures warn once";
  EXPECT_TRUE(test::files_under(dir_).empty()) << "no partial entry, temp or lock file";
  const test::WorkerResult after = test::run_worker(args());
  EXPECT_EQ(after["compiles"], 1);
  EXPECT_EQ(after["disk_errors"], 0);
}

}  // namespace
}  // namespace moejit
