#include "disk_cache.h"

#include "file_cache.h"

namespace moejit {

std::unique_ptr<DiskCache> open_disk_cache(const Settings& settings, Stats& stats) {
  switch (settings.cache_mode) {
    case MOEJIT_CACHE_MODE_DISABLED:
      return nullptr;
    // no-compile serves hits only, like read-only: it must never create or write anything.
    case MOEJIT_CACHE_MODE_READ_ONLY:
    case MOEJIT_CACHE_MODE_NO_COMPILE:
      return open_file_cache(settings.cache_dir, false, settings.cache_max_bytes, stats);
    default:
      return open_file_cache(settings.cache_dir, true, settings.cache_max_bytes, stats);
  }
}

}  // namespace moejit
