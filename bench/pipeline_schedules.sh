#!/usr/bin/env bash
# The pipeline schedules side by side: `loom train` of a GPT-2-shaped model (8 blocks, d_model
# 384, seq_len 256, vocabulary 8192: 22 M parameters) on a synthetic corpus, pp = 2 thread ranks
# of one compute thread each (one core each on a 2-core machine), M micro-batches of 2 sequences,
# each schedule REPEAT times in turn (gpipe, 1f1b, interleaved with 2 chunks per rank, zb-h1,
# zb-interleaved with 2 chunks, zb-v with its 2 chunks in a V). Prints per schedule the median over runs of the median step time
# (steps after the first 2), rank 0's compute time (the step less its waits and the loader),
# tokens/s, the measured bubble (rank 0's time blocked receiving from
# a neighbour / step time), the unit-cost theory, the activation peak, and the last loss — the
# same for every schedule (zb-h1 bit for bit 1f1b's, zb-interleaved's and zb-v's interleaved's;
# the others to reduction order).
#   bench/pipeline_schedules.sh                (needs a release build)
#   M=16 REPEAT=5 bench/pipeline_schedules.sh
#   SCHEDULES="interleaved zb-interleaved" REPEAT=5 bench/pipeline_schedules.sh   (a subset)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
M=${M:-8}
STEPS=${STEPS:-8}
REPEAT=${REPEAT:-3}
SCHEDULES=${SCHEDULES:-gpipe 1f1b interleaved zb-h1 zb-interleaved zb-v}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "# pp 2, $M micro-batches of 2 x 256 tokens, $STEPS steps (first 2 untimed), $REPEAT runs each"
"$LOOM" data synth --out "$work/data" --train-tokens 400000 --val-tokens 1000 >/dev/null 2>&1
for run in $(seq "$REPEAT"); do
  for schedule in $SCHEDULES; do
    virtual=1
    case "$schedule" in *interleaved | zb-v) virtual=2 ;; esac
    cat >"$work/cfg.toml" <<TOML
[model]
vocab_size = 8192
seq_len = 256
d_model = 384
n_layers = 8
n_heads = 6
[data]
train = "$work/data/train_*.bin"
[train]
steps = $STEPS
batch_size = $((2 * M))
micro_batch_size = 2
eval_every = 0
save_every = 0
warmup_steps = 2
[parallel]
pp = 2
schedule = "$schedule"
virtual_stages = $virtual
[runtime]
ranks = 2
threads_per_rank = 1
TOML
    "$LOOM" train "$work/cfg.toml" --run-dir "$work/run_${schedule}_$run" >/dev/null 2>&1
  done
done
python3 - "$work" "$REPEAT" $SCHEDULES <<'PY'
import json, statistics as st, sys
work, repeat, schedules = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print(f"{'schedule':<14} {'step ms':>8} {'compute':>8} {'tokens/s':>9} {'bubble':>7} {'theory':>7} {'act MB':>7}  last loss")
steps = {}
for s in schedules:
    runs = []
    for r in range(1, repeat + 1):
        rows = [json.loads(l) for l in open(f"{work}/run_{s}_{r}/metrics.jsonl")][2:]
        runs.append(rows)
    step = st.median(st.median(x["step_ms"] for x in rows) for rows in runs)
    # rank 0's step less its waits and the loader: forward, backward, W's, optimizer
    compute = st.median(st.median(x["compute_ms"] for x in rows) for rows in runs)
    tps = st.median(st.median(x["tokens_per_s"] for x in rows) for rows in runs)
    bubble = st.median(st.median(x["bubble"] for x in rows) for rows in runs)
    act = max(x["mem_activations_peak_mb"] for rows in runs for x in rows)
    loss = runs[0][-1]["loss"]
    steps[s] = step
    print(f"{s:<14} {step:8.1f} {compute:8.1f} {tps:9.0f} {bubble:7.3f} {runs[0][0]['bubble_theory']:7.3f} {act:7.1f}  {loss:.10f}")
for a, b in [("zb-h1", "1f1b"), ("interleaved", "1f1b"), ("zb-interleaved", "interleaved"),
             ("zb-v", "interleaved"), ("zb-v", "zb-interleaved")]:
    if a in steps and b in steps:
        print(f"{a} / {b} step time: {steps[a] / steps[b]:.3f}")
PY
