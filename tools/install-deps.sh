#!/usr/bin/env bash
# Installs what building, testing and the default training run need on Debian 12, and
# only what is missing. Run as root (or through sudo).
set -euo pipefail

packages=(
  build-essential cmake pkg-config   # compiler and build
  libdnnl-dev                        # CPU GEMMs (oneDNN); see docs/dependencies.md
  libyaml-cpp-dev libspdlog-dev nlohmann-json3-dev libcli11-dev liburing-dev
  libxxhash-dev                      # checkpoint checksums (XXH3)
  catch2                             # tests
  python3-torch python3-pip          # tests: the transformers load check of exports (below)
  python3-jinja2                     # tests: transformers' apply_chat_template (chat data)
  clang libclang-rt-14-dev           # fuzz harnesses (libFuzzer), tools/fuzz.sh
  clang-format                       # tests: sources formatted (tools/check-format.sh)
  fortunes                           # English text for the embedded default config
)

# transformers is not in Debian 12; this release is the newest pinned one that runs on
# Debian's torch 1.13 (tests/reference/check_hf_export.py loads every export with it).
transformers_pin="transformers==4.40.2"

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: every Debian package is already installed"
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if /usr/bin/python3 -c "import transformers" 2>/dev/null; then
  echo "install-deps: transformers is already installed"
else
  echo "install-deps: installing $transformers_pin for Debian's python3 (pip)"
  $sudo /usr/bin/python3 -m pip install -q --break-system-packages --root-user-action=ignore "$transformers_pin"
fi
