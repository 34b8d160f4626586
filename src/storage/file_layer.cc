#include "src/storage/file_layer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "fuyou/error.h"

namespace fuyou {

namespace {

// Retries a call interrupted by a signal; returns its result or -errno.
template <typename F>
int retry_eintr(F f) {
  for (;;) {
    int r = f();
    if (r >= 0) return r;
    if (errno != EINTR) return -errno;
  }
}

void fill_identity(const struct stat& st, FileIdentity* out) {
  out->dev = static_cast<uint64_t>(st.st_dev);
  out->ino = static_cast<uint64_t>(st.st_ino);
  out->size = static_cast<uint64_t>(st.st_size);
}

}  // namespace

const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string errno_text(int err) {
  const char* name = strerrorname_np(err);
  return str(std::error_code(err, std::generic_category()).message(), " (", name ? name : "errno ",
             name ? "" : std::to_string(err), ")");
}

int FileLayer::open(const std::string& path, int flags, mode_t mode) {
  return retry_eintr([&] { return ::open(path.c_str(), flags, mode); });
}

int FileLayer::close(int fd) {
  // close() must not be retried on EINTR on Linux: the descriptor is gone either way.
  return ::close(fd) == 0 ? 0 : -errno;
}

int FileLayer::ftruncate(int fd, uint64_t size) {
  return retry_eintr([&] { return ::ftruncate(fd, static_cast<off_t>(size)); });
}

int FileLayer::fallocate(int fd, uint64_t offset, uint64_t bytes) {
  return retry_eintr(
      [&] { return ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)); });
}

int FileLayer::fdatasync(int fd) {
  return retry_eintr([&] { return ::fdatasync(fd); });
}

int FileLayer::fstat(int fd, FileIdentity* out) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return -errno;
  fill_identity(st, out);
  return 0;
}

int FileLayer::stat(const std::string& path, FileIdentity* out) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return -errno;
  fill_identity(st, out);
  return 0;
}

int FileLayer::statvfs_free(const std::string& dir, uint64_t* free_bytes) {
  struct statvfs sv;
  int r = retry_eintr([&] { return ::statvfs(dir.c_str(), &sv); });
  if (r < 0) return r;
  *free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  return 0;
}

int FileLayer::unlink(const std::string& path) { return ::unlink(path.c_str()) == 0 ? 0 : -errno; }

}  // namespace fuyou
