#include "src/runtime/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "fuyou/error.h"
#include "fuyou/log.h"

namespace fuyou {
namespace {

// Errors a later attempt may not see: the disk or quota may free up, a transient device or
// network error may clear.
bool may_pass(int err) { return err == ENOSPC || err == EDQUOT || err == EIO || err == EAGAIN; }

}  // namespace

MetricsLog::MetricsLog(std::string path, double retry_seconds, WriteFn write)
    : path_(std::move(path)), retry_seconds_(retry_seconds), write_(std::move(write)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(str(path_, ": cannot open for appending: ", std::strerror(errno)));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::append(const std::string& line) {
  const std::string text = line + "\n";
  size_t done = 0;
  double waited = 0, pause = 0.05;
  bool warned = false;
  while (done < text.size()) {
    const ssize_t w = write_ ? write_(fd_, text.data() + done, text.size() - done)
                             : ::write(fd_, text.data() + done, text.size() - done);
    if (w > 0) {
      done += static_cast<size_t>(w);
      continue;
    }
    const int err = w < 0 ? errno : EIO;  // 0 bytes written for a non-empty write: no progress
    if (w < 0 && err == EINTR) continue;
    if (!may_pass(err) || waited >= retry_seconds_)
      throw IoError(str(path_, ": cannot append ", text.size() - done, " of the ", text.size(),
                        " bytes of a line: ", std::strerror(err),
                        may_pass(err) ? str(" (retried for ", waited, " s)") : std::string()));
    if (!warned)
      spdlog::warn("{}: write failed: {}; retrying for up to {} s (the line is kept)", path_,
                   std::strerror(err), retry_seconds_);
    warned = true;
    std::this_thread::sleep_for(std::chrono::duration<double>(pause));
    waited += pause;
    pause = std::min(2 * pause, 2.0);
  }
  if (warned) spdlog::info("{}: written again after {} s", path_, waited);
}

}  // namespace fuyou
