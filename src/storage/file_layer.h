// The file layer under the SSD store: every system call the store makes on its backing
// files goes through here, so a test can make any of them fail the way a real disk does
// (EIO, ENOSPC, a short transfer, a lying stat) without a broken disk or root.
//
// The named points a test can override:
//   "open", "close", "ftruncate", "fallocate", "fdatasync", "fstat", "stat", "statvfs":
//       the file-management calls below;
//   "ring.submit": before_io(), consulted for every io_uring request just before it goes
//       to the kernel (resubmissions included); it may fail the request with an errno
//       (the kernel never sees it) or shorten it, which makes the kernel do a genuinely
//       short transfer that the store must complete by resubmitting.
// All calls return 0 (or an fd) on success and -errno on failure, like io_uring, so an
// implementation never has to touch the global errno.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace fuyou {

enum class IoOp { kRead, kWrite };

const char* io_op_name(IoOp op);  // "read" / "write"

// One io_uring request as the store is about to submit it.
struct IoAttempt {
  IoOp op;
  int dir;                  // index of the directory (and backing file)
  const std::string* path;  // the backing file
  uint64_t file_offset;
  uint64_t bytes;
  int attempt;  // 0 for the first submission of this piece, then 1, 2, ...
};

// What before_io() decides. error != 0: complete the request with -error without doing it.
// Otherwise at most max_bytes of it go to the kernel (0 is treated as "no limit").
struct IoFault {
  int error = 0;
  uint64_t max_bytes = 0;
};

struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
};

class FileLayer {
 public:
  virtual ~FileLayer() = default;

  virtual int open(const std::string& path, int flags, mode_t mode);
  virtual int close(int fd);
  virtual int ftruncate(int fd, uint64_t size);
  // Allocates [offset, offset + bytes) and extends the size (mode 0).
  virtual int fallocate(int fd, uint64_t offset, uint64_t bytes);
  virtual int fdatasync(int fd);
  virtual int fstat(int fd, FileIdentity* out);
  virtual int stat(const std::string& path, FileIdentity* out);
  // Bytes an unprivileged writer may still allocate on the filesystem holding `dir`.
  virtual int statvfs_free(const std::string& dir, uint64_t* free_bytes);
  virtual int unlink(const std::string& path);

  virtual IoFault before_io(const IoAttempt& attempt) { return {}; }
};

// "Input/output error (EIO)": the errno text and name for messages.
std::string errno_text(int err);

}  // namespace fuyou
