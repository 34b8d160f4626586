#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz) with clang in a build directory of their own and
# runs each one, starting from its committed seeds (tests/fuzz/corpus/NAME).
#
#   tools/fuzz.sh [--build-dir DIR] [--seconds N | --runs N] [--build-only | --no-build] [NAME...]
#
# Default: every harness for 60 seconds, build directory build-fuzz. New inputs that reach
# new code go to DIR/corpus/NAME (the committed seeds are only read); a crash leaves its input
# in DIR/artifacts/ and makes the script exit non-zero. Each run's last libFuzzer status line
# (executions, coverage) is printed, and the full log kept in DIR/logs/NAME.log.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzz"
limit=(-max_total_time=60)
do_build=1
do_run=1
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build="$(realpath -m "$2")"; shift 2 ;;
    --seconds) limit=(-max_total_time="$2"); shift 2 ;;
    --runs) limit=(-runs="$2"); shift 2 ;;
    --build-only) do_run=0; shift ;;
    --no-build) do_build=0; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) names+=("${1#fuzz_}"); shift ;;  # NAME or fuzz_NAME
  esac
done
if [ ${#names[@]} -eq 0 ]; then
  for f in "$root"/tests/fuzz/fuzz_*.cc; do
    n=$(basename "$f" .cc)
    names+=("${n#fuzz_}")
  done
fi

if [ "$do_build" = 1 ]; then
  clangxx=$(command -v clang++ || true)
  clangc=$(command -v clang || true)
  if [ -z "$clangxx" ] || [ -z "$clangc" ]; then
    echo "fuzz.sh: clang is not installed (Debian: apt-get install clang libclang-rt-14-dev)" >&2
    exit 2
  fi
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -DFUYOU_FUZZ=ON -DFUYOU_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_COMPILER="$clangxx" -DCMAKE_C_COMPILER="$clangc" > "$build/configure.log" 2>&1 ||
    { cat "$build/configure.log" >&2; exit 1; }
  cmake --build "$build" --target fuyou-fuzzers -j"$(nproc)"
fi
[ "$do_run" = 1 ] || exit 0

mkdir -p "$build/artifacts" "$build/logs"
failed=()
for n in "${names[@]}"; do
  bin="$build/tests/fuzz/fuzz_$n"
  seeds="$root/tests/fuzz/corpus/$n"
  [ -x "$bin" ] || { echo "fuzz.sh: no harness $bin (build it first)" >&2; exit 2; }
  [ -d "$seeds" ] || { echo "fuzz.sh: no seed corpus $seeds" >&2; exit 2; }
  mkdir -p "$build/corpus/$n"
  log="$build/logs/$n.log"
  status=0
  # Chat templates are read up to 1 MiB, and each input must end within 10 s.
  extra=()
  [ "$n" = chat_template ] && extra=(-max_len=1048576 -len_control=0 -timeout=10)
  "$bin" "${limit[@]}" "${extra[@]}" -print_final_stats=1 -artifact_prefix="$build/artifacts/$n-" \
    "$build/corpus/$n" "$seeds" > "$log" 2>&1 || status=$?
  # libFuzzer's status lines: "#N  DONE  cov: C ft: F corp: ..." at the end of a run.
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  echo "fuzz_$n: ${last:-no status line} (exit $status)"
  if [ "$status" -ne 0 ]; then
    failed+=("$n")
    grep -E 'ERROR|==[0-9]+==|accepted input breaks|uncaught|runtime error|Test unit written' "$log" | head -20 >&2 || true
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: failures in ${failed[*]} (inputs in $build/artifacts, logs in $build/logs)" >&2
  exit 1
fi
