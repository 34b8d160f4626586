// HostPool: a few large pinned regions, mapped once at start and carved into fixed slots.
//
// Regions are anonymous mappings aligned to 2 MiB (so transparent huge pages can back
// them, which cuts TLB misses when the optimizer streams through gigabytes) and populated
// before use, so the first touch on the hot path never page-faults. mlock keeps them out of
// swap and keeps DMA addresses valid; without the privilege it is a warning, since the
// pool still works (io_uring and CUDA pin pages themselves when they register them).
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "fuyou/storage.h"
#include "src/storage/file_layer.h"

namespace fuyou {

namespace {

constexpr uint64_t kRegionAlign = 2ull << 20;

// Where each slot goes: region sizes, and (region, offset) of every slot of every class.
struct Layout {
  std::vector<uint64_t> region_bytes;
  std::vector<std::vector<std::pair<size_t, uint64_t>>> slots;  // [class][slot]
};

Layout plan_layout(const std::vector<SlotSpec>& specs, const HostPoolOptions& opts) {
  uint64_t max_region =
      round_up(std::max<uint64_t>(opts.max_region_bytes, kRegionAlign), kRegionAlign);
  Layout l;
  uint64_t used = 0;  // bytes used in the open region (the last one), if any
  bool open = false;
  for (const auto& spec : specs) {
    uint64_t bytes = round_up(spec.bytes, kIoAlign);
    l.slots.emplace_back();
    for (uint32_t i = 0; i < spec.count; ++i) {
      if (bytes > max_region) {  // a slot larger than a region gets a region of its own
        if (open) l.region_bytes.back() = round_up(used, kRegionAlign);
        l.region_bytes.push_back(round_up(bytes, kRegionAlign));
        l.slots.back().push_back({l.region_bytes.size() - 1, 0});
        open = false;
        continue;
      }
      if (!open || used + bytes > max_region) {
        if (open) l.region_bytes.back() = round_up(used, kRegionAlign);
        l.region_bytes.push_back(0);
        used = 0;
        open = true;
      }
      l.slots.back().push_back({l.region_bytes.size() - 1, used});
      used += bytes;
    }
  }
  if (open) l.region_bytes.back() = round_up(used, kRegionAlign);
  return l;
}

void validate(const std::vector<SlotSpec>& specs) {
  for (size_t i = 0; i < specs.size(); ++i) {
    const SlotSpec& s = specs[i];
    if (s.name.empty()) throw ConfigError(str("host pool: slot class ", i, " has no name"));
    if (s.bytes == 0 || s.count == 0)
      throw ConfigError(str("host pool: slot class '", s.name, "' has ", s.count, " slots of ",
                            s.bytes, " bytes; both must be positive"));
    for (size_t k = 0; k < i; ++k)
      if (specs[k].name == s.name)
        throw ConfigError(str("host pool: slot class '", s.name, "' is given twice"));
  }
}

// An anonymous mapping of `bytes` whose start is 2 MiB aligned: map a little more and
// trim both ends.
void* map_aligned(uint64_t bytes) {
  void* raw = ::mmap(nullptr, bytes + kRegionAlign, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    throw Error(str("host pool: cannot map a region of ", bytes, " bytes (", format_size(bytes),
                    "): ", errno_text(errno)));
  uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = round_up(begin, kRegionAlign);
  if (aligned > begin) ::munmap(raw, aligned - begin);
  uintptr_t tail = aligned + bytes, end = begin + bytes + kRegionAlign;
  if (end > tail) ::munmap(reinterpret_cast<void*>(tail), end - tail);
  return reinterpret_cast<void*>(aligned);
}

void populate(void* base, uint64_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (::madvise(base, bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  long page = ::sysconf(_SC_PAGESIZE);
  for (uint64_t off = 0; off < bytes; off += static_cast<uint64_t>(page))
    static_cast<volatile char*>(base)[off] = 0;
}

}  // namespace

struct HostPool::Class {
  std::string name;
  uint64_t slot_bytes = 0;
  std::vector<char*> ptrs;  // [slot]
};

uint64_t HostPool::planned_bytes(const std::vector<SlotSpec>& specs, const HostPoolOptions& opts) {
  validate(specs);
  uint64_t total = 0;
  for (uint64_t b : plan_layout(specs, opts).region_bytes) total += b;
  return total;
}

HostPool::HostPool(std::vector<SlotSpec> specs, HostPoolOptions opts) : opts_(std::move(opts)) {
  validate(specs);
  Layout layout = plan_layout(specs, opts_);
  uint64_t total = 0;
  for (uint64_t b : layout.region_bytes) total += b;

  try {
    locked_ = opts_.lock;
    for (uint64_t bytes : layout.region_bytes) {
      void* base = map_aligned(bytes);
      regions_.push_back(Region{base, bytes});
      bytes_ += bytes;
      // Huge pages must be asked for before the pages are populated.
      if (opts_.huge_pages) ::madvise(base, bytes, MADV_HUGEPAGE);
      bool locked = opts_.lock && ::mlock(base, bytes) == 0;
      if (opts_.lock && !locked) {
        rlimit lim{};
        ::getrlimit(RLIMIT_MEMLOCK, &lim);
        if (locked_)  // warn once, not per region
          spdlog::warn(
              "host pool: mlock of a {} region failed ({}); RLIMIT_MEMLOCK is {}; the pool "
              "works unlocked (it may be swapped, and copies from it are not zero-copy)",
              format_size(bytes), errno_text(errno),
              lim.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : format_size(lim.rlim_cur));
        locked_ = false;
      }
      if (!locked) populate(base, bytes);  // mlock populated the locked ones
    }
  } catch (...) {
    for (auto& r : regions_) ::munmap(r.base, r.bytes);
    throw;
  }

  for (size_t c = 0; c < specs.size(); ++c) {
    Class cls;
    cls.name = specs[c].name;
    cls.slot_bytes = round_up(specs[c].bytes, kIoAlign);
    cls.ptrs.reserve(specs[c].count);
    for (const auto& [region, offset] : layout.slots[c])
      cls.ptrs.push_back(static_cast<char*>(regions_[region].base) + offset);
    classes_.push_back(std::move(cls));
  }
}

HostPool::~HostPool() {
  for (auto& r : regions_) {
    ::munmap(r.base, r.bytes);
  }
}

int HostPool::slot_class(const std::string& name) const {
  for (size_t c = 0; c < classes_.size(); ++c)
    if (classes_[c].name == name) return static_cast<int>(c);
  std::string known;
  for (const auto& c : classes_) known += (known.empty() ? "" : ", ") + c.name;
  throw Error(str("host pool: no slot class named '", name, "' (classes: ", known, ")"));
}

HostSlot HostPool::slot(int c, uint32_t index) const {
  FY_CHECK(c >= 0 && static_cast<size_t>(c) < classes_.size(), "slot class ", c, " out of range");
  const Class& cls = classes_[c];
  FY_CHECK(index < cls.ptrs.size(), "slot ", index, " of class ", cls.name, " out of range");
  return HostSlot{cls.ptrs[index], cls.slot_bytes, c, index};
}

uint64_t HostPool::bytes() const { return bytes_; }
bool HostPool::locked() const { return locked_; }
const std::vector<HostPool::Region>& HostPool::regions() const { return regions_; }

bool HostPool::contains(const void* p, uint64_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (const auto& r : regions_) {
    const char* b = static_cast<const char*>(r.base);
    if (c >= b && c + bytes <= b + r.bytes) return true;
  }
  return false;
}

}  // namespace fuyou
