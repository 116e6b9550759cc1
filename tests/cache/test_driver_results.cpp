// What a driver failure at module load does to the disk cache, through the public C API on a
// stand-in libcuda.so.1 (fake_cuda.c, found through LD_LIBRARY_PATH, set by CMake): a refused
// image makes its entry a miss (rebuilt once), any other failure (out of memory, a context an
// earlier fault broke) is the caller's error and leaves the entry alone. Host only: the kernels
// compile with NVRTC, the fake driver loads and "launches" them without running anything.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace {

namespace fs = std::filesystem;

constexpr int kOutOfMemory = 2;       // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kInvalidImage = 200;    // CUDA_ERROR_INVALID_IMAGE
constexpr int kIllegalAddress = 700;  // CUDA_ERROR_ILLEGAL_ADDRESS

// The fake driver's controls (fake_cuda.c).
struct FakeDriver {
  void (*fail_module_loads)(int result, int times) = nullptr;
  int (*module_load_calls)() = nullptr;
  int (*launches)() = nullptr;
  void (*refuse_stream_launches)(int mode) = nullptr;
  void (*replace_context)() = nullptr;
  int (*stale_unloads)() = nullptr;
};

FakeDriver fake_driver() {
  FakeDriver f;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return f;
  f.fail_module_loads =
      reinterpret_cast<void (*)(int, int)>(dlsym(h, "fake_cuda_fail_module_loads"));
  f.module_load_calls = reinterpret_cast<int (*)()>(dlsym(h, "fake_cuda_module_load_calls"));
  f.launches = reinterpret_cast<int (*)()>(dlsym(h, "fake_cuda_launches"));
  f.refuse_stream_launches =
      reinterpret_cast<void (*)(int)>(dlsym(h, "fake_cuda_refuse_stream_launches"));
  f.replace_context = reinterpret_cast<void (*)()>(dlsym(h, "fake_cuda_replace_context"));
  f.stale_unloads = reinterpret_cast<int (*)()>(dlsym(h, "fake_cuda_stale_unloads"));
  return f;
}

