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
};

// Throws Error(MOEJIT_ERROR_INVALID_ARGUMENT) naming the option or environment variable that
// holds a value it cannot use.
Settings resolve_settings(const moejit_runtime_options* options);

// "read-write" | "read-only" | "disabled" | "no-compile"
const char* cache_mode_name(moejit_cache_mode mode);

}  // namespace moejit
