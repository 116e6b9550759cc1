#include "key_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

namespace moejit {

std::unique_ptr<FileKeyLock> FileKeyLock::acquire(int dir_fd, const std::string& name,
                                                  double timeout_seconds, bool* timed_out,
                                                  std::string* why) {
  *timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<long long>(timeout_seconds * 1e6));
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    const int fd = openat(dir_fd, name.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      *why = "cannot open lock file " + name + ": " + std::strerror(errno);
      return nullptr;
    }
    for (;;) {
      if (flock(fd, LOCK_EX | LOCK_NB) == 0) break;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        *why = "cannot lock " + name + ": " + std::strerror(errno);
        close(fd);
        return nullptr;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        *timed_out = true;
        close(fd);
        return nullptr;
      }
      // Polling with a capped back-off instead of a blocking flock(): a blocking wait could not
      // honour the timeout, and the holder is usually done within one compile.
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::milliseconds(50)) pause *= 2;
    }
    // The previous holder unlinks the file before it unlocks; if we locked such an orphaned
    // inode, the lock excludes nobody: start over on the file now at that name.
    struct stat held {
    }, linked{};
    if (fstat(fd, &held) == 0 && fstatat(dir_fd, name.c_str(), &linked, AT_SYMLINK_NOFOLLOW) == 0 &&
        held.st_ino == linked.st_ino && held.st_dev == linked.st_dev) {
      const int dir_copy = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
      if (dir_copy < 0) {
        *why = std::string("cannot duplicate a directory descriptor: ") + std::strerror(errno);
        close(fd);
        return nullptr;
      }
      return std::unique_ptr<FileKeyLock>(new FileKeyLock(dir_copy, fd, name));
    }
    close(fd);
  }
}

FileKeyLock::~FileKeyLock() {
  unlinkat(dir_fd_, name_.c_str(), 0);
  close(fd_);
  close(dir_fd_);
}

}  // namespace moejit
