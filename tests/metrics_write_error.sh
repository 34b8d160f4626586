#!/usr/bin/env bash
# metrics.jsonl that cannot grow (a file-size limit: writes past it fail with EFBIG) must stop
# the run with an error naming it, never end "done" with lines missing.
#   tests/metrics_write_error.sh FUYOU_TRAIN WORK_DIR
set -uo pipefail
train=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
for i in $(seq 1 200); do echo "line $i: the quick brown fox jumps over the lazy dog."; done > "$work/corpus.txt"
cat > "$work/config.yaml" <<EOC
model: {n_layer: 1, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 16}
data: {text: [$work/corpus.txt], val_fraction: 0.1}
schedule: {steps: 1000, warmup_steps: 2, micro_batch: 2, eval_every: 0, eval_batches: 1, log_every: 1}
runtime: {backend: cpu, threads: 1, seed: 1}
checkpoint: {every_steps: 0, every_minutes: 0}
EOC
# 128 KiB per file: the data shards (~20 KB) and the final weights (~85 KB) fit, the 1000 lines
# of metrics (~150 KB) do not. SIGXFSZ ignored: the write fails with EFBIG instead of killing.
status=0
( trap '' XFSZ; ulimit -f 128; exec "$train" --config "$work/config.yaml" --run-dir "$work/run" ) > "$work/log" 2>&1 || status=$?
lines=$(wc -l < "$work/run/metrics.jsonl" 2> /dev/null || echo 0)
if [ "$status" -eq 0 ]; then
  echo "metrics_write_error: FAILED: the run exited 0 with $lines of 1000 metric lines: $(tail -1 "$work/log")" >&2
  exit 1
fi
grep -q "metrics.jsonl: cannot append" "$work/log" || {
  echo "metrics_write_error: FAILED: exit $status without naming metrics.jsonl: $(tail -2 "$work/log")" >&2
  exit 1
}
echo "metrics_write_error: the run stopped with status $status after $lines lines: $(grep -o 'metrics.jsonl: cannot append.*' "$work/log" | cut -c1-160)"
rm -rf "$work"
