#!/usr/bin/env bash
# Kills fuyou-train with SIGKILL at random instants and resumes it from whatever is on disk,
# in memory and offloaded (weights, optimizer state and activations on SSD), then requires
# the final weights and every logged loss to equal an uninterrupted run's bit for bit, every
# step logged exactly once, and the SSD directories empty.
#
#   tools/crash-torture.sh BUILD_DIR WORK_DIR [KILLS_PER_ENGINE [STEPS [STATE MASTER [BEST [EVERY]]]]]
#   tools/crash-torture.sh BUILD_DIR WORK_DIR signals                      # SIGINT/SIGTERM/2x SIGINT
#
# ctest runs 6 kills per engine, and 4 per engine with the optimizer's state packed (STATE
# int8, MASTER split: optimizer.state / optimizer.master, with the bf16 device tensors a split
# master needs).
#
# A run killed before its first checkpoint is restarted as a job scheduler would, with the same
# --resume-or-start command (it starts over in its directory); EVERY (checkpoint.every_steps,
# default 1) set higher puts more kills before the first checkpoint. With BEST keep_best
# (checkpoint.keep 1, checkpoint.keep_best, and a learning rate ten times higher, so that the
# validation loss turns up before the end and the best is not the newest), checkpoints/best is
# damaged at random between kills (removed, garbage, a missing step, a path outside the run,
# the newest checkpoint), and the run must end with the uninterrupted run's best on disk.
#
# The soak (docs/performance.md) is the first form with 25+ kills per engine. It prints one
# line per kill (the step it reached, whether a checkpoint was being written) and a summary.
set -euo pipefail

build=$(cd "$1" && pwd)
work=$2
mode=${3:-6}
steps=${4:-60}
state=${5:-fp32}
master=${6:-fp32}
keep_best=${7:-}
every=${8:-1}
tensors=fp32
[ "$master" == split ] && tensors=bf16
train=$build/fuyou-train
rm -rf "$work"
mkdir -p "$work/ssd0" "$work/ssd1"
work=$(cd "$work" && pwd)

for i in $(seq 1 400); do
  echo "line $i: the quick brown fox jumps over the lazy dog; all that glitters is not gold."
done > "$work/corpus.txt"
cat > "$work/config.yaml" <<EOF
model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 32}
data: {text: [$work/corpus.txt], val_fraction: 0.1}
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: 1.0, state: $state, master: $master}
schedule: {steps: $steps, warmup_steps: 5, micro_batch: 4, grad_accum: 2, eval_every: 20, eval_batches: 2, log_every: 1}
runtime: {backend: cpu, threads: 2, seed: 3, device_tensors: $tensors}
checkpoint: {every_steps: $every, keep: 2}
EOF
if [ "$keep_best" == keep_best ]; then
  sed -i -e "s/keep: 2}/keep: 1, keep_best: true}/" \
    -e "s/lr: 3.0e-3, min_lr: 3.0e-4/lr: 3.0e-2, min_lr: 3.0e-3/" "$work/config.yaml"
fi
offload=(--set "offload.ssd_paths=[$work/ssd0, $work/ssd1]" --set offload.weights=ssd
         --set offload.optimizer_state=ssd --set offload.activations=swap)

fail() { echo "crash-torture: FAILED: $*" >&2; exit 1; }

# (step, loss) of every training line, one per line, in step order.
losses() { python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    if "loss" in r: print(r["step"], repr(r["loss"]))' "$1/metrics.jsonl"; }

# The tensor bytes of a safetensors file (its header holds the run config, which is the same).
same_weights() { cmp -s "$1/model.safetensors" "$2/model.safetensors"; }

ssd_empty() { [ -z "$(ls -A "$work/ssd0")" ] && [ -z "$(ls -A "$work/ssd1")" ]; }

has_checkpoint() { compgen -G "$1/checkpoints/step-*/manifest.json" > /dev/null; }

# Starts a run (fresh, or resumed when a checkpoint exists) in the background; sets $pid.
start() {
  local run=$1; shift
  if has_checkpoint "$run"; then
    "$train" --resume "$run" "$@" >> "$run.log" 2>&1 &
  else
    "$train" --resume-or-start --config "$work/config.yaml" --run-dir "$run" "$@" >> "$run.log" 2>&1 &
  fi
  pid=$!
}

# keep_best: checkpoints/best damaged in one of five ways, or left, at random.
damaged=0
damage_best() {
  local b=$1/checkpoints/best
  [ -d "$1/checkpoints" ] || return 0
  case $((RANDOM % 6)) in
    0) rm -f "$b" ;;
    1) printf '\x01garbage\x1b[31m' > "$b" ;;
    2) echo step-999999 > "$b" ;;
    3) echo ../../elsewhere/checkpoints/step-1 > "$b" ;;
    4) ls "$1/checkpoints" | grep -E '^step-[0-9]+$' | sort -t- -k2 -n | tail -1 > "$b" ;;
    *) return 0 ;;
  esac
  damaged=$((damaged + 1))
}

reference() {  # $1: name, rest: --set options
  local ref=$work/$1-ref; shift
  "$train" --config "$work/config.yaml" --run-dir "$ref" "$@" > "$ref.log" 2>&1 || fail "reference run: $(tail -3 "$ref.log")"
}

