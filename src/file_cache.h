// The disk cache as a directory of entry files (see cache_entry.h for one entry):
//
//   <dir>/v1/<ab>/<key>.moejit      one entry per key, ab = the key's first two hex digits
//   <dir>/v1/<ab>/<key>.lock        per-key build lock (key_lock.h), removed by its holder
//   <dir>/v1/<ab>/.<key>.<pid>.<host>.<n>.tmp   an entry being written
//
// Publishing writes a uniquely named temp file in the entry's directory, fsyncs it, renames it
// over the entry and fsyncs the directory: a reader sees the old entry, the new one, or none,
// never a part. Directories are created 0700 and refused (memory only, one warning) if they are
// symlinks, not owned by us (or root), or writable by group or others.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "disk_cache.h"
#include "stats.h"

namespace moejit {

// The file cache at dir, writable or read-only; nullptr (after one warning) when dir cannot be
// used. Never throws.
std::unique_ptr<DiskCache> open_file_cache(const std::string& dir, bool writable,
                                           uint64_t max_bytes, Stats& stats);

}  // namespace moejit
