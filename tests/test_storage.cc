// The storage tier: round trips over one and several directories, the striping layout on
// disk, queue depths, tickets, every fault the issue names (EIO, ENOSPC, short transfers,
// EAGAIN, a backing file truncated, removed or replaced) injected through the file layer
// or done for real, and the host pool and budget. Files go to the temp directory, or under
// the build directory when the temp directory cannot do O_DIRECT.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/storage.h"
#include "src/storage/file_layer.h"
#include "src/storage/stripe_layout.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

uint64_t padded(uint64_t n) { return (n + kIoAlign - 1) / kIoAlign * kIoAlign; }

bool supports_o_direct(const fs::path& dir) {
  fs::path probe = dir / ("fuyou-odirect-probe-" + std::to_string(::getpid()));
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

// A fresh directory with `n` subdirectories (one per "SSD"), removed at the end.
struct TempDirs {
  fs::path root;
  std::vector<std::string> dirs;
  TempDirs(const std::string& name, int n) {
    static const fs::path base = supports_o_direct(fs::temp_directory_path())
                                     ? fs::temp_directory_path()
                                     : fs::path(FUYOU_BINARY_DIR) / "storage-test-tmp";
    root = base / ("fuyou-storage-" + name + "-" + std::to_string(::getpid()));
    fs::remove_all(root);
    for (int i = 0; i < n; ++i) {
      dirs.push_back((root / ("ssd" + std::to_string(i))).string());
      fs::create_directories(dirs.back());
    }
  }
  ~TempDirs() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

// 4 KiB-aligned memory, as O_DIRECT needs, padded to whole blocks.
struct Buf {
  char* p;
  uint64_t n;
  explicit Buf(uint64_t bytes)
      : p(static_cast<char*>(std::aligned_alloc(kIoAlign, padded(bytes)))), n(padded(bytes)) {
    std::memset(p, 0, n);
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

void fill(char* p, uint64_t n, uint64_t seed) {
  Rng rng(seed);
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = rng.next();
    std::memcpy(p + i, &v, std::min<uint64_t>(8, n - i));
  }
}

bool same(const char* a, const char* b, uint64_t n) { return std::memcmp(a, b, n) == 0; }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

StoreConfig config(const std::vector<std::string>& dirs, uint64_t stripe, uint64_t request,
                   int qd) {
  StoreConfig c;
  c.dirs = dirs;
  c.stripe_unit = stripe;
  c.request_size = request;
  c.queue_depth = qd;
  return c;
}

// The file layer with faults: rules matched against every io_uring request, and switches
// for the file-management calls.
class FaultyFiles : public FileLayer {
 public:
  struct Rule {
    IoOp op;
    int dir = -1;  // -1: any
    int error = 0;
    uint64_t max_bytes = 0;
    int times = -1;  // -1: always
    bool first_attempt_only = false;
  };
  void add(Rule r) {
    std::lock_guard<std::mutex> lk(m_);
    rules_.push_back(r);
  }
  void clear() {
    std::lock_guard<std::mutex> lk(m_);
    rules_.clear();
  }
  IoFault before_io(const IoAttempt& a) override {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& r : rules_) {
      if (r.op != a.op || (r.dir >= 0 && r.dir != a.dir) || r.times == 0) continue;
      if (r.first_attempt_only && a.attempt != 0) continue;
      if (r.times > 0) --r.times;
      ++hits;
      last_offset = a.file_offset;
      last_bytes = a.bytes;
      last_path = *a.path;
      return IoFault{r.error, r.max_bytes};
    }
    return {};
  }
  int fallocate(int fd, uint64_t offset, uint64_t bytes) override {
    return fallocate_error ? -fallocate_error : FileLayer::fallocate(fd, offset, bytes);
  }
  int fdatasync(int fd) override {
    return fdatasync_error ? -fdatasync_error : FileLayer::fdatasync(fd);
  }
  int statvfs_free(const std::string& dir, uint64_t* free_bytes) override {
    int r = FileLayer::statvfs_free(dir, free_bytes);
    if (free_override >= 0) *free_bytes = static_cast<uint64_t>(free_override);
    return r;
  }
  // A filesystem without direct I/O (ramfs): the kernel creates the file, then refuses O_DIRECT.
  int open(const std::string& path, int flags, mode_t mode) override {
    if (!refuse_direct || !(flags & O_DIRECT)) return FileLayer::open(path, flags, mode);
    const int fd = FileLayer::open(path, flags & ~O_DIRECT, mode);
    if (fd < 0) return fd;
    FileLayer::close(fd);
    return -EINVAL;
  }
  int fstat(int fd, FileIdentity* out) override {
    int r = FileLayer::fstat(fd, out);
    out->size = std::max<uint64_t>(out->size, fstat_min_size.load());
    return r;
  }

  std::atomic<bool> refuse_direct{false};
  std::atomic<int> fallocate_error{0}, fdatasync_error{0};
  std::atomic<int64_t> free_override{-1};
  std::atomic<uint64_t> fstat_min_size{0};
  int hits = 0;
  uint64_t last_offset = 0, last_bytes = 0;
  std::string last_path;

 private:
  std::mutex m_;
  std::vector<Rule> rules_;
};

}  // namespace

TEST_CASE("storage: round trip over 1 and 3 directories with small stripes and odd sizes",
          "[storage]") {
  for (int ndirs : {1, 3}) {
    INFO(ndirs << " directories");
    TempDirs t("roundtrip", ndirs);
    // A request size that is not a divisor of the stripe unit, so pieces end on both.
    auto store = SsdStore::open(config(t.dirs, 64 * KiB, 40 * KiB, 8));
    const std::vector<uint64_t> sizes = {1,      4095, 4097, 64 * KiB, 100000, 3 * 64 * KiB + 12345,
                                         MiB + 7};
    std::vector<ExtentId> ids;
    std::vector<std::unique_ptr<Buf>> src;
    std::vector<Ticket> tickets;
    for (size_t i = 0; i < sizes.size(); ++i) {
      ids.push_back(store->define_extent("layer." + std::to_string(i) + "/adam_m", sizes[i]));
      src.push_back(std::make_unique<Buf>(sizes[i]));
      fill(src.back()->p, sizes[i], 100 + i);
    }
    for (size_t i = 0; i < sizes.size(); ++i)
      tickets.push_back(store->submit_write(ids[i], 0, src[i]->p, padded(sizes[i])));
    store->wait_all();

    uint64_t expect_offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      ExtentInfo e = store->extent(ids[i]);
      CHECK(e.logical_offset == expect_offset);  // contiguous and 4 KiB aligned
      CHECK(e.padded_bytes == padded(sizes[i]));
      expect_offset += e.padded_bytes;
      Buf back(sizes[i]);
      store->read_sync(ids[i], 0, back.p, padded(sizes[i]));
      CHECK(same(back.p, src[i]->p, sizes[i]));
    }
    CHECK(store->logical_bytes() == expect_offset);
    CHECK(store->find_extent("layer.6/adam_m") == ids[6]);

    // A piece of the middle of the largest extent, crossing stripe boundaries.
    Buf part(24 * KiB);
    store->read_sync(ids[6], 60 * KiB, part.p, 24 * KiB);
    CHECK(same(part.p, src[6]->p + 60 * KiB, 24 * KiB));
    StoreStats st = store->stats();
    CHECK(st.bytes_written == expect_offset);
    CHECK(st.short_transfers == 0);
    CHECK(st.failed_requests == 0);
  }
}

