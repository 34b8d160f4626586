#include "fuyou/error.h"

namespace fuyou {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(str(file, ":", line, ": check failed: ", cond, msg.empty() ? "" : ": ", msg));
}

}  // namespace fuyou
