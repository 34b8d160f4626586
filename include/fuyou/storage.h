// The storage tier: an SSD store of named extents (io_uring, O_DIRECT, striped over one
// directory per SSD) and a pinned host pool carved into fixed slots.
//
// SsdStore. Every extent lives in one logical address space, contiguous and 4 KiB aligned,
// so one layer's state of one kind ("layer.17/adam_m") is one extent that moves in one
// request. Logical offsets map to the backing files by round robin over stripe units:
//   stripe s = L / stripe_unit  ->  directory s % ndirs, file offset
//   (s / ndirs) * stripe_unit + L % stripe_unit
// with one backing file per directory, preallocated (fallocate) as extents are defined, so
// running out of space is reported when the extent is defined, with the numbers.
//
// Requests are asynchronous: submit_read / submit_write return a Ticket at once; poll()
// says whether it finished; wait() returns when it has and throws IoError naming the
// backing file, the file offset, the size and the errno text if any part failed. A
// request is split into io_uring requests of at most request_size bytes that never cross
// a stripe boundary, and up to queue_depth of them are kept in flight, first submitted
// first served. Short transfers and EINTR/EAGAIN are resubmitted; a read past the end of a
// backing file (truncated under the store) is an error, never zeros. The store never
// reports success for bytes it did not transfer, and a failed write touches only the
// range it was asked to write.
//
// Integrity: with `verify` (the default) the store keeps the XXH3-64 of every written block
// (kSumBlock bytes of a write request, counted from the request's start) in memory, and a
// read that covers a whole block checks it when it is waited: bytes that changed on the disk
// after they were written (a failing SSD, another process writing into a backing file) are
// reported as an IoError naming the extent, the extent offset, the backing file and its
// offset, never handed on as data. The sums a read checks are those in force when it was
// submitted. A block that a later write overlaps only in part is dropped (its bytes are no
// longer known); reads of such bytes, or of bytes never written, are counted in
// StoreStats::unverified_bytes. The engine writes and reads back the same ranges, so its
// reads are all verified (tests check unverified_bytes == 0). Cost: docs/robustness.md.
//
// Durability: a write is on the device (past the page cache, O_DIRECT) when wait() returns,
// but may sit in the device's volatile write cache and, for ext4/xfs, its block mapping may
// still be in the journal; it survives a power loss only after flush().
//
// Thread safety: every SsdStore method takes one internal mutex, so several threads may
// submit and wait. The store's own I/O thread keeps requests moving between calls, so a
// caller can submit, compute, and wait later; wait() sleeps on a condition variable and
// does not block other callers. Tickets are per store.
//
// The pool given to register_pool() must outlive the store (the ring holds its pages).
//
// Buffers must be 4 KiB aligned, and offsets and sizes multiples of 4 KiB (O_DIRECT).
// Buffers inside a HostPool registered with register_pool() go through io_uring's fixed
// buffers (READ_FIXED / WRITE_FIXED: no page pinning per request); others work, slower.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fuyou {

class FileLayer;  // src/storage/file_layer.h: the injectable file layer (tests, fault injection)
class HostPool;

// O_DIRECT alignment of buffers, offsets and sizes, and the extent alignment.
constexpr uint64_t kIoAlign = 4096;

struct StoreConfig {
  std::vector<std::string> dirs;          // one per SSD; must exist
  uint64_t stripe_unit = 4ull << 20;      // multiple of 4 KiB
  int queue_depth = 32;                   // io_uring requests in flight, 1..4096
  uint64_t request_size = 1ull << 20;     // largest io_uring request, multiple of 4 KiB, <= 1 GiB
  std::string file_name = "fuyou.store";  // backing file name inside each directory
  // Each directory is locked (flock on DIR/fuyou.lock) while the store is open, so two
  // processes cannot share one. A backing file found under a lock that a process gone left
  // behind is reclaimed (removed, with a log line naming its bytes). Any other existing
  // backing file is refused (it may hold someone's data) unless this is set, in which case
  // it is truncated.
  bool overwrite = false;
  // The layout lives in this process only, so the backing files are removed at close
  // unless asked to keep them (for inspection).
  bool keep_files = false;
  uint64_t max_bytes = 0;  // SSD budget for all extents together; 0: no limit
  // Keep a checksum of every written block and check it on read (see "Integrity" above).
  bool verify = true;
  // The file layer; null means the real one (open/fallocate/fsync, no faults).
  std::shared_ptr<FileLayer> files;
};

using ExtentId = uint32_t;

struct ExtentInfo {
  std::string name;
  uint64_t logical_offset = 0;  // in the store's logical address space, 4 KiB aligned
  uint64_t bytes = 0;           // as defined
  uint64_t padded_bytes = 0;    // bytes rounded up to 4 KiB: the most one request may move
};

// A submitted request. 0 is never a valid ticket.
using Ticket = uint64_t;

struct StoreStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;         // io_uring requests issued (resubmissions included)
  uint64_t fixed_requests = 0;   // of which through registered buffers
  uint64_t short_transfers = 0;  // completions with fewer bytes than asked, resubmitted
  uint64_t retries = 0;          // EINTR / EAGAIN resubmissions
  uint64_t failed_requests = 0;  // tickets that ended in an error
  uint64_t reclaimed_bytes = 0;  // of backing files left by processes that are gone (open)
  // Seconds with at least one request in flight, whoever made it: the union of the times
  // the disks are busy (the executor's `disk` busy time).
  double busy_s = 0;
  bool fixed_buffers = false;  // a pool is registered with the ring
  // With StoreConfig::verify: bytes read whose block checksum matched, bytes read that no
  // whole written block covered (never written, or written in part since), and reads that
  // found a mismatch.
  uint64_t verified_bytes = 0;
  uint64_t unverified_bytes = 0;
  uint64_t checksum_failures = 0;
};

