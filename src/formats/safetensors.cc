#include "fuyou/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "fuyou/error.h"
#include "src/common/xxh3.h"

namespace fuyou {
namespace {

// Dimensions per tensor: real checkpoints use at most 5; a bound keeps a hostile shape list
// from costing more than the header it came in.
constexpr size_t kMaxRank = 16;

bool parse_dtype(const std::string& s, StDtype* out) {
  static const std::pair<const char*, StDtype> names[] = {
      {"F32", StDtype::kF32}, {"F16", StDtype::kF16}, {"BF16", StDtype::kBF16},
      {"I32", StDtype::kI32}, {"I64", StDtype::kI64}, {"U8", StDtype::kU8},
      {"U16", StDtype::kU16}};
  for (auto& [n, d] : names)
    if (s == n) {
      *out = d;
      return true;
    }
  return false;
}

// One tensor's header entry: dtype, shape and offsets, each checked, and the byte size
// dtype x shape implies equal to the offsets' span. The product is computed with an
// overflow check, so a shape of huge dimensions cannot wrap into a small size.
StTensorInfo parse_tensor_entry(const std::string& name, const nlohmann::json& v,
                                uint64_t data_size, const std::string& path) {
  auto field_error = [&](const std::string& why) {
    return IoError(str(path, ": tensor '", printable(name), "': ", why));
  };
  if (name.empty()) throw IoError(str(path, ": a tensor has an empty name"));
  if (name.find('\0') != std::string::npos) throw field_error("the name contains a NUL byte");
  if (!v.is_object()) throw field_error("entry must be an object");
  StTensorInfo t;
  t.name = name;
  if (!v.contains("dtype") || !v["dtype"].is_string())
    throw field_error("missing string field 'dtype'");
  if (!parse_dtype(v["dtype"].get<std::string>(), &t.dtype))
    throw field_error(str("unsupported dtype '", v["dtype"].get<std::string>(),
                          "' (supported: F32, F16, BF16, I32, I64, U8, U16)"));
  if (!v.contains("shape") || !v["shape"].is_array())
    throw field_error("missing array field 'shape'");
  if (v["shape"].size() > kMaxRank)
    throw field_error(
        str("shape has ", v["shape"].size(), " dimensions; at most ", kMaxRank, " are allowed"));
  uint64_t bytes = st_dtype_size(t.dtype);
  for (const auto& d : v["shape"]) {
    if (!d.is_number_unsigned())
      throw field_error(str("shape entry ", d.dump(), " is not a non-negative integer"));
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(INT64_MAX) || (dim != 0 && bytes > UINT64_MAX / dim))
      throw field_error(str("shape dimension ", dim, " makes the byte size overflow 64 bits"));
    t.shape.push_back(static_cast<int64_t>(dim));
    bytes *= dim;
  }
  const auto& off = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    throw field_error("'data_offsets' must be two non-negative integers");
  t.begin = off[0].get<uint64_t>();
  t.end = off[1].get<uint64_t>();
  if (t.begin > t.end || t.end > data_size)
    throw field_error(str("data_offsets [", t.begin, ", ", t.end, "] lie outside the ", data_size,
                          "-byte data section"));
  if (t.end - t.begin != bytes)
    throw field_error(str("data_offsets cover ", t.end - t.begin, " bytes but dtype ",
                          st_dtype_name(t.dtype), " and shape need ", bytes));
  return t;
}

// The format requires the tensors to tile the data section: in offset order each starts
// where the previous one ended, the first at 0, the last ending at the end of the file. A
// header whose length field is a few bytes short still parses as JSON (it ends inside its
// own padding), but then the data section starts early and is longer than the tensors:
// this check is what refuses it, instead of reading every tensor a few bytes off.
void check_tiling(const std::vector<StTensorInfo>& tensors, uint64_t data_size,
                  const std::string& path) {
  std::vector<const StTensorInfo*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  // Overlaps first: two tensors sharing bytes is the more specific report, and it usually
  // leaves a gap elsewhere too.
  for (size_t i = 1; i < sorted.size(); ++i) {
    const StTensorInfo* a = sorted[i - 1];
    const StTensorInfo* b = sorted[i];
    if (b->begin < a->end)
      throw IoError(str(path, ": tensors '", printable(a->name), "' and '", printable(b->name),
                        "' overlap ('", printable(b->name), "' begins at data offset ", b->begin,
                        ", before '", printable(a->name), "' ends at ", a->end, ")"));
  }
  uint64_t covered = 0;
  for (const StTensorInfo* t : sorted) {
    if (t->begin > covered)
      throw IoError(str(path, ": data bytes [", covered, ", ", t->begin,
                        ") belong to no tensor (gap before '", printable(t->name),
                        "'); safetensors tensors must cover the data section exactly"));
    covered = t->end;
  }
  if (covered != data_size)
    throw IoError(str(path, ": the tensors end at data offset ", covered,
                      " but the data section has ", data_size, " bytes (", data_size - covered,
                      " trailing bytes: a wrong header length, or a damaged file)"));
}

}  // namespace

