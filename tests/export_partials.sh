#!/usr/bin/env bash
# An export killed before its final rename leaves OUT.partial-PID: the next fuyou-convert to
# the same OUT removes it, saying what it held, and leaves alone (naming it) one that a
# running fuyou-convert is still writing.
#   export_partials.sh BIN_DIR WORK_DIR
set -euo pipefail
bin=$1 work=$2
fail() { echo "FAILED: $*" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work/text"
for i in $(seq 200); do echo "the quick brown fox jumps over the lazy dog $i"; done > "$work/text/a.txt"
"$bin/fuyou-train" --run-dir "$work/run" --set model.n_layer=2 --set model.n_head=2 \
  --set model.d_model=32 --set model.d_ff=64 --set model.seq_len=32 --set "data.text=[$work/text]" \
  --set schedule.steps=2 --set schedule.warmup_steps=1 --set schedule.micro_batch=2 \
  --set schedule.eval_batches=1 --set runtime.backend=cpu --set runtime.threads=2 2> "$work/train.log" ||
  fail "training: $(tail -3 "$work/train.log")"
out=$work/hf
# Two interrupted exports (PIDs that no longer run), and one a running fuyou-convert holds (a
# copy of sleep under that name).
mkdir -p "$out.partial-999999" "$out.partial-999998/sub"
head -c 4096 /dev/zero > "$out.partial-999999/model.safetensors.tmp"
echo '{}' > "$out.partial-999998/sub/config.json"
cp "$(command -v sleep)" "$work/fuyou-convert"
"$work/fuyou-convert" 60 &
holder=$!
trap 'kill $holder 2> /dev/null || true' EXIT
mkdir -p "$out.partial-$holder" && echo x > "$out.partial-$holder/a"
"$bin/fuyou-convert" to-hf "$work/run" --out "$out" 2> "$work/convert.log" ||
  fail "to-hf: $(tail -3 "$work/convert.log")"
[ -f "$out/config.json" ] || fail "no export in $out"
for pid in 999999 999998; do
  [ ! -e "$out.partial-$pid" ] || fail "$out.partial-$pid was not removed"
done
grep -q "hf.partial-999999: removed, left by an interrupted conversion (PID 999999, 1 files, 4.00 KiB)" "$work/convert.log" ||
  fail "the removal was not said: $(grep partial "$work/convert.log")"
[ -d "$out.partial-$holder" ] || fail "the partial output of a running fuyou-convert was removed"
grep -q "hf.partial-$holder: 1 files, .*being written by fuyou-convert (PID $holder), which is still running" "$work/convert.log" ||
  fail "the partial output in use was not named: $(grep partial "$work/convert.log")"
echo "export partials: 2 interrupted exports removed, 1 in use named and kept"
