// The SSD store's private parts (src/storage/ssd_store.cc, ssd_store_io.cc): the state that
// callers and the I/O thread share, and the requests in flight. Not for use elsewhere.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fuyou/storage.h"
#include "src/storage/block_sums.h"
#include "src/storage/dir_lock.h"
#include "src/storage/file_layer.h"
#include "src/storage/io_ring.h"
#include "src/storage/stripe_layout.h"

namespace fuyou {

namespace ssd_store_detail {

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

}  // namespace ssd_store_detail

class SsdStore::Impl {
 public:
  explicit Impl(const StoreConfig& c) : cfg(c), layer(c.files) {}
  ~Impl();
  void init();

  StoreConfig cfg;
  std::shared_ptr<FileLayer> layer;
  std::vector<std::unique_ptr<DirLock>> locks;  // one per directory, released after the files go
  std::vector<ssd_store_detail::BackingFile> files;
  std::unique_ptr<IoRing> ring;
  int wake_fd = -1;
  uint64_t wake_buf = 0;
  std::thread io_thread;

  std::mutex m;
  std::condition_variable cv;
  std::vector<ExtentInfo> extents;
  std::unordered_map<std::string, ExtentId> by_name;
  uint64_t end = 0;  // logical end of the last extent
  std::vector<ssd_store_detail::Job> jobs;
  std::vector<int> free_jobs;
  std::vector<ssd_store_detail::Piece> pieces;
  std::vector<int> free_pieces;
  std::vector<RingCompletion> synthetic;  // failures injected by before_io, not sent
  std::vector<ssd_store_detail::Registered> registered;
  BlockSums sums;  // StoreConfig::verify
  int head = -1, tail = -1;
  int inflight = 0;                                  // pieces in flight, synthetic ones included
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

}  // namespace fuyou
