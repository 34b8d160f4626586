#!/usr/bin/env bash
# expect_failure.sh PATTERN COMMAND...: runs COMMAND and passes when it exits with status 1
# (not a crash: an uncaught exception ends in SIGABRT, status 134) and its output has a
# line matching PATTERN (grep -E).
set -uo pipefail
pattern=$1
shift
out=$("$@" 2>&1)
status=$?
printf '%s\n' "$out"
if [ "$status" -ne 1 ]; then
  echo "expect_failure: exit status $status, expected 1" >&2
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$pattern"; then
  echo "expect_failure: no line matches '$pattern'" >&2
  exit 1
fi
