#!/usr/bin/env bash
# Regenerates tests/data/gpt2_reference_golden.safetensors (the PyTorch reference of the GPT-2
# test). Needs a release build and PyTorch (apt-get install python3-torch, or pip install torch).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release --target loom_export_reference
tmp=$(mktemp -d)
./build/release/tools/loom_export_reference "$tmp/init.safetensors"
"${PYTHON:-python3}" tools/torch_reference.py "$tmp/init.safetensors" tests/data/gpt2_reference_golden.safetensors
rm -rf "$tmp"
