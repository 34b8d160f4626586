#include "src/formats/safetensors_stream.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "fuyou/sizes.h"
#include "kernels/common/element_math.h"

namespace fuyou {

uint64_t StEntry::bytes() const {
  uint64_t n = st_dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path, std::vector<StEntry> entries,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), entries_(std::move(entries)) {
  // The header is built with the same rules as SafetensorsWriter (metadata first, tensors in
  // the given order, padded with spaces to 8 bytes) so both writers produce the same files.
  nlohmann::ordered_json header;
  // The checksums' placeholder: as long as the text that replaces it in finish().
  const std::string placeholder =
      entries_.empty() ? std::string() : std::string(17 * entries_.size() - 1, '0');
  if (!metadata.empty() || !entries_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    if (!entries_.empty()) m[kTensorChecksumsKey] = placeholder;
    header["__metadata__"] = m;
  }
  std::set<std::string> seen;
  for (const auto& e : entries_) {
    if (e.name.empty() || e.name == "__metadata__" || !seen.insert(e.name).second)
      throw Error(str(path_, ": tensor name '", e.name, "' is empty, reserved or repeated"));
    for (int64_t d : e.shape)
      if (d < 0) throw Error(str(path_, ": tensor '", e.name, "' has a negative dimension"));
    header[e.name] = {{"dtype", st_dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {data_bytes_, data_bytes_ + e.bytes()}}};
    data_bytes_ += e.bytes();
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  header_bytes_ = 8 + h.size();
  sums_.assign(entries_.size(), xxh3_64(nullptr, 0));
  if (!entries_.empty()) {
    const std::string key = str("\"", kTensorChecksumsKey, "\":\"", placeholder, "\"");
    const size_t at = h.find(key);
    FY_CHECK(at != std::string::npos && h.find(key, at + 1) == std::string::npos, path_,
             ": checksum placeholder");
    sums_offset_ = 8 + at + key.size() - 1 - placeholder.size();
  }

  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  fd_ = ::open(tmp_.c_str(), flags | O_DIRECT, 0644);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL)
    fd_ = ::open(tmp_.c_str(), flags, 0644);  // no O_DIRECT here (tmpfs)
  if (fd_ < 0) throw IoError(str(tmp_, ": cannot create: ", std::strerror(errno)));
  for (auto& c : chunks_) {
    // 2 MiB aligned and on transparent huge pages where the kernel has them: fewer page
    // faults as the chunks are first filled, fewer pages to pin per direct write.
    c.reset(static_cast<char*>(std::aligned_alloc(kHugePage, kChunk)));
    if (!c) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
      throw std::bad_alloc();
    }
    ::madvise(c.get(), kChunk, MADV_HUGEPAGE);  // advice only: 4 KiB pages work as well
  }
  unsigned char len[8];
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
  put(len, 8);
  put(h.data(),
      h.size());  // header chunks go out as they fill; the destructor cleans up after an error
}

void SafetensorsStreamWriter::FreeAligned::operator()(char* p) const { std::free(p); }

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  for (auto& w : writing_) {
    if (!w.valid()) continue;
    try {
      w.get();
    } catch (...) {  // the error was or will never be reported: the file goes anyway
    }
  }
  if (!finished_ && fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsStreamWriter::put(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes) {
    const size_t n = std::min(bytes, kChunk - fill_);
    std::memcpy(chunks_[filling_].get() + fill_, p, n);
    fill_ += n;
    p += n;
    bytes -= n;
    if (fill_ == kChunk) submit_chunk();
  }
}

void SafetensorsStreamWriter::submit_chunk() {
  writing_[filling_] = std::async(std::launch::async, [this, c = chunks_[filling_].get(), n = fill_,
                                                       at = queued_] { write_at(c, n, at); });
  queued_ += fill_;
  filling_ = (filling_ + 1) % kChunks;
  fill_ = 0;
  if (writing_[filling_].valid()) writing_[filling_].get();  // the chunk to fill next is written
}

void SafetensorsStreamWriter::wait_writes() {
  for (int k = 1; k <= kChunks; ++k) {
    auto& w = writing_[(filling_ + k) % kChunks];
    if (w.valid()) w.get();
  }
}

