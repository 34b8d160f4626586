// Errors and checks.
//
// Two kinds of failure, two mechanisms. A user error (bad config key, unreadable file,
// budget that does not fit) throws fuyou::Error with a message the user can act on: which
// key, which file, which offset, which number. A programmer error (a broken invariant)
// goes through FY_CHECK, which also throws, with file:line, so tests can observe it and a
// tool can print it instead of dumping core.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fuyou {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A config value that is missing, of the wrong type, or impossible.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what) {}
};

// A file that cannot be read or written, or whose contents are malformed.
class IoError : public Error {
 public:
  explicit IoError(const std::string& what) : Error(what) {}
};

[[noreturn]] void check_failed(const char* file, int line, const char* cond,
                               const std::string& msg);

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

// Concatenates any streamable values into a string: str("layer ", l, " of ", n).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

// The items with `sep` between them: join({"a", "b"}) is "a, b".
std::string join(const std::vector<std::string>& items, std::string_view sep = ", ");

// A name or value from a file, made safe to print in an error message: control bytes (a NUL
// would end the message early; an escape sequence would reach the terminal) are written as
// \xNN, and text beyond `max_bytes` is cut with "...".
std::string printable(std::string_view text, size_t max_bytes = 200);

}  // namespace fuyou

#define FY_CHECK(cond, ...)                                                                   \
  do {                                                                                        \
    if (!(cond)) ::fuyou::check_failed(__FILE__, __LINE__, #cond, ::fuyou::str(__VA_ARGS__)); \
  } while (0)
