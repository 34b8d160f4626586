// The out-of-core AdamW: fp32 master weights and Adam moments for parameter groups (one
// per layer) that live in host memory or on the SSD store, updated group by group on a
// worker thread so the caller (the scheduler) overlaps updates with the backward pass.
//
// A group on SSD is streamed in chunks through pinned slots: while chunk k is updated,
// chunk k+1's master/m/v are being read and chunk k-1's are being written (three slot
// sets). A group in host memory is updated in place. Both run the same kernel
// (adamw_update) on the same element ranges, so results are bit-identical whichever tier
// a group lives on.
//
// Extents: "<group>/master", "<group>/adam_m", "<group>/adam_v", each one contiguous
// extent of the store, so each chunk moves as three sequential requests. In a packed format
// (OocAdamWOptions::format) each holds its kind as the format stores it: the master's
// remainders (split), the moments' bf16 values or int8 codes, and after the codes, from the
// next 4 KiB boundary, their scales (one request more per int8 moment and chunk).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fuyou/optim.h"
#include "fuyou/storage.h"
#include "fuyou/tier.h"
#include "fuyou/train_state.h"

namespace fuyou {

// A tensor inside a group: its element range (relative to the group) and its decay flag.
struct OptimTensor {
  size_t offset = 0;
  size_t numel = 0;
  bool decay = false;
};

struct OptimGroup {
  std::string name;  // e.g. "layer.17"; names the store extents
  size_t numel = 0;
  std::vector<OptimTensor> tensors;  // must cover only [0, numel)
};

struct OocAdamWOptions {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  // Per streamed chunk; a multiple of 1024 (4 KiB of fp32), and with int8 moments of 262144
  // (so that a chunk's scales start on a 4 KiB boundary of their region).
  size_t chunk_elems = 1 << 20;
  SimdPath simd = SimdPath::kAuto;
  // How the state is stored (optimizer.state, optimizer.master). A split master's working
  // halves are the updates' `lowp` (bf16), read and written; the optimizer keeps the rest.
  OptimFormat format;
};

// Bytes of the store extents of a group of `numel` parameters (its three kinds, each rounded
// to 4 KiB), and the bytes a whole-group update reads (and writes) streaming them in chunks.
uint64_t ooc_state_extent_bytes(const OptimFormat& f, uint64_t numel);
uint64_t ooc_update_io_bytes(const OptimFormat& f, uint64_t numel,
                             size_t chunk_elems = size_t{1} << 20);

// The pinned chunk slots an optimizer with groups on SSD holds: three slot sets (read ahead,
// update, write behind) of master, m and v chunks.
constexpr uint32_t kOocChunkSlots = 9;
constexpr uint64_t ooc_chunk_pool_bytes(const OocAdamWOptions& o = {}) {
  return kOocChunkSlots * 4ull * o.chunk_elems;
}

// Decides where each group's state lives: host memory for groups while their state
// (optim_state_bytes: 12 bytes per parameter in fp32) fits `host_state_budget`, in order, the
// rest on SSD. With no store every group must fit in host memory (else Error with the numbers).
std::vector<Tier> place_optimizer_state(const std::vector<OptimGroup>& groups,
                                        uint64_t host_state_budget, bool have_store,
                                        const OptimFormat& format = {});

// One kind's packed state in pieces (checkpoints): plane 0 holds the values or codes
// (`n` elements from element `begin`, moment_elem_bytes or master_elem_bytes each), plane 1 an
// int8 moment's scales (`n` floats from block `begin`); plane 0 in order, then plane 1.
using PackedSink = std::function<void(int plane, size_t begin, const void* data, size_t n)>;
using PackedSource = std::function<void(int plane, size_t begin, void* data, size_t n)>;

class OocAdamW {
 public:
  // `store` may be null when every group is on the host. Allocates host state for host
  // groups, defines the store extents and the pinned chunk slots for SSD groups: nothing is
  // allocated after construction.
  OocAdamW(std::vector<OptimGroup> groups, std::vector<Tier> tiers, SsdStore* store,
           OocAdamWOptions opts);
  ~OocAdamW();
  OocAdamW(const OocAdamW&) = delete;
  OocAdamW& operator=(const OocAdamW&) = delete;

  size_t num_groups() const;
  const OptimGroup& group(int g) const;
  Tier tier(int g) const;
  // Host bytes this optimizer holds: resident state plus the chunk slots.
  uint64_t host_bytes() const;

  const OptimFormat& format() const;

  // Sets a group's master weights (m and v to zero). Synchronous. With a split master the
  // optimizer keeps the remainders; the caller stores the working halves (math::split_hi).
  void init_group(int g, const float* master);
  // Reads a group's master weights into dst (numel floats). Synchronous; waits for any
  // pending update of the group first. A split master needs the group's working halves
  // (`hi`, numel bf16).
  void read_master(int g, float* dst, const uint16_t* hi = nullptr);
  // One kind of a group's state in pieces (checkpoints): a host group in one piece from its
  // arrays, an SSD group chunk by chunk through the optimizer's own pinned slots, reading or
  // writing that kind's extent only. Synchronous, after any pending update. write_state does
  // not touch the other kinds (init_group first for a master that goes with zero moments).
  // In a packed format the values are decoded (v: as the update reads it) and encoded with
  // rounding to nearest; a split master's kMaster is written (its remainders; the caller
  // stores the working halves) but read only through read_master.
  void read_state(int g, StateKind kind, const StateSink& sink);
  void write_state(int g, StateKind kind, const StateSource& source);
  // The same kind as stored, without conversion (exact checkpoints of a packed format).
  void read_packed(int g, StateKind kind, const PackedSink& sink);
  void write_packed(int g, StateKind kind, const PackedSource& source);

  struct Update {
    int group = 0;
    const void* grad = nullptr;  // numel gradient values, host memory, valid until done
    ElemType grad_type = ElemType::kF32;
    // Optional: numel updated weights for the next forward (a split master: required, bf16,
    // holding the current working weights, which the update reads).
    void* lowp = nullptr;
    ElemType lowp_type = ElemType::kF32;
    float grad_scale = 1.0f;
    float lr = 0;
    int64_t t = 1;  // 1-based step for bias correction
    // OpenMP threads of the kernel (0: those of the thread that built the optimizer). Any count
    // gives the same bits: the update is element-wise.
    int threads = 0;
    // Elements [begin, end) of the group only (end 0: the whole group); `grad` and `lowp`
    // still point at the group's element 0. Groups whose state is in host memory only.
    size_t begin = 0, end = 0;
    // Instead of [begin, end): these `nranges` element ranges [first, second) of the group,
    // disjoint (host-memory state only; nranges 0 with ranges set: nothing to do).
    const std::pair<size_t, size_t>* ranges = nullptr;
    size_t nranges = 0;
  };
  using Handle = uint64_t;
  // Queues an update; returns at once. Updates run in submission order on the worker.
  Handle submit(const Update& u);
  bool done(Handle h);
  // Blocks until the update is complete (its state written back); rethrows its error.
  void wait(Handle h);
  void wait_all();

  // Bytes read from / written to the store so far.
  uint64_t ssd_bytes_read() const;
  uint64_t ssd_bytes_written() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
