#!/usr/bin/env bash
# What an evaluation costs beyond its batches' compute when the validation split is one big shard
# (llm.c's FineWeb val shard: 100 M tokens, 200 MB): `loom train` of the quick start's model on
# two thread ranks, evaluating every step (train.eval_batches = 2) and never, the two alternating
# round by round; prints each run's wall seconds and the extra seconds per evaluation.
#   bench/eval_loading.sh            (needs a release build; LOOM=path to compare another binary)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
VAL_TOKENS=${VAL_TOKENS:-100000000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); loom: $LOOM"
"$LOOM" data synth --out "$work/data" --train-tokens 2000000 --val-tokens "$VAL_TOKENS" >/dev/null 2>&1
echo "# validation shard: $(stat -c %s "$work/data/val_000000.bin") bytes"
run() {  # $1: eval_every
  local start end
  start=$(date +%s.%N)
  "$LOOM" train configs/quickstart.toml --quiet --ranks 2 \
    --set "data.train=$work/data/train_*.bin" --set "data.val=$work/data/val_*.bin" \
    --set train.steps="$STEPS" --set train.warmup_steps=1 --set train.eval_every="$1" \
    --set train.eval_batches=2 --set train.save_every=0 --set runtime.threads_per_rank=1 \
    --run-dir "$work/run_$1" >/dev/null 2>&1
  end=$(date +%s.%N)
  awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }'
}
printf "%-6s %-22s %-22s %s\n" round "eval every step (s)" "no evaluation (s)" "extra s per evaluation"
for r in $(seq 1 "$ROUNDS"); do
  with=$(run 1)
  without=$(run 0)
  printf "%-6s %-22.2f %-22.2f %.3f\n" "$r" "$with" "$without" \
    "$(awk -v w="$with" -v o="$without" -v n="$STEPS" 'BEGIN { print (w - o) / n }')"
done
