// The CPU backend with the CUDA backend's ordering rules (runtime.backend: cpu-streams), so
// that a missing wait fails a test on a machine without a GPU.
//
// It wraps the CPU backend: the arithmetic is the same code, only when it runs changes, as
// kernels/cuda/cuda_backend.h describes for the GPU. Kernels, zero() and
// the zeroing of new allocations are queued on a compute queue (a worker thread) and return
// at once. Host<->device copies run on one queue per direction and return when the copy is
// done; unless the caller orders the work itself (set_caller_ordered), a copy first waits for
// the compute queued before it. finish_compute() and synchronize() wait for the compute
// queue. New allocations hold garbage (bytes 0xFF, NaN as floats) until their
// zeroing runs, as device memory does until cudaMemsetAsync reaches it; a caller-ordered
// copy still waits for the zeroing of every allocation made before it (the caller cannot
// order work it never queued); free() returns memory
// only once the kernels queued before it have run (on the GPU a later user of the block is
// queued behind them, so the twin cannot be stricter there).
// StreamOptions::max_delay_us adds a random sleep before every queued operation, so that an
// operation a caller forgot to wait for usually has not run yet when the caller looks.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "fuyou/backend.h"
#include "kernels/cpu/op_queue.h"

namespace fuyou::cpu {

class StreamBackend final : public Backend {
 public:
  StreamBackend(std::unique_ptr<Backend> inner, const StreamOptions& opts);
  ~StreamBackend() override;

  BackendKind kind() const override { return inner_->kind(); }
  std::string name() const override;
  int threads() const override { return inner_->threads(); }
  void set_matmul_precision(MatmulPrecision p) override;
  MatmulPrecision matmul_precision() const override { return inner_->matmul_precision(); }
  void set_storage_type(ElemType t) override { inner_->set_storage_type(t); }
  ElemType storage_type() const override { return inner_->storage_type(); }

  void* alloc(size_t bytes, const std::string& what) override;
  void free(void* ptr) override;
  MemoryStats memory() const override { return inner_->memory(); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void zero(void* ptr, size_t bytes) override;
  void synchronize() override;
  void set_caller_ordered(bool on) override { caller_ordered_ = on; }
  void finish_compute() override { compute_.wait_all(); }

  // Every kernel queued on the compute queue, its arguments captured by value.
#define FY_KERNEL_QUEUED(name, params, args)  \
  void name params override {                 \
    kernel([=, this] { inner_->name args; }); \
  }
  FUYOU_LAYER_KERNELS(FY_KERNEL_QUEUED)
  FUYOU_DECODE_KERNELS(FY_KERNEL_QUEUED)
#undef FY_KERNEL_QUEUED

  bool supports_device_optimizer() const override { return inner_->supports_device_optimizer(); }
  void accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) override;
  double sum_squares(const void* x, ElemType type,
                     const std::vector<std::pair<size_t, size_t>>& groups) override;
  void adamw(const DeviceAdamW& a) override;

  // Marks queued on the compute queue: the clock when the queue reaches them.
  void timing_start() override;
  void timing_mark(int tag) override;
  std::vector<TimingMark> timing_stop() override;

 private:
  void copy(OpQueue& q, void* dst, const void* src, size_t bytes);
  template <class F>
  void kernel(F&& f) {
    compute_.submit(std::forward<F>(f));
  }

  std::unique_ptr<Backend> inner_;  // first: destroyed after the queues have drained
  StreamOptions opts_;
  std::atomic<bool> caller_ordered_{false};
  std::mutex zeroed_mu_;
  uint64_t zeroed_ = 0;  // compute ticket of the last allocation's zeroing
  std::mutex marks_mu_;
  std::vector<std::pair<int, double>> marks_;  // tag, clock seconds
  OpQueue compute_, h2d_, d2h_;
};

}  // namespace fuyou::cpu
