#!/usr/bin/env bash
# Stops fuyou-train with SIGINT or SIGTERM at random instants (start-up, steps, validation,
# checkpoint writes, the final write) while other processes load the CPU, and resumes it from
# whatever is on disk, in four engines: in memory with runtime.threads 1 and 2, offloaded
# (weights, optimizer state and activations on SSD) and cpu-streams. Every stopped run must
# exit 128 + its signal (0 when it had already finished) and leave either a resumable
# checkpoint or, stopped before training began, its run directory as it found it (so the same
# command runs again); the chain of resumes must end with the uninterrupted run's weights, bit
# for bit, and nothing left behind (temporary files, staging directories, SSD store files).
# First, every thread of a training process must block both signals (include/fuyou/stop.h).
#
#   tools/signal-storm.sh BUILD_DIR WORK_DIR [SIGNALS [LOAD]]   # ctest: 60 signals, 2 loaders
#
# SIGNALS are shared out over the four engines; LOAD busy processes run beside. It prints one
# line per signal (engine, signal, the phase the run said it was stopping in, exit status) and
# per engine a count by phase. docs/robustness.md has the figures of a long run.
set -euo pipefail

build=$(cd "$1" && pwd)
work=$2
signals=${3:-60}
load=${4:-2}
train=$build/fuyou-train
rm -rf "$work"
mkdir -p "$work/ssd"
work=$(cd "$work" && pwd)

fail() { echo "signal-storm: FAILED: $*" >&2; exit 1; }

loaders=()
stop_loaders() { for p in "${loaders[@]}"; do kill "$p" 2> /dev/null || true; done; }
trap stop_loaders EXIT
for _ in $(seq 1 "$load"); do
  (while :; do :; done) &
  loaders+=($!)
done

for i in $(seq 1 400); do
  echo "line $i: the quick brown fox jumps over the lazy dog; all that glitters is not gold."
done > "$work/corpus.txt"
cat > "$work/config.yaml" <<EOF
model: {n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 256, seq_len: 64}
data: {text: [$work/corpus.txt], val_fraction: 0.1}
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: 1.0}
schedule: {steps: 16, warmup_steps: 3, micro_batch: 8, grad_accum: 2, eval_every: 8, eval_batches: 40, log_every: 1}
runtime: {backend: cpu, threads: 2, seed: 3}
checkpoint: {every_steps: 4, keep: 2}
EOF

has_checkpoint() { compgen -G "$1/checkpoints/step-*/manifest.json" > /dev/null; }

# Starts a run (resumed when it has a checkpoint, else the same fresh command) in the
# background; sets $pid. Its output goes to $run.log.N.
start() {
  local run=$1 log=$2; shift 2
  if has_checkpoint "$run"; then
    "$train" --resume "$run" "$@" > "$log" 2>&1 &
  else
    "$train" --config "$work/config.yaml" --run-dir "$run" "$@" > "$log" 2>&1 &
  fi
  pid=$!
}

# The phase a stopped run was in, from the line its first signal printed.
phase_of() {
  case "$(grep -m1 -o 'fuyou: SIG[A-Z]*: .*' "$1" || true)" in
    *"before training begins"*) echo start-up ;;
    *"validation pass is cut short"*) echo validation ;;
    *"once this checkpoint is written"*) echo checkpoint ;;
    *"once the final weights are written"*) echo final-write ;;
    *"after this step"*) echo step ;;
    *": stopped") echo at-once ;;  # before the run could stop gracefully (arguments, config)
    *) echo after-exit ;;
  esac
}

leftovers() {  # what a finished run must not hold
  local run=$1
  ls -A "$run" | grep -E '\.tmp$|^\.data-staging-' || true
  ls -A "$run/checkpoints" 2> /dev/null | grep -v -E '^(latest|step-[0-9]+)$' || true
  ls -A "$work/ssd"
}

