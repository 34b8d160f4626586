#include "fuyou/op_class.h"

namespace fuyou {

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::kForward:
      return "forward";
    case StepPhase::kBackward:
      return "backward";
    case StepPhase::kOptimizer:
      return "optimizer";
    case StepPhase::kOther:
      return "other";
    case StepPhase::kCount:
      break;
  }
  return "?";
}

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::kEmbedding:
      return "embedding";
    case OpClass::kNorm:
      return "norm";
    case OpClass::kGemmQkv:
      return "gemm.qkv";
    case OpClass::kGemmAttnProj:
      return "gemm.attn_proj";
    case OpClass::kGemmMlpUp:
      return "gemm.mlp_up";
    case OpClass::kGemmMlpDown:
      return "gemm.mlp_down";
    case OpClass::kAttention:
      return "attention";
    case OpClass::kActivation:
      return "activation";
    case OpClass::kResidual:
      return "residual";
    case OpClass::kRope:
      return "rope";
    case OpClass::kHeadGemm:
      return "gemm.head";
    case OpClass::kLoss:
      return "loss";
    case OpClass::kCopyToDevice:
      return "copy.to_device";
    case OpClass::kCopyToHost:
      return "copy.to_host";
    case OpClass::kDeviceOptimizer:
      return "optimizer.device";
    case OpClass::kHostSums:
      return "host.grad_sums";
    case OpClass::kHostNorm:
      return "host.grad_norm";
    case OpClass::kHostAdamW:
      return "host.adamw";
    case OpClass::kZeroGrads:
      return "zero_grads";
    case OpClass::kHost:
      return "host.other";
    case OpClass::kWait:
      return "wait";
    case OpClass::kCount:
      break;
  }
  return "?";
}

}  // namespace fuyou