torture() {  # $1: name, $2: kills, rest: --set options
  local name=$1 kills=$2; shift 2
  local run=$work/$name ref=$work/$name-ref
  reference "$name" "$@"
  local t0 t1 dt killed=0 finished=0 in_ckpt=0
  damaged=0
  t0=$(date +%s.%N)
  "$train" --resume "$ref" --run-dir "$work/$name-time" --set "schedule.steps=$((steps + 1))" "$@" > /dev/null 2>&1 || true
  t1=$(date +%s.%N)
  rm -rf "$work/$name-time"
  # Kill anywhere in a window as long as one resumed run: start-up, steps, checkpoints.
  dt=$(python3 -c "print(max(0.3, ($t1 - $t0) * 1.5))")
  while [ "$killed" -lt "$kills" ]; do
    start "$run" "$@"
    sleep "$(python3 -c "import random; print(round(random.uniform(0.02, $dt), 3))")"
    if kill -9 "$pid" 2> /dev/null; then
      wait "$pid" 2> /dev/null || true
      killed=$((killed + 1))
      local at=none staging=""
      has_checkpoint "$run" && at=$(cat "$run/checkpoints/latest" 2> /dev/null || echo "?")
      compgen -G "$run/checkpoints/.staging-*" > /dev/null && { staging=" (killed while writing a checkpoint)"; in_ckpt=$((in_ckpt + 1)); }
      echo "crash-torture: $name: kill $killed/$kills, latest checkpoint $at$staging"
      if [ "$keep_best" == keep_best ]; then damage_best "$run"; fi
    else
      wait "$pid" || fail "$name: a run ended on its own with status $?: $(tail -3 "$run.log")"
      finished=$((finished + 1))
      echo "crash-torture: $name: the run finished before the kill; starting it over"
      rm -rf "$run"
    fi
  done
  start "$run" "$@"
  wait "$pid" || fail "$name: the final resume failed: $(tail -5 "$run.log")"
  same_weights "$ref" "$run" || fail "$name: final weights differ from the uninterrupted run's"
  [ "$(losses "$ref")" == "$(losses "$run")" ] || fail "$name: logged losses differ from the uninterrupted run's"
  ssd_empty || fail "$name: SSD directories hold files: $(ls -A "$work/ssd0" "$work/ssd1")"
  [ -z "$(ls -A "$run/checkpoints" | grep -v -E '^(latest|best|step-[0-9]+)$' || true)" ] || fail "$name: leftovers in $run/checkpoints"
  local best=""
  if [ "$keep_best" == keep_best ]; then
    [ "$(cat "$run/checkpoints/best")" == "$(cat "$ref/checkpoints/best")" ] ||
      fail "$name: best is $(cat "$run/checkpoints/best"), the uninterrupted run's $(cat "$ref/checkpoints/best")"
    [ -f "$run/checkpoints/$(cat "$ref/checkpoints/best")/manifest.json" ] || fail "$name: the best checkpoint is gone"
    best="; best $(cat "$ref/checkpoints/best") as uninterrupted, best damaged $damaged times"
  fi
  local restarts
  restarts=$(grep -c "starting over in it" "$run.log" || true)
  echo "crash-torture: $name: $killed kills ($in_ckpt while writing a checkpoint, $restarts before the first one restarted in place, $finished runs finished first): final weights and all $steps losses equal the uninterrupted run's; SSD directories empty$best"
}

# Waits until the run has logged a training step, then sends the signals given.
signal_after_first_step() {
  local run=$1; shift
  for _ in $(seq 1 600); do
    grep -q '"loss"' "$run/metrics.jsonl" 2> /dev/null && break
    sleep 0.05
  done
  for s in "$@"; do
    kill "-$s" "$pid"
    sleep 0.1  # signals of one kind sent back to back may merge into one
  done
}

signals() {
  sed -i "s/every_steps: 1,/every_steps: 0, every_minutes: 1000,/" "$work/config.yaml"
  reference sig "${offload[@]}"
  local status
  for sig in INT TERM; do
    local run=$work/sig-$sig want=$((128 + $(kill -l "$sig")))
    start "$run" "${offload[@]}"
    signal_after_first_step "$run" "$sig"
    status=0; wait "$pid" || status=$?
    [ "$status" -eq "$want" ] || fail "SIG$sig: exit status $status, expected $want: $(tail -3 "$run.log")"
    has_checkpoint "$run" || fail "SIG$sig: no checkpoint written"
    ssd_empty || fail "SIG$sig: SSD directories hold files"
    grep -q "continue with: fuyou-train --resume" "$run.log" || fail "SIG$sig: no resume hint in the log"
    local at; at=$(cat "$run/checkpoints/latest")
    start "$run" "${offload[@]}"
    wait "$pid" || fail "SIG$sig: the resume failed: $(tail -3 "$run.log")"
    same_weights "$work/sig-ref" "$run" || fail "SIG$sig: resumed weights differ from the uninterrupted run's"
    echo "crash-torture: SIG$sig: exit $status after a checkpoint at $at; the resume completes it exactly"
  done
  # Steps long enough (a larger model) that the second signal lands inside the step the
  # first one is waiting for.
  local run=$work/sig-twice
  start "$run" "${offload[@]}" --set model.n_layer=4 --set model.d_model=256 --set model.d_ff=1024 \
    --set model.seq_len=128 --set schedule.micro_batch=8
  signal_after_first_step "$run" INT INT
  status=0; wait "$pid" || status=$?
  [ "$status" -eq 130 ] || fail "second SIGINT: exit status $status, expected 130"
  grep -q "second stop signal: exiting now" "$run.log" || fail "second SIGINT: the run did not stop at once: $(tail -3 "$run.log")"
  ssd_empty || fail "second SIGINT: SSD directories hold files: $(ls -A "$work/ssd0" "$work/ssd1")"
  echo "crash-torture: a second SIGINT exits 130 at once; SSD directories empty"
}

if [ "$mode" == signals ]; then
  signals
else
  start_s=$(date +%s)
  torture mem "$mode"
  torture off "$mode" "${offload[@]}"
  echo "crash-torture: done in $(( $(date +%s) - start_s )) s"
fi
rm -rf "$work"
