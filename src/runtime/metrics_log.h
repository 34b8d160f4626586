// metrics.jsonl of a run: one JSON object per line, appended as the run logs. A line that
// cannot be written is never dropped in silence: a write that fails with an error that can
// pass (ENOSPC, EDQUOT, EIO, EAGAIN: a disk that fills for a moment, a network filesystem
// that hiccups) is retried with growing pauses, the part already written kept, so that the
// line lands whole and once; when it still fails after the retry time, or fails with an
// error that cannot pass (EFBIG, EBADF, ...), append() throws an IoError naming the file, the
// bytes and the reason, and the run stops.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>

namespace fuyou {

class MetricsLog {
 public:
  // Replaces write(2) (tests inject ENOSPC or short writes through it).
  using WriteFn = std::function<ssize_t(int fd, const void* data, size_t bytes)>;

  // Opens (creates) `path` for appending. IoError naming it when it cannot.
  MetricsLog(std::string path, double retry_seconds = 30, WriteFn write = {});
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Appends `line` and a newline, retrying as above.
  void append(const std::string& line);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  double retry_seconds_;
  WriteFn write_;
};

}  // namespace fuyou
