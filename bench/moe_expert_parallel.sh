#!/usr/bin/env bash
# Expert parallelism against keeping every expert on every rank (docs/moe.md): `loom bench
# train --shape moe-s` (8 experts, top 2, 62 M parameters) on 2 data-parallel thread ranks of
# one compute thread each, under plain DDP, ZeRO-1, ZeRO-3, ep = 2 and ep = 2 with ZeRO-1, and
# ep = 2 by the all-to-all dispatcher;
# ROUNDS rounds in turn, medians of tokens/s, and rank 0's parameters and state (values,
# gradients, AdamW moments) — the memory expert parallelism exists to save.
#   bench/moe_expert_parallel.sh [LOOM_BINARY]     (ROUNDS=3 STEPS=3)
set -euo pipefail
loom=${1:-build/release/apps/loom}
rounds=${ROUNDS:-3}
steps=${STEPS:-3}
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
preload=()
[[ -f $tcmalloc ]] && preload=(env LD_PRELOAD=$tcmalloc)
layouts=("--zero 0" "--zero 1" "--zero 3" "--ep 2 --zero 0" "--ep 2 --zero 1"
  "--ep 2 --zero 0 --ep-dispatch all_to_all")
echo "# $(date -u +%F) $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}, rounds $rounds, steps $steps"
declare -A tokens state params
for ((r = 0; r < rounds; ++r)); do
  for l in "${layouts[@]}"; do
    # shellcheck disable=SC2086
    j=$("${preload[@]}" "$loom" bench train --shape moe-s --ranks 2 --threads 1 --steps "$steps" \
      --warmup 1 $l --json)
    echo "$l: $j"
    tokens[$l]+="$(jq -r .tokens_per_s <<<"$j") "
    state[$l]=$(jq -r .state_mb <<<"$j")
    params[$l]=$(jq -r .rank_parameters <<<"$j")
  done
done
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf '%-42s %12s %16s %14s\n' layout "tokens/s" "rank parameters" "state MiB"
for l in "${layouts[@]}"; do
  printf '%-42s %12.0f %16s %14.1f\n' "$l" "$(median "${tokens[$l]}")" "${params[$l]}" "${state[$l]}"
done
