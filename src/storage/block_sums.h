// The SSD store's checksums (StoreConfig::verify, include/fuyou/storage.h "Integrity"): per
// extent, the XXH3-64 of each kSumBlock-byte block of every write request, kept by the
// request's extent offset, and the blocks a read covers whole, which it checks when waited.
// Not thread-safe: the store calls it with its lock held (hashing itself runs outside).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "fuyou/storage.h"

namespace fuyou {

// A block a read checks: where it lies in the read's buffer, and its sum when written.
struct SumCheck {
  uint64_t buf_off = 0;
  uint64_t len = 0;
  uint64_t sum = 0;
};

// The sums of `bytes` at `p` in kSumBlock blocks from the start (the last one shorter).
std::vector<uint64_t> hash_blocks(const char* p, uint64_t bytes);

// What checking a read's buffer found: the bytes whose sums matched and the mismatches (the
// first one, with what it hashes to now).
struct SumResult {
  uint64_t ok_bytes = 0;
  size_t bad = 0;
  SumCheck first_bad;
  uint64_t first_got = 0;
};
SumResult check_blocks(const char* buf, const std::vector<SumCheck>& blocks);

class BlockSums {
 public:
  void add_extent() { extents_.emplace_back(); }
  // A write of [offset, offset + bytes) with its blocks' sums; replaces what it overlaps.
  void record(ExtentId id, uint64_t offset, uint64_t bytes, std::vector<uint64_t> sums);
  // Drops the sums of every block the range touches; whole blocks of the same records outside
  // it stay (a failed write: what reached the disk is unknown).
  void forget(ExtentId id, uint64_t offset, uint64_t bytes);
  // Appends the blocks a read of [offset, offset + bytes) covers whole; returns their bytes
  // (the rest of the read cannot be checked).
  uint64_t expect(ExtentId id, uint64_t offset, uint64_t bytes, std::vector<SumCheck>* out) const;

 private:
  struct Record {
    uint64_t len = 0;
    std::vector<uint64_t> sums;
  };
  using Records = std::map<uint64_t, Record>;  // by the write's extent offset; never overlapping
  std::vector<Records> extents_;
};

}  // namespace fuyou