TEST_CASE("storage: stripe units go round robin into one file per directory", "[storage]") {
  TempDirs t("layout", 2);
  const uint64_t su = 64 * KiB;
  auto store = SsdStore::open(config(t.dirs, su, 32 * KiB, 4));
  store->define_extent("pad", 4096);  // the next extent starts inside a stripe unit
  ExtentId id = store->define_extent("x", 5 * su);
  Buf pad(4096), x(5 * su);
  fill(pad.p, 4096, 1);
  fill(x.p, 5 * su, 2);
  store->write_sync(0, 0, pad.p, 4096);
  store->write_sync(id, 0, x.p, 5 * su);

  // The layout written out independently: logical L -> stripe L / su -> directory
  // stripe % 2, file offset (stripe / 2) * su + L % su.
  std::vector<std::string> file = {slurp(store->backing_paths()[0]),
                                   slurp(store->backing_paths()[1])};
  uint64_t end = 4096 + 5 * su;
  CHECK(file[0].size() + file[1].size() == end);
  for (uint64_t l = 0; l < end; l += 512) {
    uint64_t s = l / su, fo = (s / 2) * su + l % su;
    const char* want = l < 4096 ? pad.p + l : x.p + (l - 4096);
    REQUIRE(fo + 512 <= file[s % 2].size());
    CHECK(std::memcmp(file[s % 2].data() + fo, want, 512) == 0);
  }
}

TEST_CASE("storage: stripe layout arithmetic covers every byte exactly once", "[storage]") {
  for (int nd : {1, 2, 3, 5}) {
    for (uint64_t su : {4 * KiB, 64 * KiB}) {
      StripeLayout lay{nd, su};
      for (uint64_t end : {uint64_t{0}, 4 * KiB, su, 7 * su + 12 * KiB, 20 * su}) {
        INFO(nd << " dirs, stripe " << su << ", end " << end);
        // Walk the logical space piece by piece: pieces must tile each file without gaps,
        // and the file sizes must be exactly what the walk reaches.
        std::vector<uint64_t> reached(nd, 0);
        for (uint64_t l = 0; l < end;) {
          int d;
          uint64_t fo, run;
          lay.map(l, &d, &fo, &run);
          uint64_t n = std::min(run, end - l);
          CHECK(fo == reached[d]);
          reached[d] = fo + n;
          l += n;
        }
        uint64_t total = 0;
        for (int d = 0; d < nd; ++d) {
          CHECK(lay.file_size_for(d, end) == reached[d]);
          total += reached[d];
        }
        CHECK(total == end);
      }
      uint64_t fo = 0;
      CHECK(lay.first_in_dir(nd - 1, su / 2, su * nd, &fo) == true);
      CHECK(fo == (nd == 1 ? su / 2 : 0));
      if (nd > 2) CHECK_FALSE(lay.first_in_dir(2, 0, su, &fo));
    }
  }
}

