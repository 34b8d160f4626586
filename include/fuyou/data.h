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
// A shard's 32-byte header, validated as read_token_shard validates it (all but the tokens).
struct TokenShardHeader {
  uint32_t width = 0;  // bytes per token
  uint64_t count = 0;  // tokens
  uint32_t vocab_size = 0;
};
TokenShardHeader read_token_shard_header(const std::string& path);
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
  BatchSampler(const std::vector<int32_t>* tokens, const std::vector<uint8_t>* mask, int B, int T,
               uint64_t seed);
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

// ---- records ------------------------------------------------------------------------------
// Fine-tuning data kept in records (docs/data.md, "Records"): a record index beside a shard
// (train.rec next to train.tok) says where each record (a JSON Lines line: a document, a
// prompt/completion pair, a conversation) begins. Its header has the token shard's 32-byte
// layout with magic "FYRECIDX", version 1, 8 bytes per entry, the number of records as the
// count and 0 in the vocab field; then each record's first token as a u64, strictly
// increasing from 0. Record i is tokens [start[i], start[i + 1]) of the shard, the last one
// ending with the shard.
constexpr char kRecordMagic[8] = {'F', 'Y', 'R', 'E', 'C', 'I', 'D', 'X'};

void write_record_index(const std::string& path, const std::vector<uint64_t>& starts);
// Reads and validates (magic, version, width, count against the file size, starts from 0,
// strictly increasing, below the shard's `shard_tokens`).
std::vector<uint64_t> read_record_index(const std::string& path, uint64_t shard_tokens);
std::vector<uint64_t> parse_record_index(std::string_view bytes, const std::string& path,
                                         uint64_t shard_tokens);

struct Record {
  uint64_t start = 0;   // first token in the split's concatenated tokens
  uint32_t length = 0;  // tokens, at most seq_len + 1 once selected
};

// data.truncate: what happens to a record longer than seq_len + 1 tokens (a record of seq_len
// + 1 tokens fills a row: its last token is only ever a target).
enum class TruncatePolicy { kRefuse, kRight, kDrop };
TruncatePolicy truncate_policy(const std::string& name);  // refuse | right | drop

// The records a split trains or validates on, after the truncate policy, and what it did.
struct RecordSelection {
  std::vector<Record> records;  // kept, in file order
  uint64_t total = 0;           // records in the index
  uint64_t too_long = 0;        // longer than seq_len + 1 (truncated or dropped)
  uint64_t longest = 0;         // tokens of the longest record
  uint64_t cut_tokens = 0;      // tokens removed by truncation, or in dropped records
  uint64_t no_target = 0;       // records skipped: no counted target (after truncation)
  uint64_t kept_tokens = 0;
};
// `starts` index the split's `tokens` (concatenated shards); `mask` (same size, or null: every
// target counts). kRefuse throws ConfigError naming `split`, the count and the longest record
// when any record is longer than max_tokens. A record none of whose tokens after the first
// counts carries no signal and is skipped (counted in no_target).
RecordSelection select_records(const std::vector<uint64_t>& starts, uint64_t tokens,
                               const std::vector<uint8_t>* mask, uint64_t max_tokens,
                               TruncatePolicy policy, const std::string& split);

// Packs whole records into micro-batches of B rows of T+1 tokens: each record starts at
// position 0 of its own segment, records follow each other in a row while they fit (next
// fit: a record that does not fit starts the next row) and the rest of a row is padding (token
// 0, its own segment, no target counts). For every micro-batch it yields the tokens
// (B*(T+1)), which targets count (B*T: counted[b*T + t] is 1 when tokens t and t+1 of row b
// are in one record and the record's mask counts token t+1) and each input's position within
// its record (B*T; Transformer::set_tokens).
//
// The records form a stream: with `shuffle`, epoch e visits every record once in an order
// drawn from (seed, e); without, file order, every epoch alike. The stream ends at `limit`
// records (rows after it are padding only); position() is the stream index of the next record
// to pack, so a sampler set to a saved position packs exactly the rows an uninterrupted one
// would have.
class RecordSampler {
 public:
  RecordSampler(const std::vector<int32_t>* tokens, const std::vector<uint8_t>* mask,
                std::vector<Record> records, int B, int T, uint64_t seed, bool shuffle,
                uint64_t limit);
  void next(int32_t* batch, uint8_t* counted, int32_t* positions);
  uint64_t position() const { return next_; }
  void set_position(uint64_t p) { next_ = p; }
  size_t size() const { return records_.size(); }
  // Rows the stream from position `from` fills up to `to` (a dry run of the packing).
  uint64_t rows_between(uint64_t from, uint64_t to) const;

 private:
  const Record& at(uint64_t stream_index) const;  // the record at a stream position
  // Packs one row from next_ (or padding past the limit).
  void row(int32_t* tokens, uint8_t* counted, int32_t* positions);

  const std::vector<int32_t>* tokens_;
  const std::vector<uint8_t>* mask_;
  std::vector<Record> records_;
  int B_, T_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t limit_;
  uint64_t next_ = 0;
  mutable int64_t order_epoch_ = -1;     // the epoch whose order order_ holds
  mutable std::vector<uint32_t> order_;  // that epoch's order (indices into records_)
};

}  // namespace fuyou
