// SsdStore: named extents in a striped logical space, moved by io_uring.
//
// One I/O thread owns the ring: it splits queued requests ("jobs") into io_uring requests
// ("pieces"), keeps up to queue_depth of them in flight, handles completions (resubmitting
// short transfers and EINTR/EAGAIN) and marks jobs finished. Callers only enqueue jobs and
// wait on a condition variable, so I/O keeps flowing while the caller computes, which is
// what the optimizer needs (it submits a layer's reads, then runs AdamW on the previous
// layer). The I/O thread sleeps in io_uring_enter; a submit wakes it through an eventfd
// whose read is always armed in the ring.
//
// Everything shared is guarded by one mutex. Only the I/O thread touches the ring's
// submission and completion queues, so the ring needs no lock of its own.
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "fuyou/storage.h"
#include "src/common/xxh3.h"
#include "src/storage/block_sums.h"
#include "src/storage/dir_lock.h"
#include "src/storage/file_layer.h"
#include "src/storage/io_ring.h"
#include "src/storage/stripe_layout.h"

namespace fuyou {

namespace {

constexpr uint64_t kMaxRequest = 1ull << 30;     // io_uring lengths are 32-bit; keep well inside
constexpr uint64_t kMaxRegistered = 1ull << 30;  // the kernel's limit on one fixed buffer
constexpr int kMaxRetries = 100;                 // EINTR/EAGAIN resubmissions of one piece
constexpr int kMaxNoProgress = 3;                // completions in a row that moved nothing
constexpr uint64_t kWakeTag = ~0ull;             // user_data of the eventfd read


struct BackingFile {
  std::string dir;
  std::string path;
  int fd = -1;
  bool created = false;   // by this store: removed at close unless keep_files
  FileIdentity identity;  // at open: a different inode at `path` later means "replaced"
  uint64_t size = 0;      // bytes allocated for the extents defined so far
};

struct Job {
  uint32_t gen = 1;
  bool active = false;  // holds a ticket that has not been waited
  bool finished = false;
  bool failed = false;
  bool queued = false;  // in the issue FIFO (still has bytes to hand out)
  IoOp op = IoOp::kRead;
  ExtentId extent = 0;
  uint64_t logical = 0;  // logical offset of the first byte
  uint64_t bytes = 0;
  char* buf = nullptr;
  uint64_t cursor = 0;  // bytes handed to pieces so far
  uint64_t done = 0;    // bytes completed
  int inflight = 0;     // pieces in flight
  int next = -1;        // issue FIFO link
  int more_errors = 0;  // failures after the first, which `error` describes
  std::string error;
  std::vector<SumCheck> expect;  // a read's blocks to check (StoreConfig::verify)
};

struct Piece {
  int job = -1;
  int dir = 0;
  uint64_t file_offset = 0;
  char* buf = nullptr;
  uint64_t len = 0;
  uint64_t done = 0;   // completed so far (after short transfers)
  int buf_index = -1;  // registered buffer, or -1
  int attempt = 0;
  int retries = 0;
  int no_progress = 0;
};

struct Registered {
  const char* base;
  uint64_t bytes;
};

}  // namespace

class SsdStore::Impl {
 public:
  explicit Impl(const StoreConfig& c) : cfg(c), layer(c.files) {}
  ~Impl();
  void init();

  StoreConfig cfg;
  std::shared_ptr<FileLayer> layer;
  std::vector<std::unique_ptr<DirLock>> locks;  // one per directory, released after the files go
  std::vector<BackingFile> files;
  std::unique_ptr<IoRing> ring;
  int wake_fd = -1;
  uint64_t wake_buf = 0;
  std::thread io_thread;

  std::mutex m;
  std::condition_variable cv;
  std::vector<ExtentInfo> extents;
  std::unordered_map<std::string, ExtentId> by_name;
  uint64_t end = 0;  // logical end of the last extent
  std::vector<Job> jobs;
  std::vector<int> free_jobs;
  std::vector<Piece> pieces;
  std::vector<int> free_pieces;
  std::vector<RingCompletion> synthetic;  // failures injected by before_io, not sent
  std::vector<Registered> registered;
  BlockSums sums;  // StoreConfig::verify
  int head = -1, tail = -1;
  int inflight = 0;  // pieces in flight, synthetic ones included
  std::chrono::steady_clock::time_point busy_since;  // when inflight last left 0
  bool stop = false;
  bool sleeping = false;  // the I/O thread is (about to be) in io_uring_enter
  std::string fatal;      // the ring itself failed; every later request fails with this
  StoreStats stats;

  int ndirs() const { return static_cast<int>(files.size()); }
  StripeLayout layout() const { return StripeLayout{ndirs(), cfg.stripe_unit}; }

  // ---- checks ---------------------------------------------------------------------------
  void check_file(int d, const std::string& doing) const;
  void reclaim_stale(const std::string& path, const DirLock& lock);
  void check_space(const std::vector<uint64_t>& new_size, const std::string& doing) const;
  void check_request(ExtentId id, uint64_t offset, const void* buf, uint64_t bytes, IoOp op) const;