TEST_CASE("storage: queue depth 1 and 32 give the same bytes, in memory and on disk", "[storage]") {
  std::vector<std::string> on_disk[2];
  int k = 0;
  for (int qd : {1, 32}) {
    INFO("queue depth " << qd);
    TempDirs t("qd" + std::to_string(qd), 2);
    auto store = SsdStore::open(config(t.dirs, 128 * KiB, 64 * KiB, qd));
    const uint64_t n = 3 * MiB + 4096;
    ExtentId id = store->define_extent("layer.0/w", n);
    Buf src(n), back(n);
    fill(src.p, n, 7);
    store->write_sync(id, 0, src.p, n);
    for (uint64_t off = 0; off < n; off += 192 * KiB)
      store->read_sync(id, off, back.p + off, std::min<uint64_t>(192 * KiB, n - off));
    CHECK(same(back.p, src.p, n));
    for (const auto& p : store->backing_paths()) on_disk[k].push_back(slurp(p));
    ++k;
  }
  CHECK(on_disk[0] == on_disk[1]);
}

TEST_CASE("storage: tickets can be polled and waited in any order, once", "[storage]") {
  TempDirs t("tickets", 1);
  auto store = SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4));
  const int n = 16;
  Buf src(n * 64 * KiB), back(n * 64 * KiB);
  fill(src.p, n * 64 * KiB, 3);
  std::vector<ExtentId> ids;
  std::vector<Ticket> tickets;
  for (int i = 0; i < n; ++i)
    ids.push_back(store->define_extent("e" + std::to_string(i), 64 * KiB));
  for (int i = 0; i < n; ++i)
    tickets.push_back(store->submit_write(ids[i], 0, src.p + i * 64 * KiB, 64 * KiB));
  for (int i = n - 1; i >= 0; --i) store->wait(tickets[i]);
  CHECK_THROWS_WITH(store->wait(tickets[3]), Contains("unknown or was already waited"));
  CHECK_THROWS_WITH(store->poll(0), Contains("unknown"));

  for (int i = 0; i < n; ++i)
    tickets[i] = store->submit_read(ids[i], 0, back.p + i * 64 * KiB, 64 * KiB);
  while (!store->poll(tickets[n - 1])) std::this_thread::yield();  // progress without wait()
  for (int i = 0; i < n; ++i) store->wait(tickets[i]);
  CHECK(same(back.p, src.p, n * 64 * KiB));

  // Closing with requests queued and in flight drains them before the buffers can go.
  for (int i = 0; i < n; ++i) store->submit_write(ids[i], 0, src.p + i * 64 * KiB, 64 * KiB);
  std::string path = store->backing_paths()[0];
  store.reset();
  CHECK_FALSE(fs::exists(path));  // the store's own file is removed at close
}

