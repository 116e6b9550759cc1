// Runs moejit-precompile as a child process and captures what operators see: exit code, stdout,
// stderr and wall time. Shared by the precompile tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace moejit {
namespace test {

struct ToolRun {
  int rc = -1;
  std::string out;
  std::string err;
  double seconds = 0;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A fresh directory under the test's temporary directory, removed by the caller's fixture or left
// for the OS (tests write little).
inline std::string make_temp_dir(const char* tag) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/moejit-" + tag + "-XXXXXX";
  char* made = mkdtemp(&templ[0]);
  EXPECT_NE(made, nullptr);
  return templ;
}

// Best effort (a test's scratch directory): errors are ignored, as `rm -rf` would.
inline void remove_tree(const std::string& dir) {
  std::error_code ignored;
  if (dir.size() > 5) std::filesystem::remove_all(dir, ignored);
}

inline std::string configs(const std::string& name) {
  return std::string(MOEJIT_PRECOMPILE_CONFIGS) + "/" + name;
}

// args go to the shell as written (callers quote paths they build). env: "NAME=value " prefix.
inline ToolRun run_tool(const std::string& args, const std::string& scratch,
                        const std::string& env = "") {
  static std::atomic<int> counter{0};  // concurrent runs get their own files
  const std::string base =
      scratch + "/run" + std::to_string(counter.fetch_add(1)) + "." + std::to_string(getpid());
  const std::string cmd = env + "'" MOEJIT_PRECOMPILE_EXE "' " + args + " >'" + base + ".out' 2>'" +
                          base + ".err' </dev/null";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  ToolRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  std::remove((base + ".out").c_str());
  std::remove((base + ".err").c_str());
  return r;
}

}  // namespace test
}  // namespace moejit
