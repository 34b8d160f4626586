// The SSD store's I/O thread (see src/storage/ssd_store.cc): it hands queued requests out
// as io_uring pieces, completes them (short transfers, EINTR/EAGAIN, failures) and finishes
// the jobs callers wait on.
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "src/storage/ssd_store_impl.h"

namespace fuyou {

using namespace ssd_store_detail;

// ---- the I/O thread ---------------------------------------------------------------------

// Hands out pieces of the queued jobs, oldest first, while fewer than queue_depth are in
// flight. A piece never crosses a stripe boundary or exceeds request_size.
void SsdStore::Impl::pump() {
  while (head >= 0 && !free_pieces.empty() && !stop) {
    Job& j = jobs[head];
    int p = free_pieces.back();
    free_pieces.pop_back();
    Piece& pc = pieces[p];
    uint64_t run;
    layout().map(j.logical + j.cursor, &pc.dir, &pc.file_offset, &run);
    pc.job = head;
    pc.len = std::min({cfg.request_size, run, j.bytes - j.cursor});
    pc.buf = j.buf + j.cursor;
    pc.done = 0;
    pc.buf_index = buffer_index(pc.buf, pc.len);
    pc.attempt = pc.retries = pc.no_progress = 0;
    j.cursor += pc.len;
    ++j.inflight;
    if (inflight++ == 0) busy_since = std::chrono::steady_clock::now();
    if (j.cursor == j.bytes) {  // fully handed out: the next job may start
      j.queued = false;
      head = j.next;
      if (head < 0) tail = -1;
    }
    issue(p);
  }
}

// Sends (the rest of) a piece to the kernel, after asking the file layer's fault hook.
void SsdStore::Impl::issue(int p) {
  Piece& pc = pieces[p];
  const Job& j = jobs[pc.job];
  uint64_t off = pc.file_offset + pc.done, len = pc.len - pc.done;
  IoFault fault =
      layer->before_io(IoAttempt{j.op, pc.dir, &files[pc.dir].path, off, len, pc.attempt});
  ++pc.attempt;
  if (fault.error) {
    synthetic.push_back(RingCompletion{static_cast<uint64_t>(p), -fault.error});
    return;
  }
  // An injected short transfer stays a multiple of 4 KiB: O_DIRECT refuses anything else.
  if (fault.max_bytes && fault.max_bytes < len)
    len = std::max(kIoAlign, fault.max_bytes / kIoAlign * kIoAlign);
  bool ok = ring->prep(j.op, pc.dir, pc.buf + pc.done, static_cast<uint32_t>(len), off,
                       pc.buf_index, static_cast<uint64_t>(p));
  FY_CHECK(ok, "io_uring submission queue full with ", inflight, " pieces in flight");
  ++stats.requests;
  if (pc.buf_index >= 0) ++stats.fixed_requests;
}

void SsdStore::Impl::complete(int p, int32_t res) {
  Piece& pc = pieces[p];
  Job& j = jobs[pc.job];
  const std::string& path = files[pc.dir].path;
  uint64_t off = pc.file_offset + pc.done, left = pc.len - pc.done;
  if (res == -EINTR || res == -EAGAIN) {
    ++stats.retries;
    if (++pc.retries <= kMaxRetries) return issue(p);
    return fail_piece(p, -res, str("still failing after ", kMaxRetries, " resubmissions"));
  }
  if (res < 0) return fail_piece(p, -res, "");
  uint64_t got = static_cast<uint64_t>(res);
  FY_CHECK(got <= left, "io_uring completed ", got, " bytes of a ", left, "-byte request");
  if (got == left) {
    (j.op == IoOp::kRead ? stats.bytes_read : stats.bytes_written) += pc.len;
    j.done += pc.len;
    return finish_piece(p);
  }
  if (got == 0 && j.op == IoOp::kRead) {
    FileIdentity now;
    uint64_t size = layer->fstat(files[pc.dir].fd, &now) == 0 ? now.size : 0;
    return fail_piece(
        p, 0,
        str("read past the end of the file: it is ", size, " bytes, the store allocated ",
            files[pc.dir].size, " (truncated under the store?)"));
  }
  // A short transfer: keep what landed (whole 4 KiB blocks only, since O_DIRECT cannot
  // resume mid-block; redoing part of a block is harmless) and resubmit the rest.
  ++stats.short_transfers;
  uint64_t kept = got / kIoAlign * kIoAlign;
  pc.done += kept;
  pc.no_progress = kept ? 0 : pc.no_progress + 1;
  if (pc.no_progress >= kMaxNoProgress)
    return fail_piece(
        p, 0,
        str(io_op_name(j.op), " made no progress ", kMaxNoProgress, " times in a row (", got,
            " bytes of ", left, " at offset ", off, " of ", path, ")"));
  issue(p);
}

void SsdStore::Impl::fail_piece(int p, int err, const std::string& why) {
  Piece& pc = pieces[p];
  Job& j = jobs[pc.job];
  const BackingFile& f = files[pc.dir];
  const ExtentInfo& e = extents[j.extent];
  uint64_t off = pc.file_offset + pc.done, left = pc.len - pc.done;
  if (j.failed && !j.error.empty()) {
    ++j.more_errors;
  } else {
    std::string detail = err ? errno_text(err) : why;
    if (err && !why.empty()) detail += "; " + why;
    if (err == ENOSPC) {
      uint64_t free_bytes = 0;
      if (layer->statvfs_free(f.dir, &free_bytes) == 0)
        detail += str(" (", free_bytes, " bytes free in ", f.dir, ")");
    }
    uint64_t ext_off = j.logical + (pc.buf - j.buf) + pc.done - e.logical_offset;
    j.error = str("SSD store: ", io_op_name(j.op), " of extent '", e.name, "' (extent offset ",
                  ext_off, ") failed at ", f.path, " offset ", off, " size ", left, ": ", detail);
  }
  j.failed = true;
  if (j.queued) {  // only the head job can have pieces in flight and bytes left to hand out
    FY_CHECK(head == pc.job, "a queued job with pieces in flight is not at the head");
    j.queued = false;
    head = j.next;
    if (head < 0) tail = -1;
  }
  finish_piece(p);
}

void SsdStore::Impl::finish_piece(int p) {
  Job& j = jobs[pieces[p].job];
  pieces[p].job = -1;
  free_pieces.push_back(p);
  if (--inflight == 0)
    stats.busy_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since).count();
  --j.inflight;
  if (j.inflight == 0 && !j.queued && (j.failed || j.done == j.bytes)) {
    j.finished = true;
    cv.notify_all();
  }
}

