// Where NVRTC is looked for and what a failed search says (src/nvrtc_loader.h). Host only: the
// candidates are files on this machine; the last test loads the real NVRTC the build uses.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "error.h"
#include "nvrtc_loader.h"

#if defined(__has_feature)
#define MOEJIT_HAS_TSAN __has_feature(thread_sanitizer)
#else
#define MOEJIT_HAS_TSAN 0
#endif

namespace moejit {
namespace {

// Sets (or unsets, for nullptr) an environment variable for the life of the object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
      had_ = true;
    }
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

size_t index_of(const std::vector<NvrtcCandidate>& list, const std::string& file) {
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].file == file) return i;
  return list.size();
}

TEST(NvrtcLoader, TheVariableIsTheOnlyCandidate) {
  ScopedEnv env("MOEJIT_NVRTC_LIBRARY", "/opt/x/libnvrtc.so.13");
  const std::vector<NvrtcCandidate> list = nvrtc_candidates();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].file, "/opt/x/libnvrtc.so.13");
  EXPECT_EQ(list[0].origin, "$MOEJIT_NVRTC_LIBRARY");
}

TEST(NvrtcLoader, PipBeforeTheToolkitAndCuda13BeforeCuda12) {
  ScopedEnv unset("MOEJIT_NVRTC_LIBRARY", "");  // empty counts as unset
  ScopedEnv home("CUDA_HOME", "/opt/cuda-home");
  ScopedEnv path("CUDA_PATH", nullptr);
  const std::vector<NvrtcCandidate> list = nvrtc_candidates();
  // pip's packages beside the directory of the file holding the library's code: this program,
  // <build>/tests/unit/moejit_unit_tests, so <build>/tests/nvidia/... (in a wheel:
  // site-packages/moejit/libmoejit.so.0, so site-packages/nvidia/...).
  char exe[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", exe, sizeof exe - 1), 0);
  std::string site = exe;
  site = site.substr(0, site.rfind('/'));
  site = site.substr(0, site.rfind('/'));
  ASSERT_GE(list.size(), 2u);
  EXPECT_EQ(list[0].file, site + "/nvidia/cu13/lib/libnvrtc.so.13");
  EXPECT_EQ(list[1].file, site + "/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
  const size_t home13 = index_of(list, "/opt/cuda-home/lib64/libnvrtc.so.13");
  const size_t home12 = index_of(list, "/opt/cuda-home/lib64/libnvrtc.so.12");
  const size_t loader = index_of(list, "libnvrtc.so.13");
  const size_t usr = index_of(list, "/usr/local/cuda/lib64/libnvrtc.so.13");
  EXPECT_LT(1u, home13);
  EXPECT_LT(home13, home12);
  EXPECT_LT(home12, loader);
  EXPECT_LT(loader, usr);
  EXPECT_LT(usr, list.size());
  for (const NvrtcCandidate& c : list) EXPECT_FALSE(c.origin.empty()) << c.file;
}

TEST(NvrtcLoader, AFailedSearchNamesEveryPlaceAndWhy) {
  const std::vector<NvrtcCandidate> list = {{"/nonexistent-moejit/libnvrtc.so.13", "first place"},
                                            {"libnvrtc-moejit-none.so.13", "the dynamic loader"},
                                            // Loads, but is no NVRTC.
                                            {"libc.so.6", "a library without NVRTC's functions"}};
  try {
    load_nvrtc(list);
    FAIL() << "load_nvrtc succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.status(), MOEJIT_ERROR_NVRTC_NOT_FOUND);
    EXPECT_NE(m.find("NVRTC (libnvrtc.so) could not be loaded"), std::string::npos) << m;
    EXPECT_NE(m.find("/nonexistent-moejit/libnvrtc.so.13 (first place): No such file or directory"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("libnvrtc-moejit-none.so.13 (the dynamic loader): "), std::string::npos) << m;
    EXPECT_NE(m.find("libc.so.6 (a library without NVRTC's functions): loaded, but it lacks "
                     "nvrtcGetErrorString"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("pip install nvidia-cuda-nvrtc"), std::string::npos) << m;
  }
}

TEST(NvrtcLoader, TheFirstCandidateThatLoadsIsTaken) {
  // The NVRTC this process uses (its search succeeded, or the unit tests could not compile).
  const NvrtcApi& real = nvrtc();
  const NvrtcApi found =
      load_nvrtc({{"/nonexistent-moejit/libnvrtc.so.13", "nowhere"}, {real.path, "the real one"}});
  EXPECT_EQ(found.path, real.path);
  EXPECT_EQ(found.origin, "the real one");
  int major = 0, minor = 0;
  ASSERT_EQ(found.nvrtcVersion(&major, &minor), NVRTC_SUCCESS);
  EXPECT_GE(major, 12);
}

bool mapped(const std::string& file) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.size() >= file.size() &&
        line.compare(line.size() - file.size(), file.size(), file) == 0)
      return true;
  return false;
}

// pip's libnvrtc has no RUNPATH to its directory: the builtins next to it must be the ones NVRTC
// uses, not whatever the loader's path offers (a toolkit's, or none when no toolkit is there).
// A copy of the real NVRTC and its builtins in a directory of their own stands in for pip's.
TEST(NvrtcLoader, TheBuiltinsNextToTheLoadedNvrtcAreLoadedWithIt) {
#if defined(__SANITIZE_THREAD__) || MOEJIT_HAS_TSAN
  GTEST_SKIP() << "under ThreadSanitizer: its called_from_lib suppression for libnvrtc.so "
                  "(tools/tsan-suppressions.txt) aborts the process once two copies are loaded";
#endif
  const NvrtcApi& real = nvrtc();
  int major = 0, minor = 0;
  ASSERT_EQ(real.nvrtcVersion(&major, &minor), NVRTC_SUCCESS);
  const std::string real_dir = real.path.substr(0, real.path.rfind('/'));
  const std::string builtins =
      "libnvrtc-builtins.so." + std::to_string(major) + "." + std::to_string(minor);
  if (access((real_dir + "/" + builtins).c_str(), R_OK) != 0)
    GTEST_SKIP() << "no " << builtins << " next to " << real.path;
  char dir_template[] = "/tmp/moejit-nvrtc-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string nvrtc_copy = dir + "/libnvrtc.so." + std::to_string(major);
  for (const auto& [from, to] : {std::pair<std::string, std::string>{real.path, nvrtc_copy},
                                 {real_dir + "/" + builtins, dir + "/" + builtins}}) {
    std::ifstream in(from, std::ios::binary);
    std::ofstream out(to, std::ios::binary);
    out << in.rdbuf();
    ASSERT_TRUE(out.good()) << to;
  }
  EXPECT_FALSE(mapped(dir + "/" + builtins));
  const NvrtcApi copy = load_nvrtc({{nvrtc_copy, "a directory of its own"}});
  EXPECT_EQ(copy.path, nvrtc_copy);
  EXPECT_TRUE(mapped(dir + "/" + builtins));
  // The mappings stay (the libraries are never closed); the files can go.
  unlink((dir + "/" + builtins).c_str());
  unlink(nvrtc_copy.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace moejit
