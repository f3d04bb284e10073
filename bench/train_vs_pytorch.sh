#!/usr/bin/env bash
# Training throughput of Loom and of PyTorch (shared/peers/gpt_bench.py) on the same machine, the
# same shapes and thread counts, one after the other. Prints one JSON line per run and a table.
#   bench/train_vs_pytorch.sh [SHAPES...]   (default: bench-s gpt2-124m)
# Environment: LOOM (binary, default ./build/release/apps/loom), STEPS (timed steps per run, 5),
# ROUNDS (repeat every measurement this many times, alternating Loom and PyTorch; the table shows
# medians over rounds — this VM's speed drifts by ±10–15% between minutes, so single runs are
# not enough to judge a 1.2× target), AS_IS=0 to skip PyTorch "as is", PRECISION=bf16 for bf16
# GEMMs on both sides (Loom's --precision bf16; PyTorch's forward under CPU autocast to bf16,
# bench/peers/gpt_bench_autocast.py), in which case "of the peak" is of the bf16 dot-product peak.
# Needs a release build (cmake --preset release && cmake --build --preset release) and, for the
# peer, PyTorch (apt-get install python3-torch; tcmalloc from libtcmalloc-minimal4 if present).
# PyTorch runs twice: with the environment as it is, and "at its best" (tcmalloc, passive OpenMP
# wait; on AVX-512 machines also OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512, as in
# shared/peers/README.md). Loom runs with the environment as it is; its OPENBLAS_CORETYPE is
# printed in its JSON. Peak resident memory: Loom's from its JSON (getrusage ru_maxrss), the
# peer's from GNU time (/usr/bin/time, apt-get install time; the same kernel counter), whole
# process, start-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
PEER=${PEER:-../shared/peers/gpt_bench.py}
PY=${PY:-/usr/bin/python3}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-1}
AS_IS=${AS_IS:-1}
PRECISION=${PRECISION:-fp32}
peer_script=$PEER
if [ "$PRECISION" = bf16 ]; then
  peer_script=bench/peers/gpt_bench_autocast.py
  export PEER_DIR=$(dirname "$PEER")
elif [ "$PRECISION" != fp32 ]; then
  echo "PRECISION=$PRECISION: expected fp32 or bf16" >&2
  exit 2
fi
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(bench-s gpt2-124m)
best_env=(OMP_WAIT_POLICY=PASSIVE)
tcm=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -f "$tcm" ] && best_env+=(LD_PRELOAD=$tcm)
if grep -q avx512f /proc/cpuinfo; then best_env+=(OPENBLAS_CORETYPE=Cooperlake ATEN_CPU_CAPABILITY=avx512); fi
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); avx512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}; precision $PRECISION; $(date -u +%F)"
have_peer=0
if [ -f "$PEER" ] && "$PY" -c "import torch" 2>/dev/null; then have_peer=1; fi
modes=(best)
[ "$AS_IS" = 1 ] && modes=(as-is best)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for shape in "${shapes[@]}"; do
    for t in 1 2; do
      echo "loom $("$LOOM" bench train --shape "$shape" --threads "$t" --steps "$STEPS" --warmup 2 --precision "$PRECISION" --json)" | tee -a "$log"
      [ $have_peer = 1 ] || continue
      for mode in "${modes[@]}"; do
        if [ $mode = best ]; then envs=("${best_env[@]}"); else envs=(); fi
        rss_file=$(mktemp)
        timed=()
        [ -x /usr/bin/time ] && timed=(/usr/bin/time -f 'MAXRSS_KB %M' -o "$rss_file")
        out=$(env "${envs[@]}" "${timed[@]}" "$PY" "$peer_script" --config "$shape" --threads "$t" --steps "$STEPS" --warmup 2 | grep '^SUMMARY' | cut -d' ' -f2-)
        rss_kb=$(awk '/^MAXRSS_KB/ {print $2}' "$rss_file")
        rm -f "$rss_file"
        # The peer's JSON with its peak RSS added, on one line.
        echo "pytorch-$mode $(echo "$out" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); r=sys.argv[1]; j["peak_rss_mb"]=int(r)/1024 if r else None; print(json.dumps(j))' "${rss_kb:-}")" | tee -a "$log"
      done
    done
  done
done
echo
"$PY" - "$log" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    side, body = line.split(" ", 1)
    j = json.loads(body)
    key = (j.get("shape") or j.get("config"), j.get("threads") or j.get("threads_per_proc"))
    runs.setdefault((side,) + key, []).append(j)
def med(side, shape, t, field, fmt):
    vals = [j[field] for j in runs.get((side, shape, t), []) if j.get(field) is not None]
    return (fmt % statistics.median(vals)) if vals else "-", (statistics.median(vals) if vals else None)
keys = sorted({k[1:] for k in runs}, key=lambda k: (k[0], k[1]))
print("| shape | threads | runs | Loom tokens/s | Loom GFLOP/s | of the peak measured in the run "
      "| PyTorch as is tokens/s | PyTorch at its best tokens/s | Loom / PyTorch at its best "
      "| Loom peak RSS MiB | PyTorch at its best peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for shape, t in keys:
    n = len(runs.get(("loom", shape, t), []))
    lt, lv = med("loom", shape, t, "tokens_per_s", "%.0f")
    lg, _ = med("loom", shape, t, "gflops", "%.1f")
    ls, sv = med("loom", shape, t, "roofline_share", "%.2f")
    ai, _ = med("pytorch-as-is", shape, t, "tokens_per_s", "%.0f")
    pb, pv = med("pytorch-best", shape, t, "tokens_per_s", "%.0f")
    lr, _ = med("loom", shape, t, "peak_rss_mb", "%.0f")
    pr, _ = med("pytorch-best", shape, t, "peak_rss_mb", "%.0f")
    ratio = "%.2f×" % (lv / pv) if lv and pv else "-"
    share = "%.0f%%" % (100 * sv) if sv is not None else "-"
    print(f"| {shape} | {t} | {n} | {lt} | {lg} | {share} | {ai} | {pb} | {ratio} | {lr} | {pr} |")
for shape in sorted({k[0] for k in keys}):
    one = [j["tokens_per_s"] for j in runs.get(("loom", shape, 1), [])]
    two = [j["tokens_per_s"] for j in runs.get(("loom", shape, 2), [])]
    if one and two:
        print(f"\nLoom {shape}: 2 threads / 1 thread = {statistics.median(two) / statistics.median(one):.2f}× "
              f"(medians; per round: {', '.join('%.2f' % (b / a) for a, b in zip(one, two))})")
PY
