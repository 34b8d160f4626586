// Records kept whole: the record index beside a shard, the truncate policy, and the sampler
// that packs whole records into rows with their positions and loss masks (include/fuyou/data.h).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"

namespace fuyou {
namespace {

// The epoch orders come from their own streams, apart from the window sampler's draws.
constexpr uint64_t kOrderStream = uint64_t(1) << 62;

}  // namespace

void write_record_index(const std::string& path, const std::vector<uint64_t>& starts) {
  std::vector<char> buf(32 + 8 * starts.size());
  std::memcpy(buf.data(), kRecordMagic, 8);
  const uint32_t version = kShardVersion, width = 8, zero = 0;
  const uint64_t count = starts.size();
  std::memcpy(buf.data() + 8, &version, 4);
  std::memcpy(buf.data() + 12, &width, 4);
  std::memcpy(buf.data() + 16, &count, 8);
  std::memcpy(buf.data() + 24, &zero, 4);
  std::memcpy(buf.data() + 28, &zero, 4);
  if (!starts.empty()) std::memcpy(buf.data() + 32, starts.data(), 8 * starts.size());
  write_file_atomic(path, buf.data(), buf.size());
}

std::vector<uint64_t> parse_record_index(std::string_view bytes, const std::string& path,
                                         uint64_t shard_tokens) {
  if (bytes.size() < 32) throw IoError(str(path, ": shorter than the 32-byte record index header"));
  if (std::memcmp(bytes.data(), kRecordMagic, 8) != 0)
    throw IoError(str(path, ": not a record index (bad magic at offset 0)"));
  uint32_t version, width;
  uint64_t count;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&width, bytes.data() + 12, 4);
  std::memcpy(&count, bytes.data() + 16, 8);
  if (version != kShardVersion)
    throw IoError(str(path, ": record index version ", version, " at offset 8 is not supported"));
  if (width != 8) throw IoError(str(path, ": bytes per entry ", width, " at offset 12 must be 8"));
  if (count > (bytes.size() - 32) / 8 || bytes.size() != 32 + 8 * count)
    throw IoError(str(path, ": header says ", count, " records but the file has ",
                      bytes.size() - 32, " data bytes"));
  std::vector<uint64_t> starts(count);
  if (count) std::memcpy(starts.data(), bytes.data() + 32, 8 * count);
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t lo = i == 0 ? 0 : starts[i - 1] + 1;
    if ((i == 0 && starts[0] != 0) || starts[i] < lo || starts[i] >= shard_tokens)
      throw IoError(str(
          path, ": record ", i, " starts at token ", starts[i], " (offset ", 32 + 8 * i, "); ",
          i == 0
              ? "the first record starts at 0"
              : str("starts must increase, and stay below the shard's ", shard_tokens, " tokens")));
  }
  if (count == 0 && shard_tokens != 0)
    throw IoError(str(path, ": no records for a shard of ", shard_tokens, " tokens"));
  return starts;
}

std::vector<uint64_t> read_record_index(const std::string& path, uint64_t shard_tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open record index"));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_record_index(bytes, path, shard_tokens);
}

TruncatePolicy truncate_policy(const std::string& name) {
  if (name == "refuse") return TruncatePolicy::kRefuse;
  if (name == "right") return TruncatePolicy::kRight;
  if (name == "drop") return TruncatePolicy::kDrop;
  throw ConfigError(str("data.truncate: '", name, "' is not one of refuse, right, drop"));
}

RecordSelection select_records(const std::vector<uint64_t>& starts, uint64_t tokens,
                               const std::vector<uint8_t>* mask, uint64_t max_tokens,
                               TruncatePolicy policy, const std::string& split) {
  RecordSelection sel;
  sel.total = starts.size();
  for (size_t i = 0; i < starts.size(); ++i) {
    const uint64_t end = i + 1 < starts.size() ? starts[i + 1] : tokens;
    const uint64_t len = end - starts[i];
    sel.longest = std::max(sel.longest, len);
    if (len > max_tokens) ++sel.too_long;
  }
  if (sel.too_long && policy == TruncatePolicy::kRefuse)
    throw ConfigError(str(
        "data: ", sel.too_long, " of ", sel.total, " ", split,
        " records are longer than model.seq_len + 1 = ", max_tokens, " tokens (the longest has ",
        sel.longest,
        "); nothing is cut without being asked: raise model.seq_len, or set data.truncate to right "
        "(keep each record's first ",
        max_tokens, " tokens) or drop (leave those records out)"));
  for (size_t i = 0; i < starts.size(); ++i) {
    const uint64_t end = i + 1 < starts.size() ? starts[i + 1] : tokens;
    uint64_t len = end - starts[i];
    if (len > max_tokens) {
      if (policy == TruncatePolicy::kDrop) {
        sel.cut_tokens += len;
        continue;
      }
      sel.cut_tokens += len - max_tokens;
      len = max_tokens;
    }
    // Targets are tokens 1 .. len-1 of the record.
    const bool counts =
        len >= 2 && (!mask || std::any_of(mask->begin() + static_cast<ptrdiff_t>(starts[i] + 1),
                                          mask->begin() + static_cast<ptrdiff_t>(starts[i] + len),
                                          [](uint8_t m) { return m != 0; }));
    if (!counts) {
      ++sel.no_target;
      continue;
    }
    sel.records.push_back({starts[i], static_cast<uint32_t>(len)});
    sel.kept_tokens += len;
  }
  return sel;
}

