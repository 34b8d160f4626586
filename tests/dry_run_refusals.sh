#!/usr/bin/env bash
# fuyou-train --dry-run refuses what the run refuses: for each of 23 configurations the run
# refuses before it starts, --dry-run exits with the run's status and says the run's message,
# and neither changes a byte of the run directory.
#   dry_run_refusals.sh BIN_DIR WORK_DIR
#   dry_run_refusals.sh BIN_DIR WORK_DIR mounts
# The second form needs filesystems of its own, mounted in a private mount namespace (unshare:
# as root, or through a user namespace): an SSD path on ramfs, which refuses O_DIRECT (or the
# directory FUYOU_NO_ODIRECT_DIR names), and SSD paths on a 1 MiB tmpfs, alone and beside a
# large filesystem (the stripes divide the SSD state, so the small one refuses the run). Where
# they cannot be had it exits 77, which ctest reports as skipped, saying why.
set -euo pipefail
bin=$1 work=$2 mode=${3:-}
fail() { echo "FAILED: $*" >&2; exit 1; }
skip() { echo "SKIPPED: $*" >&2; exit 77; }
if [ "$mode" = mounts ] && [ -z "${FUYOU_IN_MOUNT_NS:-}" ]; then
  ns=(--mount)
  [ "$(id -u)" = 0 ] || ns+=(--map-root-user)
  unshare "${ns[@]}" true 2> /dev/null ||
    skip "no private mount namespace here (unshare ${ns[*]} failed) to mount ramfs and a small tmpfs in"
  FUYOU_IN_MOUNT_NS=1 exec unshare "${ns[@]}" bash "$0" "$@"
fi
logs=$work.logs
rm -rf "$work" "$logs" && mkdir -p "$work/text" "$logs"
for i in $(seq 200); do echo "the quick brown fox jumps over the lazy dog $i"; done > "$work/text/a.txt"
tiny=(--set model.n_layer=2 --set model.n_head=2 --set model.d_model=32 --set model.d_ff=64
      --set model.seq_len=32 --set schedule.warmup_steps=1
      --set schedule.micro_batch=2 --set schedule.eval_batches=1 --set schedule.steps=2
      --set checkpoint.every_steps=2 --set runtime.backend=cpu --set runtime.threads=2)
text=(--set "data.text=[$work/text]")

# The bytes of every file under a directory (nothing when it does not exist).
state() { if [ -e "$1" ]; then (cd "$1" && find . -type f -print0 | sort -z | xargs -0r sha256sum; find . | sort); fi; }
# The error line a tool logged, without its timestamp; the free bytes of a filesystem, which
# others change between the two calls, as N.
said() { grep -m1 '\[error\]' "$1" | sed 's/^\[[^]]*\] \[error\] //; s/has [0-9]* free ([^)]*)/has N free/'; }

n=0
# refused NAME DIR ARGS...: the run and its --dry-run, both in DIR (their --run-dir, or the run
# directory they resume in), refuse alike and leave DIR as it was.
refused() {
  local name=$1 dir=$2; shift 2
  n=$((n + 1))
  local before rc_dry rc_run
  before=$(state "$dir")
  set +e
  "$bin/fuyou-train" --dry-run "$@" > "$logs/dry.out" 2> "$logs/dry.log"
  rc_dry=$?
  [ "$(state "$dir")" = "$before" ] || fail "$name: --dry-run changed $dir"
  "$bin/fuyou-train" "$@" > /dev/null 2> "$logs/run.log"
  rc_run=$?
  set -e
  [ "$(state "$dir")" = "$before" ] || fail "$name: the refused run changed $dir"
  [ "$rc_run" != 0 ] || fail "$name: the run was not refused: $(tail -2 "$logs/run.log")"
  [ "$rc_dry" = "$rc_run" ] ||
    fail "$name: --dry-run exit status $rc_dry, the run's $rc_run ($(said "$logs/run.log")); dry run said: $(tail -2 "$logs/dry.out")"
  local msg
  msg=$(said "$logs/run.log")
  [ -n "$msg" ] || fail "$name: the run said no error: $(tail -2 "$logs/run.log")"
  [ "$(said "$logs/dry.log")" = "$msg" ] ||
    fail "$name: --dry-run said '$(said "$logs/dry.log")', the run '$msg'"
  local reported
  reported=$(grep "^refused: " "$logs/dry.out" | sed 's/has [0-9]* free ([^)]*)/has N free/')
  [ "$reported" = "refused: $msg" ] || fail "$name: the dry run's report says '$reported'"
  echo "$n $name: status $rc_run: $msg"
}

