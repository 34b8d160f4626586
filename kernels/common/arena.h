// The device arenas' bookkeeping: offsets into one region of a fixed capacity, carved first
// fit from a free list keyed by offset, neighbours coalesced on release, every block a
// multiple of the alignment. Shared by the CUDA backend (one cudaMalloc) and the emulated
// device (address space only); the caller holds the lock and maps offsets to its memory.
// Host code only (compiled by nvcc's host compiler too).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <string>
#include <unordered_map>

#include "fuyou/backend.h"
#include "fuyou/error.h"
#include "fuyou/sizes.h"

namespace fuyou {

class ArenaBlocks {
 public:
  ArenaBlocks(uint64_t capacity, uint64_t align)
      : capacity_(capacity / align * align), align_(align) {
    free_[0] = capacity_;
  }

  uint64_t capacity() const { return capacity_; }
  MemoryStats stats() const { return {capacity_, used_, peak_}; }

  // The offset of a block of at least `bytes` (rounded up to the alignment; `*rounded`
  // receives the size). Throws Error naming `what`, the request, what is free and the largest
  // free block, and `budget` (what the capacity is, for the message) when none fits.
  uint64_t take(uint64_t bytes, const std::string& what, const std::string& budget,
                uint64_t* rounded = nullptr) {
    const uint64_t size = std::max<uint64_t>(align_, (bytes + align_ - 1) / align_ * align_);
    auto it =
        std::find_if(free_.begin(), free_.end(), [&](const auto& f) { return f.second >= size; });
    if (it == free_.end()) {
      uint64_t largest = 0;
      for (const auto& f : free_) largest = std::max(largest, f.second);
      throw Error(str("device memory: ", what, " needs ", format_size(size), " but only ",
                      format_size(capacity_ - used_), " of the ", format_size(capacity_), " ",
                      budget, " is free, the largest free block ", format_size(largest)));
    }
    const uint64_t offset = it->first, have = it->second;
    free_.erase(it);
    if (have > size) free_[offset + size] = have - size;
    blocks_[offset] = size;
    used_ += size;
    peak_ = std::max(peak_, used_);
    if (rounded) *rounded = size;
    return offset;
  }

  // Returns the block at `offset` to the free list, merged with free neighbours; FY_CHECKs
  // that it was taken.
  void give_back(uint64_t offset) {
    auto b = blocks_.find(offset);
    FY_CHECK(b != blocks_.end(), "free of a pointer this backend did not allocate");
    uint64_t size = b->second;
    blocks_.erase(b);
    used_ -= size;
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += size;
        return;
      }
    }
    free_[offset] = size;
  }

 private:
  uint64_t capacity_, align_;
  std::map<uint64_t, uint64_t> free_;              // offset -> size
  std::unordered_map<uint64_t, uint64_t> blocks_;  // offset -> size, in use
  uint64_t used_ = 0, peak_ = 0;
};

}  // namespace fuyou
