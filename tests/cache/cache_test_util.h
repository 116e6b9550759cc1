// Shared by the cache tests: a scratch directory, a counter of the library's warnings, small
// kernel specs that compile in about 0.1 s, and file helpers.
#pragma once

#include <spdlog/sinks/base_sink.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "combine_plan.h"
#include "logging.h"
#include "nvrtc_compiler.h"
#include "settings.h"

namespace moejit::test {

namespace fs = std::filesystem;

// A fresh directory, removed with everything in it at scope end. Mode 0755 so that a child
// process that dropped to another uid can reach a cache inside it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string base = fs::temp_directory_path().string() + "/moejit-cache-test-XXXXXX";
    std::vector<char> buf(base.begin(), base.end());
    buf.push_back('\0');
    path_ = mkdtemp(buf.data());
    chmod(path_.c_str(), 0755);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rest) const { return path_ + "/" + rest; }

 private:
  std::string path_;
};

// Counts the library's warnings (the "warn once" promises are tested through it).
class WarningCounter : public spdlog::sinks::base_sink<std::mutex> {
 public:
  static WarningCounter& install() {
    static std::shared_ptr<WarningCounter> sink = [] {
      auto s = std::make_shared<WarningCounter>();
      logger().sinks().push_back(s);
      return s;
    }();
    return *sink;
  }
  int warnings() const { return count_.load(); }
  std::string last() {
    std::lock_guard<std::mutex> guard(mutex_);
    return last_;
  }
  void reset() { count_ = 0; }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    if (msg.level >= spdlog::level::warn) {
      ++count_;
      last_.assign(msg.payload.data(), msg.payload.size());
    }
  }
  void flush_() override {}

 private:
  std::atomic<int> count_{0};
  std::string last_;
};

// Distinct small specializations: i selects the hidden size.
inline KernelSpec small_spec(int i) {
  return spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                        MOEJIT_INDEX_INT32, 128 * (i + 1), 2, 256);
}
inline Target test_target() {
  return Target{90, false};
}

// The settings of a runtime given these options (the environment supplies the rest, e.g.
// MOEJIT_CACHE_LOCK_TIMEOUT).
inline Settings cache_settings(const std::string& dir,
                               moejit_cache_mode mode = MOEJIT_CACHE_MODE_READ_WRITE,
                               uint64_t max_bytes = 1ull << 30) {
  Settings s = resolve_settings(nullptr);
  s.cache_dir = dir;
  s.cache_mode = mode;
  s.cache_max_bytes = max_bytes;
  return s;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Every regular file and symlink below dir (relative paths), for "nothing else was written".
inline std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  for (auto it = fs::recursive_directory_iterator(dir, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (!it->is_directory(ec) || it->is_symlink(ec))
      out.push_back(fs::relative(it->path(), dir, ec).string());
  }
  return out;
}

}  // namespace moejit::test