TEST_CASE("storage: bad configs and requests are refused with the reason", "[storage]") {
  TempDirs t("bad", 2);
  CHECK_THROWS_WITH(SsdStore::open(config({}, 64 * KiB, 64 * KiB, 4)), Contains("no directories"));
  CHECK_THROWS_WITH(SsdStore::open(config(t.dirs, 1000, 64 * KiB, 4)),
                    Contains("stripe unit 1000"));
  CHECK_THROWS_WITH(SsdStore::open(config(t.dirs, 64 * KiB, 5000, 4)),
                    Contains("request size 5000"));
  CHECK_THROWS_WITH(SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 0)),
                    Contains("queue depth 0"));
  CHECK_THROWS_WITH(SsdStore::open(config({t.dirs[0], t.dirs[0]}, 64 * KiB, 64 * KiB, 4)),
                    Contains("given twice"));
  CHECK_THROWS_WITH(SsdStore::open(config({t.dirs[0] + "/nope"}, 64 * KiB, 64 * KiB, 4)),
                    Contains("/nope' is not a directory"));

  auto store = SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4));
  // A second store on the same directories: refused by the directory lock, whether or not it
  // may overwrite, and whatever its file name; in one process the lock says so, rather than
  // naming its own pid as another process's.
  CHECK_THROWS_WITH(SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4)),
                    Contains("is already in use by this process"));
  StoreConfig over = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  over.overwrite = true;
  over.file_name = "other.store";
  CHECK_THROWS_WITH(SsdStore::open(over), Contains("each needs a directory of its own"));

  // A file no fuyou process is known to have left (no lock beside it) is refused with a hint
  // that names no configuration key; it may be overwritten when asked, and is then the store's.
  TempDirs t2("stale", 1);
  std::ofstream(t2.dirs[0] + "/fuyou.store") << "left over";
  CHECK_THROWS_WITH(SsdStore::open(config(t2.dirs, 64 * KiB, 64 * KiB, 4)),
                    Contains("already exists") && Contains("remove it if nothing needs it") &&
                        !Contains("set overwrite"));
  StoreConfig stale = config(t2.dirs, 64 * KiB, 64 * KiB, 4);
  stale.overwrite = true;
  auto s2 = SsdStore::open(stale);
  CHECK(fs::file_size(t2.dirs[0] + "/fuyou.store") == 0);

  ExtentId id = store->define_extent("a", 10000);
  CHECK_THROWS_WITH(store->define_extent("a", 4096), Contains("'a' is already defined"));
  CHECK_THROWS_WITH(store->define_extent("z", 0), Contains("size 0"));
  CHECK_THROWS_WITH(store->find_extent("b"), Contains("no extent named 'b'"));
  Buf b(16 * KiB);
  CHECK_THROWS_WITH(store->submit_read(id, 100, b.p, 4096),
                    Contains("offset 100 size 4096") && Contains("O_DIRECT"));
  CHECK_THROWS_WITH(store->submit_read(id, 0, b.p, 1000), Contains("multiples of 4096"));
  CHECK_THROWS_WITH(store->submit_read(id, 0, b.p + 8, 4096), Contains("not 4096-byte aligned"));
  CHECK_THROWS_WITH(store->submit_write(id, 8192, b.p, 8192),
                    Contains("runs past its end (10000 bytes, 12288 padded)"));
  CHECK_THROWS_WITH(store->submit_read(7, 0, b.p, 4096), Contains("no extent with id 7"));
}

TEST_CASE("storage: a filesystem without O_DIRECT is refused, leaving its directories as found",
          "[storage]") {
  TempDirs t("no-odirect", 2);
  auto files = std::make_shared<FaultyFiles>();
  files->refuse_direct = true;
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  cfg.files = files;
  CHECK_THROWS_WITH(SsdStore::open(cfg), Contains("cannot open " + t.dirs[0]) &&
                                             Contains("with O_DIRECT") &&
                                             Contains("does not support direct I/O"));
  // Neither the backing file the kernel created before refusing, nor the locks, stay.
  for (const auto& d : t.dirs) {
    INFO(d);
    CHECK(fs::is_empty(d));
  }
}

TEST_CASE("storage: ENOSPC when an extent is defined names the directory and the numbers",
          "[storage]") {
  TempDirs t("enospc-define", 2);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  ExtentId a = store->define_extent("a", 200 * KiB);
  Buf src(200 * KiB), back(200 * KiB);
  fill(src.p, 200 * KiB, 11);
  store->write_sync(a, 0, src.p, 200 * KiB);

  // For real: more than the disk holds, refused by the statvfs check before allocating.
  CHECK_THROWS_AS(store->define_extent("huge", 1ull << 50), IoError);
  CHECK_THROWS_WITH(store->define_extent("huge", 1ull << 50),
                    Contains("cannot define extent 'huge'") &&
                        Contains("the filesystem of " + t.dirs[0]) && Contains("more bytes") &&
                        Contains("free"));
  // Injected: statvfs says 1 MiB is left.
  files->free_override = static_cast<int64_t>(MiB);
  CHECK_THROWS_WITH(store->define_extent("b", 4 * MiB),
                    Contains("needs 4194304 more bytes") && Contains("has 1048576 free"));
  files->free_override = -1;
  // Injected: fallocate itself runs out; every file is shrunk back.
  std::vector<uint64_t> sizes;
  for (const auto& p : store->backing_paths()) sizes.push_back(fs::file_size(p));
  files->fallocate_error = ENOSPC;
  CHECK_THROWS_WITH(store->define_extent("c", 4 * MiB),
                    Contains("growing " + store->backing_paths()[0]) && Contains("offset ") &&
                        Contains("size ") && Contains("No space left on device (ENOSPC)"));
  files->fallocate_error = 0;
  for (size_t d = 0; d < sizes.size(); ++d)
    CHECK(fs::file_size(store->backing_paths()[d]) == sizes[d]);
  CHECK(store->num_extents() == 1);
  CHECK(store->logical_bytes() == 200 * KiB);

  // The store goes on, and the committed extent is intact.
  ExtentId c = store->define_extent("c", 4 * MiB);
  CHECK(store->extent(c).logical_offset == 200 * KiB);
  store->read_sync(a, 0, back.p, 200 * KiB);
  CHECK(same(back.p, src.p, 200 * KiB));

  // The SSD budget is a limit of its own.
  TempDirs t2("budget", 1);
  StoreConfig small = config(t2.dirs, 64 * KiB, 64 * KiB, 4);
  small.max_bytes = MiB;
  auto s2 = SsdStore::open(small);
  s2->define_extent("x", 768 * KiB);
  CHECK_THROWS_WITH(s2->define_extent("y", 512 * KiB), Contains("does not fit the SSD budget"));
}

