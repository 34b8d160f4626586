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
  python3-venv python3-pip          # tests: the reference's virtual environment (below)
  python3-jinja2                     # tests: jinja2 itself, beside transformers' templates
  clang libclang-rt-14-dev           # fuzz harnesses (libFuzzer), tools/fuzz.sh
  clang-format                       # tests: sources formatted (tools/check-format.sh)
  fortunes                           # English text for the embedded default config
)

# The tests' reference is the transformers users have: the releases pinned here, from PyPI,
# in a virtual environment of Debian's python3 (transformers 5 needs a newer torch than
# Debian 12's). tests/CMakeLists.txt runs the reference scripts with its python.
venv="${FUYOU_VENV:-/opt/fuyou-venv}"
reference_pins=(torch==2.15.0 transformers==5.23.0 peft==0.21.2 safetensors==0.8.0
                tokenizers==0.23.3 numpy==2.4.6 jinja2==3.1.6)

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
want="${reference_pins[*]}"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.fuyou-pins" 2>/dev/null)" = "$want" ]; then
  echo "install-deps: the reference environment $venv is already installed"
else
  echo "install-deps: installing the reference environment $venv (${reference_pins[*]})"
  $sudo /usr/bin/python3 -m venv "$venv"
  $sudo "$venv/bin/pip" install -q --disable-pip-version-check "${reference_pins[@]}"
  echo "$want" | $sudo tee "$venv/.fuyou-pins" >/dev/null
fi
