// Streaming safetensors I/O for checkpoints larger than memory.
//
// SafetensorsStreamWriter knows every tensor's (name, dtype, shape) up front, so it writes the
// header first and then takes the tensors' bytes one at a time, in header order, in as many
// pieces as the caller likes: converting a checkpoint never holds more than one chunk. The
// file is written to PATH.tmp and renamed into place by finish(), so a crash or an error
// leaves no half-written file under the final name.
//
// The bytes go to the disk with O_DIRECT in 8 MiB chunks at their file offsets, up to three
// written by background threads while the caller fills the fourth (four 8 MiB buffers, the
// writer's only memory): a checkpoint streams at the disk's speed instead of first filling
// the page cache, which on a loaded machine can be slower than the disk. The last chunk is
// padded to 4 KiB and the file truncated to its size. Where the filesystem (or a short write)
// refuses O_DIRECT, the writer goes on with buffered writes.
//
// Every file the writer makes records the XXH3-64 of each tensor's bytes in its metadata
// (kTensorChecksumsKey: one 16-hex-digit checksum per tensor, in data order, separated by
// spaces). The header is written first with a placeholder of the same length, and the
// checksums, computed as the bytes stream through, replace it when the file is finished.
//
// RangedTensorFile reads any byte range of a tensor in a file that SafetensorsReader has
// already validated, for the chunked reads on the input side, and verifies tensors against the
// checksums the file records: each reader of a file the engine wrote checks what it reads.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fuyou/safetensors.h"
#include "src/common/xxh3.h"

namespace fuyou {

struct StEntry {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t bytes() const;  // numel * dtype size
};

class SafetensorsStreamWriter {
 public:
  // Creates PATH.tmp and writes the header. Names must be unique and non-empty.
  SafetensorsStreamWriter(std::string path, std::vector<StEntry> entries,
                          const std::map<std::string, std::string>& metadata);
  // Without finish(), the temporary file is removed: nothing appears under `path`.
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // Starts the next tensor; it must be the next entry in header order and the previous
  // one must be complete.
  void begin_tensor(const std::string& name);
  // Appends bytes of the current tensor; the total must not exceed its size.
  void append(const void* data, size_t bytes);
  // Checks that every tensor is complete, fsyncs, renames PATH.tmp to PATH, fsyncs the
  // directory.
  void finish();

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return header_bytes_ + data_bytes_; }

  // Replaces pwrite(2) for the file's bytes (called on the writer's background threads, up to
  // three at once, each at its own offset): a test injects ENOSPC, EIO (return -1 with errno
  // set) or short writes (return fewer bytes) through it.
  using WriteFn = std::function<ssize_t(int fd, const void* data, size_t bytes, uint64_t offset)>;
  void set_write_function(WriteFn fn) { write_fn_ = std::move(fn); }

 private:
  static constexpr size_t kChunk = 8u << 20;
  static constexpr size_t kHugePage = 2u << 20;
  static constexpr int kChunks = 4;

  void put(const void* data, size_t bytes);  // into the chunk being filled
  void submit_chunk();                       // hands the full chunk to a background write
  void wait_writes();                        // for every write in flight, oldest first; rethrows
  void write_at(const char* data, size_t bytes, uint64_t offset);
  void finish_tensor_sum();  // the checksum of the tensor being written, into sums_

  std::string path_;
  std::string tmp_;
  std::vector<StEntry> entries_;
  int fd_ = -1;
  uint64_t header_bytes_ = 0;  // 8 + JSON header with padding
  uint64_t data_bytes_ = 0;
  size_t current_ = static_cast<size_t>(-1);  // index of the tensor being written
  uint64_t current_done_ = 0;                 // bytes of it written so far
  bool finished_ = false;
  std::atomic<bool> direct_{false};  // the descriptor has O_DIRECT (cleared if a write refuses it)
  WriteFn write_fn_;
  struct FreeAligned {
    void operator()(char* p) const;
  };
  std::unique_ptr<char, FreeAligned> chunks_[kChunks];  // 4 KiB aligned, kChunk bytes each
  std::future<void> writing_[kChunks];                  // each chunk's write in flight, if any
  int filling_ = 0;                                     // the chunk put() fills
  size_t fill_ = 0;                                     // its bytes so far
  uint64_t queued_ = 0;                                 // file bytes handed to writes so far
  std::vector<uint64_t> sums_;                          // per entry: XXH3-64 of its bytes
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash_{XXH3_createState(),
                                                                 &XXH3_freeState};
  uint64_t sums_offset_ = 0;  // file offset of the placeholder
};

// A validated safetensors file opened for ranged reads. Owns the reader (for the header)
// and its own descriptor.
class RangedTensorFile {
 public:
  explicit RangedTensorFile(const std::string& path);  // throws IoError
  ~RangedTensorFile();
  RangedTensorFile(const RangedTensorFile&) = delete;
  RangedTensorFile& operator=(const RangedTensorFile&) = delete;

