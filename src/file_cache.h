// The disk cache as a directory of entry files (layout and trust rules: cache_files.h; one entry:
// cache_entry.h).
//
// Publishing writes a uniquely named temp file in the entry's directory, fsyncs it, renames it
// over the entry and fsyncs the directory: a reader sees the old entry, the new one, or none,
// never a part. A write that would pass the process's file size limit (RLIMIT_FSIZE) is not
// attempted: the kernel would kill the process with SIGXFSZ. A write that fails for lack of space
// evicts least recently used entries and is tried once more. Eviction works from a scan of the
// whole cache, which a process repeats only when its count of the cache's bytes passes the cap,
// or a minute after its last scan; it then evicts down to 90% of the cap, so a cache at its cap
// is not rescanned at every write.
#pragma once

#include <atomic>
#include <memory>

#include "disk_cache.h"
#include "settings.h"
#include "stats.h"

namespace moejit {

// The disk cache the settings ask for (directory, mode, size cap, lock timeout, MAC key), or
// nullptr when it is disabled or unusable (after one warning). Never throws for I/O reasons.
std::unique_ptr<DiskCache> open_disk_cache(const Settings& settings, Stats& stats);

namespace test_hooks {
// Called by a writer with the complete temp file written, just before the rename that publishes
// it (tests stop or kill the writer there). Null, as it always is outside tests: nothing is called.
extern std::atomic<void (*)()> before_rename;
}  // namespace test_hooks

}  // namespace moejit
