// A separate process for the multi-process cache tests: builds kernels through its own
// KernelStore pointed at a shared cache directory and prints what happened, one "name=value" per
// line. Options (all optional except --dir):
//   --dir D --mode read-write|read-only|no-compile --threads T --keys K --first F
//   --count-warnings 0|1 (1, the default: count the library's warnings, which creates its logger
//   first; 0: leave the logger to be created by the library's first message)
//   --uid U (drop to this uid/gid first) --fsize BYTES (RLIMIT_FSIZE; SIGXFSZ keeps its default
//   action, which kills the process) --max-bytes N
// MOEJIT_TEST_PAUSE_BEFORE_RENAME=1 in its environment: a writer stops forever with its temp file
// complete, before the rename (file_cache.h's test hook), so that a test can kill it there.
// Exit status 0 when every obtain succeeded.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cache_test_util.h"
#include "file_cache.h"
#include "kernel_store.h"

using namespace moejit;

int main(int argc, char** argv) {
  std::string dir, mode = "read-write";
  int threads = 1, keys = 1, first = 0, count_warnings = 1;
  long uid = -1, fsize = -1;
  unsigned long long max_bytes = 1ull << 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--dir")
      dir = v;
    else if (a == "--mode")
      mode = v;
    else if (a == "--threads")
      threads = std::atoi(v.c_str());
    else if (a == "--keys")
      keys = std::atoi(v.c_str());
    else if (a == "--count-warnings")
      count_warnings = std::atoi(v.c_str());
    else if (a == "--first")
      first = std::atoi(v.c_str());
    else if (a == "--uid")
      uid = std::atol(v.c_str());
    else if (a == "--fsize")
      fsize = std::atol(v.c_str());
    else if (a == "--max-bytes")
      max_bytes = std::strtoull(v.c_str(), nullptr, 10);
  }
  if (uid >= 0 && (setgid(static_cast<gid_t>(uid)) != 0 || setuid(static_cast<uid_t>(uid)) != 0)) {
    std::perror("setuid");
    return 3;
  }
  if (fsize >= 0) {
    struct rlimit lim {
      static_cast<rlim_t>(fsize), static_cast<rlim_t>(fsize)
    };
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  if (const char* pause_here = std::getenv("MOEJIT_TEST_PAUSE_BEFORE_RENAME"))
    if (*pause_here != '\0')
      test_hooks::before_rename = [] {
        for (;;) pause();
      };
  test::WarningCounter* warnings = count_warnings != 0 ? &test::WarningCounter::install() : nullptr;
  moejit_cache_mode m = MOEJIT_CACHE_MODE_READ_WRITE;
  if (mode == "read-only") m = MOEJIT_CACHE_MODE_READ_ONLY;
  if (mode == "no-compile") m = MOEJIT_CACHE_MODE_NO_COMPILE;

  Stats stats;
  KernelStore store(test::cache_settings(dir, m, max_bytes), stats);
  std::atomic<int> failed{0}, from_disk{0}, compiled{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int k = 0; k < keys; ++k) {
        const int i = first + (k + t) % keys;  // threads start on different keys
        try {
          KernelStore::Source source;
          store.obtain(test::small_spec(i), test::test_target(), &source);
          if (source == KernelStore::Source::kDisk) ++from_disk;
          if (source == KernelStore::Source::kCompiled) ++compiled;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "obtain failed: %s\n", e.what());
          ++failed;
        }
      }
    });
  for (auto& t : pool) t.join();
  std::printf(
      "has_disk_cache=%d\nfailed=%d\ncompiles=%llu\ndisk_hits=%llu\ndisk_errors=%llu\n"
      "warnings=%d\n",
      store.has_disk_cache() ? 1 : 0, failed.load(),
      static_cast<unsigned long long>(stats.compiles.load()),
      static_cast<unsigned long long>(stats.disk_hits.load()),
      static_cast<unsigned long long>(stats.disk_errors.load()),
      warnings != nullptr ? warnings->warnings() : -1);
  std::fflush(stdout);
  return failed.load() == 0 ? 0 : 1;
}
