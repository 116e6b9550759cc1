// A synthetic but well-formed module and its entry, for tests that need no compile.
#pragma once

#include <string>

#include "cache_entry.h"
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

}  // namespace moejit::test