TEST_CASE("storage: EIO on a read names file, offset and size, and the next read works",
          "[storage]") {
  TempDirs t("eio-read", 3);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 8);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  const uint64_t n = 1 * MiB;
  ExtentId id = store->define_extent("layer.3/adam_v", n);
  Buf src(n), back(n);
  fill(src.p, n, 5);
  store->write_sync(id, 0, src.p, n);

  files->add({IoOp::kRead, 1, EIO, 0, 1});
  try {
    store->read_sync(id, 0, back.p, n);
    FAIL("the read reported success");
  } catch (const IoError& e) {
    std::string msg = e.what();
    CHECK_THAT(msg, Contains("read of extent 'layer.3/adam_v'") &&
                        Contains(store->backing_paths()[1]) &&
                        Contains(str("offset ", files->last_offset, " size ", files->last_bytes)) &&
                        Contains("Input/output error (EIO)"));
  }
  CHECK(store->stats().failed_requests == 1);
  std::memset(back.p, 0, n);
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));
}

TEST_CASE("storage: a failed write is reported and committed data elsewhere is untouched",
          "[storage]") {
  TempDirs t("eio-write", 2);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 8);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  const uint64_t n = 512 * KiB;
  ExtentId a = store->define_extent("layer.0/w", n), b = store->define_extent("layer.1/w", n);
  Buf sa(n), sb(n), back(n);
  fill(sa.p, n, 21);
  fill(sb.p, n, 22);
  store->write_sync(a, 0, sa.p, n);
  store->write_sync(b, 0, sb.p, n);
  store->flush();

  for (int err : {EIO, ENOSPC}) {
    INFO("errno " << err);
    files->clear();
    files->add({IoOp::kWrite, 0, err, 0, 1});
    fill(sb.p, n, 23 + err);
    CHECK_THROWS_WITH(
        store->write_sync(b, 0, sb.p, n),
        Contains("write of extent 'layer.1/w'") && Contains(store->backing_paths()[0]) &&
            Contains(str("offset ", files->last_offset, " size ", files->last_bytes)) &&
            Contains(err == EIO ? "Input/output error" : "No space left on device") &&
            Contains(err == ENOSPC ? "bytes free in" : ""));
    store->read_sync(a, 0, back.p, n);
    CHECK(same(back.p, sa.p, n));
  }
  files->clear();
  store->write_sync(b, 0, sb.p, n);  // a retry after the fault succeeds
  store->read_sync(b, 0, back.p, n);
  CHECK(same(back.p, sb.p, n));
}

TEST_CASE("storage: short reads and writes and EAGAIN are completed by resubmission", "[storage]") {
  TempDirs t("short", 2);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  const uint64_t n = MiB + 8192;
  ExtentId id = store->define_extent("x", n);
  Buf src(n), back(n);
  fill(src.p, n, 31);

  // The kernel really does only 8 KiB (then the rest) of every piece's first attempt.
  files->add({IoOp::kWrite, -1, 0, 8192, -1, true});
  files->add({IoOp::kRead, -1, 0, 12288, -1, true});
  store->write_sync(id, 0, src.p, n);
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));
  StoreStats st = store->stats();
  CHECK(st.short_transfers >= 2 * (n / (64 * KiB)));
  CHECK(st.failed_requests == 0);

  files->clear();
  files->add({IoOp::kWrite, -1, EAGAIN, 0, -1, true});
  files->add({IoOp::kRead, -1, EINTR, 0, -1, true});
  fill(src.p, n, 32);
  std::memset(back.p, 0, n);
  store->write_sync(id, 0, src.p, n);
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));
  CHECK(store->stats().retries >= 2 * (n / (64 * KiB)));
}

TEST_CASE("storage: a backing file truncated under the store is an error, never zeros",
          "[storage]") {
  TempDirs t("truncated", 2);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  const uint64_t n = 512 * KiB;
  ExtentId id = store->define_extent("layer.9/adam_m", n);
  Buf src(n), back(n);
  fill(src.p, n, 41);
  store->write_sync(id, 0, src.p, n);
  std::string path = store->backing_paths()[1];
  REQUIRE(::truncate(path.c_str(), 64 * KiB) == 0);

  // Found before the request goes out.
  CHECK_THROWS_WITH(store->read_sync(id, 0, back.p, n),
                    Contains(path + " was truncated under the store: it is 65536 bytes") &&
                        Contains("extent 'layer.9/adam_m' offset 0 size 524288"));
  CHECK_THROWS_WITH(store->write_sync(id, 0, src.p, n), Contains("truncated under the store"));
  // A truncation the submit-time check misses (fstat lies here) is caught when the read
  // comes back empty: an error naming the place, not zeros.
  files->fstat_min_size = 1ull << 40;
  CHECK_THROWS_WITH(store->read_sync(id, 0, back.p, n),
                    Contains("read of extent 'layer.9/adam_m'") &&
                        Contains(path + " offset 65536 size 65536") &&
                        Contains("read past the end of the file"));
  // The part still on disk reads back correctly.
  store->read_sync(id, 0, back.p, 128 * KiB);  // stripe 0 in file 0, stripe 1 = file 1 [0, 64K)
  CHECK(same(back.p, src.p, 128 * KiB));
}

