#include "settings.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "c_enum.h"
#include "error.h"
#include "logging.h"

namespace moejit {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

moejit_cache_mode parse_cache_mode(const char* text) {
  for (moejit_cache_mode m : {MOEJIT_CACHE_MODE_READ_WRITE, MOEJIT_CACHE_MODE_READ_ONLY,
                              MOEJIT_CACHE_MODE_DISABLED, MOEJIT_CACHE_MODE_NO_COMPILE})
    if (std::strcmp(text, cache_mode_name(m)) == 0) return m;
  invalid_argument("MOEJIT_CACHE_MODE", std::string("\"") + text + "\"",
                   "must be one of read-write, read-only, disabled, no-compile");
}

std::string default_cache_dir() {
  // Never /tmp: a shared, world-writable default invites cache poisoning by other users.
  // A relative XDG_CACHE_HOME is invalid and ignored (XDG Base Directory spec): taken as it is,
  // it put the cache (and created directories) under whatever the working directory was.
  const char* xdg = env("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/moejit";
  if (const char* home = env("HOME")) return std::string(home) + "/.cache/moejit";
  return std::string();
}

constexpr double kDefaultLockTimeoutSeconds = 60;

// A malformed value only warns: the wait is an optimization, and its default is safe.
double lock_timeout_from_environment() {
  const char* text = env("MOEJIT_CACHE_LOCK_TIMEOUT");
  if (text == nullptr) return kDefaultLockTimeoutSeconds;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0) || v > 86400) {
    logger().warn("MOEJIT_CACHE_LOCK_TIMEOUT={} is not a number of seconds in [0, 86400]; using {}",
                  text, kDefaultLockTimeoutSeconds);
    return kDefaultLockTimeoutSeconds;
  }
  return v;
}

}  // namespace

const char* log_level_from_environment() {
  return env("MOEJIT_LOG_LEVEL");
}

NvrtcEnvironment nvrtc_environment() {
  return {env("MOEJIT_NVRTC_LIBRARY"), env("CUDA_HOME"), env("CUDA_PATH")};
}

void apply_log_level(const Settings& settings) {
  if (settings.log_level == MOEJIT_LOG_DEFAULT) return;
  static const spdlog::level::level_enum levels[] = {
      spdlog::level::trace, spdlog::level::debug,    spdlog::level::info, spdlog::level::warn,
      spdlog::level::err,   spdlog::level::critical, spdlog::level::off};
  logger().set_level(levels[settings.log_level]);
}

const char* cache_mode_name(moejit_cache_mode mode) {
  switch (mode) {
    case MOEJIT_CACHE_MODE_READ_WRITE:
      return "read-write";
    case MOEJIT_CACHE_MODE_READ_ONLY:
      return "read-only";
    case MOEJIT_CACHE_MODE_DISABLED:
      return "disabled";
    case MOEJIT_CACHE_MODE_NO_COMPILE:
      return "no-compile";
    default:
      return "default";
  }
}

Settings resolve_settings(const moejit_runtime_options* options) {
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  if (options != nullptr) {
    // Only the sizes of released versions of the struct: any size in between would copy part of
    // a pointer, which the code below would then follow. Fields an older caller lacks keep the
    // defaults.
    if (options->struct_size != sizeof(o) && options->struct_size != kRuntimeOptionsSizeV02)
      invalid_argument("options->struct_size", std::to_string(options->struct_size),
                       "must be sizeof(moejit_runtime_options) = " + std::to_string(sizeof(o)) +
                           " for this library version (" + std::to_string(kRuntimeOptionsSizeV02) +
                           " for 0.1 and 0.2); call moejit_runtime_options_init() first");
    std::memcpy(&o, options, options->struct_size);
    o.struct_size = sizeof(o);
  }

  Settings s;
  const int cache_mode = c_enum_value(o.cache_mode);
  if (cache_mode < MOEJIT_CACHE_MODE_DEFAULT || cache_mode > MOEJIT_CACHE_MODE_NO_COMPILE)
    invalid_argument("options->cache_mode", std::to_string(cache_mode),
                     "must be a moejit_cache_mode (0 default, 1 read-write, 2 read-only, "
                     "3 disabled, 4 no-compile)");
  if (cache_mode != MOEJIT_CACHE_MODE_DEFAULT)
    s.cache_mode = static_cast<moejit_cache_mode>(cache_mode);
  else if (const char* m = env("MOEJIT_CACHE_MODE"))
    s.cache_mode = parse_cache_mode(m);

  if (o.cache_dir != nullptr && *o.cache_dir != '\0')
    s.cache_dir = o.cache_dir;
  else if (const char* d = env("MOEJIT_CACHE_DIR"))
    s.cache_dir = d;
  else
    s.cache_dir = default_cache_dir();

  if (o.cache_max_bytes != 0) {
    s.cache_max_bytes = o.cache_max_bytes;
  } else if (const char* m = env("MOEJIT_CACHE_MAX_BYTES")) {
    // Digits only: strtoull would take "-1" as 2^64 - 1 and clamp an overflow to it silently.
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(m, &end, 10);
    if (!std::isdigit(static_cast<unsigned char>(*m)) || end == m || *end != '\0' ||
        errno == ERANGE || v == 0)
      invalid_argument("MOEJIT_CACHE_MAX_BYTES", std::string("\"") + m + "\"",
                       "must be a positive number of bytes");
    s.cache_max_bytes = v;
  }

  const int log_level = c_enum_value(o.log_level);
  // 5 is no moejit_log_level (spdlog's "critical", which the library never logs at).
  if (log_level != MOEJIT_LOG_DEFAULT &&
      (log_level < MOEJIT_LOG_TRACE || log_level > MOEJIT_LOG_OFF || log_level == 5))
    invalid_argument("options->log_level", std::to_string(log_level),
                     "must be a moejit_log_level (-1 default, 0 trace .. 4 error, 6 off)");
  s.log_level = static_cast<moejit_log_level>(log_level);

  s.cache_lock_timeout_seconds = lock_timeout_from_environment();

  if (o.cache_key_file != nullptr && *o.cache_key_file != '\0')
    s.cache_mac_key = read_mac_key_file(o.cache_key_file, "options->cache_key_file");
  else if (const char* k = env("MOEJIT_CACHE_KEY_FILE"))
    s.cache_mac_key = read_mac_key_file(k, "MOEJIT_CACHE_KEY_FILE");

  if (o.template_dir != nullptr && *o.template_dir != '\0') {
    s.template_dir = o.template_dir;
    s.template_dir_setting = "options->template_dir";
  } else if (const char* t = env("MOEJIT_TEMPLATE_DIR")) {
    s.template_dir = t;
    s.template_dir_setting = "MOEJIT_TEMPLATE_DIR";
  }
  return s;
}

}  // namespace moejit
