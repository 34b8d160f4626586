// fuyou-bench io: sequential write then read of one large extent through the SSD store,
// the way the optimizer streams a layer's state, for comparison with fio on the same
// directories (docs/performance.md).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fuyou {

struct IoBenchOptions {
  std::vector<std::string> dirs;
  uint64_t size = 4ull << 30;  // bytes written, then read
  int queue_depth = 32;
  uint64_t request_size = 1ull << 20;
  uint64_t stripe_unit = 4ull << 20;
  // Bytes per submitted store request; 0 means queue_depth * request_size, so one request
  // alone can fill the queue. `buffers` requests are kept outstanding.
  uint64_t block = 0;
  int buffers = 3;
  // Register the buffers with io_uring (READ_FIXED / WRITE_FIXED), as the engine does;
  // off, every request pins its pages, like fio without --fixedbufs.
  bool register_buffers = true;
  bool huge_pages = true;  // the pool asks for transparent huge pages
  bool keep_files = false;
  bool verify = true;  // the store's block checksums (StoreConfig::verify), as the engine runs it
};

// Runs the benchmark; returns the figures (read_MBps, write_MBps in 10^6 bytes/s, as fio's
// "MB/s"; times; the store's counters; peak RSS). Throws fuyou::Error on any failure,
// including data read back that is not what was written.
nlohmann::json run_io_bench(const IoBenchOptions& opts);

// The human table for a result of run_io_bench.
void print_io_bench(const nlohmann::json& result);

}  // namespace fuyou