class ScratchDir {
 public:
  ScratchDir() {
    std::string base = (fs::temp_directory_path() / "moejit-driver-test-XXXXXX").string();
    path_ = mkdtemp(base.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The cache's entries (path and modification time), sorted.
std::vector<std::pair<std::string, fs::file_time_type>> entries(const std::string& dir) {
  std::vector<std::pair<std::string, fs::file_time_type>> found;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".moejit")
      found.emplace_back(e.path().string(), e.last_write_time());
  std::sort(found.begin(), found.end());
  return found;
}

// A gather-map combine on fake device addresses: the fake driver never dereferences them.
moejit_combine_args gather_map_args() {
  return moejit_test::fake_gather_map_args(33, 2, 256);
}

moejit_runtime_t runtime_on(const std::string& dir, moejit_cache_mode mode) {
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_dir = dir.c_str();
  o.cache_mode = mode;
  o.log_level = MOEJIT_LOG_OFF;
  moejit_runtime_t rt = nullptr;
  EXPECT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  return rt;
}

moejit_stats stats_of(moejit_runtime_t rt) {
  moejit_stats s{};
  s.struct_size = sizeof(s);
  EXPECT_EQ(moejit_runtime_get_stats(rt, &s), MOEJIT_SUCCESS);
  return s;
}

class DriverResults : public ::testing::Test {
 protected:
  void SetUp() override {
    driver_ = fake_driver();
    if (driver_.fail_module_loads == nullptr) {
      // Under ctest (which sets the variable with the library path) that is a broken setup, not
      // a reason to skip.
      if (getenv("MOEJIT_TEST_FAKE_DRIVER") != nullptr)
        FAIL() << "libcuda.so.1 is not the test's fake driver although ctest set LD_LIBRARY_PATH";
      GTEST_SKIP() << "libcuda.so.1 is not the test's fake driver: run it through ctest, or with "
                      "LD_LIBRARY_PATH naming the fake_driver directory of the build";
    }
    driver_.fail_module_loads(0, 0);
    // Warm the cache: one compile, stored.
    moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_READ_WRITE);
    const moejit_combine_args a = gather_map_args();
    ASSERT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    EXPECT_EQ(stats_of(rt).compiles, 1u);
    moejit_runtime_destroy(rt);
    warm_ = entries(dir_.path());
    ASSERT_EQ(warm_.size(), 1u);
  }
  void TearDown() override {
    if (driver_.fail_module_loads != nullptr) driver_.fail_module_loads(0, 0);
    if (driver_.refuse_stream_launches != nullptr) driver_.refuse_stream_launches(0);
  }

  FakeDriver driver_;
  ScratchDir dir_;
  std::vector<std::pair<std::string, fs::file_time_type>> warm_;
};

// Out of memory, or a context broken by an earlier fault: the call fails with the driver's own
// error, the entry stays as it was (not rebuilt, not unlinked), and once the driver loads again
// the same runtime serves the call from it.
TEST_F(DriverResults, AFailureThatIsNotTheImageLeavesTheEntry) {
  for (int result : {kOutOfMemory, kIllegalAddress}) {
    for (moejit_cache_mode mode : {MOEJIT_CACHE_MODE_READ_WRITE, MOEJIT_CACHE_MODE_NO_COMPILE,
                                   MOEJIT_CACHE_MODE_READ_ONLY}) {
      SCOPED_TRACE("result " + std::to_string(result) + ", cache mode " + std::to_string(mode));
      moejit_runtime_t rt = runtime_on(dir_.path(), mode);
      const moejit_combine_args a = gather_map_args();
      driver_.fail_module_loads(result, -1);
      EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_ERROR_CUDA);
      const std::string message = moejit_last_error_message();
      EXPECT_NE(message.find(result == kOutOfMemory ? "cuModuleLoadData failed: "
                                                      "CUDA_ERROR_OUT_OF_MEMORY"
                                                    : "CUDA_ERROR_ILLEGAL_ADDRESS"),
                std::string::npos)
          << message;
      moejit_stats s = stats_of(rt);
      EXPECT_EQ(s.compiles, 0u);
      EXPECT_EQ(s.disk_errors, 0u);
      EXPECT_EQ(entries(dir_.path()), warm_);

      driver_.fail_module_loads(0, 0);
      const int launches = driver_.launches();
      EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
          << moejit_last_error_message();
      EXPECT_EQ(driver_.launches(), launches + 1);
      s = stats_of(rt);
      EXPECT_EQ(s.compiles, 0u);
      EXPECT_EQ(entries(dir_.path()), warm_);
      moejit_runtime_destroy(rt);
    }
  }
}

// A refused image (the driver's CUDA_ERROR_INVALID_IMAGE for an entry that passed the cache's
// own checks) is a miss: the entry is dropped, the kernel rebuilt once and stored again, and the
// call succeeds.
TEST_F(DriverResults, ARefusedImageIsRebuiltOnce) {
  moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_READ_WRITE);
  const moejit_combine_args a = gather_map_args();
  driver_.fail_module_loads(kInvalidImage, 1);
  const int loads = driver_.module_load_calls();
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(driver_.module_load_calls(), loads + 2);
  const moejit_stats s = stats_of(rt);
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.disk_errors, 1u);
  const auto now = entries(dir_.path());
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(now[0].first, warm_[0].first);  // the same key, written again
  moejit_runtime_destroy(rt);
}

// A driver that refuses the rebuilt image too: the call fails with the driver's error (no loop).
TEST_F(DriverResults, AnImageRefusedAfterTheRebuildIsAnError) {
  moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_READ_WRITE);
  const moejit_combine_args a = gather_map_args();
  driver_.fail_module_loads(kInvalidImage, -1);
  const int loads = driver_.module_load_calls();
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_ERROR_CUDA);
  EXPECT_NE(std::string(moejit_last_error_message()).find("CUDA_ERROR_INVALID_IMAGE"),
            std::string::npos)
      << moejit_last_error_message();
  EXPECT_EQ(driver_.module_load_calls(), loads + 2);
  moejit_runtime_destroy(rt);
}

}  // namespace