uint64_t st_header_length(const unsigned char bytes[8], uint64_t file_size,
                          const std::string& path) {
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | bytes[i];
  if (header_len > file_size - 8)
    throw IoError(str(path, ": header length ", header_len,
                      " at offset 0 runs past the end of the ", file_size, "-byte file"));
  if (header_len > kMaxStHeader)
    throw IoError(str(path, ": header length ", header_len, " at offset 0 is above the limit of ",
                      kMaxStHeader, " bytes"));
  if (header_len < 2)
    throw IoError(
        str(path, ": header length ", header_len, " at offset 0 is too short for a JSON object"));
  return header_len;
}

StHeader parse_st_header(std::string_view header, uint64_t file_size, const std::string& path) {
  StHeader h;
  h.data_start = 8 + header.size();
  if (file_size < h.data_start)
    throw IoError(str(path, ": the ", header.size(), "-byte header runs past the end of the ",
                      file_size, "-byte file"));
  const uint64_t data_size = file_size - h.data_start;
  // The format starts the header with '{' (padding, spaces, may follow the closing '}').
  if (header.empty() || header[0] != '{')
    throw IoError(str(path, ": the header at offset 8 does not start with '{'"));
  nlohmann::json j;
  // JSON lets a key repeat and the parser keeps the last: two entries for one tensor name (or
  // two metadata values for one key) would leave the file meaning whichever a reader keeps.
  std::vector<std::set<std::string>> keys;
  std::string repeated;
  auto no_repeats = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    using ev_t = nlohmann::json::parse_event_t;
    if (ev == ev_t::object_start) keys.emplace_back();
    if (ev == ev_t::object_end && !keys.empty()) keys.pop_back();
    if (ev == ev_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
        repeated.empty())
      repeated = parsed.get<std::string>();
    return true;
  };
  try {
    j = nlohmann::json::parse(header, no_repeats);  // rejects ill-formed UTF-8 in names
  } catch (const nlohmann::json::exception& e) {
    throw IoError(str(path, ": header is not valid JSON: ", e.what()));
  }
  if (!repeated.empty())
    throw IoError(str(path, ": the header names '", printable(repeated),
                      "' twice; each key may appear once"));
  if (!j.is_object()) throw IoError(str(path, ": header must be a JSON object"));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw IoError(str(path, ": __metadata__ must be an object of strings"));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          throw IoError(str(path, ": __metadata__.", m.key(), " must be a string"));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(parse_tensor_entry(name, v, data_size, path));
  }
  check_tiling(h.tensors, data_size, path);
  return h;
}

void pread_exact(int fd, void* dst, size_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < size) {
    ssize_t r = ::pread(fd, p + done, size - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      throw IoError(str(path, ": read of ", size, " bytes at offset ", offset + done,
                        " failed: ", std::strerror(errno)));
    if (r == 0)
      throw IoError(str(path, ": file ends at offset ", offset + done, " but ", size - done,
                        " more bytes were expected (truncated file?)"));
    done += static_cast<size_t>(r);
  }
}

size_t st_dtype_size(StDtype d) {
  switch (d) {
    case StDtype::kF32:
    case StDtype::kI32:
      return 4;
    case StDtype::kF16:
    case StDtype::kBF16:
    case StDtype::kU16:
      return 2;
    case StDtype::kI64:
      return 8;
    case StDtype::kU8:
      return 1;
  }
  return 0;
}

