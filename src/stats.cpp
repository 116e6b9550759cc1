#include "stats.h"

#include <cstring>

namespace moejit {

void Stats::copy_to(moejit_stats* out) const {
  moejit_stats s;
  s.struct_size = sizeof(s);
  s.memory_hits = memory_hits.load(std::memory_order_relaxed);
  s.disk_hits = disk_hits.load(std::memory_order_relaxed);
  s.compiles = compiles.load(std::memory_order_relaxed);
  s.disk_errors = disk_errors.load(std::memory_order_relaxed);
  s.launches = launches.load(std::memory_order_relaxed);
  s.compile_seconds =
      static_cast<double>(compile_nanoseconds.load(std::memory_order_relaxed)) * 1e-9;
  s.loaded_modules = loaded_modules.load(std::memory_order_relaxed);
  // Callers built against an older (smaller) struct get the fields they know about: whole fields
  // only (every field after struct_size is 8 bytes), never the first bytes of one.
  static_assert(sizeof(s) == sizeof(size_t) + 7 * 8, "moejit_stats: 8-byte fields");
  size_t n = out->struct_size < sizeof(s) ? out->struct_size : sizeof(s);
  n -= (n - sizeof(size_t)) % 8;
  std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t),
              reinterpret_cast<const char*>(&s) + sizeof(size_t), n - sizeof(size_t));
}

}  // namespace moejit
