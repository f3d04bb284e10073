#!/usr/bin/env bash
# Fuzzes Loom's input readers (tests/fuzz/README.md) with libFuzzer, each for a while.
#   tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET (default 30)] [TARGET...]
# BUILD_DIR: a build with the fuzz targets as real fuzzers (an ASan build with Clang: the presets
# asan or cuda-emulated-asan under CC=clang CXX=clang++). Each target starts from its committed
# corpus (tests/fuzz/corpus/NAME), copied, so what a run finds does not change the tree. An input
# that fails is kept as BUILD_DIR/fuzz-artifacts/NAME/crash-* (or leak-, oom-, timeout-) and the
# script exits 1 naming it: add it to the corpus once fixed. Limits: 10 s an input, 2 GiB of
# memory, no single allocation over 1 GiB (a size read from a file must be checked before use).
set -euo pipefail
build=${1:?usage: tests/fuzz/run.sh BUILD_DIR [SECONDS] [TARGET...]}
seconds=${2:-30}
shift $(( $# >= 2 ? 2 : 1 ))
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
  echo "=== fuzz_$t: ${seconds}s from $(ls "$here/corpus/$t" | wc -l) seeds"
  if "$bin" "$work/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
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
echo "run.sh: ${#targets[@]} fuzzers, ${seconds}s each, nothing found"
