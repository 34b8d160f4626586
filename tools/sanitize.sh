#!/usr/bin/env bash
# Builds the library and the tests with AddressSanitizer and UndefinedBehaviorSanitizer in a
# build directory of their own, and runs a part of the test suite under them. Any report
# fails the run (FUYOU_SANITIZE makes every sanitizer report fatal).
#
#   tools/sanitize.sh [--build-dir DIR] [--sanitize LIST] [--build-only | --no-build] [TEST_SPEC]
#
# Defaults: build-sanitize, address,undefined, and the tests tagged below: the readers of
# every file a user hands the engine (formats, config, tokenizer, hf, mask), the storage tier
# and the simulator, which fit CI's time; TEST_SPEC (Catch's syntax, e.g. "[scheduler]")
# runs others. --sanitize thread builds a ThreadSanitizer tree the same way.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-sanitize"
sanitize=address,undefined
do_build=1
do_run=1
spec="[formats],[config],[tokenizer],[hf],[mask],[storage],[simulator],[optim],[loss_scale],[attention]"
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build="$(realpath -m "$2")"; shift 2 ;;
    --sanitize) sanitize="$2"; shift 2 ;;
    --build-only) do_run=0; shift ;;
    --no-build) do_build=0; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "sanitize.sh: unknown option $1" >&2; exit 2 ;;
    *) spec="$1"; shift ;;
  esac
done

if [ "$do_build" = 1 ]; then
  # -O1: the sanitizers' usual level (fast enough to run, quick to compile, exact stacks).
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -DFUYOU_SANITIZE="$sanitize" -DFUYOU_CUDA=OFF \
    -DFUYOU_CI_HOSTILE=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
    -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" > "$build/configure.log" 2>&1 ||
    { cat "$build/configure.log" >&2; exit 1; }
  cmake --build "$build" --target fuyou-tests -j"$(nproc)"
fi
[ "$do_run" = 1 ] || exit 0

# halt_on_error / abort: the first report ends the test binary with a failure status.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
cd "$build"
"$build/tests/fuyou-tests" "$spec"
