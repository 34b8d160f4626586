#!/usr/bin/env bash
# Installs what building, testing and the default training run need on Debian 12, and
# only what is missing. Run as root (or through sudo).
set -euo pipefail

packages=(
  build-essential cmake pkg-config   # compiler and build
  libdnnl-dev                        # CPU GEMMs (oneDNN); see docs/dependencies.md
  libyaml-cpp-dev libspdlog-dev nlohmann-json3-dev libcli11-dev liburing-dev
  catch2                             # tests
  clang libclang-rt-14-dev           # fuzz harnesses (libFuzzer), tools/fuzz.sh
  fortunes                           # English text for the embedded default config
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything is already installed"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