void SsdStore::Impl::fail_everything(const std::string& why) {
  fatal = why;
  for (auto& j : jobs) {
    if (!j.active || j.finished) continue;
    j.failed = true;
    j.finished = true;
    j.queued = false;
    if (j.error.empty()) j.error = why;
  }
  head = tail = -1;
  cv.notify_all();
}

void SsdStore::Impl::io_main() {
  RingCompletion done[64];
  bool wake_armed = false;
  std::unique_lock<std::mutex> lk(m);
  try {
    for (;;) {
      if (!wake_armed) {
        wake_armed = ring->prep_wake(wake_fd, &wake_buf, kWakeTag);
        FY_CHECK(wake_armed, "no room in the ring for the wake-up read");
      }
      pump();
      // Faults injected by before_io complete without the kernel; handle them (and what
      // they resubmit) before sleeping.
      while (!synthetic.empty()) {
        RingCompletion c = synthetic.back();
        synthetic.pop_back();
        complete(static_cast<int>(c.user_data), c.res);
        pump();
      }
      if (stop && inflight == 0) break;
      sleeping = true;
      lk.unlock();
      int r = ring->submit(1);
      unsigned n = ring->reap(done, 64);
      lk.lock();
      sleeping = false;
      if (r < 0 && r != -EAGAIN && r != -EBUSY)
        throw Error(str("io_uring_enter failed: ", errno_text(-r)));
      for (unsigned i = 0; i < n; ++i) {
        if (done[i].user_data == kWakeTag)
          wake_armed = false;
        else
          complete(static_cast<int>(done[i].user_data), done[i].res);
      }
    }
  } catch (const std::exception& e) {
    // The ring is unusable; nothing in flight can be trusted, so every request fails.
    if (!lk.owns_lock()) lk.lock();
    fail_everything(str("SSD store: the I/O thread stopped: ", e.what()));
  }
}

}  // namespace fuyou
