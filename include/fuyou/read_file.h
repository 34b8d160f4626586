// Reading a whole small file (a config, an index, a tokenizer) with a size limit, so that a
// user who points a path at the wrong, huge file gets an error instead of the process
// reading gigabytes into memory.
#pragma once

#include <cstdint>
#include <string>

namespace fuyou {

// The bytes of `path`. IoError naming the path and `what` ("tokenizer", "config") when it
// cannot be opened or read, or holds more than `max_bytes` bytes.
std::string read_file_bounded(const std::string& path, uint64_t max_bytes, const char* what);

}  // namespace fuyou
