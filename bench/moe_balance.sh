#!/usr/bin/env bash
# How a mixture's tokens spread over its experts under each balancing scheme (docs/moe.md):
# configs/moe.toml (4 blocks of 8 experts, top 2) on the synthetic corpus for STEPS steps with
# no balancing at all, with DeepSeek-V3's balancing biases alone (model.moe_bias_update_rate,
# no balance loss) at two rates, and with the config's own balance loss (coefficient 0.01).
# Prints, every 50 steps, moe_expert_load (the busiest expert's tokens over the mean, of the
# worst block: 1 is even, 4 is every token to one expert) and the loss, then the final
# validation loss. A training-quality comparison: the figures are the same on every machine.
# Then DeepSeek-V3's router (docs/moe.md): sigmoid scores with the balance loss, with biases
# alone, and its whole recipe (biases, a tiny loss, 4 groups of 2 experts with a token's pair from
# its best group, weights × 2.5). ONLY=REGEX runs the schemes whose names match it.
#   bench/moe_balance.sh [LOOM_BINARY]     (STEPS=300 ONLY=)
source "$(dirname "$0")/common.sh"
bench_setup "${1:-}" 300
runs=("none:--set model.moe_aux_loss_coef=0"
  "biases 0.001:--set model.moe_aux_loss_coef=0 --set model.moe_bias_update_rate=0.001"
  "biases 0.01:--set model.moe_aux_loss_coef=0 --set model.moe_bias_update_rate=0.01"
  "balance loss 0.01:"
  "sigmoid, loss 0.01:--set model.moe_router_score_function=sigmoid --set model.moe_router_z_loss_coef=0"
  "sigmoid, biases 0.001:--set model.moe_router_score_function=sigmoid --set model.moe_router_z_loss_coef=0 --set model.moe_aux_loss_coef=0 --set model.moe_bias_update_rate=0.001"
  "deepseek-v3 router:--set model.moe_router_score_function=sigmoid --set model.moe_router_z_loss_coef=0 --set model.moe_aux_loss_coef=0.0001 --set model.moe_bias_update_rate=0.001 --set model.moe_router_num_groups=4 --set model.moe_router_group_topk=1 --set model.moe_router_topk_scaling_factor=2.5")
echo "# $(date -u +%F) configs/moe.toml, $steps steps; per 50 steps: expert load / loss"
for run in "${runs[@]}"; do
  name=${run%%:*}
  [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && continue
  # shellcheck disable=SC2086
  bench_train "$loom" configs/moe.toml --set data.val="$dir/data/val_*.bin" ${run#*:}
  line=$(jq -r 'select(.step % 50 == 0) | "\(.moe_expert_load * 100 | round / 100) / \(.loss * 1000 | round / 1000)"' \
    "$dir/run/metrics.jsonl" | paste -sd ' ' | sed 's/ \([0-9.]* \/\)/  |  \1/g')
  val=$(jq -r 'select(.val_loss != null) | .val_loss' "$dir/run/metrics.jsonl" | tail -1)
  printf '%-22s %s  |  val %.4f\n' "$name" "$line" "$val"
done
