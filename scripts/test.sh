#!/usr/bin/env bash
# The full test suite: install dependencies, build (warnings are errors), run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
ctest --preset release
