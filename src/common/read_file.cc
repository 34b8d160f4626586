#include "fuyou/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fuyou/error.h"

namespace fuyou {

std::string read_file_bounded(const std::string& path, uint64_t max_bytes, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(str(path, ": cannot open ", what, " file: ", std::strerror(errno)));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      ::close(fd);
      throw IoError(str(path, ": cannot read ", what, " file at offset ", out.size(), ": ",
                        std::strerror(err)));
    }
    if (r == 0) break;
    // Read to the limit rather than trusting st_size: a pipe or /proc file reports 0.
    if (out.size() + static_cast<uint64_t>(r) > max_bytes) {
      ::close(fd);
      throw IoError(str(path, ": the ", what, " file is larger than the limit of ", max_bytes,
                        " bytes (is this the right file?)"));
    }
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

}  // namespace fuyou
