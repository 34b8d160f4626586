#include "fuyou/ooc_adamw.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "fuyou/threads.h"
#include "kernels/common/element_math.h"

namespace fuyou {

const char* state_kind_name(StateKind k) {
  switch (k) {
    case StateKind::kMaster:
      return "master";
    case StateKind::kAdamM:
      return "adam_m";
    case StateKind::kAdamV:
      return "adam_v";
  }
  return "?";
}

namespace {

// How one kind of state is stored: bytes per element and, for int8 moments, one fp32 scale
// per block after the values (host: a separate array; extents and chunk slots: from the next
// 4 KiB boundary).
struct KindLayout {
  size_t eb = 4;
  bool scales = false;
};

KindLayout kind_layout(const OptimFormat& f, StateKind k) {
  if (k == StateKind::kMaster) return {master_elem_bytes(f.master), false};
  return {moment_elem_bytes(f.moments), f.moments == MomentFormat::kInt8};
}

// Bytes a piece of n elements of a kind takes in the store (its values, then its scales,
// each in whole 4 KiB blocks): a chunk's requests, or a whole extent.
uint64_t kind_io_bytes(const KindLayout& k, uint64_t n) {
  return round_up(k.eb * n, kIoAlign) + (k.scales ? round_up(4 * state_blocks(n), kIoAlign) : 0);
}

constexpr StateKind kKinds[3] = {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV};

}  // namespace

uint64_t ooc_state_extent_bytes(const OptimFormat& f, uint64_t numel) {
  uint64_t b = 0;
  for (StateKind k : kKinds) b += kind_io_bytes(kind_layout(f, k), numel);
  return b;
}

uint64_t ooc_update_io_bytes(const OptimFormat& f, uint64_t numel, size_t chunk_elems) {
  uint64_t b = 0;
  for (StateKind k : kKinds)
    for (uint64_t begin = 0; begin < numel; begin += chunk_elems)
      b += kind_io_bytes(kind_layout(f, k), std::min<uint64_t>(chunk_elems, numel - begin));
  return b;
}

std::vector<Tier> place_optimizer_state(const std::vector<OptimGroup>& groups,
                                        uint64_t host_state_budget, bool have_store,
                                        const OptimFormat& format) {
  std::vector<Tier> tiers;
  uint64_t used = 0, total = 0;
  for (const auto& g : groups) {
    uint64_t bytes = optim_state_bytes(format, g.numel);
    total += bytes;
    if (used + bytes <= host_state_budget) {
      used += bytes;
      tiers.push_back(Tier::kHost);
    } else {
      tiers.push_back(Tier::kSsd);
    }
  }
  if (!have_store && used < total)
    throw Error(str("optimizer state needs ", format_size(total), " (",
                    optim_state_bytes(format, 1000) / 1000.0,
                    " bytes per parameter: optimizer.state ", moment_format_name(format.moments),
                    ", optimizer.master ", master_format_name(format.master), ") but only ",
                    format_size(host_state_budget),
                    " of host memory is available for it and no SSD ",
                    "paths are configured (offload.ssd_paths)"));
  return tiers;
}

class OocAdamW::Impl {
 public:
  Impl(std::vector<OptimGroup> groups, std::vector<Tier> tiers, SsdStore* store,
       OocAdamWOptions opts)
      : groups_(std::move(groups)), tiers_(std::move(tiers)), store_(store), opts_(opts) {
    FY_CHECK(groups_.size() == tiers_.size(), "one tier per group");
    for (Tier t : tiers_)
      FY_CHECK(t != Tier::kDevice,
               "the out-of-core optimizer keeps state in host memory or on SSD");
    FY_CHECK(opts_.chunk_elems > 0 && opts_.chunk_elems % (kIoAlign / 4) == 0, "chunk_elems ",
             opts_.chunk_elems, " must be a positive multiple of 1024");
    FY_CHECK(opts_.format.moments != MomentFormat::kInt8 ||
                 opts_.chunk_elems % (kStateBlock * kIoAlign / 4) == 0,
             "with int8 moments chunk_elems ", opts_.chunk_elems, " must be a multiple of ",
             kStateBlock * kIoAlign / 4);
    for (int k = 0; k < 3; ++k) layout_[k] = kind_layout(opts_.format, kKinds[k]);
    bool any_ssd = false;
    host_.resize(groups_.size());
    ext_.resize(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (const auto& t : groups_[g].tensors)
        FY_CHECK(t.offset + t.numel <= groups_[g].numel, "tensor outside group ", groups_[g].name);
      const uint64_t n = groups_[g].numel;
      if (tiers_[g] == Tier::kHost) {
        for (int k = 0; k < 3; ++k) {
          host_[g].data[k].assign((layout_[k].eb * n + 3) / 4, 0.0f);
          if (layout_[k].scales) host_[g].scales[k].assign(state_blocks(n), 0.0f);
        }
      } else {
        if (!store_)
          throw Error(
              str("optimizer group ", groups_[g].name, " is placed on SSD but no store is open"));
        for (int k = 0; k < 3; ++k)
          ext_[g][k] = store_->define_extent(groups_[g].name + "/" + state_kind_name(kKinds[k]),
                                             kind_io_bytes(layout_[k], n));
        any_ssd = true;
      }
    }
    if (any_ssd) {
      // Three slot sets (read ahead, update, write behind) of master, m and v chunks:
      // ooc_chunk_pool_bytes(), as the planner counts them. A packed kind's chunk (its values,
      // then from the next 4 KiB its scales) fits a slot of fp32 values.
      pool_ = std::make_unique<HostPool>(
          std::vector<SlotSpec>{{"optim.chunk", 4ull * opts_.chunk_elems, kOocChunkSlots}});
      int cls = pool_->slot_class("optim.chunk");
      for (int s = 0; s < 3; ++s)
        for (int a = 0; a < 3; ++a)
          slots_[s][a] = static_cast<char*>(pool_->slot(cls, s * 3 + a).ptr);
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

  // One kind's state of elements [begin, ...) of a group: values and (int8) scales, at the
  // pointers the kernel takes (host arrays, or a chunk slot's two regions).
  struct KindView {
    char* data = nullptr;
    float* scales = nullptr;
  };

  void update(const Update& u) {
    const OptimGroup& grp = groups_.at(u.group);
    set_thread_team(u.threads > 0 ? u.threads : default_threads_);
    const OptimFormat& f = opts_.format;
    FY_CHECK(f.master != MasterFormat::kSplit || (u.lowp && u.lowp_type == ElemType::kBF16),
             "group ", grp.name,
             ": a split master needs the bf16 working weights as the update's lowp");
    AdamWStep step{u.lr, opts_.beta1, opts_.beta2, opts_.eps, 0.0f, u.t};
    // fp32 state: adamw_update's pieces for elements [begin, end) of the group, with state at
    // the given views (which hold element `begin` at index 0), split at tensor boundaries for
    // decay; run_pieces runs those gathered so far in one parallel pass.
    std::vector<AdamWArgs> pieces;
    std::vector<float> decays;
    auto add_range = [&](const KindView* s, size_t begin, size_t end) {
      if (f.packed()) return run_packed(u, s, begin, end);
      for (const OptimTensor& t : grp.tensors) {
        size_t a = std::max(begin, t.offset), b = std::min(end, t.offset + t.numel);
        if (a >= b) continue;
        AdamWArgs args;
        args.master = reinterpret_cast<float*>(s[0].data) + (a - begin);
        args.m = reinterpret_cast<float*>(s[1].data) + (a - begin);
        args.v = reinterpret_cast<float*>(s[2].data) + (a - begin);
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
      if (!pieces.empty())
        adamw_update(pieces.data(), decays.data(), pieces.size(), step, opts_.simd);
      pieces.clear();
      decays.clear();
    };
    // The ranges to update: u.ranges, else the one range [begin, end).
    const std::pair<size_t, size_t> whole{u.begin, u.end ? u.end : grp.numel};
    const std::pair<size_t, size_t>* ranges = u.ranges ? u.ranges : &whole;
    const size_t nranges = u.ranges ? u.nranges : 1;
    for (size_t i = 0; i < nranges; ++i) {
      FY_CHECK(ranges[i].first <= ranges[i].second && ranges[i].second <= grp.numel,
               "update range [", ranges[i].first, ", ", ranges[i].second, ") of group ", grp.name,
               " with ", grp.numel, " elements");
      FY_CHECK(f.moments != MomentFormat::kInt8 ||
                   (ranges[i].first % kStateBlock == 0 &&
                    (ranges[i].second % kStateBlock == 0 || ranges[i].second == grp.numel)),
               "update range [", ranges[i].first, ", ", ranges[i].second, ") of group ", grp.name,
               " is not on int8 blocks of ", kStateBlock, " elements");
    }
    if (tiers_[u.group] == Tier::kHost) {
      for (size_t i = 0; i < nranges; ++i) {
        const auto [a, b] = ranges[i];
        KindView s[3];
        for (int k = 0; k < 3; ++k) s[k] = host_view(u.group, k, a);
        add_range(s, a, b);
      }
      run_pieces();
      return;
    }
    FY_CHECK(!u.ranges && whole.first == 0 && whole.second == grp.numel, "group ", grp.name,
             " has its optimizer state on SSD: only whole-group updates");
    const size_t C = opts_.chunk_elems;
    const size_t chunks = (grp.numel + C - 1) / C;
    std::vector<Ticket> reads(6 * chunks, 0), writes(6 * chunks, 0);
    auto wait_writes = [&](size_t k) {
      for (int a = 0; a < 6; ++a)
        if (writes[6 * k + a]) store_->wait(std::exchange(writes[6 * k + a], 0));
    };
    try {
      chunk_io(u.group, 0, /*write=*/false, &reads[0]);
      for (size_t k = 0; k < chunks; ++k) {
        if (k + 1 < chunks) {
          if (k >= 2) wait_writes(k - 2);  // chunk k+1 reuses chunk k-2's slots
          chunk_io(u.group, k + 1, false, &reads[6 * (k + 1)]);
        }
        for (int a = 0; a < 6; ++a)
          if (reads[6 * k + a]) store_->wait(std::exchange(reads[6 * k + a], 0));
        size_t begin = k * C, end = std::min(grp.numel, begin + C);
        KindView s[3];
        for (int a = 0; a < 3; ++a) s[a] = slot_view(k % 3, a);
        add_range(s, begin, end);
        run_pieces();
        chunk_io(u.group, k, /*write=*/true, &writes[6 * k]);
      }
      for (size_t k = 0; k < chunks; ++k) wait_writes(k);
    } catch (...) {
      drain(reads);
      drain(writes);
      throw;
    }
  }

  // The packed kernel over elements [begin, end) of the update's group, with state at views
  // holding element `begin` first.
  void run_packed(const Update& u, const KindView* s, size_t begin, size_t end) {
    const OptimGroup& grp = groups_.at(u.group);
    std::vector<DecayRange> dr;
    for (const OptimTensor& t : grp.tensors) {
      size_t a = std::max(begin, t.offset), b = std::min(end, t.offset + t.numel);
      if (a < b) dr.push_back({a - begin, b - begin, t.decay});
    }
    std::sort(dr.begin(), dr.end(),
              [](const DecayRange& x, const DecayRange& y) { return x.begin < y.begin; });
    PackedAdamWArgs a;
    a.format = opts_.format;
    a.master = s[0].data;
    a.m = s[1].data;
    a.m_scale = s[1].scales;
    a.v = s[2].data;
    a.v_scale = s[2].scales;
    a.grad = static_cast<const char*>(u.grad) + begin * elem_type_size(u.grad_type);
    a.grad_type = u.grad_type;
    a.lowp = u.lowp ? static_cast<char*>(u.lowp) + begin * elem_type_size(u.lowp_type) : nullptr;
    a.lowp_type = u.lowp_type;
    a.n = end - begin;
    a.first = begin;
    a.grad_scale = u.grad_scale;
    a.key = math::round_key(static_cast<uint32_t>(u.group), u.t);
    a.ranges = dr.data();
    a.nranges = dr.size();
    adamw_update_packed(
        a, AdamWStep{u.lr, opts_.beta1, opts_.beta2, opts_.eps, opts_.weight_decay, u.t},
        opts_.simd);
  }

  void init_group(int g, const float* master) {
    const size_t numel = groups_[g].numel;
    // Chunk by chunk (host groups: one chunk of the whole group) into views of the state.
    auto fill = [&](size_t begin, size_t n, const KindView* s) {
      if (opts_.format.master == MasterFormat::kSplit) {
        int16_t* lo = reinterpret_cast<int16_t*>(s[0].data);
        for (size_t i = 0; i < n; ++i) lo[i] = math::split_lo(master[begin + i]);
      } else {
        std::memcpy(s[0].data, master + begin, 4 * n);
      }
      for (int k = 1; k < 3; ++k) {
        std::memset(s[k].data, 0, layout_[k].eb * n);
        if (layout_[k].scales) std::fill(s[k].scales, s[k].scales + state_blocks(n), 0.0f);
      }
    };
    if (tiers_[g] == Tier::kHost) {
      KindView s[3];
      for (int k = 0; k < 3; ++k) s[k] = host_view(g, k, 0);
      return fill(0, numel, s);
    }
    const size_t C = opts_.chunk_elems;
    for (size_t begin = 0, k = 0; begin < numel; begin += C, ++k) {
      const size_t n = std::min(C, numel - begin);
      KindView s[3];
      for (int a = 0; a < 3; ++a) {
        s[a] = slot_view(0, a);
        std::memset(s[a].data, 0, 4 * C);  // defined padding bytes on disk
      }
      fill(begin, n, s);
      Ticket t[6] = {};
      chunk_io(g, k, /*write=*/true, t, /*from_set=*/0);
      for (Ticket x : t)
        if (x) store_->wait(x);
    }
  }

  void read_master(int g, float* dst, const uint16_t* hi) {
    const bool split = opts_.format.master == MasterFormat::kSplit;
    FY_CHECK(!split || hi, "group ", groups_[g].name,
             ": a split master is read with its working halves");
    auto take = [&](size_t begin, const char* data, size_t n) {
      if (!split) return (void)std::memcpy(dst + begin, data, 4 * n);
      const int16_t* lo = reinterpret_cast<const int16_t*>(data);
      for (size_t i = 0; i < n; ++i) dst[begin + i] = math::split_join(hi[begin + i], lo[i]);
    };
    if (tiers_[g] == Tier::kHost) return take(0, host_view(g, 0, 0).data, groups_[g].numel);
    stream_plane(g, 0, 0, /*write=*/false,
                 [&](size_t begin, size_t n, char* slot) { take(begin, slot, n); });
  }

  void read_state(int g, StateKind kind, const StateSink& sink) {
    const int k = static_cast<int>(kind);
    FY_CHECK(!(kind == StateKind::kMaster && opts_.format.master == MasterFormat::kSplit), "group ",
             groups_[g].name, ": a split master is read through read_master");
    if (kind == StateKind::kMaster || opts_.format.moments == MomentFormat::kF32) {
      if (tiers_[g] == Tier::kHost)
        return sink(0, reinterpret_cast<const float*>(host_view(g, k, 0).data), groups_[g].numel);
      return stream_plane(g, k, 0, false, [&](size_t begin, size_t n, char* slot) {
        sink(begin, reinterpret_cast<const float*>(slot), n);
      });
    }
    // Decoded: the values through a scratch of fp32 (host groups: whole; SSD: per chunk, in
    // the second slot set, idle between updates; int8 chunks read with their scales).
    const MomentFormat mf = opts_.format.moments;
    if (tiers_[g] == Tier::kHost) {
      std::vector<float> out(groups_[g].numel);
      const KindView v = host_view(g, k, 0);
      decode_moment(mf, kind == StateKind::kAdamV, v.data, v.scales, out.data(), out.size());
      return sink(0, out.data(), out.size());
    }
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel;
    float* out = reinterpret_cast<float*>(slots_[1][0]);
    for (size_t begin = 0, c = 0; begin < numel; begin += C, ++c) {
      const size_t n = std::min(C, numel - begin);
      kind_chunk_sync(g, k, c, /*write=*/false);
      const KindView v = slot_view(0, k);
      decode_moment(mf, kind == StateKind::kAdamV, v.data, v.scales, out, n);
      sink(begin, out, n);
    }
  }

  void write_state(int g, StateKind kind, const StateSource& source) {
    const int k = static_cast<int>(kind);
    const bool split = kind == StateKind::kMaster && opts_.format.master == MasterFormat::kSplit;
    if (!split && (kind == StateKind::kMaster || opts_.format.moments == MomentFormat::kF32)) {
      if (tiers_[g] == Tier::kHost)
        return source(0, reinterpret_cast<float*>(host_view(g, k, 0).data), groups_[g].numel);
      return stream_plane(g, k, 0, true, [&](size_t begin, size_t n, char* slot) {
        source(begin, reinterpret_cast<float*>(slot), n);
      });
    }
    // Encoded from fp32 values (a split master's remainders; moments rounded to nearest).
    auto encode = [&](const float* in, size_t n, const KindView& v) {
      if (!split)
        return encode_moment(opts_.format.moments, kind == StateKind::kAdamV, in, v.data, v.scales,
                             n);
      int16_t* lo = reinterpret_cast<int16_t*>(v.data);
      for (size_t i = 0; i < n; ++i) lo[i] = math::split_lo(in[i]);
    };
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel;
    if (tiers_[g] == Tier::kHost) {
      std::vector<float> in(numel);
      source(0, in.data(), numel);
      return encode(in.data(), numel, host_view(g, k, 0));
    }
    float* in = reinterpret_cast<float*>(slots_[1][0]);
    for (size_t begin = 0, c = 0; begin < numel; begin += C, ++c) {
      const size_t n = std::min(C, numel - begin);
      source(begin, in, n);
      const KindView v = slot_view(0, k);
      std::memset(v.data, 0, 4 * C);
      encode(in, n, v);
      kind_chunk_sync(g, k, c, /*write=*/true);
    }
  }

  void read_packed(int g, StateKind kind, const PackedSink& sink) {
    const int k = static_cast<int>(kind);
    const uint64_t numel = groups_[g].numel;
    if (tiers_[g] == Tier::kHost) {
      const KindView v = host_view(g, k, 0);
      sink(0, 0, v.data, numel);
      if (layout_[k].scales) sink(1, 0, v.scales, state_blocks(numel));
      return;
    }
    for (int plane = 0; plane < (layout_[k].scales ? 2 : 1); ++plane)
      stream_plane(g, k, plane, false,
                   [&](size_t begin, size_t n, char* slot) { sink(plane, begin, slot, n); });
  }

  void write_packed(int g, StateKind kind, const PackedSource& source) {
    const int k = static_cast<int>(kind);
    const uint64_t numel = groups_[g].numel;
    if (tiers_[g] == Tier::kHost) {
      const KindView v = host_view(g, k, 0);
      source(0, 0, v.data, numel);
      if (layout_[k].scales) source(1, 0, v.scales, state_blocks(numel));
      return;
    }
    for (int plane = 0; plane < (layout_[k].scales ? 2 : 1); ++plane)
      stream_plane(g, k, plane, true,
                   [&](size_t begin, size_t n, char* slot) { source(plane, begin, slot, n); });
  }

  const OptimFormat& format() const { return opts_.format; }
  const OptimGroup& group(int g) const { return groups_.at(g); }
  Tier tier(int g) const { return tiers_.at(g); }
  size_t num_groups() const { return groups_.size(); }
  uint64_t host_bytes() const {
    uint64_t b = pool_ ? pool_->bytes() : 0;
    for (const auto& h : host_)
      for (int k = 0; k < 3; ++k) b += 4ull * (h.data[k].size() + h.scales[k].size());
    return b;
  }
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  struct HostState {
    std::vector<float> data[3];    // each kind's values in its format (fp32, int16, bf16, int8)
    std::vector<float> scales[3];  // an int8 moment's block scales
  };

  KindView host_view(int g, int k, size_t begin) {
    HostState& h = host_[g];
    KindView v;
    v.data = reinterpret_cast<char*>(h.data[k].data()) + layout_[k].eb * begin;
    if (layout_[k].scales) v.scales = h.scales[k].data() + begin / kStateBlock;
    return v;
  }
  // Kind k's chunk in slot set `set`: its values, then from the next 4 KiB its scales.
  KindView slot_view(int set, int k) const {
    KindView v;
    v.data = slots_[set][k];
    if (layout_[k].scales)
      v.scales = reinterpret_cast<float*>(slots_[set][k] +
                                          round_up(layout_[k].eb * opts_.chunk_elems, kIoAlign));
    return v;
  }
  // Where chunk c of kind k's plane (0: values, 1: scales) lies in its extent, and its bytes.
  std::pair<uint64_t, uint64_t> plane_range(int g, int k, int plane, size_t c) const {
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel, n = std::min(C, numel - c * C);
    if (plane == 0) return {layout_[k].eb * c * C, round_up(layout_[k].eb * n, kIoAlign)};
    return {round_up(layout_[k].eb * numel, kIoAlign) + 4 * (c * C / kStateBlock),
            round_up(4 * state_blocks(n), kIoAlign)};
  }
  // Submits chunk c's requests of every kind (values, and scales where a kind has them),
  // reading into or writing from slot set `from_set` (default c % 3); tickets into t[0..5].
  void chunk_io(int g, size_t c, bool write, Ticket* t, int from_set = -1) {
    const int set = from_set >= 0 ? from_set : static_cast<int>(c % 3);
    for (int k = 0; k < 3; ++k) {
      const KindView v = slot_view(set, k);
      for (int plane = 0; plane < (layout_[k].scales ? 2 : 1); ++plane) {
        const auto [off, bytes] = plane_range(g, k, plane, c);
        char* buf = plane == 0 ? v.data : reinterpret_cast<char*>(v.scales);
        t[2 * k + plane] = write ? store_->submit_write(ext_[g][k], off, buf, bytes)
                                 : store_->submit_read(ext_[g][k], off, buf, bytes);
        (write ? bytes_written_ : bytes_read_) += bytes;
      }
    }
  }
  // Kind k's chunk c through slot set 0, synchronously (checkpoint conversions).
  void kind_chunk_sync(int g, int k, size_t c, bool write) {
    const KindView v = slot_view(0, k);
    for (int plane = 0; plane < (layout_[k].scales ? 2 : 1); ++plane) {
      const auto [off, bytes] = plane_range(g, k, plane, c);
      char* buf = plane == 0 ? v.data : reinterpret_cast<char*>(v.scales);
      if (write)
        store_->write_sync(ext_[g][k], off, buf, bytes);
      else
        store_->read_sync(ext_[g][k], off, buf, bytes);
    }
  }

  // Waits for every ticket still set, dropping their errors: after a failure, before the slots
  // can be reused (the first error is the one the caller rethrows).
  void drain(const std::vector<Ticket>& tickets) {
    for (Ticket t : tickets)
      if (t) try {
          store_->wait(t);
        } catch (...) {
        }
  }

  // One plane of one kind's extent of an SSD group (plane 0: values, 1: an int8 moment's
  // scales), chunk by chunk through the three slots of set 0 in turn (the worker is idle while
  // this runs: it is called from a queued task), so that the disk works on the next chunks
  // while `fn` takes this one: reads run two chunks ahead, writes go out behind. `fn` gets the
  // chunk's first element (or block) and count. Writes zero the padding past the last element,
  // so the bytes on disk are defined.
  void stream_plane(int g, int k, int plane, bool write,
                    const std::function<void(size_t, size_t, char*)>& fn) {
    const ExtentId id = ext_[g][k];
    const size_t C = opts_.chunk_elems, numel = groups_[g].numel, chunks = (numel + C - 1) / C;
    char* const* slot = slots_[0];
    std::vector<Ticket> t(chunks, 0);
    auto elems = [&](size_t c) { return std::min(C, numel - c * C); };
    auto count = [&](size_t c) { return plane == 0 ? elems(c) : state_blocks(elems(c)); };
    auto used = [&](size_t c) { return plane == 0 ? layout_[k].eb * elems(c) : 4 * count(c); };
    auto first = [&](size_t c) { return plane == 0 ? c * C : c * C / kStateBlock; };
    auto wait = [&](size_t c) { store_->wait(std::exchange(t[c], 0)); };
    auto read = [&](size_t c) {
      const auto [off, bytes] = plane_range(g, k, plane, c);
      t[c] = store_->submit_read(id, off, slot[c % 3], bytes);
    };
    try {
      for (size_t c = 0; !write && c < std::min<size_t>(2, chunks); ++c) read(c);
      for (size_t c = 0; c < chunks; ++c) {
        char* s = slot[c % 3];
        const auto [off, bytes] = plane_range(g, k, plane, c);
        if (write) {
          if (c >= 3) wait(c - 3);  // the slot's previous chunk is on disk
          std::memset(s + used(c), 0, bytes - used(c));
          fn(first(c), count(c), s);
          t[c] = store_->submit_write(id, off, s, bytes);
        } else {
          wait(c);
          if (c + 2 < chunks) read(c + 2);  // into the slot chunk c-1 has left
          fn(first(c), count(c), s);
        }
      }
      for (size_t c = 0; c < chunks; ++c)
        if (t[c]) wait(c);
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
  std::vector<Tier> tiers_;
  SsdStore* store_;
  OocAdamWOptions opts_;
  KindLayout layout_[3];
  std::vector<HostState> host_;
  std::vector<std::array<ExtentId, 3>> ext_;
  std::unique_ptr<HostPool> pool_;
  char* slots_[3][3] = {};
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

OocAdamW::OocAdamW(std::vector<OptimGroup> groups, std::vector<Tier> tiers, SsdStore* store,
                   OocAdamWOptions opts)
    : impl_(std::make_unique<Impl>(std::move(groups), std::move(tiers), store, opts)) {}
OocAdamW::~OocAdamW() = default;

size_t OocAdamW::num_groups() const { return impl_->num_groups(); }
const OptimGroup& OocAdamW::group(int g) const { return impl_->group(g); }
Tier OocAdamW::tier(int g) const { return impl_->tier(g); }
uint64_t OocAdamW::host_bytes() const { return impl_->host_bytes(); }
const OptimFormat& OocAdamW::format() const { return impl_->format(); }

void OocAdamW::init_group(int g, const float* master) {
  wait(impl_->enqueue([this, g, master] { impl_->init_group(g, master); }));
}

void OocAdamW::read_master(int g, float* dst, const uint16_t* hi) {
  wait(impl_->enqueue([this, g, dst, hi] { impl_->read_master(g, dst, hi); }));
}

void OocAdamW::read_state(int g, StateKind kind, const StateSink& sink) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &sink] { impl_->read_state(g, kind, sink); }));
}

void OocAdamW::write_state(int g, StateKind kind, const StateSource& source) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &source] { impl_->write_state(g, kind, source); }));
}

void OocAdamW::read_packed(int g, StateKind kind, const PackedSink& sink) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &sink] { impl_->read_packed(g, kind, sink); }));
}

void OocAdamW::write_packed(int g, StateKind kind, const PackedSource& source) {
  FY_CHECK(g >= 0 && static_cast<size_t>(g) < impl_->num_groups(), "group ", g);
  wait(impl_->enqueue([this, g, kind, &source] { impl_->write_packed(g, kind, source); }));
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
