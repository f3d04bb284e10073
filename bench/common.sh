# What the training benchmarks share, sourced by them (bench/moe_*.sh, hybrid_sharding.sh,
# zero1_reduce_scatter.sh):
#   source "$(dirname "$0")/common.sh"
#   bench_setup "${1:-}" DEFAULT_STEPS   # $loom (the binary: the argument, else the release
#                                        # build's), $steps (STEPS, else the default), $dir (a
#                                        # scratch directory removed on exit) with the synthetic
#                                        # corpus in $dir/data
#   bench_train BINARY CONFIG [--set key=value ...]
#       `loom train` quietly into $dir/run (removed first) for $steps steps on that corpus, no
#       checkpoints, the rest as the caller sets
#   jq "$bench_median ..."                # a jq prelude defining median
set -euo pipefail

bench_setup() {
  loom=${1:-build/release/apps/loom}
  steps=${STEPS:-$2}
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  "$loom" data synth --out "$dir/data" 2>/dev/null
}

bench_train() {
  local binary=$1 config=$2
  shift 2
  rm -rf "$dir/run"
  "$binary" train "$config" --run-dir "$dir/run" --quiet --set train.steps="$steps" \
    --set train.save_every=0 --set data.train="$dir/data/train_*.bin" "$@" 2>/dev/null
}

# shellcheck disable=SC2034  # used by the scripts that source this file
bench_median='def median: sort | .[length / 2 | floor];'
