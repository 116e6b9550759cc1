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
namespace {

// Whether the open file fd is still the one linked at name in dir_fd.
bool still_linked(int fd, int dir_fd, const std::string& name) {
  struct stat held {
  }, linked{};
  return fstat(fd, &held) == 0 &&
         fstatat(dir_fd, name.c_str(), &linked, AT_SYMLINK_NOFOLLOW) == 0 &&
         held.st_ino == linked.st_ino && held.st_dev == linked.st_dev;
}

}  // namespace

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
    bool locked = false;
    for (;;) {
      if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        locked = true;
        break;
      }
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
      // The holder unlinks the file before it unlocks. Once the name no longer leads here the
      // holder is done, though this inode may stay locked: a child it forked keeps a copy of its
      // descriptor, and the flock with it, until that child closes it or exits. Start over on the
      // name rather than wait for the child.
      if (!still_linked(fd, dir_fd, name)) break;
    }
    // An orphaned inode (locked just as its holder unlinked it, or left by the loop above)
    // excludes nobody: start over on the file now at that name.
    if (locked && still_linked(fd, dir_fd, name)) {
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