// On a background thread; other chunks' writes may be in flight beside it.
void SafetensorsStreamWriter::write_at(const char* p, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const uint64_t at = offset + done;
    ssize_t w = write_fn_ ? write_fn_(fd_, p + done, bytes - done, at)
                          : ::pwrite(fd_, p + done, bytes - done, static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && direct_) {
      // O_DIRECT refused (an unaligned remainder after a short write, a filesystem that takes
      // it at open but not here): the rest of the file goes through the page cache.
      const int fl = ::fcntl(fd_, F_GETFL);
      if (fl >= 0 && ::fcntl(fd_, F_SETFL, fl & ~O_DIRECT) == 0) {
        direct_ = false;
        continue;
      }
    }
    if (w <= 0)
      throw IoError(str(tmp_, ": write of ", bytes - done, " bytes at offset ", at,
                        " failed: ", w < 0 ? std::strerror(errno) : "no progress"));
    done += static_cast<size_t>(w);
  }
}

void SafetensorsStreamWriter::begin_tensor(const std::string& name) {
  size_t next = current_ + 1;  // wraps from -1 to 0 for the first tensor
  if (current_ != static_cast<size_t>(-1) && current_done_ != entries_[current_].bytes())
    throw Error(str(path_, ": tensor '", entries_[current_].name, "' got ", current_done_, " of ",
                    entries_[current_].bytes(), " bytes before '", name, "' began"));
  if (next >= entries_.size() || entries_[next].name != name)
    throw Error(str(path_, ": tensor '", name, "' is not the next one in the header (expected '",
                    next < entries_.size() ? entries_[next].name : std::string("<end>"), "')"));
  if (current_ != static_cast<size_t>(-1)) finish_tensor_sum();
  current_ = next;
  current_done_ = 0;
  XXH3_64bits_reset(hash_.get());
}

void SafetensorsStreamWriter::finish_tensor_sum() {
  sums_[current_] = XXH3_64bits_digest(hash_.get());
}

void SafetensorsStreamWriter::append(const void* data, size_t bytes) {
  if (current_ == static_cast<size_t>(-1) || current_ >= entries_.size())
    throw Error(str(path_, ": append() before begin_tensor()"));
  const StEntry& e = entries_[current_];
  if (current_done_ + bytes > e.bytes())
    throw Error(str(path_, ": tensor '", e.name, "' takes ", e.bytes(), " bytes; ",
                    current_done_ + bytes, " were appended"));
  xxh3_64_update(hash_.get(), data, bytes);
  put(data, bytes);
  current_done_ += bytes;
}

void SafetensorsStreamWriter::finish() {
  if (finished_) return;
  size_t complete = current_ == static_cast<size_t>(-1) ? 0 : current_ + 1;
  if (complete > 0 && current_done_ != entries_[current_].bytes()) complete -= 1;
  if (complete != entries_.size())
    throw Error(str(path_, ": finish() with tensor '", entries_[complete].name, "' incomplete (",
                    entries_.size() - complete, " of ", entries_.size(), " tensors missing data)"));
  // The tail: with O_DIRECT padded to whole 4 KiB blocks, then cut back to the file's size.
  const uint64_t size = header_bytes_ + data_bytes_;
  if (fill_) {
    const size_t n = direct_ ? round_up(fill_, 4096) : fill_;
    std::memset(chunks_[filling_].get() + fill_, 0, n - fill_);
    try {
      write_at(chunks_[filling_].get(), n, queued_);
    } catch (...) {
      wait_writes();  // an earlier chunk's error, if any, is the one to report
      throw;
    }
    queued_ += n;
    fill_ = 0;
  }
  wait_writes();
  if (queued_ != size && ::ftruncate(fd_, static_cast<off_t>(size)) != 0)
    throw IoError(str(tmp_, ": cannot truncate to ", size, " bytes: ", std::strerror(errno)));
  if (!entries_.empty()) {
    // The checksums over their placeholder, in place (not 4 KiB aligned: write_at goes on
    // without O_DIRECT). The fsync below covers them.
    if (current_ != static_cast<size_t>(-1)) finish_tensor_sum();
    std::string text;
    for (uint64_t v : sums_) text += (text.empty() ? "" : " ") + hex64(v);
    write_at(text.data(), text.size(), sums_offset_);
  }
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    int err = errno;
    fd_ = -1;
    ::unlink(tmp_.c_str());
    throw IoError(str(tmp_, ": fsync/close failed: ", std::strerror(err)));
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp_.c_str());
    throw IoError(str(path_, ": rename from ", tmp_, " failed: ", std::strerror(err)));
  }
  finished_ = true;
  std::string dir = std::filesystem::path(path_).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

