// Runtime settings: explicit options first, then environment variables, then defaults. Resolved
// once when a runtime is created. Every environment variable the library reads is read here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "entry_mac.h"
#include "moejit/moejit.h"

namespace moejit {

struct Settings {
  std::string cache_dir;  // empty when no usable default exists (no HOME): memory only
  moejit_cache_mode cache_mode = MOEJIT_CACHE_MODE_READ_WRITE;
  uint64_t cache_max_bytes = 1ull << 30;
  // How long a process waits for another one building the same entry (MOEJIT_CACHE_LOCK_TIMEOUT).
  double cache_lock_timeout_seconds = 60;
  // The cache key (options->cache_key_file, MOEJIT_CACHE_KEY_FILE): entries are written with a
  // MAC under it and served only with a valid one. Null: no key, entries are not authenticated.
  std::shared_ptr<const MacKey> cache_mac_key;
  std::string template_dir;  // empty: the embedded templates
  // Where template_dir came from, for messages: "options->template_dir" or "MOEJIT_TEMPLATE_DIR".
  std::string template_dir_setting = "template_dir";
  // options->log_level, validated (MOEJIT_LOG_DEFAULT: leave the logger as the environment set
  // it). The logger is shared by every runtime, so only a runtime that was created applies it.
  moejit_log_level log_level = MOEJIT_LOG_DEFAULT;
};

// sizeof(moejit_runtime_options) in the headers of 0.1 and 0.2, which ended at template_dir.
constexpr size_t kRuntimeOptionsSizeV02 = offsetof(moejit_runtime_options, cache_key_file);

// Throws Error(MOEJIT_ERROR_INVALID_ARGUMENT) naming the option or environment variable that
// holds a value it cannot use (a cache key file that breaks the rule of entry_mac.h included).
Settings resolve_settings(const moejit_runtime_options* options);

// MOEJIT_LOG_LEVEL, or nullptr when unset or empty (the logger parses it when first used).
const char* log_level_from_environment();

// Where the environment points NVRTC's search (src/nvrtc_loader.cpp); nullptr where unset or empty.
struct NvrtcEnvironment {
  const char* library;    // MOEJIT_NVRTC_LIBRARY: the one file to load
  const char* cuda_home;  // CUDA_HOME: a toolkit's root
  const char* cuda_path;  // CUDA_PATH: a toolkit's root
};
NvrtcEnvironment nvrtc_environment();

// Sets the library's logger to settings.log_level unless that is MOEJIT_LOG_DEFAULT.
void apply_log_level(const Settings& settings);

// "read-write" | "read-only" | "disabled" | "no-compile"
const char* cache_mode_name(moejit_cache_mode mode);

}  // namespace moejit