  // ---- the I/O thread (all with `m` held) -------------------------------------------------
  void io_main();
  void pump();
  void issue(int p);
  void complete(int p, int32_t res);
  void fail_piece(int p, int err, const std::string& why);
  void finish_piece(int p);
  void fail_everything(const std::string& why);
  int buffer_index(const char* p, uint64_t bytes) const;

  Ticket submit(IoOp op, ExtentId id, uint64_t offset, char* buf, uint64_t bytes,
                std::vector<uint64_t> write_sums = {});
  std::string mismatch(ExtentId id, uint64_t logical, const SumResult& r) const;
  int ticket_index(Ticket t) const;
  void wake();
};

// ---- open and close ---------------------------------------------------------------------

// Opening is separate from construction so that a failure half-way runs ~Impl, which
// closes (and removes) the files opened so far.
void SsdStore::Impl::init() {
  if (!layer) layer = std::make_shared<FileLayer>();
  if (cfg.dirs.empty()) throw ConfigError("SSD store: no directories given (one per SSD)");
  if (cfg.stripe_unit == 0 || cfg.stripe_unit % kIoAlign)
    throw ConfigError(str("SSD store: stripe unit ", cfg.stripe_unit,
                          " must be a positive multiple of ", kIoAlign));
  if (cfg.request_size == 0 || cfg.request_size % kIoAlign || cfg.request_size > kMaxRequest)
    throw ConfigError(str("SSD store: request size ", cfg.request_size, " must be a multiple of ",
                          kIoAlign, " between ", kIoAlign, " and ", kMaxRequest));
  if (cfg.queue_depth < 1 || cfg.queue_depth > 4096)
    throw ConfigError(
        str("SSD store: queue depth ", cfg.queue_depth, " must be between 1 and 4096"));
  if (cfg.file_name.empty() || cfg.file_name.find('/') != std::string::npos)
    throw ConfigError(
        str("SSD store: backing file name '", cfg.file_name, "' must be a plain name"));

  namespace fs = std::filesystem;
  std::vector<std::string> seen;
  for (const auto& dir : cfg.dirs) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw IoError(
          str("SSD store: '", dir, "' is not a directory", ec ? ": " + ec.message() : ""));
    std::string canon = fs::canonical(dir, ec).string();
    if (std::find(seen.begin(), seen.end(), canon) != seen.end())
      throw ConfigError(str("SSD store: directory '", dir, "' is given twice (", canon,
                            "); two stripes would share one file"));
    seen.push_back(canon);
  }

  for (const auto& dir : cfg.dirs) {
    BackingFile f;
    f.dir = dir;
    f.path = (fs::path(dir) / cfg.file_name).string();
    locks.push_back(std::make_unique<DirLock>(dir, "SSD store: directory"));
    reclaim_stale(f.path, *locks.back());
    // No O_TRUNC even with overwrite: the file is truncated only once we hold its lock.
    int flags = O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC | (cfg.overwrite ? 0 : O_EXCL);
    FileIdentity before;
    bool existed = layer->stat(f.path, &before) == 0;
    int fd = layer->open(f.path, flags, 0644);
    if (fd == -EEXIST)
      throw IoError(str("SSD store: ", f.path, " already exists and no fuyou process left a lock beside it, "
                        "so it may hold someone's data and the store will not overwrite it (remove it if "
                        "nothing needs it)"));
    if (fd == -EINVAL)
      throw IoError(str("SSD store: cannot open ", f.path, " with O_DIRECT: ", errno_text(EINVAL),
                        "; the filesystem does not support direct I/O (tmpfs before Linux 6.6?)"));
    if (fd < 0) throw IoError(str("SSD store: cannot open ", f.path, ": ", errno_text(-fd)));
    f.fd = fd;
    f.created = !existed;
    files.push_back(f);  // from here the destructor closes (and maybe removes) it
    int r = layer->fstat(fd, &files.back().identity);
    if (r < 0) throw IoError(str("SSD store: cannot stat ", f.path, ": ", errno_text(-r)));
    // Two processes (or two stores) striping into one file would corrupt each other.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0)
      throw IoError(str("SSD store: ", f.path,
                        " is in use by another store (flock: ", errno_text(errno), ")"));
    if (cfg.overwrite && existed) {
      r = layer->ftruncate(fd, 0);
      if (r < 0) throw IoError(str("SSD store: cannot truncate ", f.path, ": ", errno_text(-r)));
      files.back().created = true;  // its old contents are gone: it is ours now
    }
  }

  pieces.resize(static_cast<size_t>(cfg.queue_depth));
  for (int i = cfg.queue_depth - 1; i >= 0; --i) free_pieces.push_back(i);
  synthetic.reserve(static_cast<size_t>(cfg.queue_depth));
  jobs.reserve(64);

