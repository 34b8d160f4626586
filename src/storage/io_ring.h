// A thin owner of one io_uring: setup, registered files and buffers, preparing reads and
// writes, submitting, and reaping completions. It keeps liburing out of every other file
// and knows nothing about extents, striping or retries (ssd_store.cc does).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "src/storage/file_layer.h"

namespace fuyou {

struct RingCompletion {
  uint64_t user_data;
  int32_t res;  // bytes transferred, or -errno
};

class IoRing {
 public:
  // A ring with room for `entries` requests in flight. Throws Error when the kernel has
  // no io_uring (or it is disabled by sysctl), with the errno.
  explicit IoRing(unsigned entries);
  ~IoRing();
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;

  // Registers the backing files so requests skip the per-request file lookup. Falls back
  // to plain descriptors if the kernel refuses; either way `file` in prep() is an index.
  void set_files(const std::vector<int>& fds);
  // Registers buffers (each at most 1 GiB) for READ_FIXED / WRITE_FIXED. Returns 0 or
  // -errno (ENOMEM when it exceeds the memory-lock limit); no request may be in flight.
  int register_buffers(const std::vector<iovec>& iovs);
  void unregister_buffers();

  // Prepares one request; buf_index >= 0 uses that registered buffer. Returns false when
  // the submission queue is full (the caller keeps at most `entries` in flight, so this
  // is a bug there, not a condition to handle).
  bool prep(IoOp op, int file, void* buf, uint32_t bytes, uint64_t offset, int buf_index,
            uint64_t user_data);
  // Prepares an 8-byte read of an eventfd (a plain descriptor, not a registered file):
  // another thread writing the eventfd then wakes a thread waiting in submit().
  bool prep_wake(int fd, uint64_t* buf, uint64_t user_data);
  // Submits what was prepared and, if wait_for > 0, waits until that many completions
  // are available. Returns the number submitted or -errno (EINTR is retried here).
  int submit(unsigned wait_for);
  // Copies up to `max` available completions into `out` and marks them seen; never blocks.
  unsigned reap(RingCompletion* out, unsigned max);

  bool fixed_files() const { return fixed_files_; }

 private:
  struct State;
  std::unique_ptr<State> s_;
  std::vector<int> fds_;
  bool fixed_files_ = false;
};

}  // namespace fuyou
