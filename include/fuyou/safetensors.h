// safetensors files: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the data. Reading validates the header
// completely (length inside the file, offsets in range, no overlaps, sizes matching dtype
// and shape, tensors tiling the data section exactly) before any tensor is touched, and reads
// tensors one at a time, so a file larger than memory can be streamed.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fuyou {

enum class StDtype { kF32, kF16, kBF16, kI32, kI64, kU8, kU16 };

size_t st_dtype_size(StDtype d);
const char* st_dtype_name(StDtype d);

struct StTensorInfo {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
  size_t numel() const;
};

// The metadata key under which the engine's writers record each tensor's XXH3-64: 16
// lower-case hex digits per tensor, in data order, separated by spaces. Readers of a file that
// has it verify what they read (RangedTensorFile::verify).
inline constexpr const char* kTensorChecksumsKey = "fuyou_xxh3";

// A header larger than this is refused, as the reference implementation refuses it: no
// real checkpoint comes close, and a corrupt length must not make us allocate gigabytes.
constexpr uint64_t kMaxStHeader = 100ull << 20;

// The header length stored in the first 8 bytes of a file of `file_size` (>= 8) bytes,
// checked against the file and kMaxStHeader; IoError naming `path` otherwise.
uint64_t st_header_length(const unsigned char bytes[8], uint64_t file_size,
                          const std::string& path);

struct StHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::map<std::string, std::string> metadata;
  std::vector<StTensorInfo> tensors;  // in header order
};
// Parses and validates the JSON header of a file of `file_size` bytes: every entry's dtype,
// shape and offsets, and the tensors tiling the data section exactly (no gap, no overlap,
// no trailing bytes). IoError naming `path`, the tensor and the offsets on any violation.
StHeader parse_st_header(std::string_view header, uint64_t file_size, const std::string& path);

class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);  // throws IoError
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }
  bool has(const std::string& name) const;
  const StTensorInfo& info(const std::string& name) const;  // throws IoError naming the file

  // Reads a tensor's raw bytes into dst (info(name).end - begin bytes).
  void read_raw(const std::string& name, void* dst) const;
  // Reads an F32 tensor, checking dtype and, when given, the shape.
  std::vector<float> read_f32(const std::string& name,
                              const std::vector<int64_t>& expect_shape = {}) const;
  std::vector<int32_t> read_i32(const std::string& name) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<StTensorInfo> tensors_;
};

// Collects tensors, then writes the file atomically (temporary file, fsync, rename), so a
// crash never leaves a half-written file under the final name. Records the tensors'
// checksums (kTensorChecksumsKey) as SafetensorsStreamWriter does: both make the same bytes.
class SafetensorsWriter {
 public:
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // The data is copied; the caller's buffer may be reused at once.
  void add(const std::string& name, StDtype dtype, const std::vector<int64_t>& shape,
           const void* data);
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    StDtype dtype;
    std::vector<int64_t> shape;
    std::vector<char> bytes;
  };
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
};

// Reads exactly `size` bytes at `offset` (retrying short reads and EINTR); IoError naming
// `path`, the offset and the size on failure or end of file.
void pread_exact(int fd, void* dst, size_t size, uint64_t offset, const std::string& path);

// Writes `bytes` to `path` atomically: path.tmp, fsync, rename, fsync of the directory.
void write_file_atomic(const std::string& path, const void* bytes, size_t size);

}  // namespace fuyou
