#!/usr/bin/env bash
# Checks that every C++ and CUDA source of the repository is formatted by the project's
# .clang-format; prints each file that is not, with the first lines of its difference, and
# exits 1. `--fix` rewrites them instead. Needs clang-format 14 (Debian 12's, installed by
# tools/install-deps.sh): other versions format differently, so with another one, or none,
# it says so and exits 77 (ctest counts that as skipped).
# Usage: tools/check-format.sh [--fix] [REPO_ROOT]
set -euo pipefail
fix=0
if [ "${1:-}" = "--fix" ]; then fix=1; shift; fi
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root"

if ! command -v clang-format >/dev/null; then
  echo "check-format: clang-format is not installed (tools/install-deps.sh installs it); not checked"
  exit 77
fi
version=$(clang-format --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$version" != "14" ]; then
  echo "check-format: clang-format $version; the tree is formatted with version 14 (Debian 12's); not checked"
  exit 77
fi

# The sources: tracked files in a git checkout, else every file below the root.
if [ -e .git ]; then
  mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' '*.inc' | grep -v '^tests/fuzz/corpus/')
else
  mapfile -t files < <(find src include kernels tools tests -type f \
    \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) -not -path 'tests/fuzz/corpus/*' | sort)
fi

bad=0
for f in "${files[@]}"; do
  if [ "$fix" = 1 ]; then
    clang-format --style=file -i "$f"
  elif ! clang-format --style=file "$f" | cmp -s - "$f"; then
    echo "$f: not formatted (clang-format --style=file -i $f, or tools/check-format.sh --fix)"
    clang-format --style=file "$f" | diff "$f" - | head -8 | sed 's/^/    /'  || true
    bad=$((bad + 1))
  fi
done
if [ "$bad" -gt 0 ]; then
  echo "check-format: $bad of ${#files[@]} files differ from .clang-format"
  exit 1
fi
echo "check-format: ${#files[@]} files, all formatted"
