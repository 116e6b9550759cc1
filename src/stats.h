// Counters of one runtime, updated lock-free from any thread.
#pragma once

#include <atomic>
#include <cstdint>

#include "moejit/moejit.h"

namespace moejit {

struct Stats {
  std::atomic<uint64_t> memory_hits{0};
  std::atomic<uint64_t> disk_hits{0};
  std::atomic<uint64_t> compiles{0};
  std::atomic<uint64_t> disk_errors{0};
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> compile_nanoseconds{0};
  std::atomic<uint64_t> loaded_modules{0};  // a gauge: loaded now, not a count of loads

  void copy_to(moejit_stats* out) const;
};

}  // namespace moejit
