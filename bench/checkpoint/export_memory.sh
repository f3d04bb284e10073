#!/usr/bin/env bash
# What `loom checkpoint export` holds in memory: a Llama of 152 M parameters (0.61 GB of f32
# weights; its largest parameters, the embedding and the untied head, 34 MB each) trained one
# step on 2 thread ranks with ZeRO-1 and saved whole and sharded, then exported from each — hf at
# fp32, and hf at bf16 split over files of at most 100MB (llm.c's format is GPT-2's). Prints per
# export the process's peak resident memory next to the model's weights and its largest
# parameter, the wall time and what it wrote, and checks that the exports from the two
# checkpoints are byte for byte the same. Export reads one parameter at a time (CheckpointReader)
# and writes each tensor as it comes, so its peak follows the largest parameter, not the model.
#   bash bench/checkpoint/export_memory.sh [LOOM_BINARY]     (default build/release/apps/loom)
set -euo pipefail
loom=${1:-build/release/apps/loom}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$loom" data synth --out "$dir/data" --train-tokens 200000 --val-tokens 1000 2>/dev/null
cat >"$dir/model.toml" <<TOML
[model]
arch = "llama"
vocab_size = 8192
seq_len = 64
d_model = 1024
n_layers = 12
n_heads = 16
n_kv_heads = 4
ffn_hidden = 2816
tie_embeddings = false
[data]
train = "$dir/data/train_*.bin"
[train]
steps = 1
batch_size = 2
micro_batch_size = 1
warmup_steps = 0
eval_every = 0
save_every = 1
[parallel]
zero = 1
[runtime]
ranks = 2
threads_per_rank = 1
TOML
for format in whole sharded; do
  "$loom" train "$dir/model.toml" --quiet --run-dir "$dir/$format" \
    --set train.checkpoint_format=$format 2>"$dir/err" || {
    cat "$dir/err"
    exit 1
  }
done
params=$(python3 -c "
import json; m = json.load(open('$dir/whole/checkpoints/step_1/state.json'))['model']['parameters']
import math; sizes = [math.prod(s) for s in m.values()]
print(sum(sizes), max(sizes))")
read -r numel largest <<<"$params"
echo "llama 152M ($(nproc) cores): weights $(echo "$numel * 4 / 1048576" | bc) MiB f32, largest parameter $(echo "$largest * 4 / 1048576" | bc) MiB"
export_one() {  # checkpoint format, name, extra flags
  local format=$1 name=$2
  shift 2
  /usr/bin/time -f "%M %e" -o "$dir/time" "$loom" checkpoint export "$dir/$format" \
    --out "$dir/out_${format}_$name" "$@" 2>"$dir/err" || {
    cat "$dir/err"
    exit 1
  }
  read -r kib seconds <"$dir/time"
  printf "%-8s %-16s peak RSS %5.0f MiB   wall %5.1f s   wrote %4.0f MiB in %d files\n" \
    "$format" "$name" "$(echo "$kib / 1024" | bc -l)" "$seconds" \
    "$(echo "$(du -sb "$dir/out_${format}_$name" | cut -f1) / 1048576" | bc -l)" \
    "$(find "$dir/out_${format}_$name" -type f | wc -l)"
}
for format in whole sharded; do
  export_one $format hf-fp32
  export_one $format hf-bf16-100MB --bf16 --max-shard-size 100MB
done
for name in hf-fp32 hf-bf16-100MB; do
  if diff -r "$dir/out_whole_$name" "$dir/out_sharded_$name" >/dev/null; then
    echo "$name: the exports of the whole and the sharded checkpoint are byte for byte the same"
  else
    echo "$name: the exports of the whole and the sharded checkpoint DIFFER" && exit 1
  fi
done
