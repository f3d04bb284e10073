#!/usr/bin/env bash
# The all-to-all dispatcher's exchange (parallel.ep_dispatch = "all_to_all", docs/moe.md) in
# blocks of exactly each destination's rows (Communicator::all_to_all_v) against blocks padded to
# the group's fullest (what Loom sent before 2026-12-07: give that build's binary as OLD=...):
# configs/moe.toml (8 experts, top 2) on the synthetic corpus for STEPS steps on 4 thread ranks
# of one compute thread (dp = ep = 4: 2 experts a rank), with the config's balance loss and with
# none (coefficient 0: routing crowds a few experts, the blocks grow uneven). Per run: rank 0's
# expert-parallel bytes per step (median; every block it hands the exchange, forward and
# backward), the median step time and the last loss (the same run either way: padding is not read).
#   bench/moe_all_to_all.sh [LOOM_BINARY]     (STEPS=100, OLD=an older loom binary)
source "$(dirname "$0")/common.sh"
bench_setup "${1:-}" 100
binaries=("exact blocks:$loom")
[[ -n ${OLD:-} ]] && binaries+=("padded blocks:$OLD")
echo "# $(date -u +%F) configs/moe.toml, $steps steps, dp = ep = 4 (all-to-all), 1 thread a rank, $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
printf '%-16s %-14s %12s %9s %9s\n' run blocks "ep MiB/step" "step ms" loss
for loss in "0.01:balance loss" "0:no balance loss"; do
  for b in "${binaries[@]}"; do
    bench_train "${b#*:}" configs/moe.toml --set train.eval_every=0 \
      --set train.warmup_steps=$((steps / 10)) --set data.val="" --set runtime.ranks=4 \
      --set runtime.threads_per_rank=1 --set parallel.dp=4 --set parallel.ep=4 \
      --set parallel.ep_dispatch=all_to_all --set train.micro_batch_size=2 \
      --set model.moe_aux_loss_coef="${loss%%:*}"
    jq -rs "$bench_median"'
      "\([.[1:][] | .comm_bytes.ep] | median / 1048576)\t\([.[1:][] | .step_ms] | median)\t\(.[-1].loss)"' \
      "$dir/run/metrics.jsonl" | while IFS=$'\t' read -r ep ms last; do
      printf '%-16s %-14s %12.2f %9.1f %9.4f\n' "${loss#*:}" "${b%%:*}" "$ep" "$ms" "$last"
    done
  done
done