# Every thread of a training process blocks SIGINT (bit 2 of SigBlk) and SIGTERM (bit 15).
check_thread_masks() {
  local run=$work/masks
  "$train" --config "$work/config.yaml" --run-dir "$run" --set runtime.threads=2 --set schedule.steps=400 \
    > "$run.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q '"loss"' "$run/metrics.jsonl" 2> /dev/null && break
    sleep 0.05
  done
  local tasks=0 open=""
  for status in /proc/"$pid"/task/*/status; do
    local mask
    mask=$(awk '/^SigBlk:/ {print $2}' "$status" 2> /dev/null) || continue
    [ -n "$mask" ] || continue
    tasks=$((tasks + 1))
    (( (0x$mask & 0x4002) == 0x4002 )) || open="$open $(basename "$(dirname "$status")")"
  done
  kill -INT "$pid"
  local st=0
  wait "$pid" || st=$?
  [ -z "$open" ] || fail "threads of a training process that do not block SIGINT and SIGTERM:$open (of $tasks)"
  [ "$st" -eq 130 ] || fail "the thread-mask run exited $st after SIGINT: $(tail -3 "$run.log")"
  echo "signal-storm: all $tasks threads of a training process block SIGINT and SIGTERM"
}

# Whether metrics.jsonl has a training line of a step above $2 (the step the run resumed at),
# one of the steps $3 when given (comma-separated; 0: any).
trained_past() {
  [ -f "$1/metrics.jsonl" ] || return 1
  awk -v at="$2" -v steps=",$3," '/"loss"/ && match($0, /"step":[0-9]+/) {
      s = substr($0, RSTART + 7, RLENGTH - 7) + 0
      if (s > at && (steps == ",0," || index(steps, "," s ","))) found = 1
    } END { exit !found }' "$1/metrics.jsonl"
}

# A random number of seconds below $1 milliseconds.
random_s() { printf '0.%03d' $((RANDOM % $1)); }

# Returns once the run (pid $3) is in phase $2, plus a random part of it; at once if it ends.
wait_for() {
  local run=$1 target=$2 p=$3 at=0 delay
  has_checkpoint "$run" && at=$(tr -dc 0-9 < "$run/checkpoints/latest")
  delay=$(random_s 20)
  for _ in $(seq 1 4000); do
    kill -0 "$p" 2> /dev/null || return 0
    case $target in
      start-up) sleep "$(random_s 250)"; return 0 ;;
      step) trained_past "$run" "$at" 0 && { sleep "$delay"; return 0; } ;;
      validation) trained_past "$run" "$at" 8,16 && { sleep "$delay"; return 0; } ;;
      checkpoint) compgen -G "$run/checkpoints/.staging-*" > /dev/null && return 0 ;;
      final-write) [ -d "$run/checkpoints/step-16" ] && { sleep "$delay"; return 0; } ;;
    esac
    sleep 0.003
  done
}

storm() {  # $1: engine name, $2: signals, rest: --set options
  local name=$1 quota=$2; shift 2
  local run=$work/$name ref=$work/$name-ref
  "$train" --config "$work/config.yaml" --run-dir "$ref" "$@" > "$ref.log" 2>&1 || fail "$name: reference run: $(tail -3 "$ref.log")"
  # Each signal aims at one phase in turn (start-up, a step, validation, a checkpoint write,
  # the final write): it waits for what shows that the run is in it (a metrics line, a staging
  # directory) and then for a random part of it, so every phase is hit whatever the machine's
  # speed; what the run says when the signal lands is what is counted.
  local sent=0 n=0 finished=0
  local targets=(start-up step validation checkpoint final-write)
  declare -A by_phase=()
  while [ "$sent" -lt "$quota" ]; do
    n=$((n + 1))
    local log=$run.log.$n sig status=0 want phase target=${targets[$(( (sent + n) % 5 ))]}
    start "$run" "$log" "$@"
    wait_for "$run" "$target" "$pid"
    sig=$( ((RANDOM % 2)) && echo INT || echo TERM)
    want=$((128 + $(kill -l "$sig")))
    if kill "-$sig" "$pid" 2> /dev/null; then
      sent=$((sent + 1))
      wait "$pid" || status=$?
      phase=$(phase_of "$log")
      [ "$status" -eq "$want" ] || [ "$status" -eq 0 ] ||
        fail "$name: SIG$sig ($phase): exit status $status, expected $want: $(tail -3 "$log")"
      [ "$status" -ne 0 ] || phase=after-exit
      by_phase[$phase]=$(( ${by_phase[$phase]:-0} + 1 ))
      echo "signal-storm: $name: signal $sent/$quota SIG$sig in $phase: exit $status"
    else
      wait "$pid" || status=$?
      [ "$status" -eq 0 ] || fail "$name: a run ended on its own with status $status: $(tail -3 "$log")"
    fi
    if grep -q "done: 16 steps" "$log"; then  # finished (possibly signalled in its final write)
      cmp -s "$ref/model.safetensors" "$run/model.safetensors" || fail "$name: final weights differ from the uninterrupted run's"
      [ -z "$(leftovers "$run")" ] || fail "$name: leftovers after finishing: $(leftovers "$run")"
      finished=$((finished + 1))
      rm -rf "$run"
    elif has_checkpoint "$run"; then
      local latest
      latest=$(cat "$run/checkpoints/latest")
      [ -f "$run/checkpoints/$latest/manifest.json" ] || fail "$name: latest names '$latest', not a complete checkpoint"
    elif [ -e "$run" ] && [ -n "$(ls -A "$run")" ]; then
      fail "$name: stopped before training, but $run holds $(ls -A "$run")"
    fi
  done
  start "$run" "$run.log.final" "$@"
  wait "$pid" || fail "$name: the final run failed: $(tail -5 "$run.log.final")"
  cmp -s "$ref/model.safetensors" "$run/model.safetensors" || fail "$name: final weights differ from the uninterrupted run's"
  [ -z "$(leftovers "$run")" ] || fail "$name: leftovers: $(leftovers "$run")"
  local summary=""
  for p in at-once start-up step validation checkpoint final-write after-exit; do summary="$summary $p ${by_phase[$p]:-0}"; done
  echo "signal-storm: $name: $sent signals ($summary; $finished chains finished): every exit 130/143 (0 when finished), every stop resumable, final weights equal the uninterrupted run's"
}

start_s=$(date +%s)
check_thread_masks
per=$(( (signals + 3) / 4 ))
offload=(--set "offload.ssd_paths=[$work/ssd]" --set offload.weights=ssd --set offload.optimizer_state=ssd
         --set offload.activations=swap)
storm mem1 "$per" --set runtime.threads=1
storm mem2 "$per" --set runtime.threads=2
storm off "$per" "${offload[@]}"
storm streams "$per" --set runtime.backend=cpu-streams
echo "signal-storm: $((4 * per)) signals in $(( $(date +%s) - start_s )) s with $load busy processes beside"
rm -rf "$work"