if [ "$mode" = mounts ]; then
  nod=${FUYOU_NO_ODIRECT_DIR:-$work/ramfs}
  if [ -z "${FUYOU_NO_ODIRECT_DIR:-}" ]; then
    mkdir -p "$nod"
    mount -t ramfs fuyou-no-odirect "$nod" 2> "$logs/mount.log" ||
      skip "cannot mount ramfs in the mount namespace: $(cat "$logs/mount.log")"
  fi
  [ -d "$nod" ] && [ -z "$(ls -A "$nod")" ] || fail "$nod: not an empty directory"
  if dd if=/dev/zero of="$nod/.probe" bs=4096 count=1 oflag=direct status=none 2> /dev/null; then
    rm -f "$nod/.probe"
    skip "$nod ($(stat -f -c %T "$nod")) accepts O_DIRECT on this kernel: no filesystem here refuses it"
  fi
  rm -f "$nod/.probe"
  off=(--set offload.weights=ssd --set offload.optimizer_state=ssd)
  refused "an SSD path on a filesystem without O_DIRECT ($(stat -f -c %T "$nod"))" "$work" \
    --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[$nod]"
  grep -q "O_DIRECT" "$logs/run.log" || fail "the refusal does not say O_DIRECT: $(said "$logs/run.log")"
  [ -z "$(ls -A "$nod")" ] || fail "the refused runs left files in $nod: $(ls -A "$nod")"

  small=$work/small-ssd big=$work/big-ssd
  mkdir -p "$small" "$big"
  mount -t tmpfs -o size=1m fuyou-small-ssd "$small" 2> "$logs/mount.log" ||
    skip "cannot mount a 1 MiB tmpfs in the mount namespace: $(cat "$logs/mount.log")"
  dd if=/dev/zero of="$small/.probe" bs=4096 count=1 oflag=direct status=none 2> /dev/null ||
    skip "tmpfs refuses O_DIRECT on this kernel (before Linux 6.6): no small filesystem for the SSD store"
  rm -f "$small/.probe"
  # 49 MiB of SSD state (weights and optimizer state of 4 layers of d_model 256).
  wide=(--set model.n_layer=4 --set model.d_model=256 --set model.n_head=4 --set model.d_ff=1024)
  refused "an SSD path on a filesystem too small for the SSD state" "$work" --run-dir "$work/r1" \
    "${tiny[@]}" "${text[@]}" "${wide[@]}" "${off[@]}" --set "offload.ssd_paths=[$small]"
  refused "two SSD paths, one on a filesystem too small for its stripes" "$work" --run-dir "$work/r1" \
    "${tiny[@]}" "${text[@]}" "${wide[@]}" "${off[@]}" --set "offload.ssd_paths=[$big, $small]"
  grep -q "the filesystem of $small needs" "$logs/run.log" || fail "the refusal does not name $small: $(said "$logs/run.log")"
  [ -z "$(ls -A "$small")" ] && [ -z "$(ls -A "$big")" ] || fail "the refused runs left files in the SSD paths"
  echo "dry-run refusals: $n configurations on mounted filesystems, each refused by --dry-run as by the run"
  exit 0
fi