RangedTensorFile::RangedTensorFile(const std::string& path)
    : reader_(std::make_unique<SafetensorsReader>(path)) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError(str(path, ": cannot open: ", std::strerror(errno)));
  // The reader has validated the header; its length gives where the data starts.
  unsigned char len[8];
  try {
    pread_exact(fd_, len, 8, 0, path);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  data_start_ = 8 + n;
  size_ = data_start_;
  for (const StTensorInfo& t : reader_->tensors()) size_ = std::max(size_, data_start_ + t.end);
  auto it = reader_->metadata().find(kTensorChecksumsKey);
  if (it == reader_->metadata().end()) return;
  // One checksum per tensor, in data order (the order the writer wrote them).
  std::vector<const StTensorInfo*> order;
  for (const StTensorInfo& t : reader_->tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  const std::string& text = it->second;
  const bool well_formed = text.size() == (order.empty() ? 0 : 17 * order.size() - 1);
  for (size_t i = 0; well_formed && i < order.size(); ++i) {
    const std::string hex = text.substr(17 * i, 16);
    if (hex.find_first_not_of("0123456789abcdef") != std::string::npos ||
        (i > 0 && text[17 * i - 1] != ' '))
      break;
    sums_[order[i]->name] = std::stoull(hex, nullptr, 16);
  }
  if (sums_.size() != order.size()) {
    ::close(fd_);
    throw IoError(str(path, ": metadata ", kTensorChecksumsKey, " is not ", order.size(),
                      " checksums (16 hex digits each, separated by spaces) for its ", order.size(),
                      " tensors (the file is damaged)"));
  }
}

void RangedTensorFile::compare(const StTensorInfo& t, uint64_t sum) const {
  const uint64_t want = sums_.at(t.name);
  if (sum != want)
    throw IoError(str(path(), ": tensor '", t.name, "' has checksum ", hex64(sum),
                      " but the file records ", hex64(want),
                      " (its bytes changed after it was written: a damaged disk, copy or edit)"));
}

void RangedTensorFile::verify(const StTensorInfo& t) const {
  if (sums_.empty()) return;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> h(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(h.get());
  std::vector<char> buf(std::min<uint64_t>(t.end - t.begin, 8u << 20));
  for (uint64_t done = 0; done < t.end - t.begin;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), t.end - t.begin - done));
    read(t, done, buf.data(), n);
    xxh3_64_update(h.get(), buf.data(), n);
    done += n;
  }
  compare(t, XXH3_64bits_digest(h.get()));
}

void RangedTensorFile::check(const StTensorInfo& t, const void* data) const {
  if (!sums_.empty()) compare(t, xxh3_64(data, t.end - t.begin));
}

RangedTensorFile::~RangedTensorFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RangedTensorFile::read(const StTensorInfo& t, uint64_t offset, void* dst, size_t bytes) const {
  if (offset > t.end - t.begin || bytes > t.end - t.begin - offset)
    throw Error(str(path(), ": read of bytes [", offset, ", ", offset + bytes, ") of tensor '",
                    t.name, "' runs past its ", t.end - t.begin, " bytes"));
  const uint64_t at = data_start_ + t.begin + offset;
  // Readers go through a file front to back (a restore, a conversion) and do other work between
  // reads (writing the SSD store, converting): ask the kernel to fetch what follows while they
  // do, so the disk never waits for the next read() to learn what is wanted.
  const uint64_t end = at + bytes, advised = advised_.load(std::memory_order_relaxed);
  if (end + kReadAhead / 2 > advised || end < advised - kReadAhead) {  // near its end, or elsewhere
    const uint64_t from = end < advised && advised - end <= kReadAhead ? advised : end;
    ::posix_fadvise(fd_, static_cast<off_t>(from), static_cast<off_t>(end + kReadAhead - from),
                    POSIX_FADV_WILLNEED);
    advised_.store(end + kReadAhead, std::memory_order_relaxed);
  }
  pread_exact(fd_, dst, bytes, at, path());
}

