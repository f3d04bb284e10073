#!/usr/bin/env bash
# A/B timing of two versions of Loom's AVX-512 SGEMM kernel, interleaved in one process
# (bench/gemm/sgemm_ab.cc says why).
#   bash bench/gemm/sgemm_ab.sh [REV] [B_FILE]
# A = src/kernels/cpu/sgemm_avx512.cc at git revision REV (default HEAD), B = B_FILE (default the
# working tree's). Needs a CPU with AVX-512 F.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:-HEAD}
b_file=${2:-src/kernels/cpu/sgemm_avx512.cc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
git show "$rev:src/kernels/cpu/sgemm_avx512.cc" > "$out/a.cc"
flags=(-O3 -march=x86-64-v3 -std=c++20 -Isrc)
g++ "${flags[@]}" -Dloom=loom_a -c "$out/a.cc" -o "$out/a.o"
g++ "${flags[@]}" -Dloom=loom_b -c "$b_file" -o "$out/b.o"
g++ -O2 bench/gemm/sgemm_ab.cc "$out/a.o" "$out/b.o" -o "$out/ab"
echo "# A = $rev, B = $b_file"
"$out/ab"