const char* st_dtype_name(StDtype d) {
  switch (d) {
    case StDtype::kF32:
      return "F32";
    case StDtype::kF16:
      return "F16";
    case StDtype::kBF16:
      return "BF16";
    case StDtype::kI32:
      return "I32";
    case StDtype::kI64:
      return "I64";
    case StDtype::kU8:
      return "U8";
    case StDtype::kU16:
      return "U16";
  }
  return "?";
}

size_t StTensorInfo::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError(str(path, ": cannot open: ", std::strerror(errno)));
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw IoError(str(path, ": cannot stat: ", std::strerror(errno)));
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8)
      throw IoError(str(path, ": ", file_size, " bytes is too short for a safetensors header"));
    unsigned char len_bytes[8];
    pread_exact(fd_, len_bytes, 8, 0, path);
    const uint64_t header_len = st_header_length(len_bytes, file_size, path);
    std::string header(header_len, '\0');
    pread_exact(fd_, header.data(), header_len, 8, path);
    StHeader h = parse_st_header(header, file_size, path);
    data_start_ = h.data_start;
    metadata_ = std::move(h.metadata);
    tensors_ = std::move(h.tensors);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool SafetensorsReader::has(const std::string& name) const {
  return std::any_of(tensors_.begin(), tensors_.end(), [&](auto& t) { return t.name == name; });
}

const StTensorInfo& SafetensorsReader::info(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  throw IoError(str(path_, ": no tensor named '", printable(name), "'"));
}

void SafetensorsReader::read_raw(const std::string& name, void* dst) const {
  const StTensorInfo& t = info(name);
  pread_exact(fd_, dst, t.end - t.begin, data_start_ + t.begin, path_);
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name,
                                               const std::vector<int64_t>& expect_shape) const {
  const StTensorInfo& t = info(name);
  if (t.dtype != StDtype::kF32)
    throw IoError(
        str(path_, ": tensor '", name, "' has dtype ", st_dtype_name(t.dtype), ", expected F32"));
  if (!expect_shape.empty() && t.shape != expect_shape) {
    auto fmt = [](const std::vector<int64_t>& s) {
      std::string o = "[";
      for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
      return o + "]";
    };
    throw IoError(str(path_, ": tensor '", name, "' has shape ", fmt(t.shape), ", expected ",
                      fmt(expect_shape)));
  }
  std::vector<float> out(t.numel());
  read_raw(name, out.data());
  return out;
}

std::vector<int32_t> SafetensorsReader::read_i32(const std::string& name) const {
  const StTensorInfo& t = info(name);
  if (t.dtype != StDtype::kI32)
    throw IoError(
        str(path_, ": tensor '", name, "' has dtype ", st_dtype_name(t.dtype), ", expected I32"));
  std::vector<int32_t> out(t.numel());
  read_raw(name, out.data());
  return out;
}

void SafetensorsWriter::add(const std::string& name, StDtype dtype,
                            const std::vector<int64_t>& shape, const void* data) {
  Entry e{name, dtype, shape, {}};
  size_t n = st_dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  e.bytes.assign(static_cast<const char*>(data), static_cast<const char*>(data) + n);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::write(const std::string& path) const {
  nlohmann::ordered_json header;
  if (!metadata_.empty() || !entries_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    // Each tensor's XXH3-64, in data order, as SafetensorsStreamWriter records them.
    std::string sums;
    for (const auto& e : entries_)
      sums += (sums.empty() ? "" : " ") + hex64(xxh3_64(e.bytes.data(), e.bytes.size()));
    if (!entries_.empty()) m[kTensorChecksumsKey] = sums;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", st_dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::vector<char> out(8 + h.size() + offset);
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, h.data(), h.size());
  char* p = out.data() + 8 + h.size();
  for (const auto& e : entries_) {
    std::memcpy(p, e.bytes.data(), e.bytes.size());
    p += e.bytes.size();
  }
  write_file_atomic(path, out.data(), out.size());
}

void write_file_atomic(const std::string& path, const void* bytes, size_t size) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(str(tmp, ": cannot create: ", std::strerror(errno)));
  const char* p = static_cast<const char*>(bytes);
  size_t done = 0;
  while (done < size) {
    ssize_t w = ::write(fd, p + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(str(tmp, ": write of ", size - done, " bytes at offset ", done,
                        " failed: ", std::strerror(err)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(str(tmp, ": fsync/close failed: ", std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(str(path, ": rename from ", tmp, " failed: ", std::strerror(err)));
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace fuyou
