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
#include <filesystem>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "src/common/xxh3.h"
#include "src/storage/ssd_store_impl.h"

namespace fuyou {

using namespace ssd_store_detail;

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
      throw IoError(
          str("SSD store: ", f.path,
              " already exists and no fuyou process left a lock beside it, "
              "so it may hold someone's data and the store will not overwrite it (remove it if "
              "nothing needs it)"));
    if (fd == -EINVAL) {
      // The kernel creates the file before it refuses O_DIRECT.
      if (!existed) layer->unlink(f.path);
      throw IoError(str("SSD store: cannot open ", f.path, " with O_DIRECT: ", errno_text(EINVAL),
                        "; the filesystem does not support direct I/O (ramfs does not, nor tmpfs "
                        "before Linux 6.6): give a directory on a disk's filesystem"));
    }
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
  if (r < 0)
    throw IoError(str("SSD store: cannot remove ", path,
                      ", left by a fuyou process that is gone: ", errno_text(-r)));
  stats.reclaimed_bytes += old.size;
  spdlog::warn("SSD store: reclaimed {} ({} bytes, {}) left by a fuyou process that is gone", path,
               old.size, format_size(old.size));
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
                      ") does not fit the SSD budget: ", format_size(s.end), " in use + ",
                      format_size(padded), " > ", format_size(s.cfg.max_bytes)));
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

namespace {

// What growing directory `dir`'s backing file takes: `grow` bytes on filesystem `dev`.
struct Growth {
  std::string dir;
  uint64_t dev;
  uint64_t grow;
};

// The growths, summed per filesystem (two directories on one disk draw on one pool), against
// what statvfs says is free there; refused naming the first directory of a filesystem short.
void check_growth(FileLayer& layer, const std::vector<Growth>& growth, const std::string& doing) {
  std::vector<std::pair<uint64_t, uint64_t>> need_by_dev;  // (dev, bytes)
  for (const Growth& g : growth) {
    auto dev = std::find_if(need_by_dev.begin(), need_by_dev.end(),
                            [&](auto& p) { return p.first == g.dev; });
    if (dev == need_by_dev.end())
      need_by_dev.push_back({g.dev, g.grow});
    else
      dev->second += g.grow;
  }
  for (const Growth& g : growth) {
    auto dev = std::find_if(need_by_dev.begin(), need_by_dev.end(),
                            [&](auto& p) { return p.first == g.dev; });
    if (dev->second == 0) continue;
    uint64_t free_bytes = 0;
    int r = layer.statvfs_free(g.dir, &free_bytes);
    if (r < 0) throw IoError(str("SSD store: statvfs of ", g.dir, ": ", errno_text(-r)));
    if (dev->second > free_bytes)
      throw IoError(str("SSD store: ", doing, ": the filesystem of ", g.dir, " needs ", dev->second,
                        " more bytes (", format_size(dev->second), ") but has ", free_bytes,
                        " free (", format_size(free_bytes), ")"));
    dev->second = 0;  // checked once per filesystem
  }
}

std::string logical_what(const std::string& what, uint64_t logical_bytes) {
  return str(what, " (", logical_bytes, " bytes in all, ", format_size(logical_bytes), ")");
}

}  // namespace

// The space growing each file to new_size[d] takes.
void SsdStore::Impl::check_space(const std::vector<uint64_t>& new_size,
                                 const std::string& doing) const {
  std::vector<Growth> growth;
  for (int d = 0; d < ndirs(); ++d)
    growth.push_back({files[d].dir, files[d].identity.dev,
                      new_size[d] > files[d].size ? new_size[d] - files[d].size : 0});
  check_growth(*layer, growth, doing);
}

void SsdStore::check_space_before_open(const StoreConfig& cfg, uint64_t logical_bytes,
                                       const std::string& what) {
  const std::shared_ptr<FileLayer> layer = cfg.files ? cfg.files : std::make_shared<FileLayer>();
  const StripeLayout stripes{static_cast<int>(cfg.dirs.size()), cfg.stripe_unit};
  std::vector<Growth> growth;
  for (size_t d = 0; d < cfg.dirs.size(); ++d) {
    FileIdentity id;
    const int r = layer->stat(cfg.dirs[d], &id);
    if (r < 0) throw IoError(str("SSD store: cannot stat ", cfg.dirs[d], ": ", errno_text(-r)));
    growth.push_back(
        {cfg.dirs[d], id.dev, stripes.file_size_for(static_cast<int>(d), logical_bytes)});
  }
  check_growth(*layer, growth, logical_what(what, logical_bytes));
}

void SsdStore::check_space(uint64_t logical_bytes, const std::string& what) const {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.m);
  std::vector<uint64_t> new_size(s.ndirs());
  for (int d = 0; d < s.ndirs(); ++d)
    new_size[d] = s.layout().file_size_for(d, s.end + logical_bytes);
  s.check_space(new_size, logical_what(what, logical_bytes));
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
    if (cfg.verify && op == IoOp::kRead)
      stats.unverified_bytes += bytes - sums.expect(id, offset, bytes, &j.expect);
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
    st.busy_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->busy_since).count();
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
  return str(
      "SSD store: checksum mismatch reading extent '", e.name, "': ", x.len,
      " bytes at extent offset ", ext_off, " (", files[dir].path, " offset ", file_off,
      ") read back with XXH3 ", hex64(got), " but were written with XXH3 ", hex64(x.sum),
      more ? str(" (and ", more, " more blocks of this read)") : std::string(),
      ": the bytes changed after they were written (a failing disk, or another process writing "
      "into the backing file), or the read was submitted before the write of those bytes had "
      "finished");
}

}  // namespace fuyou