// The unit of the store's checksums: each write request is hashed in blocks of this many
// bytes from its start (the last one shorter).
constexpr uint64_t kSumBlock = 1ull << 20;

class SsdStore {
 public:
  // Opens (creates) the backing files and the io_uring. Throws ConfigError for a bad
  // config and IoError for a directory or file that cannot be used, naming it.
  static std::unique_ptr<SsdStore> open(const StoreConfig& cfg);
  ~SsdStore();
  SsdStore(const SsdStore&) = delete;
  SsdStore& operator=(const SsdStore&) = delete;

  // Appends an extent of `bytes` (> 0) to the logical space and grows the backing files
  // (fallocate). Throws IoError naming the directory, the bytes needed and the bytes free
  // when a filesystem cannot hold it; the store is unchanged then.
  ExtentId define_extent(const std::string& name, uint64_t bytes);
  ExtentId find_extent(const std::string& name) const;  // throws Error for an unknown name
  ExtentInfo extent(ExtentId id) const;
  size_t num_extents() const;
  uint64_t logical_bytes() const;  // end of the last extent

  // Registers the pool's regions as io_uring fixed buffers. No request may be in flight.
  // If the kernel refuses (memory-lock limit), the store logs it and goes on without.
  void register_pool(const HostPool& pool);

  // Reads/writes `bytes` at `offset` inside extent `id`. offset, bytes and the buffer must
  // be 4 KiB aligned and offset + bytes <= padded_bytes. The buffer must stay valid and
  // untouched until wait() returns. Argument errors and a backing file found truncated,
  // removed or replaced throw here; I/O errors are thrown by wait().
  Ticket submit_read(ExtentId id, uint64_t offset, void* dst, uint64_t bytes);
  Ticket submit_write(ExtentId id, uint64_t offset, const void* src, uint64_t bytes);
  // True once the request has finished, successfully or not; never blocks. Call wait()
  // to learn which and to release the ticket.
  bool poll(Ticket t);
  // Blocks until the request has finished; throws IoError if any part of it failed. A
  // ticket can be waited once; waiting again (or an unknown ticket) throws Error.
  void wait(Ticket t);
  void wait_all();  // waits every outstanding ticket; throws the first error after all end

  void read_sync(ExtentId id, uint64_t offset, void* dst, uint64_t bytes);
  void write_sync(ExtentId id, uint64_t offset, const void* src, uint64_t bytes);

  // Makes completed writes durable (fdatasync of every backing file). Throws IoError
  // naming the file.
  void flush();

  StoreStats stats() const;
  const StoreConfig& config() const;
  std::vector<std::string> backing_paths() const;
  // What closing the store removes: the backing files it created (unless keep_files) and
  // its directory locks. For a process that must exit at once (a second SIGINT) and can
  // only unlink.
  std::vector<std::string> cleanup_paths() const;
  // Refuses (IoError with the numbers, per filesystem) when the directories cannot hold a
  // logical space of `logical_bytes`: what a plan will define, checked before the first
  // extent so that a run does not start and then stop half-way through its definitions.
  void check_space(uint64_t logical_bytes, const std::string& what) const;
  // The same check, in the same words, for a store not yet opened (no backing file yet): what
  // --dry-run asks, writing nothing.
  static void check_space_before_open(const StoreConfig& cfg, uint64_t logical_bytes,
                                      const std::string& what);

  class Impl;

 private:
  explicit SsdStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- host pool --------------------------------------------------------------------------

// A class of equal slots: `count` slots of `bytes` each (rounded up to 4 KiB).
struct SlotSpec {
  std::string name;
  uint64_t bytes = 0;
  uint32_t count = 0;
};

struct HostPoolOptions {
  // Largest region. 1 GiB matches io_uring's limit on one registered buffer, so every
  // slot lies inside one registered buffer. A slot larger than this gets its own region.
  uint64_t max_region_bytes = 1ull << 30;
  bool lock = true;  // mlock the regions; failure is a warning, not an error
  // Ask for transparent huge pages (MADV_HUGEPAGE). Pinning and DMA-mapping a request's
  // buffer then walks 2 MiB pages instead of 4 KiB ones; docs/performance.md measures it.
  bool huge_pages = true;
};

// One slot of a HostPool.
struct HostSlot {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  int slot_class = -1;
  uint32_t index = 0;
};

// Pinned host memory allocated once, at start, in a few large regions (2 MiB aligned,
// populated), carved into fixed slots that their owner (the executor, the optimizer) assigns
// by index: nothing is allocated after construction.
class HostPool {
 public:
  struct Region {
    void* base = nullptr;
    uint64_t bytes = 0;
  };

  explicit HostPool(std::vector<SlotSpec> specs, HostPoolOptions opts = {});
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Dry run: the bytes a pool of these specs maps (slots rounded up, regions rounded up to
  // 2 MiB), without mapping anything.
  static uint64_t planned_bytes(const std::vector<SlotSpec>& specs,
                                const HostPoolOptions& opts = {});

  int slot_class(const std::string& name) const;  // throws Error for an unknown name
  HostSlot slot(int slot_class, uint32_t index) const;

  uint64_t bytes() const;  // mapped bytes, all regions
  bool locked() const;     // all regions are mlocked
  const std::vector<Region>& regions() const;
  bool contains(const void* p, uint64_t bytes) const;

 private:
  struct Class;
  std::vector<Class> classes_;
  std::vector<Region> regions_;
  HostPoolOptions opts_;
  uint64_t bytes_ = 0;
  bool locked_ = false;
};

}  // namespace fuyou
