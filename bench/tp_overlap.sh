#!/usr/bin/env bash
# parallel.tp_backward_overlap on and off (parallel/tp_backward_overlap.h): `loom train` of a
# GPT-2-shaped model (vocabulary 8192, d_model D (384), 6 blocks, 6 heads) at seq_len T (512),
# 4 sequences a step in micro-batches of 1, on 2 thread ranks of one compute thread each, with
# tp = 2 and with tp = 2 + sequence parallelism; each setting ROUNDS times (default 3), on and
# off alternating, so that the machine's drift falls on both.
# Prints per layout and setting the median over rounds of each run's median step time (steps
# after the first 2), tokens/s, rank 0's time blocked in tp collectives a step (comm_ms.tp) and
# the last loss — the same bits on and off, as the unit tests check layer by layer.
#   bench/tp_overlap.sh                         (needs a release build)
#   ROUNDS=5 STEPS=10 D=512 bench/tp_overlap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
T=${T:-512}
D=${D:-384}
STEPS=${STEPS:-8}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
echo "# seq_len $T, d_model $D, 6 blocks, 4 sequences a step (micro-batches of 1), $STEPS steps (first 2 untimed), $ROUNDS rounds"
"$LOOM" data synth --out "$work/data" --train-tokens 400000 --val-tokens 1000 >/dev/null 2>&1
runs=()
for round in $(seq "$ROUNDS"); do
  for layout in tp2 tp2sp; do
    for overlap in on off; do
      sp=false
      [ "$layout" = tp2sp ] && sp=true
      name="${layout}_${overlap}_$round"
      cat >"$work/$name.toml" <<TOML
[model]
vocab_size = 8192
seq_len = $T
d_model = $D
n_layers = 6
n_heads = 6
[data]
train = "$work/data/train_*.bin"
[train]
steps = $STEPS
batch_size = 4
micro_batch_size = 1
eval_every = 0
save_every = 0
warmup_steps = 2
[parallel]
tp = 2
sequence_parallel = $sp
tp_backward_overlap = "$overlap"
[runtime]
ranks = 2
threads_per_rank = 1
TOML
      "$LOOM" train "$work/$name.toml" --run-dir "$work/run_$name" >/dev/null 2>&1
      runs+=("$name")
    done
  done
done
python3 - "$work" "${runs[@]}" <<'PY'
import json, statistics as st, sys
work, runs = sys.argv[1], sys.argv[2:]
by = {}
for name in runs:
    layout, overlap, _ = name.split("_")
    rows = [json.loads(l) for l in open(f"{work}/run_{name}/metrics.jsonl")]
    timed = rows[2:]
    by.setdefault((layout, overlap), []).append((
        st.median(x["step_ms"] for x in timed),
        st.median(x["tokens_per_s"] for x in timed),
        st.median(x["comm_ms"]["tp"] for x in timed),
        rows[-1]["loss"]))
print(f"{'layout':<7} {'overlap':<8} {'step ms':>8} {'tokens/s':>9} {'tp ms':>7}  last loss")
for layout in ("tp2", "tp2sp"):
    for overlap in ("on", "off"):
        r = by[(layout, overlap)]
        print(f"{layout:<7} {overlap:<8} {st.median(x[0] for x in r):8.1f} {st.median(x[1] for x in r):9.0f} "
              f"{st.median(x[2] for x in r):7.1f}  {r[0][3]!r}")
    on, off = by[(layout, "on")], by[(layout, "off")]
    same = len({x[3] for x in on + off}) == 1
    print(f"{layout}: step time on / off {st.median(x[0] for x in on) / st.median(x[0] for x in off):.3f}; "
          f"the same last loss on and off in every round: {same}")
PY
