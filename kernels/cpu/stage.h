// fp32 views of a kernel's tensors for one call of the CPU backend, whatever the backend
// stores them as (fp32, bf16, fp16), so one set of fp32 kernels serves every storage type.
//
// With fp32 storage every view is the tensor itself (nothing is copied). With 16-bit storage
// an input is widened into scratch; an output gets scratch that is rounded (to nearest even)
// into the tensor when the Stage ends; an accumulator (+=) is widened, updated, then rounded
// back. So a kernel computes in fp32 from the stored 16-bit values and rounds once per stored
// element, as a GPU kernel that loads and stores 16-bit values does. Scratch belongs to the
// calling thread, grows to the largest call seen and is reused: nothing is allocated once warm.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuyou/elem_type.h"

namespace fuyou::cpu {

class Stage {
 public:
  explicit Stage(ElemType t);
  ~Stage();  // rounds outputs and accumulators into their tensors (unless unwinding)
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  // Null stays null (an optional tensor the kernel skips).
  const float* in(const void* p, size_t n);
  float* out(void* p, size_t n);
  float* acc(void* p, size_t n);

 private:
  float* scratch(size_t n);
  struct Back {
    uint16_t* dst;
    const float* src;
    size_t n;
  };
  static constexpr int kMaxViews = 8;
  ElemType t_;
  int used_ = 0;
  Back back_[kMaxViews];
  int nback_ = 0;
};

// Bytes of fp32 scratch the calling thread's Stages hold (tests: within
// cpu_kernel_scratch_bytes).
size_t stage_scratch_bytes();
// Frees it (tests: a measurement starts from nothing).
void release_stage_scratch();

}  // namespace fuyou::cpu