  wake_fd = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd < 0) throw Error(str("SSD store: eventfd: ", errno_text(errno)));
  ring = std::make_unique<IoRing>(static_cast<unsigned>(cfg.queue_depth + 1));
  std::vector<int> fds;
  for (const auto& f : files) fds.push_back(f.fd);
  ring->set_files(fds);
  io_thread = std::thread([this] { io_main(); });
}

SsdStore::Impl::~Impl() {
  if (io_thread.joinable()) {
    int unwaited = 0;
    {
      std::lock_guard<std::mutex> lk(m);
      stop = true;
      // Requests that have not started are dropped; pieces in flight must land before
      // the ring and the caller's buffers go away.
      for (int j = head; j >= 0; j = jobs[j].next) {
        jobs[j].queued = false;
        jobs[j].failed = true;
        if (jobs[j].inflight == 0) jobs[j].finished = true;
      }
      head = tail = -1;
      for (const auto& j : jobs) unwaited += j.active;
    }
    wake();
    io_thread.join();
    if (unwaited) spdlog::warn("SSD store closed with {} request(s) never waited", unwaited);
  }
  ring.reset();
  if (wake_fd >= 0) ::close(wake_fd);
  for (auto& f : files) {
    // Remove the file only if the path still names the inode this store created: a file
    // that replaced it under the store is someone else's.
    FileIdentity now;
    bool ours = f.fd >= 0 && layer->stat(f.path, &now) == 0 && now.dev == f.identity.dev &&
                now.ino == f.identity.ino;
    if (f.fd >= 0) layer->close(f.fd);
    if (f.created && ours && !cfg.keep_files) layer->unlink(f.path);
  }
}

// A store file under a lock file that we could take was left by a fuyou process that is
// gone (killed, crashed, power lost): nothing can read it again (the layout lived in that
// process), so it is removed. One without a stale lock beside it is not known to be ours and
// is left to the O_EXCL open, which refuses it unless `overwrite`.
void SsdStore::Impl::reclaim_stale(const std::string& path, const DirLock& lock) {
  FileIdentity old;
  if (!lock.found_stale() || layer->stat(path, &old) != 0) return;
  int r = layer->unlink(path);
  if (r < 0) throw IoError(str("SSD store: cannot remove ", path, ", left by a fuyou process that is gone: ", errno_text(-r)));
  stats.reclaimed_bytes += old.size;
  spdlog::warn("SSD store: reclaimed {} ({} bytes, {}) left by a fuyou process that is gone", path, old.size,
               format_size(old.size));
}

SsdStore::SsdStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SsdStore::~SsdStore() = default;

std::unique_ptr<SsdStore> SsdStore::open(const StoreConfig& cfg) {
  auto impl = std::make_unique<Impl>(cfg);
  impl->init();
  return std::unique_ptr<SsdStore>(new SsdStore(std::move(impl)));
}

// ---- checks -----------------------------------------------------------------------------

// A backing file removed, replaced or truncated behind the store's back would make reads
// return zeros or writes vanish into an orphaned inode; both are refused here.
void SsdStore::Impl::check_file(int d, const std::string& doing) const {
  const BackingFile& f = files[d];
  FileIdentity now;
  int r = layer->stat(f.path, &now);
  if (r == -ENOENT)
    throw IoError(str("SSD store: backing file ", f.path, " was removed under the store; ", doing));
  if (r < 0)
    throw IoError(str("SSD store: cannot stat ", f.path, ": ", errno_text(-r), "; ", doing));
  if (now.dev != f.identity.dev || now.ino != f.identity.ino)
    throw IoError(str("SSD store: backing file ", f.path, " was replaced under the store (inode ",
                      now.ino, ", the store opened inode ", f.identity.ino, "); ", doing));
  FileIdentity open_file;
  r = layer->fstat(f.fd, &open_file);
  if (r < 0)
    throw IoError(str("SSD store: cannot fstat ", f.path, ": ", errno_text(-r), "; ", doing));
  if (open_file.size < f.size)
    throw IoError(str("SSD store: backing file ", f.path, " was truncated under the store: it is ",
                      open_file.size, " bytes, the store allocated ", f.size, "; ", doing));
}

void SsdStore::Impl::check_request(ExtentId id, uint64_t offset, const void* buf, uint64_t bytes,
                                   IoOp op) const {
  if (id >= extents.size())
    throw Error(str("SSD store: no extent with id ", id, " (", extents.size(), " defined)"));
  const ExtentInfo& e = extents[id];
  const char* what = io_op_name(op);
  if (offset % kIoAlign || bytes % kIoAlign)
    throw Error(str("SSD store: ", what, " of extent '", e.name, "' at offset ", offset, " size ",
                    bytes, ": offset and size must be multiples of ", kIoAlign, " (O_DIRECT)"));
  if (reinterpret_cast<uintptr_t>(buf) % kIoAlign)
    throw Error(str("SSD store: ", what, " of extent '", e.name, "': buffer ", buf, " is not ",
                    kIoAlign, "-byte aligned (O_DIRECT); use a HostPool slot"));
  if (offset > e.padded_bytes || bytes > e.padded_bytes - offset)
    throw Error(str("SSD store: ", what, " of extent '", e.name, "' at offset ", offset, " size ",
                    bytes, " runs past its end (", e.bytes, " bytes, ", e.padded_bytes,
                    " padded)"));
}

