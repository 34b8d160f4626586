#!/usr/bin/env bash
# One GPU lease's commands for what is still unmeasured (docs/cuda.md, "A lease"): the kit's
# steps in two calls of at most 10 minutes each, so a lease of 15 minutes of device time
# yields the whole table.
#
# Here (CUDA toolkit, no GPU needed), at the commit to measure:
#   bash tools/gpu-validate.sh --prepare
# Then through the device tool, from the repository root, carrying gpu-kit:
#   call 1: bash tools/gpu-lease.sh checks-and-perf    (timeout 600 s)
#   call 2: bash tools/gpu-lease.sh sanitize           (timeout 600 s; where time is left)
# Each writes report.json, summary.md and log.txt per phase under $OUT (else gpu-lease-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-lease-out}
kit=(--kit gpu-kit)

case "${1:-}" in
  checks-and-perf)
    # The CUDA code not yet run on a GPU (fused residual + norm, batched attention, the cuBLAS
    # workspace, the bias epilogue, the device's sums of squares and their spans, the in-memory
    # plan with AdamW on the host and on the device, compute ops done once queued) through
    # its tests, then the figures: where the step goes with fp32 tensors (batched attention),
    # bf16 with AdamW on the device as a plan and as the step, with the bias by kernel and by
    # epilogue, host AdamW as a plan and as the step, the
    # PyTorch peer between two engine runs, the GEMMs with their bias, and the 6.7B setting with
    # the executor's threads spinning and blocking while they wait for the device.
    FUYOU_GPU_PHASE_S=150 bash tools/gpu-validate.sh "${kit[@]}" --phase check \
      --only device,libraries,cuda-kernels,cuda-scheduler,cuda-families,cuda-cudnn --out "$out/c"
    FUYOU_GPU_PHASE_S=420 bash tools/gpu-validate.sh "${kit[@]}" --phase perf \
      --only profile,bench-gpt2-fp32,bench-gpt2-bf16-tensors,bench-gpt2-bf16-tensors-device-step,bench-gpt2-bf16-tensors-bias-epilogue,bench-gpt2-bf16-tensors-host-adamw,bench-gpt2-bf16-tensors-host-adamw-step,torch-peer-gpt2,bench-gpt2-bf16-tensors-again,gemm-cublaslt-gpt2,offload-6.7b-24g-int8,offload-6.7b-24g-int8-block \
      --out "$out/p"
    ;;
  sanitize)
    # racecheck, synccheck and initcheck with the phase's full time (the last lease's
    # shortened limit stopped racecheck in the device-optimizer test).
    FUYOU_GPU_PHASE_S=560 bash tools/gpu-validate.sh "${kit[@]}" --phase sanitize --out "$out/s"
    ;;
  *)
    echo "usage: bash tools/gpu-lease.sh checks-and-perf|sanitize (see the header)" >&2
    exit 2
    ;;
esac