// A stream of another device's context (or of a context the caller created) while the calling
// thread's current context is not its: the driver refuses the launch with only
// CUDA_ERROR_INVALID_HANDLE. The call says which argument, which devices and what to do, launches
// nothing, and the same runtime serves the next call on a stream of the current context.
TEST_F(DriverResults, AStreamOfAnotherContextIsNamed) {
  ASSERT_NE(driver_.refuse_stream_launches, nullptr);
  moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_READ_WRITE);
  const moejit_combine_args a = gather_map_args();
  int stream_storage = 0;  // the fake driver only compares stream handles
  const auto stream = reinterpret_cast<moejit_stream_t>(&stream_storage);
  const int launches = driver_.launches();
  driver_.refuse_stream_launches(1);
  EXPECT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_ERROR_INVALID_ARGUMENT);
  std::string message = moejit_last_error_message();
  for (const char* part :
       {"stream belongs to a CUDA context other than the calling thread's current one",
        "the stream's: device 1; current: device 0", "cudaSetDevice(1)",
        "CUDA_ERROR_INVALID_HANDLE"})
    EXPECT_NE(message.find(part), std::string::npos)
        << "missing \"" << part << "\" in: " << message;
  EXPECT_EQ(driver_.launches(), launches);
  // The legacy default stream is always the current context's.
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  // A refused launch on a stream of the current context stays the driver's error.
  driver_.refuse_stream_launches(2);
  EXPECT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_ERROR_CUDA);
  message = moejit_last_error_message();
  EXPECT_NE(message.find("cuLaunchKernel(combine) failed: CUDA_ERROR_INVALID_HANDLE"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("stream belongs"), std::string::npos) << message;
  // And once the stream is usable, the same runtime serves it.
  driver_.refuse_stream_launches(0);
  EXPECT_EQ(moejit_runtime_combine(rt, &a, stream), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(driver_.launches(), launches + 2);
  moejit_runtime_destroy(rt);
}

// A context destroyed while a runtime holds modules loaded in it (cuCtxDestroy, cudaDeviceReset),
// and a new one created under the same handle, as the driver may reuse one: the new context loads
// its own module, and destroying the runtime unloads that one only. The old module went with its
// context, and its handle may since name another module (of another library, say), which an
// unload would destroy. The runtime forgets the old context's modules once the new one is used:
// a process that destroys and creates contexts in a loop holds one context's records, not all.
TEST_F(DriverResults, ADestroyedContextsModulesAreNotUnloaded) {
  ASSERT_NE(driver_.replace_context, nullptr);
  moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_READ_WRITE);
  const moejit_combine_args a = gather_map_args();
  const moejit_combine_args b = moejit_test::fake_gather_map_args(33, 2, 512);
  const int loads = driver_.module_load_calls();
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(moejit_runtime_combine(rt, &b, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(stats_of(rt).loaded_modules, 2u);
  for (int round = 0; round < 3; ++round) {
    driver_.replace_context();
    // Destroyed, and no new context used yet: its records are still counted.
    EXPECT_EQ(stats_of(rt).loaded_modules, round == 0 ? 2u : 1u);
    EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS)
        << moejit_last_error_message();
    EXPECT_EQ(stats_of(rt).loaded_modules, 1u) << "round " << round;
  }
  EXPECT_EQ(driver_.module_load_calls(), loads + 2 + 3);
  EXPECT_EQ(stats_of(rt).memory_hits, 0u);
  // The live context's module is still served from memory.
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  EXPECT_EQ(stats_of(rt).memory_hits, 1u);
  EXPECT_EQ(stats_of(rt).loaded_modules, 1u);
  // Destroyed once more, and the runtime with it before any new context: the runtime still holds
  // that context's module, which it must not unload.
  driver_.replace_context();
  const int stale = driver_.stale_unloads();
  moejit_runtime_destroy(rt);
  EXPECT_EQ(driver_.stale_unloads(), stale) << "a destroyed context's module was unloaded";
}

// First calls of several shapes from eight threads at once (two per shape; one shape on the
// token index's list path, which builds its helpers' module on another thread): every call
// succeeds, each module is compiled and loaded exactly once, and the later calls are memory hits.
// The sanitizer build (tools/sanitize.sh thread) watches the module cache and the store here.
TEST_F(DriverResults, ConcurrentFirstCallsBuildAndLoadEachModuleOnce) {
  moejit_runtime_t rt = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_DISABLED);
  moejit_combine_args token_index = moejit_test::fake_gather_map_args(65536, 1, 256);
  token_index.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  // Two rows per token: the list path (clear, assign, token_index_heavy, combine).
  token_index.num_rows = 131072;
  token_index.workspace = moejit_test::fake_address(0x7f0040000000);
  token_index.workspace_bytes = size_t{1} << 26;
  const moejit_combine_args shapes[] = {moejit_test::fake_gather_map_args(33, 2, 256),
                                        moejit_test::fake_gather_map_args(33, 2, 512),
                                        moejit_test::fake_gather_map_args(33, 4, 256), token_index};
  const int loads = driver_.module_load_calls();
  std::atomic<int> succeeded{0}, ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      // A start barrier: all eight call at once, or the test could pass with calls that ran one
      // after another.
      ++ready;
      while (!go.load()) std::this_thread::yield();
      if (moejit_runtime_combine(rt, &shapes[i % 4], nullptr) == MOEJIT_SUCCESS) ++succeeded;
    });
  while (ready.load() < 8) std::this_thread::yield();
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(succeeded.load(), 8);
  const moejit_stats s = stats_of(rt);
  EXPECT_EQ(s.compiles, 5u);  // three gather-map modules, the list module and its helpers
  EXPECT_EQ(driver_.module_load_calls(), loads + 5);
  EXPECT_EQ(s.launches, 2u * (3 + 4));
  EXPECT_EQ(s.loaded_modules, 5u);
  moejit_runtime_destroy(rt);
}

