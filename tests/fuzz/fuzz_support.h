// Shared by the libFuzzer harnesses: what a harness may let through and what it checks.
//
// A harness feeds arbitrary bytes to one parser. A fuyou::Error is the parser refusing the
// input, which is the expected outcome for most inputs; any other exception escapes the
// harness and libFuzzer reports it (uncaught exception -> abort), and so do crashes and
// sanitizer reports. FUZZ_REQUIRE checks a property of an accepted input: accepting
// something inconsistent is silent corruption, so it aborts like a crash.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_REQUIRE(cond)                                                                   \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: accepted input breaks: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)
