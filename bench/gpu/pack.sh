#!/usr/bin/env bash
# Packs what the GPU session runs, built here, into one git-ignored archive that travels with the
# device call (`carry: [".gpu_pack"]`), so the 15 minutes of a lent GPU go to the checks and not to
# a build that may lack Debian's libraries there:
#
#   bash bench/gpu/pack.sh        # builds the cuda preset's targets, writes .gpu_pack/loom-gpu.tar.xz
#
# The archive holds bin/ (loom and the test programs the GPU checks run, stripped) and lib/ (the
# shared libraries they need that a bare CUDA machine may lack: OpenBLAS, Open MPI, toml++,
# gfortran, ...). The CUDA libraries (cudart, cuBLASLt, NCCL) are not packed: they are large and
# come from the device machine's CUDA 13 toolkit or NCCL wheel, as they must match its driver.
# bench/gpu/run.sh uses the archive when it is there and builds from source otherwise.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUILD=build/cuda
TARGETS=(loom cuda_backend_test cuda_kernels_test gpt2_cuda_test nccl_link_test nccl_backend_test
         train_test)
cmake --preset cuda >/dev/null
cmake --build "$BUILD" --target "${TARGETS[@]}"

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib"
for t in "${TARGETS[@]}"; do
  f=$(find "$BUILD" -type f -name "$t" -perm -u+x | head -n 1)
  [[ -n $f ]] || { echo "pack: $t was not built" >&2; exit 1; }
  cp "$f" "$STAGE/bin/$t"
  strip "$STAGE/bin/$t"
done
# Libraries: everything ldd resolves except glibc's own and CUDA's.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libcuda|libcudart|libcublas|libnccl)'
for b in "$STAGE"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -L "$path" "$STAGE/lib/$name"
done
mkdir -p .gpu_pack
tar -C "$STAGE" -cJf .gpu_pack/loom-gpu.tar.xz bin lib
git rev-parse --short HEAD > .gpu_pack/commit
echo "pack: .gpu_pack/loom-gpu.tar.xz $(du -h .gpu_pack/loom-gpu.tar.xz | cut -f1) (commit $(cat .gpu_pack/commit)); libs: $(ls "$STAGE/lib" | tr '\n' ' ')"
