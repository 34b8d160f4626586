// What a step's time is spent on, for fuyou-bench train --breakdown: the phase of the step
// and the class of work, carried as one integer tag by the backend's timing marks
// (Backend::timing_mark). The model marks its kernels' classes, the steps their copies, host
// work and waits.
#pragma once

namespace fuyou {

enum class StepPhase { kForward, kBackward, kOptimizer, kOther, kCount };

enum class OpClass {
  kEmbedding,
  kNorm,          // LayerNorm / RMSNorm, forward or backward
  kGemmQkv,       // the q/k/v projection
  kGemmAttnProj,  // the attention's output projection
  kGemmMlpUp,     // the MLP's first matrix (fc; gate|up)
  kGemmMlpDown,   // the MLP's second matrix (fc projection; down)
  kAttention,
  kActivation,  // GELU, ReLU, SwiGLU
  kResidual,    // the residual adds
  kRope,        // rotary positions and grouped-query head copies
  kHeadGemm,    // the LM head's GEMMs
  kLoss,        // softmax cross-entropy
  kCopyToDevice,
  kCopyToHost,
  kDeviceOptimizer,  // the gradient's fp32 sums, sum of squares and AdamW on the device
  kHostSums,         // fp32 sums of micro-batch gradients on the host
  kHostNorm,         // the gradient's sum of squares on the host
  kHostAdamW,        // AdamW on the host (with its conversions)
  kZeroGrads,        // clearing the gradients before a micro-batch
  kHost,             // other host work between device work (batch preparation, decisions)
  kWait,             // waiting for another resource (the offloading executor's dependencies)
  kCount
};

inline int timing_tag(StepPhase p, OpClass c) {
  return static_cast<int>(p) * static_cast<int>(OpClass::kCount) + static_cast<int>(c);
}
inline StepPhase tag_phase(int tag) {
  return static_cast<StepPhase>(tag / static_cast<int>(OpClass::kCount));
}
inline OpClass tag_class(int tag) {
  return static_cast<OpClass>(tag % static_cast<int>(OpClass::kCount));
}

const char* step_phase_name(StepPhase p);  // "forward", "backward", "optimizer", "other"
const char* op_class_name(OpClass c);      // "gemm.qkv", "attention", "copy.to_device", ...

}  // namespace fuyou