TEST_CASE("storage: a backing file removed or replaced under the store is an error", "[storage]") {
  TempDirs t("replaced", 2);
  auto store = SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4));
  ExtentId id = store->define_extent("x", 256 * KiB);
  Buf src(256 * KiB);
  fill(src.p, 256 * KiB, 51);
  store->write_sync(id, 0, src.p, 256 * KiB);
  std::string path = store->backing_paths()[0];

  REQUIRE(::unlink(path.c_str()) == 0);
  CHECK_THROWS_WITH(
      store->read_sync(id, 0, src.p, 256 * KiB),
      Contains(path + " was removed under the store") && Contains("offset 0 size 262144"));
  CHECK_THROWS_WITH(store->flush(), Contains(path + " was removed"));
  std::ofstream(path) << "someone else's file";
  CHECK_THROWS_WITH(
      store->write_sync(id, 0, src.p, 256 * KiB),
      Contains(path + " was replaced under the store") && Contains("offset 0 size 262144"));
  CHECK_THROWS_WITH(store->define_extent("y", 4096), Contains("was replaced under the store"));
  // A request that touches only the intact directory still works.
  store->read_sync(id, 64 * KiB, src.p, 64 * KiB);
  // Closing the store leaves the file that replaced its own.
  store.reset();
  CHECK(slurp(path) == "someone else's file");
}

TEST_CASE("storage: a failed fdatasync in flush names the file", "[storage]") {
  TempDirs t("fsync", 1);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  store->define_extent("x", 4096);
  store->flush();
  files->fdatasync_error = EIO;
  CHECK_THROWS_WITH(store->flush(), Contains("fdatasync of " + store->backing_paths()[0]) &&
                                        Contains("Input/output error"));
}

TEST_CASE("storage: each directory is locked while open, and closing leaves it empty",
          "[storage]") {
  TempDirs t("lock", 2);
  {
    auto store = SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4));
    store->define_extent("a", 100 * KiB);
    for (const auto& d : t.dirs) {
      CHECK(fs::exists(d + "/fuyou.lock"));
      CHECK(slurp(d + "/fuyou.lock") == std::to_string(::getpid()) + "\n");
    }
    // What a process that must exit at once unlinks: exactly what closing removes.
    auto paths = store->cleanup_paths();
    CHECK(paths.size() == 4);
  }
  for (const auto& d : t.dirs) CHECK(fs::is_empty(d));
}

TEST_CASE("storage: a store file left by a process that is gone is reclaimed at open",
          "[storage]") {
  TempDirs t("reclaim", 2);
  // What a SIGKILLed run leaves: its lock files (no longer locked: the kernel dropped the
  // flock with the process) and its backing files.
  for (const auto& d : t.dirs) {
    std::ofstream(d + "/fuyou.lock") << "999999\n";
    std::ofstream(d + "/fuyou.store") << std::string(12345, 'x');
  }
  auto store = SsdStore::open(config(t.dirs, 64 * KiB, 64 * KiB, 4));
  CHECK(store->stats().reclaimed_bytes == 2 * 12345);
  for (const auto& d : t.dirs) CHECK(fs::file_size(d + "/fuyou.store") == 0);  // a new, empty file
  // Another store's file beside a stale lock is not this store's to take.
  TempDirs t2("reclaim-other", 1);
  std::ofstream(t2.dirs[0] + "/fuyou.lock") << "999999\n";
  std::ofstream(t2.dirs[0] + "/other.store") << "keep me";
  auto s2 = SsdStore::open(config(t2.dirs, 64 * KiB, 64 * KiB, 4));
  CHECK(s2->stats().reclaimed_bytes == 0);
  CHECK(slurp(t2.dirs[0] + "/other.store") == "keep me");
}

TEST_CASE("storage: check_space refuses a plan larger than the free space, with the numbers",
          "[storage]") {
  TempDirs t("space", 2);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig c = config(t.dirs, 64 * KiB, 64 * KiB, 4);
  c.files = files;
  auto store = SsdStore::open(c);
  files->free_override = 1 * MiB;  // both directories on one filesystem: 1 MiB in all
  store->check_space(1 * MiB - 128 * KiB, "the plan");
  CHECK_THROWS_WITH(store->check_space(3 * MiB, "the plan's extents"),
                    Contains("the plan's extents (3145728 bytes in all") &&
                        Contains("needs 3145728 more bytes") && Contains("has 1048576 free"));
}

