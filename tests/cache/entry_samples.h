// A synthetic but well-formed module and its entry, for tests that need no compile.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_entry.h"
#include "entry_mac.h"
#include "nvrtc_compiler.h"

namespace moejit::test {

inline const std::string& sample_key() {
  static const std::string key = "0123456789abcdef0123456789abcdef";
  return key;
}

inline CompiledModule sample_module() {
  CompiledModule m;
  m.target = Target{90, false};
  m.image = std::string(
                "\x7f"
                "ELF",
                4) +
            std::string(200, '\x11');
  m.name_expressions = {"moejit::combine<float, 4>", "moejit::clear<int>"};
  m.lowered_names = {"_ZN6moejit7combineIfLi4EEEvv", "_ZN6moejit5clearIiEEvv"};
  m.options = {"--std=c++17", "--gpu-architecture=sm_90", "-DNDEBUG"};
  m.nvrtc_version = "13.0";
  m.log = "warning: something harmless";
  return m;
}

inline void put_u64(std::string* bytes, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    (*bytes)[at + static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
}

// Recomputes both checksums of an entry, so that damage reaches the checks behind them.
inline void reseal(std::string* bytes) {
  const size_t header = kCacheEntryHeaderBytes;
  put_u64(bytes, kCacheEntryPayloadHashOffset,
          XXH3_64bits(bytes->data() + header, bytes->size() - header));
  put_u64(bytes, kCacheEntryHeaderHashOffset,
          XXH3_64bits(bytes->data(), kCacheEntryHeaderHashOffset));
}

// A cache key (HMAC key) for tests: 32 fixed bytes.
inline std::shared_ptr<const MacKey> sample_mac_key(char fill = 'k') {
  return std::make_shared<const MacKey>(std::string(32, fill), "test-key");
}

}  // namespace moejit::test
