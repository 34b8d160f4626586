#!/usr/bin/env bash
# Kills fuyou-train with SIGKILL at random instants and resumes it from whatever is on disk,
# in memory and offloaded (weights, optimizer state and activations on SSD), then requires
# the final weights and every logged loss to equal an uninterrupted run's bit for bit, every
# step logged exactly once, and the SSD directories empty.
#
#   tools/crash-torture.sh BUILD_DIR WORK_DIR [KILLS_PER_ENGINE [STEPS [STATE MASTER [BEST [EVERY [DATA]]]]]]
#   tools/crash-torture.sh BUILD_DIR WORK_DIR signals                      # SIGINT/SIGTERM/2x SIGINT
#   tools/crash-torture.sh BUILD_DIR WORK_DIR generate [STOPS]             # fuyou-generate, streamed
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
# DATA (default text: plain text, windows at random) is `records` (JSON Lines text, tokenized
# by fuyou-convert tokenize --jsonl-field into records with an index) or `chat` (conversations
# tokenized with --chat-field through the shipped Qwen2.5 chat template, loss masks over the
# assistant turns); both train under schedule.epochs, STEPS then being the number of epochs, so
# most kills land mid-epoch and the resume must continue the epoch's record order exactly.
#
# generate: fuyou-generate --input with --stream-layers always, stopped STOPS times (default 12)
# at random instants by SIGKILL, SIGINT or SIGTERM in turn: the --output file must never exist
# unless complete (equal to an uninterrupted run's), a stop signal must exit 128 + signal
# leaving no OUTPUT.partial, and what a SIGKILL leaves in OUTPUT.partial is whole lines of the
# uninterrupted output, in order, and at most a torn last line.
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
data=${9:-text}
fixtures=$(cd "$(dirname "$0")/../tests/reference/fixtures" && pwd)
tensors=fp32
[ "$master" == split ] && tensors=bf16
train=$build/fuyou-train
rm -rf "$work"
mkdir -p "$work/ssd0" "$work/ssd1"
work=$(cd "$work" && pwd)

for i in $(seq 1 400); do
  echo "line $i: the quick brown fox jumps over the lazy dog; all that glitters is not gold."
done > "$work/corpus.txt"
model="model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 32}"
data_keys="data: {text: [$work/corpus.txt], val_fraction: 0.1}"
length="steps: $steps"
if [ "$data" == records ] || [ "$data" == chat ]; then
  # A byte-level BPE tokenizer of 512 tokens; chat with the shipped Qwen2.5 template.
  mkdir -p "$work/tok"
  cp "$fixtures/hf/tok_bytelevel.json" "$work/tok/tokenizer.json"
  python3 - "$work" "$data" "$fixtures/chat_templates/qwen2.5-instruct.jinja" <<'PY'
import json, random, sys
work, kind, template = sys.argv[1:]
rng = random.Random(54)
words = "the quick brown fox jumps over the lazy dog all that glitters is not gold".split()
with open(work + "/data.jsonl", "w") as f:
    for i in range(240 if kind == "records" else 160):
        if kind == "records":
            rec = {"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))}
        else:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            rec = {"messages": [{"role": "system", "content": "Add."},
                                {"role": "user", "content": "%d+%d" % (a, b)},
                                {"role": "assistant", "content": str(a + b)}]}
        f.write(json.dumps(rec) + "\n")
if kind == "chat":
    with open(work + "/tok/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": open(template).read()}, f)
PY
  field=(--jsonl-field text)
  [ "$data" == chat ] && field=(--chat-field messages)
  "$build/fuyou-convert" tokenize --tokenizer "$work/tok/tokenizer.json" "$work/data.jsonl" \
    --out "$work/data" "${field[@]}" --val-fraction 0.1 > "$work/tokenize.log" 2>&1 ||
    { echo "crash-torture: tokenize failed: $(tail -3 "$work/tokenize.log")" >&2; exit 1; }
  seq_len=32
  [ "$data" == chat ] && seq_len=96  # a conversation is 60-83 tokens
  model="model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 512, seq_len: $seq_len}"
  data_keys="data: {train_shards: [$work/data/train.tok], val_shards: [$work/data/val.tok]}"
  length="epochs: $steps"