TEST_CASE("storage: host pool carves fixed slots from a few 2 MiB-aligned regions", "[storage]") {
  HostPoolOptions opts;
  opts.max_region_bytes = 8 * MiB;
  std::vector<SlotSpec> specs = {
      {"weights", 3 * MiB + 5, 4}, {"grads", 64 * KiB, 10}, {"big", 9 * MiB, 1}};
  HostPool pool(specs, opts);
  CHECK(pool.bytes() == HostPool::planned_bytes(specs, opts));
  // 2 x (3 MiB + 4 KiB) fill the first 8 MiB region, two more plus ten grads the second,
  // and the 9 MiB slot gets one of its own.
  CHECK(pool.regions().size() == 3);
  for (const auto& r : pool.regions()) CHECK(reinterpret_cast<uintptr_t>(r.base) % (2 * MiB) == 0);

  int w = pool.slot_class("weights"), g = pool.slot_class("grads"), big = pool.slot_class("big");
  std::set<std::pair<uintptr_t, uintptr_t>> spans;
  for (int c : {w, g, big}) {
    for (uint32_t i = 0; i < static_cast<uint32_t>(specs[c].count); ++i) {
      HostSlot s = pool.slot(c, i);
      CHECK(s.bytes == padded(specs[c].bytes));
      CHECK(reinterpret_cast<uintptr_t>(s.ptr) % kIoAlign == 0);
      CHECK(pool.contains(s.ptr, s.bytes));
      std::memset(s.ptr, c + 1, s.bytes);
      spans.insert(
          {reinterpret_cast<uintptr_t>(s.ptr), reinterpret_cast<uintptr_t>(s.ptr) + s.bytes});
    }
  }
  uintptr_t prev_end = 0;
  for (const auto& [b, e] : spans) {  // sorted by start: no slot overlaps the next
    CHECK(b >= prev_end);
    prev_end = e;
  }

  CHECK_THROWS_WITH(pool.slot_class("adam"),
                    Contains("no slot class named 'adam' (classes: weights, grads, big)"));
  CHECK_THROWS_AS(HostPool({{"a", 0, 1}}), ConfigError);
  INFO("pool mlocked: " << pool.locked());
}

TEST_CASE("storage: pool slots go through registered (fixed) buffers", "[storage]") {
  TempDirs t("fixed", 2);
  auto store = SsdStore::open(config(t.dirs, 256 * KiB, 128 * KiB, 8));
  HostPool pool({{"io", MiB, 2}});
  store->register_pool(pool);
  REQUIRE(store->stats().fixed_buffers);
  ExtentId id = store->define_extent("x", MiB);
  HostSlot w = pool.slot(0, 0), r = pool.slot(0, 1);
  fill(static_cast<char*>(w.ptr), MiB, 61);
  store->write_sync(id, 0, w.ptr, MiB);
  store->read_sync(id, 0, r.ptr, MiB);
  CHECK(same(static_cast<char*>(r.ptr), static_cast<char*>(w.ptr), MiB));
  StoreStats st = store->stats();
  CHECK(st.fixed_requests == st.requests);
  // Memory outside the pool still works, without fixed buffers.
  Buf plain(MiB);
  store->read_sync(id, 0, plain.p, MiB);
  CHECK(same(plain.p, static_cast<char*>(w.ptr), MiB));
  CHECK(store->stats().fixed_requests < store->stats().requests);
}

// ---- checksums (StoreConfig::verify) -------------------------------------------------------

