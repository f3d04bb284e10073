#!/usr/bin/env bash
# Fine-tuning with loss masks (data.loss_mask): the quick start's small GPT-2 learns to double
# numbers from prompt-completion examples ("417 doubled is " -> "834", then a newline), packed
# and document-masked: with and without loss masks (without: every target counted, as plain
# language-model training; with: the prompts' targets out), each with positions as packed and
# restarting at each example (data.reset_position_ids: each reads as at a sequence's start, as it
# is sampled).
# Prints, for each, the share of held-out prompts it completes exactly (greedy, stopping at the
# newline: `loom sample --stop-token 10`) and its last validation loss (over the completions with
# masks, over every target without).
#   bench/sft.sh             (needs a release build; LOOM=path to time another binary; STEPS=N)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
STEPS=${STEPS:-600}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); loom: $LOOM;" \
  "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}; $STEPS steps"

# 4000 examples of 0..3999 in a fixed shuffled order; the last 10% held out (never trained on).
seq 0 3999 | shuf --random-source=<(yes) | while read -r i; do
  printf '{"prompt": "%d doubled is ", "completion": "%d"}\n' "$i" $((2 * i))
done > "$WORK/examples.jsonl"
"$LOOM" data prepare "$WORK/examples.jsonl" --sft --eot 10 --out "$WORK/data" 2>&1
held_out=$(tail -n 100 "$WORK/examples.jsonl")

for variant in "loss_mask=false" "loss_mask=true" "loss_mask=false reset_position_ids=true" \
  "loss_mask=true reset_position_ids=true"; do
  run="$WORK/run_${variant// /_}"
  sets=()
  for kv in $variant; do sets+=(--set "data.$kv"); done
  "$LOOM" train configs/quickstart.toml --run-dir "$run" --quiet "${sets[@]}" \
    --set data.train="$WORK/data/train_*.bin" --set data.val="$WORK/data/val_*.bin" \
    --set data.document_mask=true --set data.eot_token=10 \
    --set train.steps="$STEPS" --set train.warmup_steps=$((STEPS / 10)) \
    --set train.eval_every="$STEPS" --set train.save_every="$STEPS" --set train.seed=1
  val=$(grep -o '"val_loss": *[0-9.]*' "$run/metrics.jsonl" | tail -1 | grep -o '[0-9.]*$')
  right=0
  example=""
  while read -r line; do
    n=$(echo "$line" | sed -E 's/.*"prompt": "([0-9]+) .*/\1/')
    out=$("$LOOM" sample --checkpoint "$run" --prompt "$n doubled is " --tokens 8 \
            --temperature 0 --stop-token 10 --threads 2 2>/dev/null)
    [ -z "$example" ] && example="$out"
    [ "$out" = "$n doubled is $((2 * n))" ] && right=$((right + 1))
  done <<< "$held_out"
  echo "$variant: held-out prompts completed exactly: $right / 100 (first: \"$example\");" \
    "last val loss $val"
done
