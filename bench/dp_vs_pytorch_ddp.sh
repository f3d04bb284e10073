#!/usr/bin/env bash
# Data-parallel training throughput: Loom `bench train --ranks R` (thread ranks, local backend,
# 1 compute thread per rank) against PyTorch DistributedDataParallel over gloo
# (shared/peers/gpt_bench.py --ddp 2, 1 thread per process), same shape, batch per rank and
# machine, one after the other. Prints one JSON line per run and a table with tokens/s and the
# fraction of step time spent waiting for communication (Loom's; the peer script does not
# separate it).
#   bench/dp_vs_pytorch_ddp.sh [SHAPE]   (default bench-s)
# Needs a release build (cmake --preset release && cmake --build --preset release) and, for the
# peer, PyTorch (apt-get install python3-torch). PyTorch runs as is and "at its best" (tcmalloc,
# passive OpenMP wait; on AVX-512 machines OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
PEER=${PEER:-../shared/peers/gpt_bench.py}
PY=${PY:-/usr/bin/python3}
STEPS=${STEPS:-5}
shape=${1:-bench-s}
best_env=(OMP_WAIT_POLICY=PASSIVE)
tcm=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -f "$tcm" ] && best_env+=(LD_PRELOAD=$tcm)
if grep -q avx512f /proc/cpuinfo; then best_env+=(OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512); fi
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); avx512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
rows=()
field() { "$PY" -c "import json,sys; j=json.load(sys.stdin); print($1)"; }
for run in "1 0" "2 0" "2 1" "2 2" "2 3"; do
  set -- $run
  out=$("$LOOM" bench train --shape "$shape" --threads 1 --ranks "$1" --zero "$2" --steps "$STEPS" --warmup 2 --json)
  echo "loom $out"
  rows+=("| Loom | $1 | $2 | $(echo "$out" | field '"%.0f | %.0f | %.1f%%" % (j["tokens_per_s"], j["step_ms"], 100 * j["comm_wait_fraction"])') |")
done
if [ -f "$PEER" ] && "$PY" -c "import torch" 2>/dev/null; then
  for mode in as-is best; do
    if [ $mode = best ]; then envs=("${best_env[@]}"); else envs=(); fi
    for ddp in 0 2; do
      out=$(env "${envs[@]}" "$PY" "$PEER" --config "$shape" --threads 1 --ddp $ddp --steps "$STEPS" --warmup 2 | grep '^SUMMARY' | cut -d' ' -f2-)
      echo "pytorch-$mode $out"
      rows+=("| PyTorch $( [ $ddp = 0 ] && echo single || echo DDP-gloo ) ($mode) | $( [ $ddp = 0 ] && echo 1 || echo $ddp ) | – | $(echo "$out" | field '"%.0f | %.0f | –" % (j["tokens_per_s"], j["median_step_ms"])') |")
    done
  done
fi
echo
echo "| run | ranks | ZeRO | tokens/s | step ms | waiting for communication |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
