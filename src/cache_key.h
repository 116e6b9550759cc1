// The cache key: a strong hash of everything that changes the compiled binary. One function,
// shared by the runtime and tools/precompile, so a warmed cache is exactly what the runtime asks
// for. (A hit must never return a binary built from another source, arch or compiler: the failure
// users reported against CuPy's and Velox's caches.)
#pragma once

#include <string>

#include "nvrtc_compiler.h"

namespace moejit {

// Bumped whenever the on-disk entry format or the meaning of a key changes.
constexpr int kCacheFormatVersion = 2;

// 32 lowercase hex digits (XXH3-128) of: cache format version, library version, NVRTC version,
// target, every option, every name expression, the generated source, and every header's name and
// bytes, each length-prefixed so no two different inputs serialize the same.
std::string cache_key(const CompileRequest& request);

// The same, with the NVRTC version and format version given explicitly (tests vary them).
std::string cache_key(const CompileRequest& request, const std::string& nvrtc_version,
                      int format_version);

}  // namespace moejit
