#!/bin/bash
# Predicted (fuyou-bench simulate) vs measured (fuyou-bench train) step time on the CPU
# backend for four configs bound by different resources: compute, optimizer, SSD read, SSD
# write (docs/performance.md, "Simulator: predicted vs measured").
#
#   tools/validate-simulator.sh [BUILD_DIR] [SSD_DIR] [OUT_DIR]      (as root, from the repo root)
#
# Run it on an idle machine: the CPU profile it measures first is only as good as the
# machine's quietness. The SSD-bound rows need a disk slower than the CPU; the script
# throttles the store's disk for its own processes with a cgroup-v1 blkio limit
# (/sys/fs/cgroup/blkio must exist) and measures each row's profile under the same limit.
# It rewrites configs/hardware/this-cpu.yaml with the unthrottled profile.
set -eu
BUILD=${1:-build}
SSD=${2:-/work/sim-ssd}
OUT=${3:-/tmp/fuyou-sim-val}
B=$BUILD/fuyou-bench
REPS=${REPS:-3}
mkdir -p "$SSD" "$OUT"
DEV=$(stat -c '%Hd:%Ld' "$SSD")  # major:minor of the disk holding the store
CG=/sys/fs/cgroup/blkio/fuyou-sim-val
[ -d /sys/fs/cgroup/blkio ] || { echo "needs cgroup-v1 blkio at /sys/fs/cgroup/blkio" >&2; exit 1; }
mkdir -p $CG
trap 'throttle 0 0; rmdir $CG 2>/dev/null || true' EXIT
wait_quiet() {  # up to a minute for the 1-minute load average to drop below 2
  for i in $(seq 6); do awk '{exit !($1>2.0)}' /proc/loadavg || return 0; sleep 10; done
}
throttle() {  # read and write bytes/s for processes in $CG (0: unlimited)
  echo "$DEV $1" > $CG/blkio.throttle.read_bps_device
  echo "$DEV $2" > $CG/blkio.throttle.write_bps_device
}
incg() { bash -c "echo \$\$ > $CG/cgroup.procs; exec \"\$@\"" _ "$@"; }

TINY="--set model.n_layer=4 --set model.n_head=2 --set model.d_model=64 --set model.d_ff=256 --set model.vocab_size=256 --set model.seq_len=256 --set schedule.micro_batch=32 --set offload.ssd_paths=[$SSD] --set offload.activations=swap --set optimizer.grad_clip=0"
declare -A CFG PROF THR
CFG[compute]="--set offload.ssd_paths=[$SSD] --set offload.activations=swap --set optimizer.grad_clip=0"
PROF[compute]=configs/hardware/this-cpu.yaml; THR[compute]="0 0"
CFG[optimizer]="--config configs/gpt-3b-offload.yaml --set model.n_layer=8 --set model.n_head=8 --set model.d_model=512 --set model.d_ff=2048 --set model.vocab_size=256 --set offload.host_memory=480MiB --set offload.device_memory=1GiB --set model.seq_len=64 --set offload.ssd_paths=[$SSD]"
PROF[optimizer]=$OUT/this-cpu-400MBps.yaml; THR[optimizer]="400000000 400000000"
CFG[ssd_read]="$TINY"; PROF[ssd_read]=$OUT/this-cpu-read8MBps.yaml; THR[ssd_read]="8000000 0"
CFG[ssd_write]="$TINY"; PROF[ssd_write]=$OUT/this-cpu-write8MBps.yaml; THR[ssd_write]="0 8000000"

echo "profiles: $(uptime)"
wait_quiet; throttle 0 0
incg $B profile --dir $SSD --out configs/hardware/this-cpu.yaml > $OUT/profile.log 2>&1
wait_quiet; throttle 400000000 400000000
incg $B profile --dir $SSD --io-size 256MiB --out ${PROF[optimizer]} >> $OUT/profile.log 2>&1
wait_quiet; throttle 8000000 0
incg $B profile --dir $SSD --io-size 64MiB --out ${PROF[ssd_read]} >> $OUT/profile.log 2>&1
wait_quiet; throttle 0 8000000
incg $B profile --dir $SSD --io-size 64MiB --out ${PROF[ssd_write]} >> $OUT/profile.log 2>&1
for k in compute optimizer ssd_read ssd_write; do
  throttle ${THR[$k]}
  $B simulate ${CFG[$k]} --hardware ${PROF[$k]} --json > $OUT/$k.sim.json
  for r in $(seq $REPS); do
    wait_quiet
    echo "$k rep $r: $(uptime)"
    incg $B train ${CFG[$k]} --steps 3 --warmup 1 --json > $OUT/$k.train$r.json 2> $OUT/$k.train$r.err
  done
done
throttle 0 0
python3 - "$OUT" "$REPS" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
print("| bound | predicted s | measured s (median; all) | error | busiest predicted / measured |")
for k in ["compute", "optimizer", "ssd_read", "ssd_write"]:
    s = json.load(open(f"{out}/{k}.sim.json"))
    t = [json.load(open(f"{out}/{k}.train{r}.json")) for r in range(1, reps + 1)]
    its = [x["iteration_s"] for x in t]
    med = statistics.median(its)
    m = t[its.index(med)]
    mb = max(m["busy_s"], key=m["busy_s"].get)
    # Steps overlap: the prediction to compare with a measured step is the steady-state
    # period (the measured iteration_s is the window between two steps' returns).
    print(f"| {k} | {s['period_s']:.3f} | {med:.3f} ({' '.join(f'{x:.3f}' for x in its)}) | "
          f"{100 * (s['period_s'] / med - 1):+.1f}% | {s['busiest']} / {mb} |")
PY