// ---- extents ----------------------------------------------------------------------------

ExtentId SsdStore::define_extent(const std::string& name, uint64_t bytes) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.m);
  if (name.empty()) throw Error("SSD store: an extent needs a name");
  auto it = s.by_name.find(name);
  if (it != s.by_name.end())
    throw Error(str("SSD store: extent '", name, "' is already defined (",
                    s.extents[it->second].bytes, " bytes)"));
  if (bytes == 0) throw Error(str("SSD store: extent '", name, "' has size 0"));
  uint64_t padded = round_up(bytes, kIoAlign), new_end = s.end + padded;
  if (s.cfg.max_bytes && new_end > s.cfg.max_bytes)
    throw IoError(str("SSD store: extent '", name, "' (", format_size(padded),
                      ") does not fit the SSD "
                      "budget: ",
                      format_size(s.end), " in use + ", format_size(padded), " > ",
                      format_size(s.cfg.max_bytes)));
  const std::string doing = str("cannot define extent '", name, "'");
  for (int d = 0; d < s.ndirs(); ++d) s.check_file(d, doing);

  std::vector<uint64_t> new_size(s.ndirs());
  for (int d = 0; d < s.ndirs(); ++d) new_size[d] = s.layout().file_size_for(d, new_end);
  s.check_space(new_size, str(doing, " (", bytes, " bytes)"));

  // Then allocate; on any failure shrink every file back, so the store is unchanged.
  for (int d = 0; d < s.ndirs(); ++d) {
    BackingFile& f = s.files[d];
    if (new_size[d] == f.size) continue;
    int r = s.layer->fallocate(f.fd, f.size, new_size[d] - f.size);
    if (r == -EOPNOTSUPP) {
      spdlog::warn(
          "SSD store: {} does not support fallocate; the file is grown sparse and running "
          "out of space will show up at write time",
          f.dir);
      r = s.layer->ftruncate(f.fd, new_size[d]);
    }
    if (r < 0) {
      uint64_t free_bytes = 0;
      s.layer->statvfs_free(f.dir, &free_bytes);
      for (int k = 0; k <= d; ++k) s.layer->ftruncate(s.files[k].fd, s.files[k].size);
      throw IoError(str("SSD store: ", doing, " (", bytes, " bytes): growing ", f.path, " from ",
                        f.size, " to ", new_size[d], " bytes (offset ", f.size, " size ",
                        new_size[d] - f.size, ") failed: ", errno_text(-r), "; ", free_bytes,
                        " bytes free"));
    }
  }
  for (int d = 0; d < s.ndirs(); ++d) s.files[d].size = new_size[d];

  ExtentId id = static_cast<ExtentId>(s.extents.size());
  s.extents.push_back(ExtentInfo{name, s.end, bytes, padded});
  s.sums.add_extent();
  s.by_name.emplace(name, id);
  s.end = new_end;
  return id;
}

// The space growing each file to new_size[d] takes, per filesystem (two directories on one
// disk draw on one pool), against what statvfs says is free there.
void SsdStore::Impl::check_space(const std::vector<uint64_t>& new_size, const std::string& doing) const {
  std::vector<std::pair<uint64_t, uint64_t>> need_by_dev;  // (dev, bytes)
  for (int d = 0; d < ndirs(); ++d) {
    uint64_t delta = new_size[d] > files[d].size ? new_size[d] - files[d].size : 0;
    auto dev = std::find_if(need_by_dev.begin(), need_by_dev.end(),
                            [&](auto& p) { return p.first == files[d].identity.dev; });
    if (dev == need_by_dev.end())
      need_by_dev.push_back({files[d].identity.dev, delta});
    else
      dev->second += delta;
  }
  for (int d = 0; d < ndirs(); ++d) {
    auto dev = std::find_if(need_by_dev.begin(), need_by_dev.end(),
                            [&](auto& p) { return p.first == files[d].identity.dev; });
    if (dev->second == 0) continue;
    uint64_t free_bytes = 0;
    int r = layer->statvfs_free(files[d].dir, &free_bytes);
    if (r < 0) throw IoError(str("SSD store: statvfs of ", files[d].dir, ": ", errno_text(-r)));
    if (dev->second > free_bytes)
      throw IoError(str("SSD store: ", doing, ": the filesystem of ", files[d].dir, " needs ", dev->second,
                        " more bytes (", format_size(dev->second), ") but has ", free_bytes, " free (",
                        format_size(free_bytes), ")"));
    dev->second = 0;  // checked once per filesystem
  }
}