namespace {

// Templates that fail to compile, slowly: the real ones, with a long run of declarations and an
// #error at the end of the combine template, so that a compile takes long enough for every thread
// of a test to be waiting on it.
std::string broken_templates(const std::string& dir) {
  const std::string out = dir + "/broken-templates";
  fs::create_directories(out);
  for (const auto& e : fs::directory_iterator(MOEJIT_TEMPLATES_SOURCE)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (e.path().filename() == "combine_params.h") {
      for (int i = 0; i < 200000; ++i)
        text += "static const int moejit_test_padding_" + std::to_string(i) + " = " +
                std::to_string(i) + ";\n";
      text += "#error deliberately broken template\n";
    }
    std::ofstream(out + "/" + e.path().filename().string(), std::ios::binary) << text;
  }
  return out;
}

}  // namespace

// Threads that waited on a compile that failed share its failure: six threads released at once
// onto one broken shape give one NVRTC compile, not six one after another; a later call (a retry)
// compiles again. Failed compiles count in stats.compiles.
TEST_F(DriverResults, ThreadsWaitingOnAFailedCompileShareItsFailure) {
  const std::string templates = broken_templates(dir_.path());
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  o.template_dir = templates.c_str();
  o.log_level = MOEJIT_LOG_OFF;
  moejit_runtime_t rt = nullptr;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  const moejit_combine_args a = gather_map_args();
  constexpr int kThreads = 6;
  std::atomic<int> ready{0}, failed{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&] {
      ++ready;
      while (!go.load()) std::this_thread::yield();  // released together
      if (moejit_runtime_combine(rt, &a, nullptr) == MOEJIT_ERROR_COMPILE &&
          std::string(moejit_last_error_message()).find("deliberately broken template") !=
              std::string::npos)
        ++failed;
    });
  while (ready.load() < kThreads) std::this_thread::yield();
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(failed.load(), kThreads) << "every thread gets the compile's error";
  moejit_stats s = stats_of(rt);
  EXPECT_EQ(s.compiles, 1u) << "one compile for all the threads that waited on it";
  EXPECT_GT(s.compile_seconds, 0.0);
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_ERROR_COMPILE);
  EXPECT_EQ(stats_of(rt).compiles, 2u) << "a later call tries again";
  moejit_runtime_destroy(rt);
}