namespace {

// Overwrites one byte of a backing file behind the store's back (buffered; the store's next
// O_DIRECT read of the range writes the page back and then reads the device).
void flip_byte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char c = 0;
  REQUIRE(::pread(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  c ^= 0x5a;
  REQUIRE(::pwrite(fd, &c, 1, static_cast<off_t>(offset)) == 1);
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

TEST_CASE("storage: bytes changed on the disk after a write are reported as a checksum mismatch",
          "[storage]") {
  TempDirs t("sums", 2);
  const uint64_t stripe = 64 * KiB;
  auto store = SsdStore::open(config(t.dirs, stripe, 64 * KiB, 8));
  const uint64_t n = 3 * MiB + 12 * KiB;  // three whole checksum blocks and a short one
  store->define_extent("pad", 8 * KiB);   // so that the extent does not start at logical 0
  ExtentId id = store->define_extent("layer.2/adam_m", n);
  const uint64_t base = store->extent(id).logical_offset;
  Buf src(n), back(n);
  fill(src.p, n, 71);
  store->write_sync(id, 0, src.p, n);
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));
  CHECK(store->stats().verified_bytes == n);
  CHECK(store->stats().unverified_bytes == 0);

  // One byte inside the third block (extent offset 2 MiB + 5000), at its place on the disk.
  const uint64_t bad = 2 * MiB + 5000;
  int dir = 0;
  uint64_t file_off = 0, run = 0;
  StripeLayout{2, stripe}.map(base + bad, &dir, &file_off, &run);
  flip_byte(store->backing_paths()[dir], file_off);
  try {
    store->read_sync(id, 0, back.p, n);
    FAIL("a read of changed bytes reported success");
  } catch (const IoError& e) {
    uint64_t block_dir_off = 0;
    StripeLayout{2, stripe}.map(base + 2 * MiB, &dir, &block_dir_off, &run);
    CHECK_THAT(e.what(),
               Contains("checksum mismatch reading extent 'layer.2/adam_m'") &&
                   Contains(str(MiB, " bytes at extent offset ", 2 * MiB)) &&
                   Contains(str(store->backing_paths()[dir], " offset ", block_dir_off)) &&
                   Contains("changed after they were written"));
  }
  CHECK(store->stats().checksum_failures == 1);
  // The blocks around it are intact and still read (and check) clean.
  store->read_sync(id, 0, back.p, 2 * MiB);
  CHECK(same(back.p, src.p, 2 * MiB));
  store->read_sync(id, 3 * MiB, back.p, 12 * KiB);
  CHECK(same(back.p, src.p + 3 * MiB, 12 * KiB));
  CHECK(store->stats().checksum_failures == 1);
  // Rewriting the block heals it.
  store->write_sync(id, 2 * MiB, src.p + 2 * MiB, MiB);
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));

  // Without verify the same damage comes back as data: what the option turns off.
  TempDirs t2("nosums", 1);
  StoreConfig off = config(t2.dirs, stripe, 64 * KiB, 8);
  off.verify = false;
  auto plain = SsdStore::open(off);
  ExtentId p = plain->define_extent("x", MiB);
  plain->write_sync(p, 0, src.p, MiB);
  flip_byte(plain->backing_paths()[0], 100);
  plain->read_sync(p, 0, back.p, MiB);
  CHECK(back.p[100] != src.p[100]);
  CHECK(plain->stats().verified_bytes == 0);
}

TEST_CASE("storage: checksums follow partial overwrites, sub-range reads and failed writes",
          "[storage]") {
  TempDirs t("sums-partial", 1);
  auto files = std::make_shared<FaultyFiles>();
  StoreConfig cfg = config(t.dirs, 256 * KiB, 256 * KiB, 8);
  cfg.files = files;
  auto store = SsdStore::open(cfg);
  const uint64_t n = 3 * MiB;
  ExtentId id = store->define_extent("x", n + 64 * KiB);
  Buf src(n), back(n);
  fill(src.p, n, 3);
  // Never written: read, but nothing to check.
  store->read_sync(id, 0, back.p, 64 * KiB);
  CHECK(store->stats().unverified_bytes == 64 * KiB);
  store->write_sync(id, 0, src.p, n);
  // 4 KiB inside the second block: that block's sum is gone, the first and third stay, and
  // the new write has its own.
  fill(src.p + MiB + 4 * KiB, 4 * KiB, 4);
  store->write_sync(id, MiB + 4 * KiB, src.p + MiB + 4 * KiB, 4 * KiB);
  StoreStats before = store->stats();
  store->read_sync(id, 0, back.p, n);
  CHECK(same(back.p, src.p, n));
  StoreStats after = store->stats();
  CHECK(after.verified_bytes - before.verified_bytes == 2 * MiB + 4 * KiB);
  CHECK(after.unverified_bytes - before.unverified_bytes == MiB - 4 * KiB);
  // A read that starts inside a block checks only the whole blocks it covers.
  before = after;
  store->read_sync(id, 512 * KiB, back.p, MiB + 512 * KiB);
  CHECK(same(back.p, src.p + 512 * KiB, MiB + 512 * KiB));
  after = store->stats();
  CHECK(after.verified_bytes - before.verified_bytes == 4 * KiB);
  // A damaged third block is still caught after the overwrite split its record.
  flip_byte(store->backing_paths()[0], store->extent(id).logical_offset + 2 * MiB + 77);
  CHECK_THROWS_WITH(store->read_sync(id, 2 * MiB, back.p, MiB), Contains("checksum mismatch"));
  // A write that failed leaves its bytes unknown: no sum, so no false alarm and no check.
  files->add({IoOp::kWrite, -1, EIO, 0, 1});
  CHECK_THROWS_WITH(store->write_sync(id, 2 * MiB, src.p + 2 * MiB, MiB),
                    Contains("Input/output error"));
  before = store->stats();
  store->read_sync(id, 2 * MiB, back.p, MiB);
  CHECK(store->stats().unverified_bytes - before.unverified_bytes == MiB);
  CHECK(store->stats().checksum_failures == 1);
}