TensorSet TensorSet::open_file(const std::string& path) {
  TensorSet set;
  set.source_ = path;
  set.files_.push_back(std::make_unique<RangedTensorFile>(path));
  for (const StTensorInfo& t : set.files_[0]->reader().tensors()) {
    set.names_.push_back(t.name);
    set.where_[t.name] = {0, &t};
  }
  return set;
}

std::vector<std::pair<std::string, std::string>> parse_st_index(std::string_view json_text,
                                                                const std::string& index_path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw IoError(str(index_path, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw IoError(str(index_path, ": must be a JSON object"));
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw IoError(str(index_path, ": missing object field 'weight_map'"));
  if (j.contains("metadata") && !j["metadata"].is_null() && !j["metadata"].is_object())
    throw IoError(str(index_path, ": field 'metadata' must be an object"));
  std::vector<std::pair<std::string, std::string>> out;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    const std::string& name = it.key();
    if (name.empty()) throw IoError(str(index_path, ": weight_map has an empty tensor name"));
    if (!it.value().is_string())
      throw IoError(
          str(index_path, ": weight_map['", printable(name), "'] must be a file name string"));
    std::string file = it.value().get<std::string>();
    // Shards live beside the index: a path that leaves the directory is refused, and so is
    // a NUL, which would silently cut the name short when the file is opened.
    if (file.empty() || file.find('/') != std::string::npos ||
        file.find('\0') != std::string::npos || file == "." || file == "..")
      throw IoError(str(index_path, ": weight_map['", printable(name), "'] = '", printable(file),
                        "' is not a plain file name in the index's directory"));
    out.emplace_back(name, std::move(file));
  }
  if (out.empty()) throw IoError(str(index_path, ": weight_map is empty"));
  return out;
}

TensorSet TensorSet::open_index(const std::string& index_path) {
  namespace fs = std::filesystem;
  TensorSet set;
  set.source_ = index_path;
  const std::string text = read_file_bounded(index_path, kMaxStHeader, "safetensors index");
  const fs::path dir = fs::path(index_path).parent_path();
  std::map<std::string, size_t> file_index;
  for (const auto& [name, file] : parse_st_index(text, index_path)) {
    auto [pos, inserted] = file_index.emplace(file, set.files_.size());
    if (inserted) {
      std::string shard = (dir / file).string();
      std::error_code ec;
      if (!fs::is_regular_file(shard, ec))
        throw IoError(
            str(shard, ": missing shard (named by ", index_path, " for tensor '", name, "')"));
      set.files_.push_back(std::make_unique<RangedTensorFile>(shard));
    }
    const RangedTensorFile& f = *set.files_[pos->second];
    if (!f.reader().has(name))
      throw IoError(str(f.path(), ": has no tensor '", name, "', which ", index_path,
                        " places in this shard"));
    set.names_.push_back(name);
    set.where_[name] = {pos->second, &f.reader().info(name)};
  }
  return set;
}

TensorSet TensorSet::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw IoError(str(dir, ": not a directory"));
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index, ec)) return open_index(index.string());
  if (fs::exists(single, ec)) return open_file(single.string());
  if (fs::exists(fs::path(dir) / "pytorch_model.bin", ec) ||
      fs::exists(fs::path(dir) / "pytorch_model.bin.index.json", ec))
    throw IoError(str(dir,
                      ": only safetensors weights are supported, and this directory has "
                      "pytorch_model.bin (re-save with save_pretrained(..., "
                      "safe_serialization=True))"));
  throw IoError(str(dir, ": no model.safetensors or model.safetensors.index.json"));
}

const StTensorInfo& TensorSet::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw IoError(str(source_, ": no tensor named '", name, "'"));
  return *it->second.second;
}

const RangedTensorFile& TensorSet::file(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw IoError(str(source_, ": no tensor named '", name, "'"));
  return *files_[it->second.first];
}

const std::map<std::string, std::string>& TensorSet::metadata() const {
  return files_.at(0)->reader().metadata();
}

