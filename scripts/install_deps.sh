#!/usr/bin/env bash
# Installs every Debian package Loom needs to build, test and run. Used by the README quick start and
# by .ci/run. Idempotent; needs root (or sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PKGS=(cmake ninja-build g++ pkg-config libgtest-dev libopenblas-dev libtomlplusplus-dev
      nlohmann-json3-dev libcli11-dev libxxhash-dev libspdlog-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
