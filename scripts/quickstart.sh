#!/usr/bin/env bash
# Quick start: install dependencies, build, make the synthetic corpus, train the default model.
# Extra arguments go to `loom train` (e.g. --set train.steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --no-test-tools  # the tests install the rest (scripts/test.sh)
cmake --preset release >/dev/null
cmake --build --preset release --target loom
[ -f data/synth/train_000000.bin ] || ./build/release/apps/loom data synth --out data/synth
./build/release/apps/loom train configs/quickstart.toml --run-dir runs/quickstart "$@"
echo "sample: ./build/release/apps/loom sample --checkpoint runs/quickstart/checkpoints/step_300 --prompt '12+34=' --tokens 40 --temperature 0"
