#!/usr/bin/env bash
# Context parallelism against the other ways of spending two ranks on long sequences: `loom
# train` of a GPT-2-shaped model (4 blocks, d_model 256, 4 heads of 64, vocabulary 8192) at
# seq_len T (default 2048) on a synthetic corpus, a global batch of 2 sequences per step, on
# thread ranks of one compute thread each (one core each on a 2-core machine):
#   one rank (2 threads) | dp 2 | tp 2 with sequence parallelism | cp 2 | cp 2 with full recompute
#   | cp 2 with the ring exchange (parallel.cp_comm = "ring")
# Prints per layout the median step time (steps after the first 2), tokens/s, the activation
# peak of rank 0 (what context parallelism is for: each rank holds T/cp positions through every
# layer, the attention alone the whole sequence's keys and values — with the ring only its own),
# cp's and tp's bytes per step and rank 0's time blocked in them, and the last loss (every
# layout trains the same run, to reduction order).
#   bench/context_parallel.sh                  (needs a release build)
#   T=4096 STEPS=6 bench/context_parallel.sh
#   LAYOUTS="one cp2 cp4" bench/context_parallel.sh   (cp4: 4 ranks — on 2 cores its time is
#                                                      oversubscribed; its memory is what it is)
#   LAYOUTS="one cp2 cp2ring cp4 cp4ring" bench/context_parallel.sh   (the two exchanges)
#   LAYOUTS="one tp2 tp2sp tp4sp" bench/context_parallel.sh   (sequence parallelism's memory)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
T=${T:-2048}
STEPS=${STEPS:-6}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "# seq_len $T, 2 sequences a step, $STEPS steps (first 2 untimed)"
"$LOOM" data synth --out "$work/data" --train-tokens 400000 --val-tokens 1000 >/dev/null 2>&1
LAYOUTS=${LAYOUTS:-one dp2 tp2sp cp2 cp2full cp2ring}
for layout in $LAYOUTS; do
  ranks=2 threads=1 par=""
  case "$layout" in
    one) ranks=1 threads=2 ;;
    dp2) par="dp = 2" ;;
    tp2) par="tp = 2" ;;
    tp2sp) par=$'tp = 2\nsequence_parallel = true' ;;
    tp4sp) ranks=4 par=$'tp = 4\nsequence_parallel = true' ;;
    cp2) par="cp = 2" ;;
    cp2full) par=$'cp = 2\nrecompute = "full"' ;;
    cp4) ranks=4 par="cp = 4" ;;
    cp2ring) par=$'cp = 2\ncp_comm = "ring"' ;;
    cp4ring) ranks=4 par=$'cp = 4\ncp_comm = "ring"' ;;
  esac
  cat >"$work/cfg.toml" <<TOML
[model]
vocab_size = 8192
seq_len = $T
d_model = 256
n_layers = 4
n_heads = 4
[data]
train = "$work/data/train_*.bin"
[train]
steps = $STEPS
batch_size = 2
micro_batch_size = 1
eval_every = 0
save_every = 0
warmup_steps = 2
[parallel]
$par
[runtime]
ranks = $ranks
threads_per_rank = $threads
TOML
  "$LOOM" train "$work/cfg.toml" --run-dir "$work/run_$layout" >/dev/null 2>&1
done
python3 - "$work" $LAYOUTS <<'PY'
import json, statistics as st, sys
work, layouts = sys.argv[1], sys.argv[2:]
print(f"{'layout':<9} {'step ms':>8} {'tokens/s':>9} {'act MB':>7} {'cp MB':>7} {'cp ms':>6} {'tp MB':>7} {'tp ms':>6}  last loss")
acts = {}
for name in layouts:
    rows = [json.loads(l) for l in open(f"{work}/run_{name}/metrics.jsonl")]
    timed = rows[2:]
    step = st.median(x["step_ms"] for x in timed)
    tps = st.median(x["tokens_per_s"] for x in timed)
    act = max(x["mem_activations_peak_mb"] for x in rows)
    acts[name] = act
    cp = rows[-1]["comm_bytes"].get("cp", 0) / 1e6
    tp = rows[-1]["comm_bytes"]["tp"] / 1e6
    # rank 0's time blocked in each axis' collectives, a step (median)
    cp_ms = st.median(x["comm_ms"].get("cp", 0) for x in timed)
    tp_ms = st.median(x["comm_ms"]["tp"] for x in timed)
    print(f"{name:<9} {step:8.1f} {tps:9.0f} {act:7.1f} {cp:7.1f} {cp_ms:6.1f} {tp:7.1f} {tp_ms:6.1f}  {rows[-1]['loss']:.10f}")
for a in ("tp2sp", "cp2", "cp2full", "cp4", "cp2ring", "cp4ring"):
    if a in acts and "one" in acts:
        print(f"activation peak {a} / one rank: {acts[a] / acts['one']:.3f}")
PY
