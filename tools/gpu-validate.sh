#!/usr/bin/env bash
# The GPU validation kit (docs/cuda.md): everything this engine can check on a GPU, from one
# command, on a machine that has a GPU but no network and none of the project's Debian
# packages.
#
# On a machine with the CUDA toolkit (no GPU needed):
#   tools/gpu-validate.sh --prepare [--build-dir DIR] [--kit DIR] [--no-build]
#     builds the CUDA test and tool binaries (DIR, default build-gpu, configured for sm_90),
#     packs them with the shared libraries a bare GPU machine lacks and the default run's text
#     into KIT/fuyou-gpu-kit.tar.xz (KIT default gpu-kit, git-ignored), checks that the source
#     tree and the kit together fit the 64 MiB a GPU machine may receive, and prints the
#     commands to run there. --no-build packs DIR as it is (CI packs its own build).
#
# On the GPU machine, from the repository root:
#   tools/gpu-validate.sh [--kit DIR] [--out DIR] [--phase check|sanitize|perf|all] [--work DIR]
#     runs each step of the phase under its own time limit (a phase fits one 10-minute
#     command on an H100) and writes report.json, summary.md and log.txt under OUT (default
#     $OUT, else gpu-validate-out); perf also writes this-gpu.yaml, the measured profile.
#     Without a GPU it says so in one line and exits 3.
#   --only NAME[,NAME...] runs just the named steps of the phase (a short lease); the others
#     are left out of the report. --limits NAME=S[,NAME=S...] gives those steps S seconds
#     instead of their own limits (tools/gpu-lease.sh sizes a lease's steps so).
#   --plumbing runs the kit's machinery without a GPU (unpacking, libraries, data, the
#     report) on a short CPU list; its report says that nothing was validated on a GPU.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kit_rel=gpu-kit
build_dir=build-gpu
mode=run
phase=all
out=${OUT:-}
work=""
no_build=0
limit_mib=64
plumbing=0
only=""
limits=""

die() { echo "gpu-validate: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) mode=prepare ;;
    --plumbing) plumbing=1 ;;
    --no-build) no_build=1 ;;
    --build-dir) build_dir=$2; shift ;;
    --kit) kit_rel=$2; shift ;;
    --out) out=$2; shift ;;
    --work) work=$2; shift ;;
    --phase) phase=$2; shift ;;
    --only) only=,$2,; shift ;;
    --limits) limits=,$2,; shift ;;
    --limit-mib) limit_mib=$2; shift ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
case "$phase" in check|sanitize|perf|all) ;; *) die "--phase: expected check, sanitize, perf or all, got '$phase'" ;; esac
abs() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
kit_dir=$(abs "$kit_rel")
build_dir=$(abs "$build_dir")
kit_tar="$kit_dir/fuyou-gpu-kit.tar.xz"
binaries=(tests/fuyou-cuda-tests fuyou-train fuyou-bench fuyou-convert)

# ---- preparation (this machine) ----------------------------------------------------------

