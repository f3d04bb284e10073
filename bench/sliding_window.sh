#!/usr/bin/env bash
# What a sliding window (model.sliding_window) saves in the attention: `loom bench attention` of
# one sequence (12 heads of 64, GPT-2 124M's / Mistral's per-head size) causal and with windows
# of several lengths, on the CPU kernel, 1 and 2 threads. Prints each run's whole-sequence lines:
# forward and backward ms, the fraction of the causal (query, key) pairs the window leaves, and
# windowed / causal time. The work should follow the pairs (plus a query block's own rows).
#   bench/sliding_window.sh           (needs a release build; LOOM=path to time another binary)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
SEQ=${SEQ:-4096}
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); loom: $LOOM;" \
  "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
for threads in 1 2; do
  for window in 256 1024; do
    echo "## T $SEQ, sliding window of $window, $threads thread(s)"
    "$LOOM" bench attention --seq "$SEQ" --heads 12 --head-dim 64 --cp 2 --window "$window" \
      --threads "$threads" --iters 3 | grep -E '^whole|^sliding window'
  done
done
