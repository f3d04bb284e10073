#!/usr/bin/env bash
# ZeRO-1's gradient reduction (docs/data_parallel.md, "Stage 1"): each unit reduce-scattered once a
# step, then the updated chunks all-gathered, against the buckets' all-reduce plus the gather that
# Loom ran before 2026-12-07 (give that build's binary as OLD=...). configs/bench-s.toml (13.9 M
# parameters) on the synthetic corpus, dp = 4 thread ranks of one compute thread, ZeRO-1, for
# STEPS steps, with 1 and 4 micro-batches a step. Per run: what a rank sends on a ring for the
# step's gradient reduction and parameter gather (modelled from the gradient buffer's bytes G:
# all-reduce 2(N−1)/N·G, reduce-scatter and all-gather (N−1)/N·G each), rank 0's median time
# blocked on dp communication (comm_ms.dp) and step time, and the last loss (the same run to
# rounding).
#   bench/zero1_reduce_scatter.sh [LOOM_BINARY]     (STEPS=30, OLD=an older loom binary)
source "$(dirname "$0")/common.sh"
bench_setup "${1:-}" 30
binaries=("reduce-scatter:$loom")
[[ -n ${OLD:-} ]] && binaries+=("all-reduce:$OLD")
echo "# $(date -u +%F) configs/bench-s.toml, $steps steps, dp = 4, ZeRO-1, 1 thread a rank, $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
printf '%-14s %-7s %16s %12s %9s %9s\n' reduction micro "ring MiB/step" "dp wait ms" "step ms" loss
for micro in 1 4; do
  for b in "${binaries[@]}"; do
    bench_train "${b#*:}" configs/bench-s.toml --set train.eval_every=0 \
      --set train.warmup_steps=$((steps / 10)) --set data.val="" --set runtime.ranks=4 \
      --set runtime.threads_per_rank=1 --set parallel.dp=4 --set parallel.zero=1 \
      --set train.batch_size=16 --set train.micro_batch_size=$((16 / 4 / micro))
    name=${b%%:*}
    jq -rs --arg all_reduce "$([[ $name == all-reduce ]] && echo 1 || echo 0)" "$bench_median"'
      (.[0].mem_grads_mb) as $g |
      (if $all_reduce == "1" then 2 * 3 / 4 * $g + 3 / 4 * $g else 2 * 3 / 4 * $g end) as $ring |
      "\($ring)\t\([.[1:][] | .comm_ms.dp] | median)\t\([.[1:][] | .step_ms] | median)\t\(.[-1].loss)"' \
      "$dir/run/metrics.jsonl" | while IFS=$'\t' read -r ring wait ms last; do
      printf '%-14s %-7s %16.1f %12.1f %9.1f %9.4f\n' "$name" "$micro" "$ring" "$wait" "$ms" "$last"
    done
  done
done
