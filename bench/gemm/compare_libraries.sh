#!/usr/bin/env bash
# Single-thread sgemm speed of the BLAS libraries Debian packages, on the GEMM shapes of a
# gpt2-124m training step (bench/gemm/gemm_shapes.cc), one after the other on this machine; and
# OpenBLAS on two threads, each GEMM split in two as Loom's gemm() splits it.
#   bash bench/gemm/compare_libraries.sh        (LOOM=path/to/loom to print the FMA peak too)
# Needs libopenblas-dev; BLIS (libblis-dev) and oneDNN (libdnnl-dev) are measured when installed.
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
cat > "$out/corename.c" <<'C'
#include <stdio.h>
char* openblas_get_corename(void);
int main(void) { printf("# OpenBLAS chose its %s kernels\n", openblas_get_corename()); return 0; }
C
gcc "$out/corename.c" -lopenblas -o "$out/corename" && "$out/corename"
LOOM=${LOOM:-../../build/release/apps/loom}
if [ -x "$LOOM" ]; then "$LOOM" bench fma --threads 1; "$LOOM" bench fma --threads 2; else echo "# no loom binary at $LOOM: FMA peak not measured"; fi
g++ -O2 -DUSE_OPENBLAS gemm_shapes.cc -I/usr/include/x86_64-linux-gnu/openblas-pthread -lopenblas -o "$out/openblas"
"$out/openblas"
"$out/openblas" split2   # two threads, split as Loom's gemm() splits
# Loom's AVX-512 kernel (src/kernels/cpu/sgemm_avx512.cc), what Loom's float GEMMs run on where the
# CPU has AVX-512 F; OpenBLAS's own choice of kernels is printed above (OPENBLAS_CORETYPE).
if grep -q avx512f /proc/cpuinfo; then
  g++ -O3 -march=x86-64-v3 -std=c++20 -DUSE_LOOM512 -I../../src gemm_shapes.cc ../../src/kernels/cpu/sgemm_avx512.cc -o "$out/loom512"
  "$out/loom512"
  "$out/loom512" split2
  for core in SkylakeX Cooperlake; do
    echo "# OpenBLAS with OPENBLAS_CORETYPE=$core"
    OPENBLAS_CORETYPE=$core "$out/openblas" | tail -1
    OPENBLAS_CORETYPE=$core "$out/openblas" split2 | tail -1
  done
fi
# Our own BLIS-style AVX2 kernel (loom_sgemm.cc), the experiment of 2026-11-30.
g++ -O3 -march=x86-64-v3 -DUSE_LOOM gemm_shapes.cc loom_sgemm.cc -o "$out/loom"
"$out/loom"
"$out/loom" split2
if [ -f /usr/include/x86_64-linux-gnu/blis.h ] || [ -f /usr/include/blis/blis.h ]; then
  g++ -O2 -DUSE_BLIS gemm_shapes.cc -I/usr/include/x86_64-linux-gnu -I/usr/include/blis -lblis -o "$out/blis"
  BLIS_NUM_THREADS=1 "$out/blis"
else
  echo "# BLIS not installed (apt-get install libblis-dev)"
fi
if [ -f /usr/include/dnnl.h ]; then
  g++ -O2 -DUSE_DNNL gemm_shapes.cc -ldnnl -o "$out/onednn"
  OMP_NUM_THREADS=1 "$out/onednn"
else
  echo "# oneDNN not installed (apt-get install libdnnl-dev)"
fi