fi
cat > "$work/config.yaml" <<EOF
$model
$data_keys
optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: 1.0, state: $state, master: $master}
schedule: {$length, warmup_steps: 5, micro_batch: 4, grad_accum: 2, eval_every: 20, eval_batches: 2, log_every: 1}
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
  local t0 t1 dt killed=0 finished=0 in_ckpt=0 mid_epoch=0 total
  total=$(losses "$ref" | wc -l)
  damaged=0
  t0=$(date +%s.%N)
  if [ "$data" == text ]; then
    "$train" --resume "$ref" --run-dir "$work/$name-time" --set "schedule.steps=$((steps + 1))" "$@" > /dev/null 2>&1 || true
  else  # under schedule.epochs: the uninterrupted run resumed from its older checkpoint
    "$train" --resume "$ref/checkpoints/$(ls "$ref/checkpoints" | grep -E '^step-[0-9]+$' | sort -t- -k2 -n | head -1)" \
      --run-dir "$work/$name-time" "$@" > /dev/null 2>&1 || true
  fi
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
      # Records: a checkpoint between epoch ends (of `total` steps over `steps` epochs).
      if [ "$data" != text ] && [ "$at" != none ] && [ "$at" != "?" ] &&
         [ $(( ${at#step-} * steps % total )) -ne 0 ]; then mid_epoch=$((mid_epoch + 1)); fi
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
  local records=""
  [ "$data" != text ] && records=", $mid_epoch resumed mid-epoch ($data, $steps epochs of $((total / steps)) steps)"
  echo "crash-torture: $name: $killed kills ($in_ckpt while writing a checkpoint, $restarts before the first one restarted in place, $finished runs finished first$records): final weights and all $total losses equal the uninterrupted run's; SSD directories empty$best"
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

# fuyou-generate --input, streamed layers, stopped at random instants (see the top).
generate() {
  local stops=$1 gen_model=$work/gen-model
  "$train" --config "$work/config.yaml" --run-dir "$gen_model" --set schedule.steps=10 \
    --set checkpoint.every_steps=0 --set model.n_layer=4 --set model.d_model=256 --set model.n_head=4 \
    --set model.d_ff=1024 --set model.seq_len=128 > "$work/gen-model.log" 2>&1 || fail "training the model: $(tail -3 "$work/gen-model.log")"
  for i in $(seq 1 12); do echo "{\"id\": $i, \"prompt\": \"line $i: the quick\"}"; done > "$work/prompts.jsonl"
  local gen=("$build/fuyou-generate" --model "$gen_model" --input "$work/prompts.jsonl" --stream-layers always
             --max-new-tokens 96 --ignore-eos --backend cpu --set runtime.threads=2)
  local ref=$work/gen-ref.jsonl out=$work/gen-out.jsonl t0 t1 dt
  t0=$(date +%s.%N)
  "${gen[@]}" --output "$ref" > "$work/gen-ref.log" 2>&1 || fail "generate: $(tail -3 "$work/gen-ref.log")"
  t1=$(date +%s.%N)
  grep -q "layers streamed from host memory" "$work/gen-ref.log" || fail "generate: the layers were not streamed"
  dt=$(python3 -c "print(max(0.3, ($t1 - $t0) * 0.9))")
  local sigs=(KILL INT TERM) k sig status want done_n finished=0 torn=0 partials=0 stopped=0 tally=""
  for k in $(seq 1 "$stops"); do
    sig=${sigs[$(((k - 1) % 3))]}
    rm -f "$out" "$out.partial"
    t0=$(date +%s.%N)
    "${gen[@]}" --output "$out" > "$work/gen.log" 2>&1 &
    pid=$!
    sleep "$(python3 -c "import random; print(round(random.uniform(0.02, $dt), 3))")"
    status=0
    if kill "-$sig" "$pid" 2> /dev/null; then
      wait "$pid" 2> /dev/null || status=$?
    else
      wait "$pid" || fail "generate: a run ended on its own with status $?: $(tail -3 "$work/gen.log")"
    fi
    done_n=$(grep -c -E '\] [0-9]+/12: prompt' "$work/gen.log" || true)
    if [ "$status" -eq 0 ]; then  # it finished before the signal reached it
      finished=$((finished + 1))
      cmp -s "$out" "$ref" || fail "generate: a finished run's output differs from the uninterrupted run's"
      # The machine got faster (a build beside it ended): aim within this run's time.
      dt=$(python3 -c "print(max(0.3, min($dt, ($(date +%s.%N) - $t0) * 0.9)))")
      echo "crash-torture: generate: SIG$sig $k/$stops came after the run finished"
      continue
    fi
    want=$((128 + $(kill -l "$sig")))
    [ "$status" -eq "$want" ] || fail "generate: SIG$sig: exit status $status, expected $want: $(tail -3 "$work/gen.log")"
    stopped=$((stopped + 1))
    # OUTPUT exists only complete: renamed, then stopped before exiting.
    if [ -e "$out" ]; then cmp -s "$out" "$ref" || fail "generate: SIG$sig left $out, which is not the whole output"; fi
    if [ -e "$out.partial" ]; then
      [ "$sig" == KILL ] || fail "generate: SIG$sig left $out.partial ($(wc -l < "$out.partial") lines)"
      partials=$((partials + 1))
      python3 - "$out.partial" "$ref" <<'PY' || fail "generate: $out.partial is not a prefix of the output"
import sys
part, ref = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
whole = part[:part.rfind(b"\n") + 1]
sys.exit(0 if ref.startswith(whole) and len(part) < len(ref) + 1 else 1)
PY
      [ "$(tail -c1 "$out.partial" | od -An -c | tr -d ' ')" == '\n' ] || [ ! -s "$out.partial" ] || torn=$((torn + 1))
    fi
    tally="$tally $sig@$done_n"
    echo "crash-torture: generate: SIG$sig $k/$stops after $done_n of 12 prompts: exit $status$( [ -e "$out.partial" ] && echo ", $out.partial holds $(wc -l < "$out.partial") whole lines")"
  done
  rm -f "$out" "$out.partial"
  "${gen[@]}" --output "$out" > "$work/gen.log" 2>&1 || fail "generate: the last run failed: $(tail -3 "$work/gen.log")"
  cmp -s "$out" "$ref" || fail "generate: the last run's output differs from the uninterrupted run's"
  echo "crash-torture: generate: $stops stops ($stopped stopped, $finished after the run finished; SIG@prompts done:$tally): OUTPUT never incomplete, no .partial after SIGINT/SIGTERM, $partials SIGKILL partials each a prefix ($torn with a torn last line); the last run equals the uninterrupted one"
}

if [ "$mode" == signals ]; then
  signals
elif [ "$mode" == generate ]; then
  generate "${4:-12}"
else
  start_s=$(date +%s)
  torture mem "$mode"
  torture off "$mode" "${offload[@]}"
  echo "crash-torture: done in $(( $(date +%s) - start_s )) s"
fi
rm -rf "$work"