d=$work/holds; mkdir -p "$d" && echo notes > "$d/notes.txt"
refused "a new run in a directory holding a file" "$d" --run-dir "$d" "${tiny[@]}" "${text[@]}"
d=$work/finished; mkdir -p "$d" && echo '{}' > "$d/summary.json" && echo w > "$d/model.safetensors"
refused "a new run in a finished run's directory" "$d" --run-dir "$d" "${tiny[@]}" "${text[@]}"
d=$work/mixed; mkdir -p "$d" && echo '{"step": 1}' > "$d/metrics.jsonl" && echo x > "$d/notes.txt"
refused "--resume-or-start beside a foreign file" "$d" --resume-or-start --run-dir "$d" "${tiny[@]}" "${text[@]}"
d=$work/odd-ckpt; mkdir -p "$d/checkpoints" && echo x > "$d/checkpoints/notes"
refused "--resume-or-start with a foreign file in checkpoints/" "$d" --resume-or-start --run-dir "$d" "${tiny[@]}" "${text[@]}"
echo file > "$work/a-file"
refused "the run directory is a file" "$work" --run-dir "$work/a-file" "${tiny[@]}" "${text[@]}"
refused "the run directory is under a file" "$work" --run-dir "$work/a-file/run" "${tiny[@]}" "${text[@]}"
refused "the run directory cannot be created (/proc)" "$work" --run-dir /proc/fuyou-no/run "${tiny[@]}" "${text[@]}"
refused "the run directory is not writable (/sys/kernel)" "$work" --run-dir /sys/kernel "${tiny[@]}" "${text[@]}"
refused "the run directory cannot be created in a read-only tree (/sys)" "$work" --run-dir /sys/fuyou-no "${tiny[@]}" "${text[@]}"
off=(--set offload.weights=ssd --set offload.optimizer_state=ssd)
refused "an SSD path that does not exist" "$work" --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[$work/no-ssd]"
refused "an SSD path that is a file" "$work" --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[$work/a-file]"
mkdir -p "$work/ssd"
refused "an SSD path given twice" "$work" --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[$work/ssd, $work/ssd/.]"
refused "an SSD path that is the run directory" "$work" --run-dir "$work/ssd" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[$work/ssd]"
refused "an SSD path that is not writable" "$work" --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" "${off[@]}" --set "offload.ssd_paths=[/sys/kernel]"
refused "data.text that does not exist" "$work" --run-dir "$work/r1" "${tiny[@]}" --set "data.text=[$work/text, $work/no-text]"
refused "a training shard that does not exist" "$work" --run-dir "$work/r1" "${tiny[@]}" --set "data.text=[]" --set "data.train_shards=[$work/no.tok]"
refused "a training shard that is a directory" "$work" --run-dir "$work/r1" "${tiny[@]}" --set "data.text=[]" --set "data.train_shards=[$work/text]"
refused "--resume-or-start in a finished run's directory without checkpoints" "$work/finished" --resume-or-start --run-dir "$work/finished" "${tiny[@]}" "${text[@]}"
refused "a run directory too small for the checkpoints" "$work" --run-dir "$work/r1" "${tiny[@]}" "${text[@]}" --set model.n_layer=1024 --set model.d_model=16384 --set model.n_head=128 --set model.d_ff=65536
# A run with keep_best and a checkpoint, then its best made a directory: a resume refuses.
kb=$work/kb
"$bin/fuyou-train" --run-dir "$kb" "${tiny[@]}" "${text[@]}" --set checkpoint.keep_best=true --set data.val_fraction=0.2 2> "$logs/kb.log" ||
  fail "the keep_best run failed: $(tail -3 "$logs/kb.log")"
rm -f "$kb/checkpoints/best" && mkdir "$kb/checkpoints/best"
refused "a resume whose checkpoints/best is a directory" "$kb" --resume "$kb" --set schedule.steps=4
refused "a resume into a directory holding a file" "$work/holds" --resume "$kb/checkpoints/step-2" --run-dir "$work/holds"
# Shards against the base model's tokenizer (model.checkpoint's tokenizer.json): one that does
# not parse, and one of another vocabulary than the shards'.
base=$work/base; mkdir -p "$base"
cp "$kb/model.safetensors" "$kb/config.yaml" "$base/"
"$bin/fuyou-convert" text "$work/text" --out "$work/shards" > /dev/null 2>&1 || fail "fuyou-convert text failed"
cat > "$work/ft.yaml" <<EOF
model: {checkpoint: $base}
data: {train_shards: [$work/shards/train.tok], val_shards: [$work/shards/val.tok]}
schedule: {steps: 2, warmup_steps: 1, micro_batch: 2, eval_batches: 1}
runtime: {backend: cpu, threads: 2}
EOF
echo '{"model": ' > "$base/tokenizer.json"
refused "a base model whose tokenizer.json does not parse" "$work" --config "$work/ft.yaml" --run-dir "$work/ft"
cp "$(dirname "$0")/reference/fixtures/hf/tok_bytelevel.json" "$base/tokenizer.json"
refused "shards of another vocabulary than the base model's tokenizer" "$work" --config "$work/ft.yaml" --run-dir "$work/ft"
[ "$n" -ge 20 ] || fail "only $n configurations"
echo "dry-run refusals: $n configurations, each refused by --dry-run as by the run"
