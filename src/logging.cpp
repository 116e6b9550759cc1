#include "logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/sink.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "fork_guard.h"
#include "settings.h"

namespace moejit {
namespace {

// The library's stderr sink. spdlog's console sinks share one process-wide mutex, which a fork
// while another thread writes would copy locked: the child's next line would wait forever. This
// one writes inside the fork gate (fork_guard.h), with write(2) rather than stdio, whose stream
// lock a fork can copy held as well. (The pattern marks no color range, so spdlog's color sink
// printed no colors either.)
class StderrSink final : public spdlog::sinks::sink {
 public:
  StderrSink() : formatter_(std::make_unique<spdlog::pattern_formatter>()) {}

  void log(const spdlog::details::log_msg& msg) override {
    ForkGateScope gate;
    std::lock_guard<std::mutex> lock(mutex_);
    spdlog::memory_buf_t text;
    formatter_->format(msg, text);
    const char* data = text.data();
    size_t size = text.size();
    while (size > 0) {
      const ssize_t n = write(STDERR_FILENO, data, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // nowhere to report it
      data += n;
      size -= static_cast<size_t>(n);
    }
  }
  void flush() override {}  // nothing is buffered
  void set_pattern(const std::string& pattern) override {
    std::lock_guard<std::mutex> lock(mutex_);
    formatter_ = std::make_unique<spdlog::pattern_formatter>(pattern);
  }
  void set_formatter(std::unique_ptr<spdlog::formatter> formatter) override {
    std::lock_guard<std::mutex> lock(mutex_);
    formatter_ = std::move(formatter);
  }

 private:
  std::mutex mutex_;  // guards formatter_ and keeps lines whole
  std::unique_ptr<spdlog::formatter> formatter_;
};

}  // namespace

bool parse_log_level(const char* text, spdlog::level::level_enum* level) {
  if (text == nullptr) return false;
  std::string s(text);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "warning") s = "warn";
  const auto parsed = spdlog::level::from_str(s);
  // from_str answers "off" for anything it does not know: only accept "off" when asked for.
  if (parsed == spdlog::level::off && s != "off") return false;
  *level = parsed;
  return true;
}

spdlog::logger& logger() {
  // Created on first use and deliberately leaked: logging from destructors of static objects in
  // the host must never touch a destroyed logger.
  static spdlog::logger* instance = [] {
    // A caller that logs errno's reason, evaluated after this first use, must still see its own.
    const int saved_errno = errno;
    auto* log = new spdlog::logger("moejit", std::make_shared<StderrSink>());
    log->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [moejit] [%l] %v");
    spdlog::level::level_enum level = spdlog::level::warn;
    const char* env = log_level_from_environment();
    if (env != nullptr && !parse_log_level(env, &level)) {
      log->warn(
          "MOEJIT_LOG_LEVEL={} is not one of trace, debug, info, warn, error, off; using warn",
          env);
    }
    log->set_level(level);
    errno = saved_errno;
    return log;
  }();
  return *instance;
}

}  // namespace moejit
