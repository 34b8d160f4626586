// Where a logical offset of the SSD store lives: round robin over the directories by
// stripe unit, one backing file per directory (the formula is in include/fuyou/storage.h).
// Pure arithmetic, kept apart so the tests can check it against the bytes on disk.
#pragma once

#include <cstdint>

namespace fuyou {

struct StripeLayout {
  int ndirs;
  uint64_t stripe_unit;

  // Logical offset -> directory, file offset, and bytes until the next stripe boundary.
  // With one directory the file is the logical space: no boundaries (run = ~0).
  void map(uint64_t logical, int* dir, uint64_t* file_offset, uint64_t* run) const {
    if (ndirs == 1) {
      *dir = 0;
      *file_offset = logical;
      *run = ~0ull;
      return;
    }
    uint64_t nd = static_cast<uint64_t>(ndirs), s = logical / stripe_unit;
    uint64_t in = logical % stripe_unit;
    *dir = static_cast<int>(s % nd);
    *file_offset = (s / nd) * stripe_unit + in;
    *run = stripe_unit - in;
  }

  // The size directory d's file needs to hold the logical range [0, end).
  uint64_t file_size_for(int d, uint64_t end) const {
    if (ndirs == 1) return end;
    uint64_t nd = static_cast<uint64_t>(ndirs), dd = static_cast<uint64_t>(d);
    uint64_t full = end / stripe_unit, rem = end % stripe_unit;
    uint64_t size = (full / nd + (dd < full % nd ? 1 : 0)) * stripe_unit;
    if (rem && dd == full % nd) size += rem;  // the partial last stripe
    return size;
  }

  // The first file offset in directory d that logical [begin, begin + bytes) touches;
  // false if the range never reaches d. At most ndirs steps.
  bool first_in_dir(int d, uint64_t begin, uint64_t bytes, uint64_t* file_offset) const {
    for (uint64_t l = begin; l < begin + bytes;) {
      int dir;
      uint64_t fo, run;
      map(l, &dir, &fo, &run);
      if (dir == d) {
        *file_offset = fo;
        return true;
      }
      if (run == ~0ull) break;
      l += run;
    }
    return false;
  }
};

}  // namespace fuyou
