#!/usr/bin/env bash
# What train.async_checkpoint buys: `loom train` of a model of bench-s's sizes (Llama form, 12.6 M
# parameters: a checkpoint of ~150 MB — values and both Adam moments) on a synthetic corpus, a
# checkpoint every 2 steps, synchronous then asynchronous, both checkpoint formats, two thread
# ranks. Prints the training loop's seconds in saves (`done: ... s in checkpoint saves`), the
# run's wall time and tokens/s, and checks that both runs trained the same losses and kept
# byte-identical checkpoint files.
#   bench/async_checkpoint.sh            (needs a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-./build/release/apps/loom}
STEPS=${STEPS:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) x $(nproc); disk: $(df -h "$work" | tail -1 | awk '{print $1}')"
"$LOOM" data synth --out "$work/data" --train-tokens 400000 --val-tokens 1000 >/dev/null
for format in whole sharded; do
  for async in false true; do
    run="$work/run_${format}_${async}"
    cat >"$work/cfg.toml" <<TOML
[model]
arch = "llama"
vocab_size = 8192
seq_len = 256
d_model = 384
n_layers = 6
n_heads = 6
n_kv_heads = 2
ffn_hidden = 1024
[data]
train = "$work/data/train_*.bin"
[train]
steps = $STEPS
batch_size = 16
micro_batch_size = 8
save_every = 2
keep_checkpoints = 2
eval_every = 0
warmup_steps = 2
checkpoint_format = "$format"
async_checkpoint = $async
[runtime]
ranks = 2
threads_per_rank = 1
TOML
    start=$(date +%s.%N)
    done_line=$("$LOOM" train "$work/cfg.toml" --run-dir "$run" 2>&1 | grep "^done:")
    end=$(date +%s.%N)
    printf '%-8s async=%-5s wall %6.2f s | %s\n' "$format" "$async" "$(echo "$end - $start" | bc)" "$done_line"
  done
  cmp <(grep -o '"loss": [^,]*' "$work/run_${format}_false/metrics.jsonl") \
      <(grep -o '"loss": [^,]*' "$work/run_${format}_true/metrics.jsonl") && echo "  $format: the same losses"
  for step in $((STEPS - 2)) $STEPS; do
    a=$(python3 -c "import json;print(json.dumps(json.load(open('$work/run_${format}_false/checkpoints/step_$step/state.json'))['files'],sort_keys=True))")
    b=$(python3 -c "import json;print(json.dumps(json.load(open('$work/run_${format}_true/checkpoints/step_$step/state.json'))['files'],sort_keys=True))")
    [ "$a" = "$b" ] && echo "  $format: step $step's files byte-identical (digests)"
  done
done
