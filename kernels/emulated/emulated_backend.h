// The emulated device (runtime.backend: emulated): a GPU that does no arithmetic but takes the
// time a hardware profile predicts, so that the executor, the io_uring store and the CPU
// optimizer run for real in the regime a GPU puts them in (bound by SSD and optimizer, not by
// compute), on a machine without a GPU.
//
// Timing. Each kernel adds its FLOPs' time to a compute timeline: the profile's
// compute_seconds at the model's GEMM size (the simulator's cost, so an emulated op lasts
// exactly what the simulator gives it), divided by `scale`. The GEMMs count 2 M N K, attention
// 4 B T^2 C forward (twice that backward), as forward_flops_per_token; element-wise kernels
// take no time, as in the simulator. Kernels return at once; finish_compute() sleeps until
// the compute timeline ends. A copy starts when its direction is
// free and, unless the caller orders the work (set_caller_ordered), when the compute queued
// before it has ended (caller-ordered: when the last allocation's zeroing has), and sleeps
// until the profile's PCIe time (h2d_seconds / d2h_seconds, divided by `scale`) has passed:
// the CUDA backend's ordering rules. A wait shorter than 100 us is skipped (a sleep would
// overshoot it by the timer slack); the timeline keeps the time.
//
// Data. The arena is address space only (a PROT_NONE reservation of the capacity, in the
// bytes the run stores): the device holds no bytes, and host code that dereferences a device
// pointer faults at once. Copies to the device move nothing; copies to the host write NaN into the
// destination (whole for up to 64 KiB, else one per 4 KiB), so every loss, gradient norm and
// update an emulated run produces is NaN: its numbers are not training results, only its
// times are.
#pragma once

#include <chrono>
#include <mutex>

#include "fuyou/backend.h"
#include "fuyou/device_costs.h"
#include "kernels/common/arena.h"

namespace fuyou::emulated {

struct EmulatedOptions {
  HardwareProfile gpu;   // the device emulated (offload.hardware)
  double scale = 1.0;    // compute and PCIe throughputs multiplied by this (runtime.emulated_scale)
  double gemm_size = 0;  // gemm_work_size of the model and micro-batch the device will run
  uint64_t capacity = 0;  // arena bytes
  int threads = 1;        // runtime.threads (the CPU optimizer's; the device itself uses none)
};

class EmulatedBackend final : public Backend {
 public:
  explicit EmulatedBackend(const EmulatedOptions& o);
  ~EmulatedBackend() override;

  BackendKind kind() const override { return BackendKind::kEmulated; }
  std::string name() const override;
  int threads() const override { return o_.threads; }
  bool device_is_host_memory() const override { return false; }
  void set_matmul_precision(MatmulPrecision p) override;
  MatmulPrecision matmul_precision() const override { return precision_; }

  void* alloc(size_t bytes, const std::string& what) override;
  void free(void* ptr) override;
  MemoryStats memory() const override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void zero(void*, size_t) override {}
  void synchronize() override { finish_compute(); }
  void set_caller_ordered(bool on) override;
  void finish_compute() override;

  void set_storage_type(ElemType t) override { storage_ = t; }
  ElemType storage_type() const override { return storage_; }

  // The GEMMs and the attention take the profile's compute time for their FLOPs (the
  // attention timed as dense causal attention whatever the records: the packed positions live
  // in device memory this device does not hold); the memory-bound kernels take none.
  FUYOU_GEMM_KERNELS(FY_KERNEL_OVERRIDE)
#define FY_KERNEL_FREE(name, params, args) \
  void name params override {}
  FUYOU_ELEMENTWISE_KERNELS(FY_KERNEL_FREE)
#undef FY_KERNEL_FREE

  // FLOPs queued so far (tests: the model's kernels add up to forward_flops_per_token).
  double flops_queued() const;

 private:
  using clock = std::chrono::steady_clock;
  void compute(double flops);
  template <class Move>
  void copy(std::mutex& dir_mu, clock::time_point& dir_free, double seconds, Move&& move);

  EmulatedOptions o_;
  MatmulPrecision precision_ = MatmulPrecision::kBf16;
  ElemType storage_ = ElemType::kF32;  // what sizes the model asks for; no arithmetic reads it
  bool caller_ordered_ = false;        // guarded by mu_

  mutable std::mutex mu_;             // the timelines and the arena
  clock::time_point compute_free_{};  // when the compute queued so far ends
  clock::time_point zeroed_{};        // when the last allocation's zeroing ends
  double flops_ = 0;
  std::mutex h2d_mu_, d2h_mu_;  // one copy per direction at a time, as the CUDA backend
  clock::time_point h2d_free_{}, d2h_free_{};

  // Arena: first-fit over offsets in the reservation, neighbours coalesced on free.
  char* base_ = nullptr;
  ArenaBlocks arena_{o_.capacity, 256};  // the CUDA arena's block alignment
};

}  // namespace fuyou::emulated
