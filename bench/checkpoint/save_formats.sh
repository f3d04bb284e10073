#!/usr/bin/env bash
# What a checkpoint save costs in each format: gpt2-124m (124 M parameters, 1.5 GB of weights and
# AdamW moments) on 2 thread ranks with ZeRO-1, one step and one save. Prints, per format, the
# process's peak resident memory and the wall time of the run, and the same for a run that saves
# nothing: the difference is the save's. "whole" gathers the model state over dp and assembles
# it on rank 0; "sharded" has every rank write its own chunks.
#   bash bench/checkpoint/save_formats.sh [LOOM_BINARY]     (default build/release/apps/loom)
set -euo pipefail
loom=${1:-build/release/apps/loom}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$loom" data synth --out "$dir/data" --train-tokens 200000 --val-tokens 1000 2>/dev/null
run() {  # name, extra --set
  local name=$1
  shift
  /usr/bin/time -f "%M %e" -o "$dir/time" "$loom" train configs/gpt2-124m.toml --ranks 2 --quiet \
    --run-dir "$dir/$name" --set parallel.zero=1 --set train.steps=1 --set train.warmup_steps=0 --set train.eval_every=0 \
    --set model.seq_len=64 --set train.batch_size=2 --set train.micro_batch_size=1 \
    --set "data.train=$dir/data/train_*.bin" --set data.val= "$@" 2>"$dir/err" || {
    cat "$dir/err"
    exit 1
  }
  read -r kib seconds <"$dir/time"
  local bytes
  bytes=$(du -sb "$dir/$name/checkpoints" 2>/dev/null | cut -f1 || echo 0)
  printf "%-8s peak RSS %6.0f MiB   wall %5.1f s   checkpoint %5.0f MiB\n" "$name" \
    "$(echo "$kib / 1024" | bc -l)" "$seconds" "$(echo "${bytes:-0} / 1048576" | bc -l)"
  rm -rf "${dir:?}/$name"
}
echo "gpt2-124m, 2 thread ranks, ZeRO-1, one step ($(nproc) cores; OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset})"
run none --set train.save_every=0
run whole --set train.save_every=1 --set train.checkpoint_format=whole
run sharded --set train.save_every=1 --set train.checkpoint_format=sharded
