#!/usr/bin/env bash
# Fuzzes Loom's input readers (tests/fuzz/README.md) with libFuzzer, each for a while.
#   tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET (default 30)] [TARGET...]
#   tests/fuzz/run.sh --ci BUILD_DIR [TARGET...]
# The first explores: a fresh random seed each run, for a time. --ci is what .ci/run does: a
# fixed seed and a fixed number of inputs a target (about 20 s each on CI's two cores), so every
# CI run tries the same inputs and its verdict can be had here before pushing — a CI that a new
# random input can fail would refuse work for a bug it did not bring. Exploring is for sessions,
# and what it finds joins the corpus (which --ci replays first).
# BUILD_DIR: a build with the fuzz targets as real fuzzers (an ASan build with Clang: the presets
# asan or cuda-emulated-asan under CC=clang CXX=clang++). Each target starts from its committed
# corpus (tests/fuzz/corpus/NAME), copied, so what a run finds does not change the tree. An input
# that fails is kept as BUILD_DIR/fuzz-artifacts/NAME/crash-* (or leak-, oom-, timeout-) and the
# script exits 1 naming it: add it to the corpus once fixed. Limits: 10 s an input, 2 GiB of
# memory, no single allocation over 1 GiB (a size read from a file must be checked before use).
set -euo pipefail
ci=0
if [ "${1:-}" = "--ci" ]; then ci=1; shift; fi
build=${1:?usage: tests/fuzz/run.sh [--ci] BUILD_DIR [SECONDS] [TARGET...]}
shift
seconds=30
if [ $ci = 0 ] && [ $# -gt 0 ]; then seconds=$1; shift; fi
# --ci's inputs a target: about 20 s each under ASan on CI's machine (a checkpoint input writes a
# checkpoint's files; a tokenizer input may parse a 27 KB tokenizer.json).
declare -A ci_runs=([checkpoint]=700 [config]=14000 [flight_dump]=30000 [hf_import]=100000
                    [safetensors]=80000 [sft]=150000 [shard]=120000 [tokenizer]=3500
                    [compressed]=40000 [parquet]=30000)
here=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then  # every target: one corpus directory each
  for d in "$here"/corpus/*/; do targets+=("$(basename "$d")"); done
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
failed=()
for t in "${targets[@]}"; do
  bin="$build/tests/fuzz/fuzz_$t"
  [ -x "$bin" ] || { echo "run.sh: no fuzzer $bin (build target loom_tests_fuzz)" >&2; exit 2; }
  help=$("$bin" -help=1 2>&1 || true)
  if [[ "$help" != *"To run fuzzing"* ]]; then
    echo "run.sh: $bin is the corpus replay, not a fuzzer (needs Clang's libFuzzer and LOOM_SANITIZE=address)" >&2
    exit 2
  fi
  mkdir -p "$work/$t" "$build/fuzz-artifacts/$t"
  cp "$here/corpus/$t/"* "$work/$t/"
  if [ $ci = 1 ]; then
    budget=(-seed=1 -runs="${ci_runs[$t]:?run.sh: no --ci input count for $t}")
    echo "=== fuzz_$t: ${ci_runs[$t]} inputs (seed 1) from $(ls "$here/corpus/$t" | wc -l) seeds"
  else
    budget=(-max_total_time="$seconds")
    echo "=== fuzz_$t: ${seconds}s from $(ls "$here/corpus/$t" | wc -l) seeds"
  fi
  if "$bin" "$work/$t" "${budget[@]}" -timeout=10 -rss_limit_mb=2048 \
       -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$t/" \
       > "$work/$t.log" 2>&1; then
    grep -E "^stat::(number_of_executed_units|new_units_added)" "$work/$t.log" | tr '\n' ' '; echo
  else
    tail -n 40 "$work/$t.log"
    failed+=("$t: $(ls -t "$build/fuzz-artifacts/$t/" | head -1)")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'run.sh: failing input (under %s/fuzz-artifacts): %s\n' "$build" "${failed[@]}" >&2
  exit 1
fi
if [ $ci = 1 ]; then echo "run.sh: ${#targets[@]} fuzzers, CI's fixed inputs, nothing found"
else echo "run.sh: ${#targets[@]} fuzzers, ${seconds}s each, nothing found"; fi