void SsdStore::check_space(uint64_t logical_bytes, const std::string& what) const {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.m);
  std::vector<uint64_t> new_size(s.ndirs());
  for (int d = 0; d < s.ndirs(); ++d) new_size[d] = s.layout().file_size_for(d, s.end + logical_bytes);
  s.check_space(new_size, str(what, " (", logical_bytes, " bytes in all, ", format_size(logical_bytes), ")"));
}

ExtentId SsdStore::find_extent(const std::string& name) const {
  std::lock_guard<std::mutex> lk(impl_->m);
  auto it = impl_->by_name.find(name);
  if (it == impl_->by_name.end()) throw Error(str("SSD store: no extent named '", name, "'"));
  return it->second;
}

ExtentInfo SsdStore::extent(ExtentId id) const {
  std::lock_guard<std::mutex> lk(impl_->m);
  if (id >= impl_->extents.size())
    throw Error(str("SSD store: no extent with id ", id, " (", impl_->extents.size(), " defined)"));
  return impl_->extents[id];
}

size_t SsdStore::num_extents() const {
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->extents.size();
}

uint64_t SsdStore::logical_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->end;
}

// ---- buffers ----------------------------------------------------------------------------

void SsdStore::register_pool(const HostPool& pool) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.m);
  FY_CHECK(s.inflight == 0 && s.head < 0, "register_pool with requests in flight");
  if (!s.registered.empty()) s.ring->unregister_buffers();
  s.registered.clear();
  std::vector<iovec> iovs;
  for (const auto& r : pool.regions()) {
    for (uint64_t off = 0; off < r.bytes; off += kMaxRegistered) {
      uint64_t n = std::min(kMaxRegistered, r.bytes - off);
      char* base = static_cast<char*>(r.base) + off;
      iovs.push_back(iovec{base, n});
      s.registered.push_back(Registered{base, n});
    }
  }
  int r = s.ring->register_buffers(iovs);
  if (r < 0) {
    spdlog::warn(
        "SSD store: io_uring could not register the host pool ({}) as fixed buffers: {}; "
        "requests go without them (raise RLIMIT_MEMLOCK to fix)",
        format_size(pool.bytes()), errno_text(-r));
    s.registered.clear();
  }
  s.stats.fixed_buffers = !s.registered.empty();
}

int SsdStore::Impl::buffer_index(const char* p, uint64_t bytes) const {
  for (size_t i = 0; i < registered.size(); ++i) {
    const Registered& r = registered[i];
    if (p >= r.base && p + bytes <= r.base + r.bytes) return static_cast<int>(i);
  }
  return -1;
}

// ---- submitting and waiting -------------------------------------------------------------

void SsdStore::Impl::wake() {
  uint64_t one = 1;
  // The counter cannot overflow in practice and a failed write only means the I/O thread
  // is already awake, so the result is not needed.
  [[maybe_unused]] ssize_t n = ::write(wake_fd, &one, sizeof one);
}

Ticket SsdStore::Impl::submit(IoOp op, ExtentId id, uint64_t offset, char* buf, uint64_t bytes,
                              std::vector<uint64_t> write_sums) {
  bool need_wake;
  Ticket t;
  {
    std::lock_guard<std::mutex> lk(m);
    check_request(id, offset, buf, bytes, op);
    if (!fatal.empty()) throw IoError(fatal);
    FY_CHECK(!stop, "submit on a closing store");
    const ExtentInfo& e = extents[id];
    uint64_t logical = e.logical_offset + offset;
    for (int d = 0; d < ndirs(); ++d) {
      uint64_t fo;
      if (layout().first_in_dir(d, logical, bytes, &fo))
        check_file(d, str("refusing to ", io_op_name(op), " extent '", e.name, "' offset ", offset,
                          " size ", bytes, " (file offset ", fo, ")"));
    }
    int idx;
    if (free_jobs.empty()) {
      idx = static_cast<int>(jobs.size());
      jobs.emplace_back();  // only when more tickets are outstanding than ever before
    } else {
      idx = free_jobs.back();
      free_jobs.pop_back();
    }
    Job& j = jobs[idx];
    j.active = true;
    j.finished = bytes == 0;
    j.failed = false;
    j.op = op;
    j.extent = id;
    j.logical = logical;
    j.bytes = bytes;
    j.buf = buf;
    j.cursor = j.done = 0;
    j.inflight = 0;
    j.next = -1;
    j.more_errors = 0;
    j.error.clear();
    j.expect.clear();
    if (cfg.verify && op == IoOp::kWrite) sums.record(id, offset, bytes, std::move(write_sums));
    if (cfg.verify && op == IoOp::kRead) stats.unverified_bytes += bytes - sums.expect(id, offset, bytes, &j.expect);
    j.queued = bytes > 0;
    if (j.queued) {
      if (tail >= 0)
        jobs[tail].next = idx;
      else
        head = idx;
      tail = idx;
    }
    t = (static_cast<Ticket>(j.gen) << 32) | static_cast<Ticket>(idx + 1);
    need_wake = j.queued && sleeping;
  }
  if (need_wake) wake();
  return t;
}

