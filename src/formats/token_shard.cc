#include <algorithm>
#include <cstring>
#include <fstream>

#include "fuyou/config.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"

namespace fuyou {
namespace {

void put32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens,
                       uint32_t vocab_size) {
  uint32_t width = vocab_size <= 65536 ? 2 : 4;
  std::vector<char> buf(32 + tokens.size() * width);
  std::memcpy(buf.data(), kShardMagic, 8);
  put32(buf.data() + 8, kShardVersion);
  put32(buf.data() + 12, width);
  put64(buf.data() + 16, tokens.size());
  put32(buf.data() + 24, vocab_size);
  put32(buf.data() + 28, 0);
  char* p = buf.data() + 32;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab_size)
      throw Error(
          str(path, ": token ", tokens[i], " at index ", i, " is outside vocab size ", vocab_size));
    if (width == 2) {
      uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(p + 2 * i, &t, 2);
    } else {
      put32(p + 4 * i, static_cast<uint32_t>(tokens[i]));
    }
  }
  write_file_atomic(path, buf.data(), buf.size());
}

namespace {

// Checks the 32-byte header `h` of a shard file of `file_size` bytes.
TokenShardHeader check_shard_header(const char* h, uint64_t file_size, const std::string& path) {
  if (std::memcmp(h, kShardMagic, 8) != 0)
    throw IoError(str(path,
                      ": not a token shard (bad magic at offset 0; build shards with "
                      "'fuyou-convert text')"));
  const uint32_t version = get32(h + 8);
  TokenShardHeader sh;
  sh.width = get32(h + 12);
  sh.count = get64(h + 16);
  sh.vocab_size = get32(h + 24);
  if (version != kShardVersion)
    throw IoError(str(path, ": shard version ", version, " at offset 8 is not supported (expected ",
                      kShardVersion, ")"));
  if (sh.width != 2 && sh.width != 4)
    throw IoError(str(path, ": bytes per token ", sh.width, " at offset 12 must be 2 or 4"));
  // Tokens become int32 ids: a vocabulary beyond the engine's bound would let a token
  // pass the check below and turn negative.
  if (sh.vocab_size > static_cast<uint32_t>(kMaxVocab))
    throw IoError(str(path, ": vocab size ", sh.vocab_size, " at offset 24 is above the limit of ",
                      kMaxVocab));
  if (sh.count > (file_size - 32) / sh.width || file_size != 32 + sh.count * sh.width)
    throw IoError(str(path, ": header says ", sh.count, " tokens of ", sh.width,
                      " bytes but the file has ", file_size - 32, " data bytes"));
  return sh;
}

void decode_tokens(const char* raw, const TokenShardHeader& sh, const std::string& path,
                   TokenShard* shard) {
  shard->vocab_size = sh.vocab_size;
  shard->tokens.resize(sh.count);
  for (uint64_t i = 0; i < sh.count; ++i) {
    uint32_t t;
    if (sh.width == 2) {
      uint16_t s;
      std::memcpy(&s, raw + 2 * i, 2);
      t = s;
    } else {
      t = get32(raw + 4 * i);
    }
    if (t >= sh.vocab_size)
      throw IoError(str(path, ": token ", t, " at index ", i, " (offset ", 32 + i * sh.width,
                        ") is outside the shard's vocab size ", sh.vocab_size));
    shard->tokens[i] = static_cast<int32_t>(t);
  }
}

}  // namespace

namespace {

// Opens a shard and reads and checks its header, leaving `in` at the first token.
TokenShardHeader open_shard(std::ifstream& in, const std::string& path) {
  in.open(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open token shard"));
  char h[32];
  if (!in.read(h, 32)) throw IoError(str(path, ": shorter than the 32-byte shard header"));
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  const TokenShardHeader sh = check_shard_header(h, size, path);
  in.seekg(32);
  return sh;
}

}  // namespace

TokenShardHeader read_token_shard_header(const std::string& path) {
  std::ifstream in;
  return open_shard(in, path);
}

TokenShard read_token_shard(const std::string& path) {
  std::ifstream in;
  const TokenShardHeader sh = open_shard(in, path);
  std::vector<char> raw(sh.count * sh.width);
  if (!in.read(raw.data(), static_cast<std::streamsize>(raw.size())))
    throw IoError(str(path, ": read failed"));
  TokenShard shard;
  shard.path = path;
  decode_tokens(raw.data(), sh, path, &shard);
  return shard;
}

TokenShard parse_token_shard(std::string_view bytes, const std::string& path) {
  if (bytes.size() < 32) throw IoError(str(path, ": shorter than the 32-byte shard header"));
  const TokenShardHeader sh = check_shard_header(bytes.data(), bytes.size(), path);
  TokenShard shard;
  shard.path = path;
  decode_tokens(bytes.data() + 32, sh, path, &shard);
  return shard;
}

BatchSampler::BatchSampler(const std::vector<int32_t>* tokens, int B, int T, uint64_t seed)
    : BatchSampler(tokens, nullptr, B, T, seed) {}

BatchSampler::BatchSampler(const std::vector<int32_t>* tokens, const std::vector<uint8_t>* mask,
                           int B, int T, uint64_t seed)
    : tokens_(tokens), mask_(mask), B_(B), T_(T), seed_(seed) {
  if (tokens_->size() < static_cast<size_t>(T + 1))
    throw Error(str("data: ", tokens_->size(),
                    " tokens is fewer than one sequence of seq_len + 1 = ", T + 1, " tokens"));
  if (mask_) {
    if (mask_->size() != tokens_->size())
      throw Error(str("data: the loss mask has ", mask_->size(), " entries for ", tokens_->size(),
                      " tokens"));
    // Token 0 is never a target.
    if (std::find_if(mask_->begin() + 1, mask_->end(), [](uint8_t m) { return m != 0; }) ==
        mask_->end())
      throw Error(
          str("data: the loss mask counts none of the ", tokens_->size(),
              " tokens as a target (every prompt/completion pair has an empty completion?)"));
  }
}

void BatchSampler::take(uint64_t start, int b, int32_t* batch, uint8_t* counted) const {
  std::memcpy(batch + static_cast<size_t>(b) * (T_ + 1), tokens_->data() + start,
              sizeof(int32_t) * (T_ + 1));
  if (mask_ && counted)
    std::memcpy(counted + static_cast<size_t>(b) * T_, mask_->data() + start + 1, T_);
}

void BatchSampler::next(int32_t* batch, uint8_t* counted) {
  const uint64_t span = tokens_->size() - T_;  // valid start positions
  for (int b = 0; b < B_; ++b) {
    Rng rng(seed_, draws_++);
    uint64_t start = rng.below(span);
    if (mask_) {
      const uint8_t* m = mask_->data() + 1;
      auto none_counts = [&](uint64_t s) {
        return std::none_of(m + s, m + s + T_, [](uint8_t c) { return c; });
      };
      for (int redraw = 0; redraw < kMaxRedraws && none_counts(start); ++redraw) {
        Rng again(seed_, draws_++);
        start = again.below(span);
      }
    }
    take(start, b, batch, counted);
  }
}

void BatchSampler::fixed(int64_t i, int64_t count, int32_t* batch, uint8_t* counted) const {
  const uint64_t span = tokens_->size() - T_;
  const uint64_t windows = static_cast<uint64_t>(count) * B_;
  for (int b = 0; b < B_; ++b) {
    uint64_t w = static_cast<uint64_t>(i) * B_ + b;
    uint64_t start = windows > 1 ? w * (span - 1) / (windows - 1) : 0;
    take(start, b, batch, counted);
  }
}

}  // namespace fuyou
