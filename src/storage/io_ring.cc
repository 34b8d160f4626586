#include "src/storage/io_ring.h"

#include <liburing.h>

#include <cerrno>

#include "fuyou/error.h"
#include "fuyou/log.h"

namespace fuyou {

struct IoRing::State {
  io_uring ring;
};

IoRing::IoRing(unsigned entries) : s_(std::make_unique<State>()) {
  io_uring_params params{};
  // COOP_TASKRUN: completions are processed when the submitting thread next enters the
  // kernel instead of interrupting it; the store's I/O thread both submits and waits, so
  // it always does. Older kernels reject the flag, so fall back to plain setup.
  params.flags = IORING_SETUP_COOP_TASKRUN;
  int r = io_uring_queue_init_params(entries, &s_->ring, &params);
  if (r == -EINVAL) {
    params = io_uring_params{};
    r = io_uring_queue_init_params(entries, &s_->ring, &params);
  }
  if (r < 0)
    throw Error(str(
        "SSD store: cannot set up io_uring with ", entries, " entries: ", errno_text(-r),
        r == -EPERM || r == -ENOSYS ? " (io_uring is disabled: see sysctl kernel.io_uring_disabled)"
                                    : ""));
}

IoRing::~IoRing() { io_uring_queue_exit(&s_->ring); }

void IoRing::set_files(const std::vector<int>& fds) {
  fds_ = fds;
  int r = io_uring_register_files(&s_->ring, fds.data(), static_cast<unsigned>(fds.size()));
  fixed_files_ = r == 0;
  if (r < 0)
    spdlog::debug("io_uring: registering files failed ({}); using plain descriptors",
                  errno_text(-r));
}

int IoRing::register_buffers(const std::vector<iovec>& iovs) {
  return io_uring_register_buffers(&s_->ring, iovs.data(), static_cast<unsigned>(iovs.size()));
}

void IoRing::unregister_buffers() { io_uring_unregister_buffers(&s_->ring); }

bool IoRing::prep(IoOp op, int file, void* buf, uint32_t bytes, uint64_t offset, int buf_index,
                  uint64_t user_data) {
  io_uring_sqe* sqe = io_uring_get_sqe(&s_->ring);
  if (!sqe) return false;
  int fd = fixed_files_ ? file : fds_[file];
  if (op == IoOp::kRead) {
    if (buf_index >= 0)
      io_uring_prep_read_fixed(sqe, fd, buf, bytes, offset, buf_index);
    else
      io_uring_prep_read(sqe, fd, buf, bytes, offset);
  } else {
    if (buf_index >= 0)
      io_uring_prep_write_fixed(sqe, fd, buf, bytes, offset, buf_index);
    else
      io_uring_prep_write(sqe, fd, buf, bytes, offset);
  }
  if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, user_data);
  return true;
}

bool IoRing::prep_wake(int fd, uint64_t* buf, uint64_t user_data) {
  io_uring_sqe* sqe = io_uring_get_sqe(&s_->ring);
  if (!sqe) return false;
  io_uring_prep_read(sqe, fd, buf, sizeof *buf, 0);
  io_uring_sqe_set_data64(sqe, user_data);
  return true;
}

int IoRing::submit(unsigned wait_for) {
  for (;;) {
    int r = wait_for ? io_uring_submit_and_wait(&s_->ring, wait_for) : io_uring_submit(&s_->ring);
    if (r != -EINTR) return r;
  }
}

unsigned IoRing::reap(RingCompletion* out, unsigned max) {
  unsigned n = 0;
  io_uring_cqe* cqe = nullptr;
  while (n < max && io_uring_peek_cqe(&s_->ring, &cqe) == 0 && cqe) {
    out[n++] = RingCompletion{io_uring_cqe_get_data64(cqe), cqe->res};
    io_uring_cqe_seen(&s_->ring, cqe);
  }
  return n;
}

}  // namespace fuyou