  const SafetensorsReader& reader() const { return *reader_; }
  const std::string& path() const { return reader_->path(); }
  // The file's size as validated when it was opened (the tensors tile it to its end).
  uint64_t size() const { return size_; }
  // Reads `bytes` bytes starting `offset` bytes into tensor `t` of this file.
  void read(const StTensorInfo& t, uint64_t offset, void* dst, size_t bytes) const;

  // Whether the file records its tensors' checksums (one the engine wrote does).
  bool checksummed() const { return !sums_.empty(); }
  // Reads tensor `t` whole and compares it with its recorded checksum; IoError naming the
  // file and the tensor on a mismatch. Nothing to do in a file without checksums.
  void verify(const StTensorInfo& t) const;
  // The same for a tensor already read whole into `data` (t.end - t.begin bytes).
  void check(const StTensorInfo& t, const void* data) const;

 private:
  // Asked of the kernel beyond a read, once the read comes within half of it of what was
  // asked before (asking per read costs the kernel a walk of the whole window every time:
  // minutes for a file read in many small pieces).
  static constexpr uint64_t kReadAhead = 32ull << 20;
  std::unique_ptr<SafetensorsReader> reader_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  uint64_t size_ = 0;
  mutable std::atomic<uint64_t> advised_{0};  // file offset the read-ahead reaches
  std::map<std::string, uint64_t> sums_;      // tensor name -> recorded checksum
  void compare(const StTensorInfo& t, uint64_t sum) const;
};

// The tensors of one checkpoint, stored in a single file or in shards named by an index
// (model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": {tensor:
// file}}). Every file is opened and its header validated when the set is opened, so a
// missing or malformed shard is reported before any conversion starts.
// The weight_map of a model.safetensors.index.json: (tensor, shard file name) in the
// index's order. Every shard is a plain file name (no '/', no NUL, not . or ..), so an
// index can only name files in its own directory. IoError naming `index_path` otherwise.
std::vector<std::pair<std::string, std::string>> parse_st_index(std::string_view json_text,
                                                                const std::string& index_path);

class TensorSet {
 public:
  // DIR/model.safetensors.index.json if present, else DIR/model.safetensors.
  static TensorSet open_dir(const std::string& dir);
  static TensorSet open_file(const std::string& path);
  static TensorSet open_index(const std::string& index_path);

  // Names in a stable order: the index's (sorted), or the file's header order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const StTensorInfo& info(const std::string& name) const;  // throws naming the source
  const RangedTensorFile& file(const std::string& name) const;
  // The index file, or the single file: what errors name.
  const std::string& source() const { return source_; }
  // RangedTensorFile::verify / check of the file holding the tensor.
  void verify(const std::string& name) const { file(name).verify(info(name)); }
  void check(const std::string& name, const void* data) const {
    file(name).check(info(name), data);
  }
  // Metadata of the first file (the engine writes the same into every shard).
  const std::map<std::string, std::string>& metadata() const;

 private:
  std::string source_;
  std::vector<std::unique_ptr<RangedTensorFile>> files_;
  std::vector<std::string> names_;
  std::map<std::string, std::pair<size_t, const StTensorInfo*>> where_;
};

// Writes a list of tensors as one file or as shards of at most max_shard_bytes (Hugging
// Face naming and index format), streaming like SafetensorsStreamWriter. Each shard is
// renamed into place when complete; the index is written last.
class ShardedSafetensorsWriter {
 public:
  ShardedSafetensorsWriter(std::string dir, std::vector<StEntry> entries, uint64_t max_shard_bytes,
                           std::map<std::string, std::string> metadata);
  void begin_tensor(const std::string& name);
  void append(const void* data, size_t bytes);
  // Returns the files written (names relative to dir), the index last when there is one.
  std::vector<std::string> finish();
  size_t shard_count() const { return shards_.size(); }

 private:
  void open_shard(size_t s);

  std::string dir_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::vector<StEntry>> shards_;
  std::vector<std::string> shard_names_;
  std::map<std::string, size_t> shard_of_;
  std::unique_ptr<SafetensorsStreamWriter> current_;
  size_t current_shard_ = static_cast<size_t>(-1);
  uint64_t total_bytes_ = 0;
  std::vector<std::string> written_;
};

// Converts n elements between the float dtypes F32, F16 and BF16. Widening to F32 is exact;
// narrowing rounds to nearest even (kernels/common/element_math.h), so F16 -> F32 -> F16 and
// BF16 -> F32 -> BF16 give back the same bits.
void convert_float_elements(const void* src, StDtype src_dtype, void* dst, StDtype dst_dtype,
                            size_t n);
bool is_float_dtype(StDtype d);

}  // namespace fuyou
