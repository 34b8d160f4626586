// The lock an SSD store holds on each of its directories while it is open: an flock on
// DIR/fuyou.lock, which holds the owner's pid as text for messages. The kernel drops the
// flock when the process ends however it ends (SIGKILL, power loss), so a lock file that
// can be locked is proof that the process that wrote the files beside it is gone, and
// those files can be reclaimed.
//
// Release unlinks the lock file while still holding the flock; an acquirer that raced with
// that unlink locked an inode no longer at the path, sees the inode change and tries again.
#pragma once

#include <string>

namespace fuyou {

inline constexpr const char* kDirLockName = "fuyou.lock";

class DirLock {
 public:
  // Takes the lock on `dir` without waiting. Throws IoError naming the directory (as `what`,
  // e.g. "SSD store: directory") and the pid that holds it when another process does.
  DirLock(const std::string& dir, const std::string& what);
  ~DirLock();  // release(): unlinks the lock file and closes it
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  const std::string& path() const { return path_; }
  // True when the lock file was already there: a fuyou process used the directory before
  // and ended without releasing it (killed, crashed), so what it left is its own.
  bool found_stale() const { return stale_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool stale_ = false;
};

}  // namespace fuyou
