#!/usr/bin/env bash
# tools/gpu-validate.sh on a machine without a GPU: one line that says so, exit code 3, and
# no report (nothing was validated). Skipped (77) where a GPU is present.
set -u
script=$1 kit=$2
if command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "a GPU is present: this test is for machines without one"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
msg=$(bash "$script" --kit "$kit" --out "$out/report" 2>&1)
rc=$?
echo "exit $rc: $msg"
[ "$rc" -eq 3 ] || { echo "FAIL: expected exit code 3"; exit 1; }
[ "$(printf '%s\n' "$msg" | wc -l)" -eq 1 ] || { echo "FAIL: expected one line"; exit 1; }
case "$msg" in *"no NVIDIA GPU"*"nothing validated"*) ;; *) echo "FAIL: the line does not say why"; exit 1 ;; esac
[ ! -e "$out/report/report.json" ] || { echo "FAIL: a report was written"; exit 1; }
