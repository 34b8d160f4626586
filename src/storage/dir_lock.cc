#include "src/storage/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "fuyou/error.h"
#include "src/storage/file_layer.h"

namespace fuyou {
namespace {

// The pid a holder wrote into the lock file, or "unknown" while it is still writing it.
std::string holder_pid(int fd) {
  char buf[32] = {};
  ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "unknown" : s;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& what)
    : path_((std::filesystem::path(dir) / kDirLockName).string()) {
  // A few rounds at most: each retry means a holder released (unlinked) the file between
  // our open and our flock, which cannot keep happening without a new holder each time.
  for (int attempt = 0; attempt < 100; ++attempt) {
    struct stat before {};
    const bool existed = ::stat(path_.c_str(), &before) == 0;
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      throw IoError(str("cannot open the directory lock ", path_, ": ", errno_text(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string pid = holder_pid(fd);
      ::close(fd);
      if (err == EWOULDBLOCK && pid == std::to_string(::getpid()))
        throw IoError(str(
            what, " ", dir, " is already in use by this process (", path_,
            "): one directory is named twice, as the run directory and in offload.ssd_paths, or "
            "twice in offload.ssd_paths; each needs a directory of its own"));
      if (err == EWOULDBLOCK)
        throw IoError(str(what, " ", dir, " is in use by another fuyou process (pid ", pid,
                          " holds ", path_, "); two runs cannot share one"));
      throw IoError(str("cannot lock ", path_, ": ", errno_text(err)));
    }
    struct stat held {
    }, now{};
    if (::fstat(fd, &held) != 0 || ::stat(path_.c_str(), &now) != 0 || held.st_ino != now.st_ino ||
        held.st_dev != now.st_dev) {
      ::close(fd);  // released and unlinked under us: lock the file that is there now
      continue;
    }
    fd_ = fd;
    // A file we locked that was there before we looked, and is not the one a releaser
    // just unlinked, was left by a process that died holding it.
    stale_ = existed && before.st_ino == held.st_ino;
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 ||
        ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      const int err = errno;
      ::close(fd_);
      throw IoError(str("cannot write the directory lock ", path_, ": ", errno_text(err)));
    }
    return;
  }
  throw IoError(str("could not lock ", path_, ": it was replaced 100 times in a row"));
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());
  ::close(fd_);
}

}  // namespace fuyou