# Bytes of what travels to the GPU machine beside the kit: tracked files and untracked files
# git does not ignore, and shared/ where the checkout has one.
tree_bytes() {
  (cd "$root" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
     xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
  [ -d "$root/shared" ] && du -sb "$root/shared" | cut -f1
}

# The libraries a binary needs that a bare GPU machine may lack: all but the C library, the
# C++ runtime (the machine's own is newer) and CUDA's (the GPU machine's toolkit supplies
# cuBLAS, the driver libcuda).
needed_libs() {
  ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    grep -Ev '^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+\.|libgcc_s\.|libcuda\.|libcudart|libcublas|libnvidia|libcudnn)' || true
}

prepare() {
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || die "--prepare needs the CUDA toolkit (nvcc)"
  if [ "$no_build" = 0 ]; then
    if [ ! -f "$build_dir/CMakeCache.txt" ]; then
      PATH=/usr/local/cuda/bin:$PATH cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
        -DFUYOU_CUDA=ON "-DFUYOU_CUDA_ARCHITECTURES=90-real;90-virtual" >/dev/null ||
        die "cmake configure of $build_dir failed"
    fi
    cmake --build "$build_dir" -j"$(nproc)" --target fuyou-cuda-tests fuyou-train fuyou-bench fuyou-convert ||
      die "build in $build_dir failed"
  fi
  local b
  for b in "${binaries[@]}"; do
    [ -x "$build_dir/$b" ] || die "$build_dir/$b is missing: configure $build_dir with the CUDA toolkit and build it (or leave out --no-build)"
  done
  [ -d /usr/share/games/fortunes ] || die "/usr/share/games/fortunes is missing (Debian package fortunes): the kit's end-to-end runs train on it"

  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  local k="$stage/fuyou-gpu-kit"
  mkdir -p "$k/bin" "$k/lib" "$k/data"
  for b in "${binaries[@]}"; do cp "$build_dir/$b" "$k/bin/"; done
  local name path
  while read -r name path; do cp -L "$path" "$k/lib/$name"; done < <(needed_libs "$k"/bin/*)
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$k/data/" \;
  {
    echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "prepared: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n)"
    echo "build: $build_dir ($(grep -E '^FUYOU_CUDA_ARCHITECTURES' "$build_dir/CMakeCache.txt" 2>/dev/null | cut -d= -f2))"
    echo "libraries: $(ls "$k/lib" | tr '\n' ' ')"
  } > "$k/MANIFEST"
  mkdir -p "$kit_dir"
  rm -f "$kit_tar"
  XZ_OPT="-6 -T0" tar -C "$stage" -cJf "$kit_tar" fuyou-gpu-kit || die "cannot write $kit_tar"

  local kit_b tree_b total limit
  kit_b=$(du -sb "$kit_dir" | cut -f1)
  tree_b=$(tree_bytes | awk '{s += $1} END {print s + 0}')
  total=$((kit_b + tree_b))
  limit=$((limit_mib * 1024 * 1024))
  awk -v k="$kit_b" -v t="$tree_b" -v l="$limit_mib" -v f="$kit_tar" 'BEGIN {
    printf "gpu-validate: kit %s (%.1f MiB), source tree %.1f MiB, together %.1f MiB of the %d MiB limit\n",
           f, k / 1048576, t / 1048576, (k + t) / 1048576, l }'
  [ "$total" -le "$limit" ] || die "the tree and the kit exceed $limit_mib MiB: $total bytes"
  git -C "$root" check-ignore -q "$kit_dir/fuyou-gpu-kit.tar.xz" ||
    echo "gpu-validate: note: $kit_rel is not ignored by git; carry it explicitly"
  local rel=${kit_dir#"$root"/}
  cat <<EOF
On the GPU machine, from the repository root, with $rel/ carried beside the tree, one
command per phase (each fits 10 minutes on an H100; results under \$OUT):
  bash tools/gpu-validate.sh --kit $rel --phase check --out "\$OUT"
  bash tools/gpu-validate.sh --kit $rel --phase sanitize --out "\$OUT"
  bash tools/gpu-validate.sh --kit $rel --phase perf --out "\$OUT"
EOF
}

if [ "$mode" = prepare ]; then
  prepare
  exit $?
fi

# ---- validation (the GPU machine) --------------------------------------------------------

if [ "$plumbing" = 0 ]; then
  if ! command -v nvidia-smi > /dev/null; then
    gpus="nvidia-smi not found"
  elif gpus=$(nvidia-smi -L 2>&1) && echo "$gpus" | grep -q '^GPU '; then
    gpus=""
  fi
  if [ -n "$gpus" ]; then
    echo "gpu-validate: no NVIDIA GPU on this machine ($(echo "$gpus" | head -n 1 | cut -c1-200)); nothing validated" >&2
    exit 3
  fi
fi
[ -f "$kit_tar" ] || die "$kit_tar is missing: run tools/gpu-validate.sh --prepare on a machine with the CUDA toolkit and carry $kit_rel/"
out=$(abs "${out:-gpu-validate-out}")
mkdir -p "$out" || die "cannot create $out"

# A work directory on a disk that takes O_DIRECT (the SSD store needs it; /tmp may be tmpfs).
direct_ok() { mkdir -p "$1" && dd if=/dev/zero of="$1/.direct" bs=4096 count=1 oflag=direct status=none 2>/dev/null && rm -f "$1/.direct"; }
for cand in "$work" /var/tmp/fuyou-gpu-validate "$root/.gpu-work"; do
  [ -n "$cand" ] && direct_ok "$cand" && { work=$cand; break; }
done
direct_ok "$work" 2>/dev/null || die "no work directory that takes O_DIRECT (tried /var/tmp and $root/.gpu-work; pass --work DIR)"
# A warm machine keeps the work directory between calls: nothing of an earlier run (stores,
# figures, logs) may reach this run's report.
rm -rf "$work/kit" "$work/logs" "$work"/bench-*.json "$work/simulate.json" "$work"/ssd-* "$work"/run-*
# The SSD store refuses a directory that does not exist: make every store directory here.
mkdir -p "$work/kit" "$work/logs" "$work/ssd-e2e" "$work/ssd-bf16" "$work/ssd-profile" "$work/ssd-big" \
  "$work/ssd-big16" && tar -C "$work/kit" -xJf "$kit_tar" || die "cannot unpack $kit_tar into $work/kit"
kit="$work/kit/fuyou-gpu-kit"
bin="$kit/bin"

# CUDA's libraries (cuBLAS, and cuDNN, which the engine opens at run time) from the machine's
# toolkit, or from the Python wheels beside PyTorch.
cuda_libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(ls -d /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib /usr/local/lib/python3*/dist-packages/nvidia/*/lib 2>/dev/null); do
  if [ -d "$d" ] && { ls "$d"/libcublas* || ls "$d"/libcudnn*; } > /dev/null 2>&1; then cuda_libs="$cuda_libs:$d"; fi
done
export LD_LIBRARY_PATH="$kit/lib$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FUYOU_SOURCE_DIR="$root" FUYOU_TEST_DATA="$work/test-data"
mkdir -p "$FUYOU_TEST_DATA"

steps_tsv="$work/steps.tsv"
: > "$steps_tsv"
: > "$out/log.txt"
phase_start=$(date +%s)
phase_budget=${FUYOU_GPU_PHASE_S:-570}  # seconds per phase: one 10-minute command

# step NAME LIMIT_S COMMAND...: runs COMMAND with its output in logs/NAME.log and log.txt;
# records pass (exit 0), fail, timeout, or "not run" when the phase's time is spent, and in a
# note what the log says cuDNN refused (the engine's own attention ran instead).
step() {
  local name=$1 limit=$2
  shift 2
  case "$only" in ""|*",$name,"*) ;; *) return 0 ;; esac
  case "$limits" in *",$name="*) limit=${limits#*,"$name"=}; limit=${limit%%,*} ;; esac
  local left=$((phase_budget - ($(date +%s) - phase_start)))
  if [ "$left" -lt 20 ]; then
    printf '%s\tnot run\t-\t0\t%s\n' "$name" "the phase's ${phase_budget} s are spent" >> "$steps_tsv"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$work/logs/$name.log" t0 rc status secs
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/log.txt"
  t0=$(date +%s%N)
  # Through bash -c, so that COMMAND may be one of this script's functions (exported below).
  timeout -k 10 "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  case $rc in
    0) status=pass ;;
    124|137) status=timeout ;;
    77) status="fail (no CUDA device)" ;;
    *) status=fail ;;
  esac
  # A test that skipped itself (a warning that says so) is a failure here.
  [ "$status" = pass ] && grep -q 'skipped:' "$log" && status="fail (skipped)"
  local note=""
  grep -q 'cuDNN refuses the attention' "$log" &&
    note="cuDNN refused: $(grep -o 'cuDNN refuses the attention.*' "$log" | sort -u | head -n 3 | tr '\t\n' '  ' | cut -c1-400)"
  tail -c 20000 "$log" >> "$out/log.txt"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$*" "$note" >> "$steps_tsv"
  echo "   -> $status (exit $rc, ${secs%.*} s)${note:+; $note}" | tee -a "$out/log.txt"
  [ "$status" = pass ]
}

libs_resolve() {
  local missing
  missing=$(ldd "$bin"/* | grep 'not found' | sort -u)
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  cat "$kit/MANIFEST"
  [ -z "$missing" ] || { echo "unresolved libraries:"; echo "$missing"; return 1; }
  "$bin/fuyou-bench" --help > /dev/null
}

device_query() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,pcie.link.gen.max,pcie.link.width.max --format=csv
  nvidia-smi
  free -g
  df -h "$work"
  nproc
}

tiny_train() {  # RUN_DIR FAMILY-SETS...: a short run on the kit's text that must learn
  local dir=$1
  shift
  rm -rf "$dir"
  "$bin/fuyou-train" --run-dir "$dir" --set "data.text=[$kit/data]" --set schedule.steps=120 \
    --set schedule.eval_every=60 --set schedule.eval_batches=4 --set schedule.micro_batch=8 "$@" || return 1
  python3 - "$dir/metrics.jsonl" <<'EOF'
import json, sys
vals = [json.loads(l)["val_loss"] for l in open(sys.argv[1]) if "val_loss" in l]
print("validation losses:", vals)
sys.exit(0 if len(vals) >= 2 and vals[-1] < vals[0] - 0.5 else 1)
EOF
}

list_tests() {  # Catch2 exits with the number of tests listed
  local names
  names=$("$bin/fuyou-cuda-tests" --list-test-names-only)
  echo "$names"
  [ -n "$names" ]
}

kernel_spec='[cuda]~[reference]~[families]~[determinism]~[large]~[scheduler]~[cudnn]'
tests="$bin/fuyou-cuda-tests"
cuda_sets=(--set runtime.backend=cuda)

run_check() {
  step device 30 device_query
  step libraries 30 libs_resolve || return
  step cuda-kernels 120 "$tests" "$kernel_spec"
  step cuda-fixtures 120 "$tests" '[reference]'
  step cuda-families 120 "$tests" '[families],[determinism]'
  step cuda-large-index 120 "$tests" '[large]'
  step cuda-scheduler 180 "$tests" '[scheduler]'
  step cuda-cudnn 180 "$tests" '[cudnn]'
  step train-gpt2-on-disk 150 tiny_train "$work/run-gpt2-disk" "${cuda_sets[@]}" \
    --set "offload.ssd_paths=[$work/ssd-e2e]" --set offload.weights=ssd \
    --set offload.optimizer_state=ssd --set offload.activations=swap
  step train-bf16-tensors-on-disk 150 tiny_train "$work/run-bf16-disk" "${cuda_sets[@]}" \
    --set runtime.device_tensors=bf16 --set runtime.precision=bf16 --set model.head_chunk_tokens=300 \
    --set "offload.ssd_paths=[$work/ssd-bf16]" --set offload.weights=ssd \
    --set offload.optimizer_state=ssd --set offload.activations=swap
  step train-bf16-cudnn 120 tiny_train "$work/run-bf16-cudnn" "${cuda_sets[@]}" \
    --set runtime.device_tensors=bf16 --set runtime.precision=bf16 --set runtime.attention=cudnn
  step train-llama 120 tiny_train "$work/run-llama" "${cuda_sets[@]}" --set model.family=llama \
    --set model.n_kv_head=2 --set model.d_ff=1024 --set model.tie_embeddings=false
  step train-opt 120 tiny_train "$work/run-opt" "${cuda_sets[@]}" --set model.family=opt
}

run_sanitize() {
  local tool
  for tool in memcheck racecheck synccheck initcheck; do
    step "sanitizer-$tool" 140 compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" "$kernel_spec"
  done
}

bench_train() {  # JSON_OUT ARGS...
  local json=$1
  shift
  "$bin/fuyou-bench" train "$@" --json > "$json" && cat "$json"
}

# The PyTorch peer (tools/torch_peer.py) with the machine's own PyTorch: the same shapes, the
# way a PyTorch user trains them on this card; JSON lines into FILE and the log.
torch_peer() {  # FILE ARGS...
  local f=$1
  shift
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' &&
    python3 "$root/tools/torch_peer.py" "$@" | tee "$f"
}

# Where the GPU time of an in-memory step goes: every kernel of fuyou-bench train timed by
# Nsight Compute (one metric, clocks as they run), summed per kernel by tools/ncu_summary.py
# against the step time the same bench measured without the profiler (WALL_JSON).
kernel_profile() {  # CSV WALL_JSON STEPS ARGS...
  local csv=$1 wall_json=$2 steps=$3 ncu
  shift 3
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  [ -n "$ncu" ] || { echo "no ncu on this machine"; return 1; }
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    --log-file "$csv" "$bin/fuyou-bench" train "$@" --json || return 1
  local wall=0
  # The bench's JSON is its last line starting with '{' (log lines may precede it).
  [ -f "$wall_json" ] && wall=$(python3 -c 'import json,sys; print(json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])["step_s"])' "$wall_json")
  python3 "$root/tools/ncu_summary.py" "$csv" --steps "$steps" --wall-s "$wall"
}

run_perf() {
  local big=(--config "$root/configs/gpt3-1.3b.yaml" "${cuda_sets[@]}" --set model.seq_len=1024
             --set "offload.ssd_paths=[$work/ssd-big]" --set offload.device_memory=8GiB
             --set offload.host_memory=32GiB --set offload.weights=ssd
             --set offload.optimizer_state=ssd --set offload.activations=swap)
  step profile 200 "$bin/fuyou-bench" profile --backend cuda --dir "$work/ssd-profile" --io-size 4GiB \
    --out "$out/this-gpu.yaml"
  step bench-gpt2-fp32 120 bench_train "$work/bench-fp32.json" --config "$root/configs/gpt2-124m.yaml" \
    "${cuda_sets[@]}" --set runtime.precision=fp32 --set schedule.micro_batch=8 --steps 8 --warmup 2 \
    --breakdown
  step bench-gpt2-bf16 120 bench_train "$work/bench-bf16.json" --config "$root/configs/gpt2-124m.yaml" \
    "${cuda_sets[@]}" --set runtime.precision=bf16 --set schedule.micro_batch=8 --steps 8 --warmup 2
  step bench-gpt2-bf16-tensors 120 bench_train "$work/bench-bf16-tensors.json" --config "$root/configs/gpt2-124m.yaml" \
    "${cuda_sets[@]}" --set runtime.precision=bf16 --set runtime.device_tensors=bf16 --set schedule.micro_batch=8 \
    --steps 8 --warmup 2 --breakdown
  local gpt2_16=(--config "$root/configs/gpt2-124m.yaml" "${cuda_sets[@]}" --set runtime.precision=bf16
                 --set runtime.device_tensors=bf16 --set schedule.micro_batch=8)
  # The same with the projections' bias in cuBLASLt's epilogue (runtime.gemm_bias: epilogue).
  step bench-gpt2-bf16-tensors-bias-epilogue 120 bench_train "$work/bench-bf16-tensors-bias-epilogue.json" \
    "${gpt2_16[@]}" --set runtime.gemm_bias=epilogue --steps 8 --warmup 2 --breakdown
  # AdamW on the device as the in-memory step (runtime.in_memory: step): what the device
  # optimizer's plan (bench-gpt2-bf16-tensors: each group's update after its backward) saves or
  # costs against one update after the whole backward.
  step bench-gpt2-bf16-tensors-device-step 120 bench_train "$work/bench-bf16-tensors-device-step.json" \
    "${gpt2_16[@]}" --set runtime.in_memory=step --steps 8 --warmup 2 --breakdown
  # The same with AdamW on the host (optimizer.placement: host): what the device optimizer saves.
  # In memory as a plan (gradients down, AdamW and weights up beside the backward and the next
  # forward), then as the in-memory step (those phases in turn): what the plan saves.
  local host_adamw=(--config "$root/configs/gpt2-124m.yaml" "${cuda_sets[@]}" --set runtime.precision=bf16
                    --set runtime.device_tensors=bf16 --set schedule.micro_batch=8
                    --set optimizer.placement=host --steps 8 --warmup 2 --breakdown)
  step bench-gpt2-bf16-tensors-host-adamw 120 bench_train "$work/bench-bf16-tensors-host.json" \
    "${host_adamw[@]}"
  step bench-gpt2-bf16-tensors-host-adamw-step 120 bench_train "$work/bench-bf16-tensors-host-step.json" \
    "${host_adamw[@]}" --set runtime.in_memory=step
  step torch-peer-gpt2 240 torch_peer "$work/torch-peer-gpt2.jsonl" train --mode best --batch 8 --seq 1024
  step bench-gpt2-bf16-tensors-again 120 bench_train "$work/bench-bf16-tensors-2.json" "${gpt2_16[@]}" \
    --steps 8 --warmup 2 --breakdown --trace "$out/trace-gpt2-in-memory.json"
  step gemm-ceiling-gpt2 60 torch_peer "$work/gemm-gpt2.jsonl" gemm --d-model 768 --d-ff 3072 --vocab 50257 \
    --tokens 8192
  step gemm-ceiling-175b 90 torch_peer "$work/gemm-175b.jsonl" gemm --d-model 12288 --d-ff 49152 \
    --vocab 50257 --tokens 16384
  # The engine's layer GEMMs beside plain cuBLASLt GEMMs of the same shapes (the ceiling).
  step gemm-cublaslt-gpt2 90 bash -c '"$0" gemm --backend cuda "$@" --json > "'"$work"'/gemm-lt-gpt2.json" && cat "'"$work"'/gemm-lt-gpt2.json"' \
    "$bin/fuyou-bench" "${gpt2_16[@]}"
  step gemm-cublaslt-175b 120 bash -c '"$0" gemm --backend cuda "$@" --json > "'"$work"'/gemm-lt-175b.json" && cat "'"$work"'/gemm-lt-175b.json"' \
    "$bin/fuyou-bench" --config "$root/configs/gpt3-175b-seq1024.yaml" --set schedule.micro_batch=16 --reps 10
  step kernels-gpt2 180 kernel_profile "$out/kernels-gpt2.csv" "$work/bench-bf16-tensors.json" 2 \
    "${gpt2_16[@]}" --steps 1 --warmup 1
  # The published setting scaled to this machine: GPT-3 2.7B (its fp32 state fits this
  # machine's host memory), 16-bit tensors, the device held to 24 GiB (an RTX 4090's memory),
  # the placement the search chooses on the profile measured here (this call's, else the H200
  # profile measured before), and the simulator's prediction on it; `rtx4090` holds the
  # setting's arguments, which the three runs share.
  local prof="$root/configs/hardware/h200-vm-measured-bf16.yaml"
  # A profile measured by an earlier call of the lease (tools/gpu-lease.sh carries it), else
  # this call's.
  [ -f "${FUYOU_GPU_PROFILE:-}" ] && prof=$FUYOU_GPU_PROFILE
  [ -f "$out/this-gpu.yaml" ] && prof="$out/this-gpu.yaml"
  local rtx4090=("${cuda_sets[@]}" --set model.seq_len=1024 --set schedule.micro_batch=16
    --set runtime.precision=bf16 --set runtime.device_tensors=bf16
    --set offload.device_memory=24GiB --set offload.activations=auto
    --set "offload.hardware=$prof" --predict-on "$prof" --steps 3 --warmup 1 --breakdown)
  step offload-2.7b-24g 240 bench_train "$work/bench-2.7b-24g.json" \
    --config "$root/configs/gpt3-2.7b.yaml" "${rtx4090[@]}"
  # The same with the optimizer state packed (int8 moments, the master as bf16 + 16 low bits:
  # 10 bytes a parameter for the host AdamW to stream instead of 28), and GPT-3 6.7B, whose
  # packed state fits this machine's host memory with room to spare (47 GB peak at 6.7B).
  local packed=(--set optimizer.state=int8 --set optimizer.master=split)
  step offload-2.7b-24g-int8 240 bench_train "$work/bench-2.7b-24g-int8.json" \
    --config "$root/configs/gpt3-2.7b.yaml" "${rtx4090[@]}" "${packed[@]}"
  step offload-6.7b-24g-int8 300 bench_train "$work/bench-6.7b-24g-int8.json" \
    --config "$root/configs/gpt3-6.7b.yaml" "${rtx4090[@]}" "${packed[@]}"
  # The same with the executor's threads blocking while they wait for the device instead of
  # spinning (runtime.cuda_wait): the CPUs they held go to the host's AdamW.
  step offload-6.7b-24g-int8-block 300 bench_train "$work/bench-6.7b-24g-int8-block.json" \
    --config "$root/configs/gpt3-6.7b.yaml" "${rtx4090[@]}" "${packed[@]}" --set runtime.cuda_wait=block
  # Two layers of GPT-3 175B's width at the published micro-batch (16 x 1024 tokens), bf16
  # tensors, chunked head, in memory: what this engine's kernels make of one 175B layer.
  # Four layers of Llama-3-8B's shape with its 128,256-column head (the config's chunked head),
  # bf16 tensors and GEMMs, in memory with AdamW on the device, sequence 4096 and 8192 (micro-
  # batch 1, unpacked): RMSNorm, SwiGLU, RoPE and grouped-query attention on a GPU at size. The
  # arena is held to 96 GiB so that cuDNN's deterministic backward workspace (2 B H T^2
  # floats: 4.3 GB at 8192) fits beside it; a refusal is the step's note.
  local llama=(--config "$root/configs/llama3-8b.yaml" "${cuda_sets[@]}" --set model.n_layer=4
               --set runtime.precision=bf16 --set runtime.device_tensors=bf16
               --set offload.device_memory=96GiB --set schedule.micro_batch=1 --steps 4 --warmup 1
               --breakdown)
  step bench-llama3-8b-4l-4k 120 bench_train "$work/bench-llama-4k.json" "${llama[@]}" --set model.seq_len=4096
  step bench-llama3-8b-4l-8k 120 bench_train "$work/bench-llama-8k.json" "${llama[@]}" --set model.seq_len=8192
  step bench-175b-layers 200 bench_train "$work/bench-175b-layers.json" --config "$root/configs/gpt3-175b-seq1024.yaml" \
    "${cuda_sets[@]}" --set model.n_layer=2 --set schedule.micro_batch=16 --set runtime.precision=bf16 \
    --set offload.device_memory=0 --steps 2 --warmup 1 --breakdown
  # The same through the offload scheduler (activations swapped, the rest as it places them):
  # each resource's busy time, and the last iteration's timeline of every operation, to tell
  # where a 175B layer's step goes (its GEMMs alone would take about a tenth of it).
  step bench-175b-layers-scheduled 200 bench_train "$work/bench-175b-sched.json" \
    --config "$root/configs/gpt3-175b-seq1024.yaml" "${cuda_sets[@]}" --set model.n_layer=2 \
    --set schedule.micro_batch=16 --set runtime.precision=bf16 --set offload.device_memory=0 \
    --set offload.activations=swap --trace "$out/trace-175b-layers.json" --steps 2 --warmup 1
  step offload-1.3b 300 bench_train "$work/bench-offload.json" "${big[@]}" --steps 2 --warmup 1
  rm -rf "$work/ssd-big"  # about 21 GB: the disk holds one such store at a time
  step offload-1.3b-bf16-tensors 300 bench_train "$work/bench-offload-bf16.json" "${big[@]}" \
    --set "offload.ssd_paths=[$work/ssd-big16]" --set runtime.precision=bf16 --set runtime.device_tensors=bf16 \
    --steps 2 --warmup 1
  [ -f "$out/this-gpu.yaml" ] &&
    step simulate-1.3b 60 bash -c '"$0" simulate "$@" --json > "'"$work"'/simulate.json" && cat "'"$work"'/simulate.json"' \
      "$bin/fuyou-bench" "${big[@]}" --hardware "$out/this-gpu.yaml"
}

run_plumbing() {
  step libraries 30 libs_resolve || return
  step list-tests 30 list_tests
  step cuda-tests-without-device 30 bash -c '"$0"; test $? -eq 77' "$tests"
  # On the disk as the GPU's train-gpt2-on-disk step, so that its stores' paths are checked here.
  step train-cpu-tiny 300 tiny_train "$work/run-cpu" --set runtime.backend=cpu --set model.n_layer=2 \
    --set model.d_model=128 --set model.n_head=4 --set model.d_ff=512 --set model.seq_len=64 \
    --set "offload.ssd_paths=[$work/ssd-e2e]" --set offload.weights=ssd \
    --set offload.optimizer_state=ssd --set offload.activations=swap
}

export kit bin work root out
export -f libs_resolve device_query tiny_train bench_train list_tests torch_peer kernel_profile

if [ "$plumbing" = 1 ]; then
  run_plumbing
else
  case "$phase" in
    check) run_check ;;
    sanitize) run_sanitize ;;
    perf) run_perf ;;
    all) run_check; phase_start=$(date +%s); run_sanitize; phase_start=$(date +%s); run_perf ;;
  esac
fi

python3 "$root/tools/gpu_report.py" --steps "$steps_tsv" --work "$work" --out "$out" --phase "$phase" \
  --plumbing "$plumbing" --root "$root" --kit "$kit" || die "the report could not be written"
! grep -qv $'\tpass\t' "$steps_tsv"
