#include "fuyou/io_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <thread>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/rng.h"
#include "fuyou/sizes.h"
#include "fuyou/storage.h"
#include "fuyou/timing.h"
#include "src/storage/file_layer.h"

namespace fuyou {

namespace {

using clock_type = std::chrono::steady_clock;

constexpr uint64_t kStampMagic = 0x66757930696f6265ull;

// Every 4 KiB block starts with its logical offset (scrambled), so a read that returns the
// wrong block, stale data or zeros is caught at the cost of one word per block.
void stamp(char* buf, uint64_t offset, uint64_t bytes) {
  for (uint64_t k = 0; k < bytes; k += kIoAlign) {
    uint64_t v = (offset + k) ^ kStampMagic;
    std::memcpy(buf + k, &v, sizeof v);
  }
}

void verify(const char* buf, uint64_t offset, uint64_t bytes, const std::string& path_hint) {
  for (uint64_t k = 0; k < bytes; k += kIoAlign) {
    uint64_t v;
    std::memcpy(&v, buf + k, sizeof v);
    if (v != ((offset + k) ^ kStampMagic))
      throw IoError(str("fuyou-bench io: data read back at logical offset ", offset + k, " of ",
                        path_hint, " is not what was written (block stamp ", v ^ kStampMagic, ")"));
  }
}

}  // namespace

namespace {

// What one run measured, for the result object.
struct IoTimes {
  uint64_t size = 0, block = 0, mixed_half = 0;
  double define_s = 0, write_s = 0, flush_s = 0, read_s = 0, mixed_s = 0;
};

nlohmann::json io_result(const IoBenchOptions& o, const IoTimes& t, const StoreStats& st,
                         const HostPool& pool) {
  auto mbps = [&](double sec) { return static_cast<double>(t.size) / sec / 1e6; };
  return nlohmann::json{
      {"read_MBps", mbps(t.read_s)},
      {"write_MBps", mbps(t.write_s)},
      {"read_s", t.read_s},
      {"write_s", t.write_s},
      {"flush_s", t.flush_s},
      {"mixed_s", t.mixed_s},
      {"mixed_read_bytes", t.mixed_half},
      {"mixed_write_bytes", t.size - t.mixed_half},
      {"define_s", t.define_s},
      {"bytes", t.size},
      {"dirs", o.dirs},
      {"queue_depth", o.queue_depth},
      {"request_size", o.request_size},
      {"stripe_unit", o.stripe_unit},
      {"block", t.block},
      {"buffers", o.buffers},
      {"fixed_buffers", st.fixed_buffers},
      {"pool_locked", pool.locked()},
      {"pool_bytes", pool.bytes()},
      {"huge_pages", o.huge_pages},
      {"verified", true},
      {"store_checksums", o.verify},
      {"checksum_verified_bytes", st.verified_bytes},
      {"checksum_unverified_bytes", st.unverified_bytes},
      {"requests", st.requests},
      {"fixed_requests", st.fixed_requests},
      {"short_transfers", st.short_transfers},
      {"retries", st.retries},
      {"peak_rss_bytes", peak_rss_bytes()},
  };
}

}  // namespace

nlohmann::json run_io_bench(const IoBenchOptions& o) {
  if (o.dirs.empty()) throw ConfigError("fuyou-bench io: give at least one --dir");
  if (o.buffers < 2)
    throw ConfigError("fuyou-bench io: --buffers must be at least 2 to keep the queue full");
  uint64_t size = round_up(o.size, kIoAlign);
  if (size == 0) throw ConfigError("fuyou-bench io: --size must be positive");
  uint64_t block = o.block ? o.block : static_cast<uint64_t>(o.queue_depth) * o.request_size;
  block = std::min(round_up(block, kIoAlign), size);

  StoreConfig sc;
  sc.dirs = o.dirs;
  sc.stripe_unit = o.stripe_unit;
  sc.queue_depth = o.queue_depth;
  sc.request_size = o.request_size;
  sc.file_name = "fuyou-bench-io.store";
  sc.overwrite = true;  // the bench's own scratch file, left over only if a run was killed
  sc.keep_files = o.keep_files;
  sc.verify = o.verify;
  auto store = SsdStore::open(sc);
  std::string where = store->backing_paths().front() + (o.dirs.size() > 1 ? " ..." : "");

  auto t0 = clock_type::now();
  ExtentId ext = store->define_extent("bench", size);
  double define_s = seconds_since(t0);

  HostPoolOptions popts;
  popts.huge_pages = o.huge_pages;
  // Two buffer sets: the mixed pass reads and writes at once.
  HostPool pool({SlotSpec{"io", block, static_cast<uint32_t>(2 * o.buffers)}}, popts);
  if (o.register_buffers) store->register_pool(pool);
  std::vector<char*> buf;
  Rng rng(1);
  for (int b = 0; b < 2 * o.buffers; ++b) {
    buf.push_back(static_cast<char*>(pool.slot(0, b).ptr));
    auto* words = reinterpret_cast<uint64_t*>(buf.back());
    for (uint64_t i = 0; i < block / 8; ++i) words[i] = rng.next();  // incompressible filler
  }

  // One pass over [from, to): requests of `block` bytes, `buffers` outstanding (of buffer set
  // `set`), each buffer reused as soon as its previous request is waited.
  auto pass = [&](IoOp op, uint64_t from, uint64_t to, int set) {
    std::vector<Ticket> ticket(o.buffers, 0);
    std::vector<uint64_t> at(o.buffers, 0), len(o.buffers, 0);
    char** bufs = buf.data() + set * o.buffers;
    auto retire = [&](int b) {
      if (!ticket[b]) return;
      store->wait(ticket[b]);
      ticket[b] = 0;
      if (op == IoOp::kRead) verify(bufs[b], at[b], len[b], where);
    };
    auto start = clock_type::now();
    int b = 0;
    for (uint64_t off = from; off < to; off += block, b = (b + 1) % o.buffers) {
      retire(b);
      at[b] = off;
      len[b] = std::min(block, to - off);
      if (op == IoOp::kWrite) {
        stamp(bufs[b], off, len[b]);
        ticket[b] = store->submit_write(ext, off, bufs[b], len[b]);
      } else {
        ticket[b] = store->submit_read(ext, off, bufs[b], len[b]);
      }
    }
    for (int k = 0; k < o.buffers; ++k) retire((b + k) % o.buffers);  // oldest first
    return seconds_since(start);
  };

  double write_s = pass(IoOp::kWrite, 0, size, 0);
  t0 = clock_type::now();
  store->flush();
  double flush_s = seconds_since(t0);
  double read_s = pass(IoOp::kRead, 0, size, 0);
  // Mixed: the first half read back while the second half is written, as the engine's reads,
  // writes and optimizer state streaming share the disks; the time until both end.
  const uint64_t half = round_up(size / 2, kIoAlign);
  t0 = clock_type::now();
  std::exception_ptr write_error;
  std::thread writer([&] {
    try {
      pass(IoOp::kWrite, half, size, 1);
    } catch (...) {
      write_error = std::current_exception();
    }
  });
  pass(IoOp::kRead, 0, half, 0);
  writer.join();
  if (write_error) std::rethrow_exception(write_error);
  double mixed_s = seconds_since(t0);
  return io_result(o, IoTimes{size, block, half, define_s, write_s, flush_s, read_s, mixed_s},
                   store->stats(), pool);
}

void print_io_bench(const nlohmann::json& r) {
  std::string dirs;
  for (const auto& d : r["dirs"]) dirs += (dirs.empty() ? "" : ", ") + d.get<std::string>();
  std::printf("fuyou-bench io: %s over %zu dir(s) [%s]\n",
              format_size(r["bytes"].get<uint64_t>()).c_str(), r["dirs"].size(), dirs.c_str());
  std::printf(
      "  queue depth %d, request %s, stripe unit %s, %d x %s buffers%s%s%s\n",
      r["queue_depth"].get<int>(), format_size(r["request_size"].get<uint64_t>()).c_str(),
      format_size(r["stripe_unit"].get<uint64_t>()).c_str(), r["buffers"].get<int>(),
      format_size(r["block"].get<uint64_t>()).c_str(),
      r["fixed_buffers"].get<bool>() ? ", fixed (registered) buffers" : ", unregistered buffers",
      r["huge_pages"].get<bool>() ? ", huge pages" : ", 4 KiB pages",
      r["pool_locked"].get<bool>() ? ", pool mlocked" : ", pool not mlocked");
  std::printf("  %-6s %10s %10s\n", "", "MB/s", "seconds");
  std::printf("  %-6s %10.1f %10.3f\n", "write", r["write_MBps"].get<double>(),
              r["write_s"].get<double>());
  std::printf("  %-6s %10.1f %10.3f\n", "read", r["read_MBps"].get<double>(),
              r["read_s"].get<double>());
  std::printf(
      "  flush %.3f s, define (fallocate) %.3f s; %llu requests, %llu short, %llu retried; "
      "data verified; store checksums %s; peak RSS %s\n",
      r["flush_s"].get<double>(), r["define_s"].get<double>(),
      static_cast<unsigned long long>(r["requests"].get<uint64_t>()),
      static_cast<unsigned long long>(r["short_transfers"].get<uint64_t>()),
      static_cast<unsigned long long>(r["retries"].get<uint64_t>()),
      r["store_checksums"].get<bool>() ? "on (XXH3 per 1 MiB block, checked on read)" : "off",
      format_size(r["peak_rss_bytes"].get<uint64_t>()).c_str());
}

}  // namespace fuyou
