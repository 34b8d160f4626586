#!/usr/bin/env bash
# fuyou-train's job-scheduler and planning conveniences (and fuyou-plot's picture of the runs
# they make), and the flags the configs' comments name, against the real binaries:
#   tool_usability.sh resume-or-start BIN_DIR WORK_DIR
#   tool_usability.sh dry-run BIN_DIR SOURCE_DIR
#   tool_usability.sh config-flags SOURCE_DIR
set -euo pipefail
mode=$1
fail() { echo "FAILED: $*" >&2; exit 1; }

case $mode in
resume-or-start)
  bin=$2 work=$3
  rm -rf "$work" && mkdir -p "$work/text"
  for i in $(seq 200); do echo "the quick brown fox jumps over the lazy dog $i"; done > "$work/text/a.txt"
  run=$work/run
  tiny=(--set model.n_layer=2 --set model.n_head=2 --set model.d_model=32 --set model.d_ff=64
        --set model.seq_len=32 --set "data.text=[$work/text]" --set schedule.warmup_steps=1
        --set schedule.micro_batch=2 --set schedule.eval_batches=1 --set checkpoint.every_steps=2
        --set runtime.backend=cpu --set runtime.threads=2)
  # No directory yet: a new run.
  "$bin/fuyou-train" --resume-or-start --run-dir "$run" "${tiny[@]}" --set schedule.steps=4 2> "$work/1.log" ||
    fail "first --resume-or-start: $(tail -3 "$work/1.log")"
  grep -q "has no checkpoint; starting a new run" "$work/1.log" || fail "the first call did not start a new run"
  [ "$(cat "$run/checkpoints/latest")" = step-4 ] || fail "no checkpoint at step 4"
  # The same command again, asked to go further: it resumes.
  "$bin/fuyou-train" --resume-or-start --run-dir "$run" "${tiny[@]}" --set schedule.steps=6 2> "$work/2.log" ||
    fail "second --resume-or-start: $(tail -3 "$work/2.log")"
  grep -q "has a checkpoint; resuming" "$work/2.log" || fail "the second call did not resume"
  grep -q "resumed from .*step-4" "$work/2.log" || fail "the second call did not resume from step 4"
  python3 -c "import json,sys; s=json.load(open('$run/summary.json')); sys.exit(0 if s['steps']==6 and s['start_step']==4 else 1)" ||
    fail "summary.json: $(cat "$run/summary.json")"
  # Without --run-dir it is refused.
  if "$bin/fuyou-train" --resume-or-start "${tiny[@]}" 2> "$work/3.log"; then fail "--resume-or-start without --run-dir ran"; fi
  grep -q -- "--resume-or-start takes --run-dir" "$work/3.log" || fail "unclear refusal: $(cat "$work/3.log")"
  # A run killed (SIGKILL) before its first checkpoint (every 30 minutes): the same command
  # starts over in its directory, keeping the old metrics aside.
  killed=$work/killed
  "$bin/fuyou-train" --resume-or-start --run-dir "$killed" "${tiny[@]}" --set schedule.steps=100000 \
    --set checkpoint.every_steps=0 --set checkpoint.every_minutes=30 2> "$work/k1.log" &
  pid=$!
  for _ in $(seq 600); do grep -qs '"loss"' "$killed/metrics.jsonl" && break; sleep 0.1; done
  kill -9 $pid && wait $pid || true
  grep -qs '"loss"' "$killed/metrics.jsonl" || fail "the run to kill logged no step: $(tail -3 "$work/k1.log")"
  ! ls "$killed/checkpoints" 2> /dev/null | grep -q step- || fail "the killed run had a checkpoint"
  cp "$killed/metrics.jsonl" "$work/killed-metrics.jsonl"
  # --resume names the command that restarts it.
  if "$bin/fuyou-train" --resume "$killed" 2> "$work/k-resume.log"; then fail "--resume of a run without a checkpoint ran"; fi
  grep -q -- "start it over in its directory with fuyou-train --resume-or-start --run-dir $killed" "$work/k-resume.log" ||
    fail "--resume does not name --resume-or-start: $(cat "$work/k-resume.log")"
  "$bin/fuyou-train" --resume-or-start --run-dir "$killed" "${tiny[@]}" --set schedule.steps=4 2> "$work/k2.log" ||
    fail "the rerun of a run killed before its first checkpoint: $(tail -3 "$work/k2.log")"
  grep -q "only the files of a run killed before its first one: starting over in it" "$work/k2.log" ||
    fail "the rerun did not say it starts over"
  cmp -s "$killed"/restarted-*/metrics.jsonl "$work/killed-metrics.jsonl" || fail "the old metrics were not kept aside"
  [ "$(cat "$killed/checkpoints/latest")" = step-4 ] || fail "the restarted run has no checkpoint at step 4"
  # Each run directory draws its curves; fuyou-plot draws runs together, one colour each.
  grep -q "<polyline" "$run/curves.svg" || fail "no curves in $run/curves.svg"
  "$bin/fuyou-plot" "$run" "$killed/metrics.jsonl" --out "$work/runs.svg" 2> "$work/plot.log" ||
    fail "fuyou-plot: $(cat "$work/plot.log")"
  grep -q ">run</text>" "$work/runs.svg" && grep -q ">killed</text>" "$work/runs.svg" ||
    fail "runs.svg does not name both runs"
  echo "resume-or-start: starts, then resumes from the latest checkpoint; a run killed before its first starts over"
  ;;
dry-run)
  bin=$2 src=$3
  tiny=(--set model.n_layer=2 --set model.n_head=2 --set model.d_model=32 --set model.d_ff=64
        --set model.seq_len=32 --set runtime.backend=cpu)
  out=$("$bin/fuyou-train" --dry-run "${tiny[@]}" --set "offload.hardware=$src/configs/hardware/this-cpu.yaml") ||
    fail "a tiny model does not fit? $out"
  echo "$out"
  grep -q "verdict: fits this machine" <<< "$out" || fail "no verdict"
  grep -q "time: a step .* s on .*an epoch" <<< "$out" || fail "no step and epoch time"
  # Llama-3-8B trained in memory on the CPU needs 16 bytes a parameter of host memory.
  set +e
  out=$("$bin/fuyou-train" --dry-run --config "$src/configs/llama3-8b.yaml" --set runtime.backend=cpu)
  rc=$?
  set -e
  echo "$out"
  # 3: does not fit; 1: the run would be refused before that (its run directory's disk is too
  # small for the checkpoints on this machine), and the memory findings are still reported.
  [ $rc = 3 ] || { [ $rc = 1 ] && grep -q "^refused: run directory .*: needs" <<< "$out"; } ||
    fail "exit status $rc for a run that does not fit (expected 3, or 1 refused for disk space)"
  grep -q "host memory: needs .*DOES NOT FIT" <<< "$out" || fail "the host memory finding is missing"
  ;;
config-flags)
  src=$2
  # Every --flag a config's comment names is an option of one of the tools (the C++ mains and
  # the scripts in tools/).
  flags=$(grep -ho '#.*' "$src"/configs/*.yaml "$src"/configs/hardware/*.yaml | grep -o -- '--[a-z][a-z-]*' | sort -u)
  for f in $flags; do
    grep -rqw -- "$f" "$src"/tools || fail "a config's comment names $f, which no tool has"
  done
  echo "flags named in configs' comments: $(echo $flags)"
  ;;
*) fail "unknown mode $mode" ;;
esac
