#!/usr/bin/env bash
# What an expert capacity (model.moe_capacity_factor, docs/moe.md#expert-capacity) costs and
# buys: configs/moe.toml (4 blocks of 8 experts, top 2) on the synthetic corpus for STEPS steps,
# on 2 ranks of one thread each with the experts split over them (dp = ep = 2, all-to-all
# dispatch, where a capacity bounds the rows each rank's experts receive), dropless and with
# capacity factors 1.0 and 1.25 — with the config's balance loss, and with none (coefficient 0),
# where routing crowds and a capacity drops the most.
# Prints, per run: the share of choices dropped (mean over steps, and at the last step), the
# expert load at the last step (busiest expert's tokens over the mean, worst block: 4 = every
# token to one expert), the median step time and its 90th percentile, and the last validation loss.
#   bench/moe_capacity.sh [LOOM_BINARY]     (STEPS=300)
source "$(dirname "$0")/common.sh"
bench_setup "${1:-}" 300
runs=("dropless:"
  "capacity 1.25:--set model.moe_capacity_factor=1.25"
  "capacity 1.0:--set model.moe_capacity_factor=1.0"
  "capacity 1.0 position:--set model.moe_capacity_factor=1.0 --set model.moe_token_drop_policy=position"
  "no loss, dropless:--set model.moe_aux_loss_coef=0"
  "no loss, capacity 1.0:--set model.moe_aux_loss_coef=0 --set model.moe_capacity_factor=1.0")
echo "# $(date -u +%F) configs/moe.toml, $steps steps, dp = ep = 2 (all-to-all), 1 thread a rank, $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
printf '%-24s %9s %9s %6s %9s %9s %9s\n' run "dropped" "last" load "step ms" "p90 ms" "val loss"
for run in "${runs[@]}"; do
  name=${run%%:*}
  # shellcheck disable=SC2086
  bench_train "$loom" configs/moe.toml --set train.warmup_steps=$((steps / 10)) \
    --set data.val="$dir/data/val_*.bin" --set runtime.ranks=2 --set runtime.threads_per_rank=1 \
    --set parallel.dp=2 --set parallel.ep=2 --set parallel.ep_dispatch=all_to_all ${run#*:}
  m=$dir/run/metrics.jsonl
  dropped=$(jq -s '[.[] | .moe_dropped // 0] | add / length' "$m")
  last=$(jq -s '.[-1].moe_dropped // 0' "$m")
  load=$(jq -s '.[-1].moe_expert_load' "$m")
  read -r median p90 < <(jq -s '[.[1:][] | .step_ms] | sort | "\(.[length / 2 | floor]) \(.[length * 9 / 10 | floor])"' -r "$m")
  val=$(jq -r 'select(.val_loss != null) | .val_loss' "$m" | tail -1)
  printf '%-24s %8.2f%% %8.2f%% %6.2f %9.1f %9.1f %9.4f\n' "$name" "$(jq -n "$dropped * 100")" \
    "$(jq -n "$last * 100")" "$load" "$median" "$p90" "$val"
done
