// Runtime settings: explicit options first, then environment variables, then defaults. Resolved
// once when a runtime is created.
#pragma once

#include <cstdint>
#include <string>

#include "moejit/moejit.h"

namespace moejit {

struct Settings {
  std::string cache_dir;  // empty when no usable default exists (no HOME): memory only
  moejit_cache_mode cache_mode = MOEJIT_CACHE_MODE_READ_WRITE;
  uint64_t cache_max_bytes = 1ull << 30;
  std::string template_dir;  // empty: the embedded templates
  // Where template_dir came from, for messages: "options->template_dir" or "MOEJIT_TEMPLATE_DIR".
  std::string template_dir_setting = "template_dir";
  // options->log_level, validated (MOEJIT_LOG_DEFAULT: leave the logger as the environment set
  // it). The logger is shared by every runtime, so only a runtime that was created applies it.
  moejit_log_level log_level = MOEJIT_LOG_DEFAULT;
};

// Throws Error(MOEJIT_ERROR_INVALID_ARGUMENT) naming the option or environment variable that
// holds a value it cannot use.
Settings resolve_settings(const moejit_runtime_options* options);

// Sets the library's logger to settings.log_level unless that is MOEJIT_LOG_DEFAULT.
void apply_log_level(const Settings& settings);

// "read-write" | "read-only" | "disabled" | "no-compile"
const char* cache_mode_name(moejit_cache_mode mode);

}  // namespace moejit