// fork() while another thread compiles, as a Python worker pool started by fork does: the child
// calls the same shape and must get an answer (its default runtime starts afresh), never wait for
// the parent's compile, whose thread does not exist in the child. A runtime the parent created is
// refused in the child, and destroying it there returns. The alarm is a safety net: it fires only
// if the child hangs.
TEST_F(DriverResults, AChildForkedWhileAnotherThreadCompilesNeverHangs) {
  ::setenv("MOEJIT_CACHE_MODE", "disabled", 1);  // the default runtime's, in parent and child
  ::setenv("MOEJIT_LOG_LEVEL", "off", 1);
  moejit_runtime_t parents = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_DISABLED);
  for (int attempt = 0; attempt < 5; ++attempt) {
    // A shape neither runtime has built: its first call compiles (a few hundred milliseconds).
    const moejit_combine_args a = moejit_test::fake_gather_map_args(33, 2, 2048 + 256 * attempt);
    std::atomic<int> done{0};
    std::thread on_default([&] {
      moe_combine(&a, nullptr);
      ++done;
    });
    std::thread on_explicit([&] {
      moejit_runtime_combine(parents, &a, nullptr);
      ++done;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (done.load() == 2) {  // both compiled before the fork: nothing tested; another shape
      on_default.join();
      on_explicit.join();
      continue;
    }
    const pid_t child = fork();
    if (child == 0) {
      alarm(60);
      int rc = 0;
      if (moe_combine(&a, nullptr) != MOEJIT_SUCCESS) rc |= 1;
      if (moejit_runtime_combine(parents, &a, nullptr) != MOEJIT_ERROR_INVALID_ARGUMENT) rc |= 2;
      if (std::string(moejit_last_error_message())
              .find("was created before this process was "
                    "forked") == std::string::npos)
        rc |= 4;
      moejit_stats s{};
      s.struct_size = sizeof(s);
      if (moejit_runtime_get_stats(parents, &s) != MOEJIT_SUCCESS) rc |= 8;
      if (moejit_runtime_destroy(parents) != MOEJIT_SUCCESS) rc |= 16;
      moejit_runtime_t own = runtime_on(dir_.path(), MOEJIT_CACHE_MODE_DISABLED);
      if (own == nullptr || moejit_runtime_combine(own, &a, nullptr) != MOEJIT_SUCCESS) rc |= 32;
      // exit_group itself, not _exit: ThreadSanitizer would report the parent's threads, copied
      // into the child's view of them, as leaked, and exit with its own status.
      syscall(SYS_exit_group, rc);
    }
    ASSERT_GT(child, 0);
    on_default.join();
    on_explicit.join();
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_FALSE(WIFSIGNALED(status))
        << "the child was killed by signal " << WTERMSIG(status) << " (14, SIGALRM: it hung)";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the child's checks that failed (bits of rc): " << WEXITSTATUS(status);
    EXPECT_EQ(moejit_runtime_combine(parents, &a, nullptr), MOEJIT_SUCCESS)
        << "the parent's runtime still serves the parent";
    moejit_runtime_destroy(parents);
    return;
  }
  moejit_runtime_destroy(parents);
  FAIL() << "every compile finished within 20 ms, before the fork: the case was not reached";
}
