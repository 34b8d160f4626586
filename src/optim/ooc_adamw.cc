#include "fuyou/ooc_adamw.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include <omp.h>

#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "fuyou/threads.h"

namespace fuyou {

const char* state_kind_name(StateKind k) {
  switch (k) {
    case StateKind::kMaster: return "master";
    case StateKind::kAdamM: return "adam_m";
    case StateKind::kAdamV: return "adam_v";
  }
  return "?";
}

std::vector<StateTier> place_optimizer_state(const std::vector<OptimGroup>& groups,
                                             uint64_t host_state_budget, bool have_store) {
  std::vector<StateTier> tiers;
  uint64_t used = 0, total = 0;
  for (const auto& g : groups) {
    uint64_t bytes = 12ull * g.numel;
    total += bytes;
    if (used + bytes <= host_state_budget) {
      used += bytes;
      tiers.push_back(StateTier::kHost);
    } else {
      tiers.push_back(StateTier::kSsd);
    }
  }
  if (!have_store && used < total)
    throw Error(str("optimizer state needs ", format_size(total), " (12 bytes per parameter) but only ",
                    format_size(host_state_budget), " of host memory is available for it and no SSD ",
                    "paths are configured (offload.ssd_paths)"));
  return tiers;
}

class OocAdamW::Impl {
 public:
  Impl(std::vector<OptimGroup> groups, std::vector<StateTier> tiers, SsdStore* store,
       OocAdamWOptions opts)
      : groups_(std::move(groups)), tiers_(std::move(tiers)), store_(store), opts_(opts) {
    FY_CHECK(groups_.size() == tiers_.size(), "one tier per group");
    FY_CHECK(opts_.chunk_elems > 0 && opts_.chunk_elems % (kIoAlign / 4) == 0,
             "chunk_elems ", opts_.chunk_elems, " must be a positive multiple of 1024");
    bool any_ssd = false;
    host_.resize(groups_.size());
    ext_.resize(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (const auto& t : groups_[g].tensors)
        FY_CHECK(t.offset + t.numel <= groups_[g].numel, "tensor outside group ", groups_[g].name);
      if (tiers_[g] == StateTier::kHost) {
        host_[g].master.assign(groups_[g].numel, 0.0f);
        host_[g].m.assign(groups_[g].numel, 0.0f);
        host_[g].v.assign(groups_[g].numel, 0.0f);
      } else {
        if (!store_) throw Error(str("optimizer group ", groups_[g].name, " is placed on SSD but no store is open"));
        uint64_t bytes = 4ull * groups_[g].numel;
        ext_[g] = {store_->define_extent(groups_[g].name + "/master", bytes),
                   store_->define_extent(groups_[g].name + "/adam_m", bytes),
                   store_->define_extent(groups_[g].name + "/adam_v", bytes)};
        any_ssd = true;
      }
    }
    if (any_ssd) {
      // Three slot sets (read ahead, update, write behind) of master, m and v chunks:
      // ooc_chunk_pool_bytes(), as the planner counts them.
      pool_ = std::make_unique<HostPool>(
          std::vector<SlotSpec>{{"optim.chunk", 4ull * opts_.chunk_elems, kOocChunkSlots}});
      int cls = pool_->slot_class("optim.chunk");
      for (int s = 0; s < 3; ++s)
        for (int a = 0; a < 3; ++a) slots_[s][a] = static_cast<float*>(pool_->slot(cls, s * 3 + a).ptr);
      store_->register_pool(*pool_);
    }
    default_threads_ = omp_get_max_threads();
    worker_ = std::thread([this] { run(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  Handle enqueue(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    Handle h = next_++;
    queue_.emplace_back(h, std::move(task));
    cv_.notify_all();
    return h;
  }

  bool done(Handle h) {
    std::lock_guard<std::mutex> lock(mu_);
    return h <= last_done_;
  }

  void wait(Handle h) {
    std::unique_lock<std::mutex> lock(mu_);
    FY_CHECK(h > 0 && h < next_, "unknown optimizer handle ", h);
    done_cv_.wait(lock, [&] { return last_done_ >= h; });
    auto it = errors_.find(h);
    if (it != errors_.end()) {
      std::exception_ptr e = it->second;
      errors_.erase(it);
      std::rethrow_exception(e);
    }
  }

  void wait_all() {
    Handle last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = next_ - 1;
    }
    std::exception_ptr first;
    for (Handle h = 1; h <= last; ++h) {
      try {
        wait(h);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  void update(const Update& u) {
    const OptimGroup& grp = groups_.at(u.group);
    set_thread_team(u.threads > 0 ? u.threads : default_threads_);
    AdamWStep step{u.lr, opts_.beta1, opts_.beta2, opts_.eps, 0.0f, u.t};
    // The kernel's pieces for elements [begin, end) of the group, with state at the given
    // pointers (which hold element `begin` at index 0), split at tensor boundaries for decay;
    // run_pieces runs those gathered so far in one parallel pass.
    std::vector<AdamWArgs> pieces;
    std::vector<float> decays;
    auto add_range = [&](float* master, float* m, float* v, size_t begin, size_t end) {
      for (const OptimTensor& t : grp.tensors) {
        size_t a = std::max(begin, t.offset), b = std::min(end, t.offset + t.numel);
        if (a >= b) continue;
        AdamWArgs args;
        args.master = master + (a - begin);
        args.m = m + (a - begin);
        args.v = v + (a - begin);
        args.grad = static_cast<const char*>(u.grad) + a * elem_type_size(u.grad_type);
        args.grad_type = u.grad_type;
        args.lowp = u.lowp ? static_cast<char*>(u.lowp) + a * elem_type_size(u.lowp_type) : nullptr;
        args.lowp_type = u.lowp_type;
        args.n = b - a;
        args.grad_scale = u.grad_scale;
        pieces.push_back(args);
        decays.push_back(t.decay ? opts_.weight_decay : 0.0f);
      }
    };
    auto run_pieces = [&] {
      adamw_update(pieces.data(), decays.data(), pieces.size(), step, opts_.simd);
      pieces.clear();
      decays.clear();
    };
    // The ranges to update: u.ranges, else the one range [begin, end).
    const std::pair<size_t, size_t> whole{u.begin, u.end ? u.end : grp.numel};
    const std::pair<size_t, size_t>* ranges = u.ranges ? u.ranges : &whole;
    const size_t nranges = u.ranges ? u.nranges : 1;
    for (size_t i = 0; i < nranges; ++i)
      FY_CHECK(ranges[i].first <= ranges[i].second && ranges[i].second <= grp.numel, "update range [",
               ranges[i].first, ", ", ranges[i].second, ") of group ", grp.name, " with ", grp.numel, " elements");
    if (tiers_[u.group] == StateTier::kHost) {
      HostState& h = host_[u.group];
      for (size_t i = 0; i < nranges; ++i) {
        const auto [a, b] = ranges[i];
        add_range(h.master.data() + a, h.m.data() + a, h.v.data() + a, a, b);
      }
      run_pieces();
      return;
    }
    FY_CHECK(!u.ranges && whole.first == 0 && whole.second == grp.numel, "group ", grp.name,
             " has its optimizer state on SSD: only whole-group updates");
    const Ext& e = ext_[u.group];
    const size_t C = opts_.chunk_elems;
    const size_t chunks = (grp.numel + C - 1) / C;
    auto chunk_bytes = [&](size_t k) {
      uint64_t elems = std::min(C, grp.numel - k * C);
      return round_up(4 * elems, kIoAlign);
    };
    std::vector<Ticket> reads(3 * chunks, 0), writes(3 * chunks, 0);
    auto submit_reads = [&](size_t k) {
      uint64_t off = 4ull * k * C, n = chunk_bytes(k);
      float** s = slots_[k % 3];
      reads[3 * k + 0] = store_->submit_read(e.master, off, s[0], n);
      reads[3 * k + 1] = store_->submit_read(e.m, off, s[1], n);
      reads[3 * k + 2] = store_->submit_read(e.v, off, s[2], n);
    };
    auto wait_writes = [&](size_t k) {
      for (int a = 0; a < 3; ++a)
        if (writes[3 * k + a]) {
          Ticket t = writes[3 * k + a];
          writes[3 * k + a] = 0;
          store_->wait(t);
        }
    };
    try {
      submit_reads(0);
      for (size_t k = 0; k < chunks; ++k) {
        if (k + 1 < chunks) {
          if (k >= 2) wait_writes(k - 2);  // chunk k+1 reuses chunk k-2's slots
          submit_reads(k + 1);
        }
        for (int a = 0; a < 3; ++a) {
          Ticket t = reads[3 * k + a];
          reads[3 * k + a] = 0;
          store_->wait(t);
        }
        float** s = slots_[k % 3];
        size_t begin = k * C, end = std::min(grp.numel, begin + C);
        add_range(s[0], s[1], s[2], begin, end);
        run_pieces();
        uint64_t off = 4ull * begin, n = chunk_bytes(k);
        writes[3 * k + 0] = store_->submit_write(e.master, off, s[0], n);
        writes[3 * k + 1] = store_->submit_write(e.m, off, s[1], n);
        writes[3 * k + 2] = store_->submit_write(e.v, off, s[2], n);
        bytes_read_ += 3 * n;
        bytes_written_ += 3 * n;
      }
      for (size_t k = 0; k < chunks; ++k) wait_writes(k);
    } catch (...) {
      drain(reads);
      drain(writes);
      throw;
    }
  }

  void init_group(int g, const float* master) {
    if (tiers_[g] == StateTier::kHost) {
      HostState& h = host_[g];
      std::copy(master, master + groups_[g].numel, h.master.begin());
      std::fill(h.m.begin(), h.m.end(), 0.0f);
      std::fill(h.v.begin(), h.v.end(), 0.0f);
      return;
    }
    write_group(g, [&](size_t begin, size_t n, float** s) {
      std::memcpy(s[0], master + begin, 4 * n);
      std::memset(s[1], 0, 4 * n);
      std::memset(s[2], 0, 4 * n);
    });
  }

  void read_master(int g, float* dst) {
    if (tiers_[g] == StateTier::kHost) {
      std::copy(host_[g].master.begin(), host_[g].master.end(), dst);
      return;
    }
    stream_kind(g, StateKind::kMaster, /*write=*/false,
                [&](size_t begin, size_t n, float* slot) { std::memcpy(dst + begin, slot, 4 * n); });
  }

  void read_state(int g, StateKind kind, const StateSink& sink) {
    if (tiers_[g] == StateTier::kHost) {
      sink(0, host_array(g, kind).data(), groups_[g].numel);
      return;
    }
    stream_kind(g, kind, /*write=*/false, [&](size_t begin, size_t n, float* slot) { sink(begin, slot, n); });
  }

  void write_state(int g, StateKind kind, const StateSource& source) {
    if (tiers_[g] == StateTier::kHost) {
      source(0, host_array(g, kind).data(), groups_[g].numel);
      return;
    }
    stream_kind(g, kind, /*write=*/true, [&](size_t begin, size_t n, float* slot) { source(begin, slot, n); });
  }

  const OptimGroup& group(int g) const { return groups_.at(g); }
  StateTier tier(int g) const { return tiers_.at(g); }
  size_t num_groups() const { return groups_.size(); }
  uint64_t host_bytes() const {
    uint64_t b = pool_ ? pool_->bytes() : 0;
    for (const auto& h : host_) b += 4ull * (h.master.size() + h.m.size() + h.v.size());
    return b;
  }
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  struct HostState {
    std::vector<float> master, m, v;
  };
  struct Ext {
    ExtentId master = 0, m = 0, v = 0;
  };

  // Writes all three kinds of an SSD group, chunk by chunk through slot set 0, `fn` filling
  // each chunk's three slots (the worker is idle while this runs: it is called from a queued
  // task).
  void write_group(int g, const std::function<void(size_t, size_t, float**)>& fn) {
    const Ext& e = ext_[g];
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel;
    float** s = slots_[0];
    for (size_t begin = 0; begin < numel; begin += C) {
      size_t n = std::min(C, numel - begin);
      uint64_t bytes = round_up(4 * n, kIoAlign), off = 4ull * begin;
      std::memset(s[0] + n, 0, bytes - 4 * n);  // defined padding bytes on disk
      std::memset(s[1] + n, 0, bytes - 4 * n);
      std::memset(s[2] + n, 0, bytes - 4 * n);
      fn(begin, n, s);
      store_->write_sync(e.master, off, s[0], bytes);
      store_->write_sync(e.m, off, s[1], bytes);
      store_->write_sync(e.v, off, s[2], bytes);
    }
  }

  // Waits for every ticket still set, dropping their errors: after a failure, before the slots
  // can be reused (the first error is the one the caller rethrows).
  void drain(const std::vector<Ticket>& tickets) {
    for (Ticket t : tickets)
      if (t) try { store_->wait(t); } catch (...) {}
  }

  std::vector<float>& host_array(int g, StateKind kind) {
    HostState& h = host_[g];
    return kind == StateKind::kMaster ? h.master : kind == StateKind::kAdamM ? h.m : h.v;
  }

  // One kind's extent of an SSD group, chunk by chunk through the three slots of set 0 in turn
  // (the worker is idle while this runs: it is called from a queued task), so that the disk
  // works on the next chunks while `fn` takes this one: reads run two chunks ahead, writes go
  // out behind. Writes zero the padding past the group's last element, so the bytes on disk
  // are defined.
  void stream_kind(int g, StateKind kind, bool write, const std::function<void(size_t, size_t, float*)>& fn) {
    const Ext& e = ext_[g];
    const ExtentId id = kind == StateKind::kMaster ? e.master : kind == StateKind::kAdamM ? e.m : e.v;
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel, chunks = (numel + C - 1) / C;
    float* const* slot = slots_[0];
    std::vector<Ticket> t(chunks, 0);
    auto elems = [&](size_t k) { return std::min(C, numel - k * C); };
    auto bytes = [&](size_t k) { return round_up(4 * elems(k), kIoAlign); };
    auto wait = [&](size_t k) { store_->wait(std::exchange(t[k], 0)); };
    auto read = [&](size_t k) { t[k] = store_->submit_read(id, 4ull * k * C, slot[k % 3], bytes(k)); };
    try {
      for (size_t k = 0; !write && k < std::min<size_t>(2, chunks); ++k) read(k);
      for (size_t k = 0; k < chunks; ++k) {
        float* s = slot[k % 3];
        if (write) {
          if (k >= 3) wait(k - 3);  // the slot's previous chunk is on disk
          std::memset(reinterpret_cast<char*>(s) + 4 * elems(k), 0, bytes(k) - 4 * elems(k));
          fn(k * C, elems(k), s);
          t[k] = store_->submit_write(id, 4ull * k * C, s, bytes(k));
        } else {
          wait(k);
          if (k + 2 < chunks) read(k + 2);  // into the slot chunk k-1 has left
          fn(k * C, elems(k), s);
        }
      }
      for (size_t k = 0; k < chunks; ++k)
        if (t[k]) wait(k);
    } catch (...) {
      drain(t);
      throw;
    }
  }

  void run() {
    for (;;) {
      std::pair<Handle, std::function<void()>> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        job.second();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (err) errors_[job.first] = err;
        last_done_ = job.first;
      }
      done_cv_.notify_all();
    }
  }

  std::vector<OptimGroup> groups_;
  std::vector<StateTier> tiers_;
  SsdStore* store_;
  OocAdamWOptions opts_;
  std::vector<HostState> host_;
  std::vector<Ext> ext_;
  std::unique_ptr<HostPool> pool_;
  float* slots_[3][3] = {};
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0};

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::pair<Handle, std::function<void()>>> queue_;
  std::map<Handle, std::exception_ptr> errors_;
  Handle next_ = 1;
  Handle last_done_ = 0;
  bool stop_ = false;
  std::thread worker_;
  int default_threads_ = 1;  // OpenMP threads of an update that names none
};

OocAdamW::OocAdamW(std::vector<OptimGroup> groups, std::vector<StateTier> tiers, SsdStore* store,
                   OocAdamWOptions opts)
    : impl_(std::make_unique<Impl>(std::move(groups), std::move(tiers), store, opts)) {}
OocAdamW::~OocAdamW() = default;

size_t OocAdamW::num_groups() const { return impl_->num_groups(); }
const OptimGroup& OocAdamW::group(int g) const { return impl_->group(g); }
StateTier OocAdamW::tier(int g) const { return impl_->tier(g); }
uint64_t OocAdamW::host_bytes() const { return impl_->host_bytes(); }

void OocAdamW::init_group(int g, const float* master) {
  wait(impl_->enqueue([this, g, master] { impl_->init_group(g, master); }));
}

void OocAdamW::read_master(int g, float* dst) {
  wait(impl_->enqueue([this, g, dst] { impl_->read_master(g, dst); }));
}

void OocAdamW::read_state(int g, StateKind kind, const StateSink& sink) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &sink] { impl_->read_state(g, kind, sink); }));
}

void OocAdamW::write_state(int g, StateKind kind, const StateSource& source) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &source] { impl_->write_state(g, kind, source); }));
}

OocAdamW::Handle OocAdamW::submit(const Update& u) {
  FY_CHECK(u.group >= 0 && static_cast<size_t>(u.group) < impl_->num_groups(), "group ", u.group);
  FY_CHECK(u.grad, "update of group ", u.group, " has no gradient");
  return impl_->enqueue([this, u] { impl_->update(u); });
}

bool OocAdamW::done(Handle h) { return impl_->done(h); }
void OocAdamW::wait(Handle h) { impl_->wait(h); }
void OocAdamW::wait_all() { impl_->wait_all(); }
uint64_t OocAdamW::ssd_bytes_read() const { return impl_->bytes_read(); }
uint64_t OocAdamW::ssd_bytes_written() const { return impl_->bytes_written(); }

}  // namespace fuyou
