#!/usr/bin/env bash
# Hybrid sharding (parallel.dp_shard, docs/data_parallel.md#hybrid-sharding-paralleldp_shard)
# against plain ZeRO, in two parts.
#  1. Measured on CPU ranks: configs/quickstart.toml's model widened to d_model 256 on the
#     synthetic corpus, STEPS steps on 4 thread ranks (dp 4, 1 thread each), ZeRO-1, ZeRO-3,
#     and ZeRO-2 / ZeRO-3 sharded over 2 pairs of ranks. Per run: rank 0's state (values,
#     gradients, AdamW moments, MiB), its dp bytes per step (the payload handed to the collectives:
#     a smaller group's gathers and reduce-scatters carry bigger chunks), the part of them between
#     the replicas (all that leaves a pair: what would cross nodes were each pair a node; without
#     hybrid sharding every dp collective spans both pairs), the median step time and the last
#     loss (the layouts train one run: the losses agree to rounding).
#  2. Modelled by `loom plan` for Llama 3 8B (configs/llama3-8b.toml) on 64 H100s in nodes of 8,
#     where the difference is the network: ZeRO-3 over all 64 against ZeRO-3 sharded within each
#     node (shard8), and ZeRO-1 / ZeRO-2 for reference.
#   bench/hybrid_sharding.sh [LOOM_BINARY]     (STEPS=60)
source "$(dirname "$0")/common.sh"
bench_setup "${1:-}" 60
runs=("zero1:--set parallel.zero=1"
  "zero3:--set parallel.zero=3"
  "zero2 shard2:--set parallel.zero=2 --set parallel.dp_shard=2"
  "zero3 shard2:--set parallel.zero=3 --set parallel.dp_shard=2")
echo "# $(date -u +%F) part 1: quickstart model at d_model 256 (3.3 M parameters), $steps steps, dp 4 thread ranks of 1 thread, $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
printf '%-14s %10s %12s %16s %9s %9s\n' run "state MiB" "dp MiB/step" "replicas MiB/st" "step ms" "loss"
for run in "${runs[@]}"; do
  name=${run%%:*}
  # shellcheck disable=SC2086
  bench_train "$loom" configs/quickstart.toml --set train.eval_every=0 \
    --set train.warmup_steps=$((steps / 10)) --set model.d_model=256 --set data.val="" \
    --set train.micro_batch_size=4 --set runtime.ranks=4 --set runtime.threads_per_rank=1 \
    ${run#*:}
  m=$dir/run/metrics.jsonl
  jq -rs --arg name "$name" "$bench_median"'
    [.[-1] | .mem_params_mb + .mem_grads_mb + .mem_optimizer_mb] as [$state]
    | ([.[1:][] | .comm_bytes.dp] | median / 1048576) as $dp
    | ([.[1:][] | .comm_bytes.dp_replicate // 0] | median / 1048576) as $rep
    | ([.[1:][] | .step_ms] | median) as $ms
    | "\($name)\t\($state)\t\($dp)\t\($rep)\t\($ms)\t\(.[-1].loss)"' "$m" |
    while IFS=$'\t' read -r n state dp rep ms loss; do
      printf '%-14s %10.2f %12.2f %16.2f %9.1f %9.4f\n' "$n" "$state" "$dp" "$rep" "$ms" "$loss"
    done
done
echo
echo "# part 2: loom plan configs/llama3-8b.toml --devices 64 --hardware h100 (8 GPUs a node), dp 64"
"$loom" plan configs/llama3-8b.toml --devices 64 --hardware h100 --top 100000 --cp config \
  --schedules config | grep -E '^layout|^dp64 tp1 pp1 zero[0-3]( shard8)? ' | sort -k4,4 -k5,5
