#!/usr/bin/env bash
# Two threads on one GEMM: C split into bands of rows vs bands of columns, interleaved in one
# process (best of 9, of 3 for the LM head's), with one thread as the reference; every GEMM shape
# of a gpt2-124m step. kernels/cpu/gemm.cc chooses the split by the packing each thread does
# (split_rows_of_c); this shows what each choice costs. Needs a release build.
#   bash bench/gemm/split_ab.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
g++ -O2 -std=c++20 -Isrc bench/gemm/split_ab.cc build/release/src/kernels/libloom_kernels.a \
  build/release/src/base/libloom_base.a -lopenblas -lpthread -o "$out/split_ab"
"$out/split_ab"
