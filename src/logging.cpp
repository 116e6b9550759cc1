#include "logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>
#include <string>

namespace moejit {

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
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto* log = new spdlog::logger("moejit", std::move(sink));
    log->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [moejit] [%l] %v");
    spdlog::level::level_enum level = spdlog::level::warn;
    const char* env = std::getenv("MOEJIT_LOG_LEVEL");
    // Empty counts as unset, as for every other MOEJIT_ variable.
    if (env != nullptr && *env != '\0' && !parse_log_level(env, &level)) {
      log->warn(
          "MOEJIT_LOG_LEVEL={} is not one of trace, debug, info, warn, error, off; using warn",
          env);
    }
    log->set_level(level);
    return log;
  }();
  return *instance;
}

}  // namespace moejit