Ticket SsdStore::submit_read(ExtentId id, uint64_t offset, void* dst, uint64_t bytes) {
  return impl_->submit(IoOp::kRead, id, offset, static_cast<char*>(dst), bytes);
}

Ticket SsdStore::submit_write(ExtentId id, uint64_t offset, const void* src, uint64_t bytes) {
  // The buffer is only read by the kernel; the cast lets one job type serve both ways. Its
  // checksums are taken here, on the caller's thread, outside the store's lock.
  char* p = static_cast<char*>(const_cast<void*>(src));
  return impl_->submit(IoOp::kWrite, id, offset, p, bytes,
                       impl_->cfg.verify ? hash_blocks(p, bytes) : std::vector<uint64_t>{});
}

int SsdStore::Impl::ticket_index(Ticket t) const {
  uint64_t low = t & 0xffffffffull;
  uint32_t gen = static_cast<uint32_t>(t >> 32);
  if (low == 0 || low > jobs.size() || !jobs[low - 1].active || jobs[low - 1].gen != gen)
    throw Error(str("SSD store: ticket ", t, " is unknown or was already waited"));
  return static_cast<int>(low - 1);
}

bool SsdStore::poll(Ticket t) {
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->jobs[impl_->ticket_index(t)].finished;
}

void SsdStore::wait(Ticket t) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lk(s.m);
  int idx = s.ticket_index(t);
  s.cv.wait(lk, [&] { return s.jobs[idx].finished; });
  Job& j = s.jobs[idx];
  j.active = false;
  ++j.gen;  // a stale copy of this ticket no longer matches
  s.free_jobs.push_back(idx);
  if (!j.failed) {
    if (j.expect.empty()) return;
    // Hash without the lock, so that the I/O thread and other callers go on meanwhile; the
    // slot may be reused at once, so keep what the check needs.
    const std::vector<SumCheck> expect = std::move(j.expect);
    const ExtentId id = j.extent;
    const uint64_t logical = j.logical;
    const char* buf = j.buf;
    lk.unlock();
    const SumResult r = check_blocks(buf, expect);
    lk.lock();
    s.stats.verified_bytes += r.ok_bytes;
    if (!r.bad) return;
    ++s.stats.checksum_failures;
    throw IoError(s.mismatch(id, logical, r));
  }
  if (j.op == IoOp::kWrite && s.cfg.verify)  // what reached the disk is unknown
    s.sums.forget(j.extent, j.logical - s.extents[j.extent].logical_offset, j.bytes);
  ++s.stats.failed_requests;
  std::string msg =
      j.error.empty() ? "SSD store: request cancelled: the store was closing" : j.error;
  if (j.more_errors) msg += str(" (and ", j.more_errors, " more failed pieces of this request)");
  throw IoError(msg);
}

void SsdStore::wait_all() {
  std::vector<Ticket> all;
  {
    std::lock_guard<std::mutex> lk(impl_->m);
    for (size_t i = 0; i < impl_->jobs.size(); ++i)
      if (impl_->jobs[i].active)
        all.push_back((static_cast<Ticket>(impl_->jobs[i].gen) << 32) | (i + 1));
  }
  std::string first;
  for (Ticket t : all) {
    try {
      wait(t);
    } catch (const IoError& e) {
      if (first.empty()) first = e.what();
    }
  }
  if (!first.empty()) throw IoError(first);
}

void SsdStore::read_sync(ExtentId id, uint64_t offset, void* dst, uint64_t bytes) {
  wait(submit_read(id, offset, dst, bytes));
}

void SsdStore::write_sync(ExtentId id, uint64_t offset, const void* src, uint64_t bytes) {
  wait(submit_write(id, offset, src, bytes));
}

void SsdStore::flush() {
  Impl& s = *impl_;
  for (int d = 0; d < s.ndirs(); ++d) {
    {
      std::lock_guard<std::mutex> lk(s.m);
      s.check_file(d, "flush would make an orphaned file durable");
    }
    // fdatasync runs without the lock: it can take long and the I/O thread must go on.
    int r = s.layer->fdatasync(s.files[d].fd);
    if (r < 0)
      throw IoError(str("SSD store: fdatasync of ", s.files[d].path, " (", s.files[d].size,
                        " bytes) failed: ", errno_text(-r),
                        "; writes since the last successful flush may not be durable"));
  }
}

StoreStats SsdStore::stats() const {
  std::lock_guard<std::mutex> lk(impl_->m);
  StoreStats st = impl_->stats;
  if (impl_->inflight > 0)
    st.busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->busy_since).count();
  return st;
}

