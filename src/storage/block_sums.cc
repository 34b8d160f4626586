#include "src/storage/block_sums.h"

#include <algorithm>
#include <iterator>

#include "src/common/xxh3.h"

namespace fuyou {

std::vector<uint64_t> hash_blocks(const char* p, uint64_t bytes) {
  std::vector<uint64_t> out((bytes + kSumBlock - 1) / kSumBlock);
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = xxh3_64(p + i * kSumBlock, std::min(kSumBlock, bytes - i * kSumBlock));
  return out;
}

SumResult check_blocks(const char* buf, const std::vector<SumCheck>& blocks) {
  SumResult r;
  for (const SumCheck& x : blocks) {
    const uint64_t h = xxh3_64(buf + x.buf_off, x.len);
    if (h == x.sum) {
      r.ok_bytes += x.len;
    } else if (r.bad++ == 0) {
      r.first_bad = x;
      r.first_got = h;
    }
  }
  return r;
}

namespace {

// The first record that ends after `offset` (records do not overlap, so at most the one
// before lower_bound can reach into the range).
template <class Records>
auto first_touching(Records& recs, uint64_t offset) {
  auto it = recs.lower_bound(offset);
  if (it != recs.begin() && std::prev(it)->first + std::prev(it)->second.len > offset) --it;
  return it;
}

}  // namespace

// A block's boundaries are fixed by its record's start, so the whole blocks kept before and
// after the range become records of their own: a suffix starts at a block boundary.
void BlockSums::forget(ExtentId id, uint64_t offset, uint64_t bytes) {
  Records& recs = extents_[id];
  const uint64_t end = offset + bytes;
  std::vector<std::pair<uint64_t, Record>> keep;
  auto it = first_touching(recs, offset);
  while (it != recs.end() && it->first < end) {
    const uint64_t r0 = it->first;
    const Record& r = it->second;
    const size_t n = r.sums.size();
    const size_t before = offset > r0 ? (offset - r0) / kSumBlock : 0;  // blocks ending <= offset
    const size_t after = (end - r0 + kSumBlock - 1) / kSumBlock;  // first block starting >= end
    if (before > 0)
      keep.push_back({r0, Record{before * kSumBlock, {r.sums.begin(), r.sums.begin() + before}}});
    if (after < n)
      keep.push_back({r0 + after * kSumBlock,
                      Record{r.len - after * kSumBlock, {r.sums.begin() + after, r.sums.end()}}});
    it = recs.erase(it);
  }
  for (auto& k : keep) recs.emplace(std::move(k));
}

void BlockSums::record(ExtentId id, uint64_t offset, uint64_t bytes, std::vector<uint64_t> sums) {
  forget(id, offset, bytes);
  if (bytes) extents_[id].emplace(offset, Record{bytes, std::move(sums)});
}

uint64_t BlockSums::expect(ExtentId id, uint64_t offset, uint64_t bytes,
                           std::vector<SumCheck>* out) const {
  const Records& recs = extents_[id];
  const uint64_t end = offset + bytes;
  uint64_t covered = 0;
  for (auto it = first_touching(recs, offset); it != recs.end() && it->first < end; ++it) {
    const uint64_t r0 = it->first;
    const Record& r = it->second;
    for (size_t i = offset > r0 ? (offset - r0 + kSumBlock - 1) / kSumBlock : 0; i < r.sums.size();
         ++i) {
      const uint64_t b0 = r0 + i * kSumBlock, b1 = r0 + std::min((i + 1) * kSumBlock, r.len);
      if (b1 > end) break;
      out->push_back(SumCheck{b0 - offset, b1 - b0, r.sums[i]});
      covered += b1 - b0;
    }
  }
  return covered;
}

}  // namespace fuyou
