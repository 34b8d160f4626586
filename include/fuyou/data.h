// Training data: token shards on disk and the byte-level tokenizer that builds them from
// plain text. The shard format is in docs/data.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace fuyou {

// Shard header: 32 bytes, little-endian.
//   0  char[8] magic "FYTOKENS"
//   8  u32     version (1)
//   12 u32     bytes per token (2 or 4)
//   16 u64     token count
//   24 u32     vocab size (every token is < this)
//   28 u32     reserved (0)
// followed by `count` tokens of `bytes per token` each.
constexpr char kShardMagic[8] = {'F', 'Y', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint32_t kShardVersion = 1;

struct TokenShard {
  std::string path;
  uint32_t vocab_size = 0;
  std::vector<int32_t> tokens;
};

// Writes atomically. Uses 2 bytes per token when vocab_size <= 65536, else 4.
void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens,
                       uint32_t vocab_size);
// Reads and validates (magic, version, width, vocab size <= kMaxVocab, count against file
// size, every token < vocab).
TokenShard read_token_shard(const std::string& path);
// The same for a shard's bytes in memory; `path` names it in errors.
TokenShard parse_token_shard(std::string_view bytes, const std::string& path);

// Byte-level tokenizer: token = byte value, vocab 256.
constexpr uint32_t kByteVocab = 256;
std::vector<int32_t> byte_encode(const std::string& text);
std::string byte_decode(const std::vector<int32_t>& tokens);

// The files named by `inputs`: files as given, directories walked recursively in sorted
// order; symlinks are skipped and counted in *skipped. IoError for a path that is neither.
std::vector<std::filesystem::path> list_input_files(const std::vector<std::string>& inputs,
                                                    size_t* skipped);
// A whole file's bytes; IoError naming the path when it cannot be opened.
std::string read_whole_file(const std::string& path);

struct TextShardResult {
  std::string train_path;
  std::string val_path;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  size_t files = 0;
  size_t skipped = 0;  // binary files (containing NUL bytes) and symlinks
};

// Tokenizes text files (directories are walked recursively, in sorted order; binary files and
// symlinks are skipped) into out_dir/train.tok and out_dir/val.tok. The last val_fraction of
// each file goes to validation, so both splits see every source.
TextShardResult build_text_shards(const std::vector<std::string>& inputs,
                                  const std::string& out_dir, double val_fraction);

// Samples training windows: micro-batches of B sequences of T+1 tokens at random positions,
// deterministic in the seed.
//
// With a loss mask (one 0/1 byte per token, read_loss_mask(): mask[i] says whether predicting
// token i counts), each window also yields which of its T targets count: counted[b*T + t] =
// mask[start + t + 1], row b's target t being token start + t + 1. A random window none of
// whose targets counts carries no training signal, so next() draws again for it (up to
// kMaxRedraws times; the draw counter advances, so sampling stays deterministic). Without a
// mask, windows are drawn exactly as before masks existed.
class BatchSampler {
 public:
  static constexpr int kMaxRedraws = 64;

  BatchSampler(const std::vector<int32_t>* tokens, int B, int T, uint64_t seed);
  // Same with a loss mask of tokens->size() entries (null: every target counts). Throws when
  // the sizes differ or no target in the data counts.
  BatchSampler(const std::vector<int32_t>* tokens, const std::vector<uint8_t>* mask, int B,
               int T, uint64_t seed);
  bool has_mask() const { return mask_ != nullptr; }
  // Fills `batch` (B*(T+1)) with the next random windows and, when the sampler has a mask and
  // `counted` is not null, counted (B*T) with which targets count.
  void next(int32_t* batch, uint8_t* counted = nullptr);
  // Fills `batch` with the i-th fixed evaluation batch (windows evenly spaced), and `counted`
  // as next() does (no redraws: a fixed window may have no counted target).
  void fixed(int64_t i, int64_t count, int32_t* batch, uint8_t* counted = nullptr) const;
  uint64_t position() const { return draws_; }
  // Continues from a position() saved earlier (a checkpoint): the windows that follow are
  // those an uninterrupted sampler would have drawn next.
  void set_position(uint64_t draws) { draws_ = draws; }

 private:
  void take(uint64_t start, int b, int32_t* batch, uint8_t* counted) const;

  const std::vector<int32_t>* tokens_;
  const std::vector<uint8_t>* mask_ = nullptr;
  int B_, T_;
  uint64_t seed_;
  uint64_t draws_ = 0;
};

}  // namespace fuyou
