#include "disk_cache.h"

namespace moejit {

std::unique_ptr<DiskCache> open_disk_cache(const Settings&, Stats&) {
  // The on-disk cache is not built yet: every runtime compiles in memory.
  return nullptr;
}

}  // namespace moejit