const StoreConfig& SsdStore::config() const { return impl_->cfg; }

std::vector<std::string> SsdStore::backing_paths() const {
  std::vector<std::string> out;
  for (const auto& f : impl_->files) out.push_back(f.path);
  return out;
}

std::vector<std::string> SsdStore::cleanup_paths() const {
  std::vector<std::string> out;
  for (const auto& f : impl_->files)
    if (f.created && !impl_->cfg.keep_files) out.push_back(f.path);
  for (const auto& l : impl_->locks) out.push_back(l->path());
  return out;
}

// ---- checksums ---------------------------------------------------------------------------

std::string SsdStore::Impl::mismatch(ExtentId id, uint64_t logical, const SumResult& r) const {
  const ExtentInfo& e = extents[id];
  const SumCheck& x = r.first_bad;
  const uint64_t got = r.first_got;
  const size_t more = r.bad - 1;
  const uint64_t ext_off = logical - e.logical_offset + x.buf_off;
  int dir = 0;
  uint64_t file_off = 0, run = 0;
  layout().map(logical + x.buf_off, &dir, &file_off, &run);
  return str("SSD store: checksum mismatch reading extent '", e.name, "': ", x.len, " bytes at extent offset ",
             ext_off, " (", files[dir].path, " offset ", file_off, ") read back with XXH3 ", hex64(got),
             " but were written with XXH3 ", hex64(x.sum),
             more ? str(" (and ", more, " more blocks of this read)") : std::string(),
             ": the bytes changed after they were written (a failing disk, or another process writing into "
             "the backing file), or the read was submitted before the write of those bytes had finished");
}

// ---- the I/O thread ---------------------------------------------------------------------

// Hands out pieces of the queued jobs, oldest first, while fewer than queue_depth are in
// flight. A piece never crosses a stripe boundary or exceeds request_size.
void SsdStore::Impl::pump() {
  while (head >= 0 && !free_pieces.empty() && !stop) {
    Job& j = jobs[head];
    int p = free_pieces.back();
    free_pieces.pop_back();
    Piece& pc = pieces[p];
    uint64_t run;
    layout().map(j.logical + j.cursor, &pc.dir, &pc.file_offset, &run);
    pc.job = head;
    pc.len = std::min({cfg.request_size, run, j.bytes - j.cursor});
    pc.buf = j.buf + j.cursor;
    pc.done = 0;
    pc.buf_index = buffer_index(pc.buf, pc.len);
    pc.attempt = pc.retries = pc.no_progress = 0;
    j.cursor += pc.len;
    ++j.inflight;
    if (inflight++ == 0) busy_since = std::chrono::steady_clock::now();
    if (j.cursor == j.bytes) {  // fully handed out: the next job may start
      j.queued = false;
      head = j.next;
      if (head < 0) tail = -1;
    }
    issue(p);
  }
}

// Sends (the rest of) a piece to the kernel, after asking the file layer's fault hook.
void SsdStore::Impl::issue(int p) {
  Piece& pc = pieces[p];
  const Job& j = jobs[pc.job];
  uint64_t off = pc.file_offset + pc.done, len = pc.len - pc.done;
  IoFault fault =
      layer->before_io(IoAttempt{j.op, pc.dir, &files[pc.dir].path, off, len, pc.attempt});
  ++pc.attempt;
  if (fault.error) {
    synthetic.push_back(RingCompletion{static_cast<uint64_t>(p), -fault.error});
    return;
  }
  // An injected short transfer stays a multiple of 4 KiB: O_DIRECT refuses anything else.
  if (fault.max_bytes && fault.max_bytes < len)
    len = std::max(kIoAlign, fault.max_bytes / kIoAlign * kIoAlign);
  bool ok = ring->prep(j.op, pc.dir, pc.buf + pc.done, static_cast<uint32_t>(len), off,
                       pc.buf_index, static_cast<uint64_t>(p));
  FY_CHECK(ok, "io_uring submission queue full with ", inflight, " pieces in flight");
  ++stats.requests;
  if (pc.buf_index >= 0) ++stats.fixed_requests;
}

