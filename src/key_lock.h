// A per-key build lock between processes: flock() on a lock file next to the entry. The kernel
// drops an flock when its holder dies, so a killed compiler never leaves a lock that hangs the
// others (the stale-lock hang of flashinfer#972); a live but stuck holder is waited for only up to
// a timeout, after which the waiter builds anyway. Correctness never depends on the lock: the
// entry itself is published atomically. A waiter watches the name as well as the lock: a holder
// that forked leaves its child a copy of the locked descriptor, so the inode may stay locked after
// the holder released it (unlinked the file), and only the name tells.
#pragma once

#include <memory>
#include <string>

#include "disk_cache.h"

namespace moejit {

class FileKeyLock : public KeyLock {
 public:
  // Waits up to timeout_seconds (0: one attempt) for the lock `name` in directory dir_fd (which
  // must stay open while the lock lives; it is duplicated). nullptr with *timed_out = true when
  // the wait ran out, or with *why set when the lock file could not be used.
  static std::unique_ptr<FileKeyLock> acquire(int dir_fd, const std::string& name,
                                              double timeout_seconds, bool* timed_out,
                                              std::string* why);
  // Removes the lock file, then unlocks: a later waiter always locks a file that is still linked.
  ~FileKeyLock() override;

  FileKeyLock(const FileKeyLock&) = delete;
  FileKeyLock& operator=(const FileKeyLock&) = delete;

 private:
  FileKeyLock(int dir_fd, int fd, std::string name)
      : dir_fd_(dir_fd), fd_(fd), name_(std::move(name)) {}
  int dir_fd_;
  int fd_;
  std::string name_;
};

}  // namespace moejit
