#!/usr/bin/env bash
# Training throughput of Loom and of PyTorch (shared/peers/gpt_bench.py) on the same machine, the
# same shapes and thread counts, one after the other. Prints one JSON line per run and a table.
#   bench/train_vs_pytorch.sh [SHAPES...]   (default: bench-s gpt2-124m)
# Needs a release build (cmake --preset release && cmake --build --preset release) and, for the
# peer, PyTorch (apt-get install python3-torch; tcmalloc from libtcmalloc-minimal4 if present).
# PyTorch runs twice: with the environment as it is, and "at its best" (tcmalloc, passive OpenMP
# wait; on AVX-512 machines also OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512, as in
# shared/peers/README.md). Loom runs with the environment as it is; its OPENBLAS_CORETYPE is
# printed in its JSON. Peak resident memory: Loom's from its JSON (getrusage ru_maxrss), the
# peer's from /usr/bin/time (the same kernel counter), whole process, start-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
PEER=${PEER:-../shared/peers/gpt_bench.py}
PY=${PY:-/usr/bin/python3}
STEPS=${STEPS:-5}
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(bench-s gpt2-124m)
best_env=(OMP_WAIT_POLICY=PASSIVE)
tcm=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -f "$tcm" ] && best_env+=(LD_PRELOAD=$tcm)
if grep -q avx512f /proc/cpuinfo; then best_env+=(OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512); fi
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); avx512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
rows=()
# The peer's peak RSS comes from GNU time (apt-get install time); without it that column is '-'.
for shape in "${shapes[@]}"; do
  for t in 1 2; do
    loom=$("$LOOM" bench train --shape "$shape" --threads "$t" --steps "$STEPS" --warmup 2 --json)
    echo "loom $loom"
    peer_rows=()
    if [ -f "$PEER" ] && "$PY" -c "import torch" 2>/dev/null; then
      for mode in as-is best; do
        if [ $mode = best ]; then envs=("${best_env[@]}"); else envs=(); fi
        rss_file=$(mktemp)
        timed=()
        [ -x /usr/bin/time ] && timed=(/usr/bin/time -f 'MAXRSS_KB %M' -o "$rss_file")
        out=$(env "${envs[@]}" "${timed[@]}" "$PY" "$PEER" --config "$shape" --threads "$t" --steps "$STEPS" --warmup 2 | grep '^SUMMARY' | cut -d' ' -f2-)
        rss_mb=$(awk '/^MAXRSS_KB/ {printf "%.0f", $2 / 1024}' "$rss_file")
        rm -f "$rss_file"
        echo "pytorch-$mode $out peak_rss_mb=${rss_mb:--}"
        peer_rows+=("$(echo "$out" | "$PY" -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["tokens_per_s"])')")
        peer_rows+=("${rss_mb:--}")
      done
    else
      peer_rows=("-" "-" "-" "-")
    fi
    lt=$(echo "$loom" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); print("%.0f | %.1f | %.0f%% | %.0f" % (j["tokens_per_s"], j["gflops"], 100 * j["roofline_share"], j["peak_rss_mb"]))')
    rows+=("| $shape | $t | $lt | ${peer_rows[0]} | ${peer_rows[2]} | ${peer_rows[3]} |")
  done
done
echo
echo "| shape | threads | Loom tokens/s | Loom GFLOP/s | of the FMA peak measured in the run | Loom peak RSS MiB | PyTorch as is tokens/s | PyTorch at its best tokens/s | PyTorch at its best peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