ShardedSafetensorsWriter::ShardedSafetensorsWriter(std::string dir, std::vector<StEntry> entries,
                                                   uint64_t max_shard_bytes,
                                                   std::map<std::string, std::string> metadata)
    : dir_(std::move(dir)), metadata_(std::move(metadata)) {
  // Greedy in order, as transformers' save_pretrained does: a tensor that would push the
  // shard past the limit starts a new one; a tensor larger than the limit sits alone.
  uint64_t in_shard = 0;
  for (auto& e : entries) {
    if (shards_.empty() || (!shards_.back().empty() && in_shard + e.bytes() > max_shard_bytes)) {
      shards_.emplace_back();
      in_shard = 0;
    }
    in_shard += e.bytes();
    total_bytes_ += e.bytes();
    shard_of_[e.name] = shards_.size() - 1;
    shards_.back().push_back(std::move(e));
  }
  if (shards_.empty()) shards_.emplace_back();
  for (size_t s = 0; s < shards_.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards_.size());
    shard_names_.push_back(shards_.size() == 1 ? "model.safetensors" : name);
  }
}

void ShardedSafetensorsWriter::open_shard(size_t s) {
  if (current_) {
    current_->finish();
    written_.push_back(shard_names_[current_shard_]);
  }
  current_ = std::make_unique<SafetensorsStreamWriter>(
      (std::filesystem::path(dir_) / shard_names_[s]).string(), shards_[s], metadata_);
  current_shard_ = s;
}

void ShardedSafetensorsWriter::begin_tensor(const std::string& name) {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) throw Error(str(dir_, ": tensor '", name, "' was not planned"));
  if (it->second != current_shard_) {
    // current_shard_ + 1 wraps to 0 before the first shard; planning never makes an empty
    // shard, so the next tensor is always in this shard or the next one.
    if (it->second != current_shard_ + 1)
      throw Error(str(dir_, ": tensor '", name, "' is out of order"));
    open_shard(it->second);
  }
  current_->begin_tensor(name);
}

void ShardedSafetensorsWriter::append(const void* data, size_t bytes) {
  if (!current_) throw Error(str(dir_, ": append() before begin_tensor()"));
  current_->append(data, bytes);
}

std::vector<std::string> ShardedSafetensorsWriter::finish() {
  if (!current_) open_shard(0);  // a model with no tensors still gets its (empty) file
  if (current_shard_ + 1 != shards_.size())
    throw Error(
        str(dir_, ": finish() after ", current_shard_ + 1, " of ", shards_.size(), " shards"));
  current_->finish();
  written_.push_back(shard_names_[current_shard_]);
  current_.reset();
  if (shards_.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", total_bytes_}};
    nlohmann::json map = nlohmann::json::object();
    for (const auto& [name, s] : shard_of_) map[name] = shard_names_[s];
    index["weight_map"] = map;
    std::string text = index.dump(2) + "\n";
    write_file_atomic((std::filesystem::path(dir_) / "model.safetensors.index.json").string(),
                      text.data(), text.size());
    written_.push_back("model.safetensors.index.json");
  }
  return written_;
}

bool is_float_dtype(StDtype d) {
  return d == StDtype::kF32 || d == StDtype::kF16 || d == StDtype::kBF16;
}

void convert_float_elements(const void* src, StDtype sd, void* dst, StDtype dd, size_t n) {
  FY_CHECK(is_float_dtype(sd) && is_float_dtype(dd), "float dtypes only: ", st_dtype_name(sd),
           " -> ", st_dtype_name(dd));
  if (sd == dd) {
    std::memcpy(dst, src, n * st_dtype_size(sd));
    return;
  }
  auto load = [&](size_t i) -> float {
    if (sd == StDtype::kF32) {
      float f;
      std::memcpy(&f, static_cast<const char*>(src) + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, static_cast<const char*>(src) + 2 * i, 2);
    return sd == StDtype::kBF16 ? math::bf16_to_float(h) : math::fp16_to_float(h);
  };
  char* out = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float f = load(i);
    if (dd == StDtype::kF32) {
      std::memcpy(out + 4 * i, &f, 4);
    } else {
      uint16_t h = dd == StDtype::kBF16 ? math::float_to_bf16(f) : math::float_to_fp16(f);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
}

}  // namespace fuyou
