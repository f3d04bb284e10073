#!/usr/bin/env bash
# What document masking (data.document_mask) saves in the attention: `loom bench attention` of
# one sequence (GPT-2 124M's 12 heads of 64) causal and with documents of several lengths, on
# the CPU kernel, 1 and 2 threads. Prints each run's whole-sequence lines: forward and backward
# ms, the fraction of the causal (query, key) pairs the documents leave, and masked / causal time.
#   bench/document_mask.sh           (needs a release build; LOOM=path to time another binary)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
SEQ=${SEQ:-2048}
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); loom: $LOOM;" \
  "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
for threads in 1 2; do
  for docs in 128 512 1024; do
    echo "## T $SEQ, documents of $docs, $threads thread(s)"
    "$LOOM" bench attention --seq "$SEQ" --heads 12 --head-dim 64 --cp 2 --documents "$docs" \
      --threads "$threads" --iters 3 | grep -E '^whole|^document masking'
  done
done
