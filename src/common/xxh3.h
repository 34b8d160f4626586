// XXH3-64, the engine's checksum (SSD store blocks, checkpoint tensors), through libxxhash's
// run-time dispatch on x86-64: AVX-512, AVX2 or SSE2, whichever the CPU has. The values are
// the same on every path; the speed is not (on an AVX-512 EPYC, 1 MiB blocks in cache: 85
// GB/s against the plain entry point's SSE2 19.5 GB/s; from memory 25-28 against 18-19).
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#endif

namespace fuyou {

inline uint64_t xxh3_64(const void* p, size_t n) {
#if defined(__x86_64__)
  return XXH3_64bits_dispatch(p, n);
#else
  return XXH3_64bits(p, n);
#endif
}

inline void xxh3_64_update(XXH3_state_t* state, const void* p, size_t n) {
#if defined(__x86_64__)
  XXH3_64bits_update_dispatch(state, p, n);
#else
  XXH3_64bits_update(state, p, n);
#endif
}

// A checksum as the engine writes it in manifests and messages: 16 lower-case hex digits.
inline std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace fuyou