RecordSampler::RecordSampler(const std::vector<int32_t>* tokens, const std::vector<uint8_t>* mask,
                             std::vector<Record> records, int B, int T, uint64_t seed, bool shuffle,
                             uint64_t limit)
    : tokens_(tokens),
      mask_(mask),
      records_(std::move(records)),
      B_(B),
      T_(T),
      seed_(seed),
      shuffle_(shuffle),
      limit_(limit) {
  if (records_.empty()) throw Error("data: no record to sample from");
  FY_CHECK(!mask_ || mask_->size() == tokens_->size(), "mask of ", mask_->size(), " for ",
           tokens_->size(), " tokens");
  for (const Record& r : records_)
    FY_CHECK(r.length >= 1 && r.length <= static_cast<uint32_t>(T + 1) &&
                 r.start + r.length <= tokens_->size(),
             "record at ", r.start, " of ", r.length, " tokens does not fit a row of ", T + 1);
}

const Record& RecordSampler::at(uint64_t stream_index) const {
  const uint64_t n = records_.size();
  const int64_t epoch = static_cast<int64_t>(stream_index / n);
  const size_t i = static_cast<size_t>(stream_index % n);
  if (!shuffle_) return records_[i];
  if (epoch != order_epoch_) {
    // Fisher-Yates from the epoch's own stream: the order depends on (seed, epoch) alone.
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0u);
    Rng rng(seed_, kOrderStream + static_cast<uint64_t>(epoch));
    for (uint64_t k = n - 1; k > 0; --k) std::swap(order_[k], order_[rng.below(k + 1)]);
    order_epoch_ = epoch;
  }
  return records_[order_[i]];
}

void RecordSampler::row(int32_t* tok, uint8_t* counted, int32_t* pos) {
  const int width = T_ + 1;
  int o = 0;
  while (next_ < limit_) {
    const Record& r = at(next_);
    if (o + static_cast<int>(r.length) > width) break;
    const int32_t* src = tokens_->data() + r.start;
    std::copy(src, src + r.length, tok + o);
    // Inputs o .. o+len-1 (those below T) at positions 0..; target i (token i+1) counts when
    // it is in this record and its mask says so.
    for (int i = o; i < o + static_cast<int>(r.length) && i < T_; ++i) {
      pos[i] = i - o;
      const bool inside = i + 1 < o + static_cast<int>(r.length);
      counted[i] = inside && (!mask_ || (*mask_)[r.start + (i - o) + 1]) ? 1 : 0;
    }
    o += static_cast<int>(r.length);
    ++next_;
  }
  // Padding: token 0 in a segment of its own, no target counted.
  for (int i = o; i < width; ++i) tok[i] = 0;
  for (int i = o; i < T_; ++i) {
    pos[i] = i - o;
    counted[i] = 0;
  }
}

void RecordSampler::next(int32_t* batch, uint8_t* counted, int32_t* positions) {
  for (int b = 0; b < B_; ++b)
    row(batch + static_cast<size_t>(b) * (T_ + 1), counted + static_cast<size_t>(b) * T_,
        positions + static_cast<size_t>(b) * T_);
}

uint64_t RecordSampler::rows_between(uint64_t from, uint64_t to) const {
  uint64_t rows = 0;
  int64_t fill = -1;  // tokens in the open row; -1: none open
  for (uint64_t s = from; s < to; ++s) {
    const int64_t len = at(s).length;
    if (fill < 0 || fill + len > T_ + 1) {
      ++rows;
      fill = 0;
    }
    fill += len;
  }
  return rows;
}

}  // namespace fuyou
