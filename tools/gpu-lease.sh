#!/usr/bin/env bash
# One GPU lease (docs/cuda.md, "A lease"): 15 minutes of device time for the whole session, a
# machine's start-up included, at most 10 minutes a command. This is the plan for it: two calls,
# most valuable first, each under 9 minutes, 13 minutes in all with the start-up, so that a
# failed call leaves time to rerun the shorter one.
#
#   call-1: correctness of every CUDA path never run on a GPU (the CUDA test binaries: the
#           qk_norm kernels, RoPE from a RopeTable, the 16-byte-vector SwiGLU / RoPE / RMSNorm,
#           cuDNN, the scheduler), then four Llama-3-8B-shaped layers with the 128k head at
#           sequence 4096 and 8192.
#   call-2: the fair GPT-2 pair (the engine, the PyTorch peer with a padded vocabulary and the
#           loss compiled with the model, the engine again) and the GEMM bench with random
#           operands on both sides.
# Not in these 13 minutes: the 6.7B spin/block pair and R1/R2 (each minutes long), the
# sanitizers (below, for a lease with time left).
#
# Here (CUDA toolkit, no GPU needed), at the commit to measure:
#   bash tools/gpu-validate.sh --prepare
#   bash tools/gpu-lease.sh plan       # the plan and its sums; tests/gpu_lease_budget.sh checks them
# Then through the device tool, from the repository root:
#   bash tools/gpu-lease.sh call-1     (timeout_s: call-1's in `plan`, carry gpu-kit)
#   bash tools/gpu-lease.sh call-2     (timeout_s: call-2's, carry gpu-kit and gpu-lease-carry)
# Each call writes under $OUT (else gpu-lease-out) three files, within what comes back from a
# call (at most 8 files, 16 MiB each): CALL.tar.xz (every phase's report.json, summary.md,
# log.txt and the rest of its output), CALL-summary.md (the phases' summaries) and, from a call
# that profiled, this-gpu.yaml. Put that file in gpu-lease-carry/ (git-ignored) before the next
# call: a call reads gpu-lease-carry/this-gpu.yaml as the measured profile where it is there.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The budget, in seconds. The start-up is the device machine's (minutes, by the device
# tool's notes); the overheads are each phase's unpacking of the kit and its report, and each
# call's packing.
lease_s=780
startup_s=150
call_max_s=540
phase_overhead_s=15
call_overhead_s=15

# The plan: one line per phase, "CALL PHASE PHASE_S STEP=LIMIT ...", the steps in the order
# they run (tools/gpu-validate.sh's order within the phase). The limits are about 3-10 times
# what the step took on the H200 leases (docs/cuda.md's table), so a hang costs its limit, not
# the call.
plan() {
  cat <<'EOF'
call-1 check 140 device=10 libraries=10 cuda-kernels=25 cuda-fixtures=15 cuda-families=15 cuda-large-index=10 cuda-scheduler=25 cuda-cudnn=30
call-1 perf 150 bench-llama3-8b-4l-4k=70 bench-llama3-8b-4l-8k=80
call-2 perf 230 bench-gpt2-bf16-tensors=20 torch-peer-gpt2=150 bench-gpt2-bf16-tensors-again=20 gemm-cublaslt-gpt2=40
EOF
}

# A call's time limit: its phases and their overheads, and its own overhead.
call_limit() {  # CALL
  plan | awk -v c="$1" -v po="$phase_overhead_s" -v co="$call_overhead_s" \
    '$1 == c { s += $3 + po } END { print s + co }'
}

calls() { plan | awk '{ print $1 }' | uniq; }

show_plan() {
  local c total=$startup_s
  echo "lease ${lease_s} s: start-up ${startup_s} s, calls at most ${call_max_s} s each"
  for c in $(calls); do
    echo "$c: timeout_s $(call_limit "$c")"
    plan | awk -v c="$c" '$1 == c { s = 0; for (i = 4; i <= NF; ++i) { split($i, kv, "="); s += kv[2] }
      printf "  %s %s s (steps %s s): %s\n", $2, $3, s, substr($0, index($0, $4)) }'
    total=$((total + $(call_limit "$c")))
  done
  echo "total with start-up: ${total} s of ${lease_s}"
}

run_call() {  # CALL
  local call=$1 out=${OUT:-gpu-lease-out} stage
  [ -n "$(plan | awk -v c="$call" '$1 == c')" ] || { echo "gpu-lease: no call '$call' (see plan)" >&2; exit 2; }
  stage=$(mktemp -d "${TMPDIR:-/tmp}/gpu-lease.XXXXXX")
  [ -f gpu-lease-carry/this-gpu.yaml ] && export FUYOU_GPU_PROFILE="$PWD/gpu-lease-carry/this-gpu.yaml"
  local rc=0 phase phase_s steps only limits
  while read -r _ phase phase_s steps; do
    only=$(echo "$steps" | tr ' ' '\n' | cut -d= -f1 | paste -sd, -)
    limits=$(echo "$steps" | tr ' ' ',')
    # The console too: a phase that stops before its report (no GPU, no kit) says why there.
    FUYOU_GPU_PHASE_S=$phase_s bash tools/gpu-validate.sh --kit gpu-kit --phase "$phase" \
      --only "$only" --limits "$limits" --out "$stage/$phase" 2>&1 | tee "$stage/$phase-console.txt" || rc=1
  done < <(plan | awk -v c="$call" '$1 == c')
  mkdir -p "$out"
  # What comes back: one archive (the traces left out if it would pass 15 MiB), the summaries,
  # and the profile to carry.
  for p in "$stage"/*/this-gpu.yaml; do [ -f "$p" ] && cp "$p" "$out/this-gpu.yaml"; done
  for c in "$stage"/*-console.txt; do
    local s=${c%-console.txt}/summary.md
    echo "## ${c#"$stage"/}"
    if [ -f "$s" ]; then cat "$s"; else tail -n 20 "$c"; fi
    echo
  done > "$out/$call-summary.md"
  XZ_OPT=-6 tar -C "$stage" -cJf "$out/$call.tar.xz" . || rc=1
  if [ "$(stat -c %s "$out/$call.tar.xz")" -gt $((15 << 20)) ]; then
    XZ_OPT=-6 tar -C "$stage" --exclude='trace-*' --exclude='*.csv' -cJf "$out/$call.tar.xz" . || rc=1
  fi
  rm -rf "$stage"
  return $rc
}

case "${1:-}" in
  plan) show_plan ;;
  plan-table) plan ;;
  budget) echo "$lease_s $startup_s $call_max_s $phase_overhead_s $call_overhead_s" ;;
  call-*) run_call "$1" ;;
  sanitize)
    # Outside the two-call plan, for a lease with time left: racecheck, synccheck and
    # initcheck with a phase's full time.
    FUYOU_GPU_PHASE_S=560 bash tools/gpu-validate.sh --kit gpu-kit --phase sanitize --out "${OUT:-gpu-lease-out}/s"
    ;;
  *)
    echo "usage: bash tools/gpu-lease.sh plan|call-1|call-2|sanitize (see the header)" >&2
    exit 2
    ;;
esac