void SsdStore::Impl::complete(int p, int32_t res) {
  Piece& pc = pieces[p];
  Job& j = jobs[pc.job];
  const std::string& path = files[pc.dir].path;
  uint64_t off = pc.file_offset + pc.done, left = pc.len - pc.done;
  if (res == -EINTR || res == -EAGAIN) {
    ++stats.retries;
    if (++pc.retries <= kMaxRetries) return issue(p);
    return fail_piece(p, -res, str("still failing after ", kMaxRetries, " resubmissions"));
  }
  if (res < 0) return fail_piece(p, -res, "");
  uint64_t got = static_cast<uint64_t>(res);
  FY_CHECK(got <= left, "io_uring completed ", got, " bytes of a ", left, "-byte request");
  if (got == left) {
    (j.op == IoOp::kRead ? stats.bytes_read : stats.bytes_written) += pc.len;
    j.done += pc.len;
    return finish_piece(p);
  }
  if (got == 0 && j.op == IoOp::kRead) {
    FileIdentity now;
    uint64_t size = layer->fstat(files[pc.dir].fd, &now) == 0 ? now.size : 0;
    return fail_piece(p, 0,
                      str("read past the end of the file: it is ", size,
                          " bytes, the store "
                          "allocated ",
                          files[pc.dir].size, " (truncated under the store?)"));
  }
  // A short transfer: keep what landed (whole 4 KiB blocks only, since O_DIRECT cannot
  // resume mid-block; redoing part of a block is harmless) and resubmit the rest.
  ++stats.short_transfers;
  uint64_t kept = got / kIoAlign * kIoAlign;
  pc.done += kept;
  pc.no_progress = kept ? 0 : pc.no_progress + 1;
  if (pc.no_progress >= kMaxNoProgress)
    return fail_piece(
        p, 0,
        str(io_op_name(j.op), " made no progress ", kMaxNoProgress, " times in a row (", got,
            " bytes of ", left, " at offset ", off, " of ", path, ")"));
  issue(p);
}

void SsdStore::Impl::fail_piece(int p, int err, const std::string& why) {
  Piece& pc = pieces[p];
  Job& j = jobs[pc.job];
  const BackingFile& f = files[pc.dir];
  const ExtentInfo& e = extents[j.extent];
  uint64_t off = pc.file_offset + pc.done, left = pc.len - pc.done;
  if (j.failed && !j.error.empty()) {
    ++j.more_errors;
  } else {
    std::string detail = err ? errno_text(err) : why;
    if (err && !why.empty()) detail += "; " + why;
    if (err == ENOSPC) {
      uint64_t free_bytes = 0;
      if (layer->statvfs_free(f.dir, &free_bytes) == 0)
        detail += str(" (", free_bytes, " bytes free in ", f.dir, ")");
    }
    uint64_t ext_off = j.logical + (pc.buf - j.buf) + pc.done - e.logical_offset;
    j.error = str("SSD store: ", io_op_name(j.op), " of extent '", e.name, "' (extent offset ",
                  ext_off, ") failed at ", f.path, " offset ", off, " size ", left, ": ", detail);
  }
  j.failed = true;
  if (j.queued) {  // only the head job can have pieces in flight and bytes left to hand out
    FY_CHECK(head == pc.job, "a queued job with pieces in flight is not at the head");
    j.queued = false;
    head = j.next;
    if (head < 0) tail = -1;
  }
  finish_piece(p);
}

void SsdStore::Impl::finish_piece(int p) {
  Job& j = jobs[pieces[p].job];
  pieces[p].job = -1;
  free_pieces.push_back(p);
  if (--inflight == 0)
    stats.busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since).count();
  --j.inflight;
  if (j.inflight == 0 && !j.queued && (j.failed || j.done == j.bytes)) {
    j.finished = true;
    cv.notify_all();
  }
}

void SsdStore::Impl::fail_everything(const std::string& why) {
  fatal = why;
  for (auto& j : jobs) {
    if (!j.active || j.finished) continue;
    j.failed = true;
    j.finished = true;
    j.queued = false;
    if (j.error.empty()) j.error = why;
  }
  head = tail = -1;
  cv.notify_all();
}

void SsdStore::Impl::io_main() {
  RingCompletion done[64];
  bool wake_armed = false;
  std::unique_lock<std::mutex> lk(m);
  try {
    for (;;) {
      if (!wake_armed) {
        wake_armed = ring->prep_wake(wake_fd, &wake_buf, kWakeTag);
        FY_CHECK(wake_armed, "no room in the ring for the wake-up read");
      }
      pump();
      // Faults injected by before_io complete without the kernel; handle them (and what
      // they resubmit) before sleeping.
      while (!synthetic.empty()) {
        RingCompletion c = synthetic.back();
        synthetic.pop_back();
        complete(static_cast<int>(c.user_data), c.res);
        pump();
      }
      if (stop && inflight == 0) break;
      sleeping = true;
      lk.unlock();
      int r = ring->submit(1);
      unsigned n = ring->reap(done, 64);
      lk.lock();
      sleeping = false;
      if (r < 0 && r != -EAGAIN && r != -EBUSY)
        throw Error(str("io_uring_enter failed: ", errno_text(-r)));
      for (unsigned i = 0; i < n; ++i) {
        if (done[i].user_data == kWakeTag)
          wake_armed = false;
        else
          complete(static_cast<int>(done[i].user_data), done[i].res);
      }
    }
  } catch (const std::exception& e) {
    // The ring is unusable; nothing in flight can be trusted, so every request fails.
    if (!lk.owns_lock()) lk.lock();
    fail_everything(str("SSD store: the I/O thread stopped: ", e.what()));
  }
}

}  // namespace fuyou
