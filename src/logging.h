// The library's own named logger ("moejit"). It is never registered as, or replaces, the host
// application's default spdlog logger; its level comes from MOEJIT_LOG_LEVEL (default: warn) or
// from an explicit runtime's options.
#pragma once

#include <spdlog/spdlog.h>

namespace moejit {

spdlog::logger& logger();

// Parses "trace|debug|info|warn|error|off" (case-insensitive); false if unknown.
bool parse_log_level(const char* text, spdlog::level::level_enum* level);

}  // namespace moejit
