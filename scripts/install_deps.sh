#!/usr/bin/env bash
# Installs every Debian package Loom needs to build, test and run. Used by the README quick start and
# by .ci/run. Idempotent; needs root (or sudo).
#   scripts/install_deps.sh [--no-test-tools | --runtime]
# --no-test-tools leaves out what only the tests use beyond the build: Slurm and munge, for the
# test that runs deploy/slurm/train.sbatch on a one-node Slurm (tests/deploy/slurm_test.sh; it
# starts its own daemons, none is enabled here). The container image's build stage passes it.
# --runtime installs only what a built `loom` needs to run (the shared libraries it links, and
# mpirun): the container image's final stage (Dockerfile).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PKGS=(cmake ninja-build g++ pkg-config libgtest-dev libopenblas-dev libtomlplusplus-dev
      nlohmann-json3-dev libcli11-dev libxxhash-dev libspdlog-dev libopenmpi-dev openmpi-bin
      libpcre2-dev libutf8proc-dev zlib1g-dev libzstd-dev libsnappy-dev libbrotli-dev liblz4-dev)
TEST_TOOLS=(slurmctld slurmd slurm-client munge)
RUNTIME=(libtomlplusplus3 libopenblas0-pthread openmpi-bin libpcre2-8-0 libutf8proc2 zlib1g libzstd1 libsnappy1v5 libbrotli1 liblz4-1)  # ldd build/release/apps/loom
case "${1:-}" in
  "") PKGS+=("${TEST_TOOLS[@]}") ;;
  --no-test-tools) ;;
  --runtime) PKGS=("${RUNTIME[@]}") ;;
  *) echo "install_deps.sh: unknown option '$1' (expected --no-test-tools or --runtime)" >&2; exit 2 ;;
esac
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
