#!/usr/bin/env bash
# One GPU session, prepared: configure (preset cuda), build, run the GPU tests (kernels against
# the CPU, a small GPT-2 against the CPU, nccl, the trainer on cuda), time GPT-2 124M training at
# T = 1024 (tokens/s, MFU), then the whole suite, and keep every log. Meant for a device machine with ~15 minutes in all, started from the
# repository root (or anywhere: it finds the root itself):
#
#   OUT=/some/dir bash bench/gpu/run.sh          # logs and summary.txt under $OUT
#
# Every step runs under a timeout drawn from one deadline (LOOM_GPU_DEADLINE_S, default 540 s,
# inside a 600 s call), and a failing step does not stop the ones after it: the logs of a bad run
# are what the session is for. Exits non-zero when any step failed. At most 12 files land in $OUT.
#
# Knobs (environment):
#   LOOM_GPU_DEADLINE_S  seconds for the whole script (540)
#   LOOM_GPU_WERROR      ON to keep the preset's -Werror (default OFF: the device machine's
#                        compiler may warn differently, and warnings are CI's job, not this run's)
#   LOOM_DEPS_PREFIX     a prefix holding missing dependencies (added to CMAKE_PREFIX_PATH and
#                        LD_LIBRARY_PATH); .deb files carried in .debs/ are unpacked into
#                        .deps/ (never into /) and used the same way
#   NCCL_ROOT            where NCCL lives, when not in the CUDA toolkit; else the pip wheel
#                        nvidia-nccl-cu13 of the machine's python3 is tried
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-$PWD/runs/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${LOOM_GPU_DEADLINE_S:-540}))
JOBS=$(nproc)
failed=()
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME MAX_SECONDS COMMAND...: runs COMMAND into $OUT/NAME.log under min(MAX, time left).
# COMMAND may be a function of this script (exported, and run through bash).
step() {
  local name=$1 max=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if ((limit < 5)); then
    note "SKIP  $name: out of time"
    failed+=("$name")
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS rc=0
  if timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1; then
    rc=0
  else
    rc=$?
  fi
  if ((rc == 0)); then
    note "OK    $name ($((SECONDS - t0))s)"
  else
    if ((rc == 124)); then
      note "FAIL  $name: timed out after ${limit}s"
    else
      note "FAIL  $name: exit $rc ($((SECONDS - t0))s)"
    fi
    failed+=("$name")
    echo "---- last lines of $name.log ----"
    tail -n 40 "$OUT/$name.log" || true
  fi
}

environment() {
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed files"
  uname -a
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
  nvcc --version || echo "no nvcc on PATH"
  cmake --version | head -n 1 || true
  ninja --version || true
  c++ --version | head -n 1 || true
  for h in /usr/local/cuda/include/nccl.h /usr/include/nccl.h; do [[ -e $h ]] && echo "NCCL header: $h"; done
  python3 -c 'import nvidia.nccl; print("NCCL wheel:", list(nvidia.nccl.__path__)[0])' 2>/dev/null || true
}
export -f environment

# ---- 1. environment, dependencies -------------------------------------------------------------
step env 60 environment
if [[ -x scripts/install_deps.sh ]]; then
  step deps 90 scripts/install_deps.sh   # no registry is reachable on some machines: may fail
fi
PREFIXES=()
if compgen -G ".debs/*.deb" >/dev/null; then
  mkdir -p .deps
  for deb in .debs/*.deb; do dpkg -x "$deb" .deps || note "could not unpack $deb"; done
  PREFIXES+=("$PWD/.deps/usr")
fi
[[ -n ${LOOM_DEPS_PREFIX:-} ]] && PREFIXES+=("$LOOM_DEPS_PREFIX")
CONFIGURE_ARGS=(-DLOOM_WERROR="${LOOM_GPU_WERROR:-OFF}")
if ((${#PREFIXES[@]})); then
  CONFIGURE_ARGS+=("-DCMAKE_PREFIX_PATH=$(IFS=';'; echo "${PREFIXES[*]}")")
  for p in "${PREFIXES[@]}"; do
    export LD_LIBRARY_PATH="$p/lib/x86_64-linux-gnu:$p/lib/x86_64-linux-gnu/openblas-pthread:$p/lib:${LD_LIBRARY_PATH:-}"
  done
fi
if [[ -z ${NCCL_ROOT:-} && ! -e /usr/local/cuda/include/nccl.h && ! -e /usr/include/nccl.h ]]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
fi
[[ -n ${NCCL_ROOT:-} ]] && CONFIGURE_ARGS+=("-DNCCL_ROOT=$NCCL_ROOT") && export LD_LIBRARY_PATH="$NCCL_ROOT/lib:${LD_LIBRARY_PATH:-}"

# ---- 2. configure and build (ninja -k 0: build every target that can be built) -----------------
step configure 120 cmake --preset cuda "${CONFIGURE_ARGS[@]}"
step build 300 cmake --build --preset cuda -j "$JOBS" -- -k 0
if [[ -f "$OUT/build.log" ]]; then
  note "      build: $(grep -c 'warning:' "$OUT/build.log" || true) warning lines, $(grep -c 'error:' "$OUT/build.log" || true) error lines"
fi

# ---- 3. the GPU tests: every CUDA kernel against the CPU's, the small GPT-2 on the GPU against
# the CPU, nccl as a group of one, and the trainer on runtime.device = "cuda" ---------------------
gpu_tests() {
  ctest --preset cuda -L cuda --timeout 100 || return 1
  ctest --preset cuda -R 'CudaDevice' --timeout 100
}
export -f gpu_tests
step ctest_cuda 150 gpu_tests

# ---- 4. speed: the GPU's own dense GEMM rates (cuBLASLt, 8192³), then GPT-2 124M at T = 1024,
# batch 16: bf16 GEMM inputs (fp32 weights and everything else; MFU against the measured bf16
# rate, the issue's ~790 TFLOP/s when the measurement failed), then TF32, then pure fp32. --------
LOOM=build/cuda/apps/loom
peaks() {
  for p in bf16 tf32 fp32; do "$LOOM" bench gemm --device cuda --precision "$p" --n 8192 --iters 10 || return 1; done
}
export -f peaks
export LOOM
step gemm_peak 60 peaks
peak_of() {
  local v
  v=$(grep "\"precision\": \"$1\"" "$OUT/gemm_peak.log" 2>/dev/null | sed -n 's/.*"tflops": \([0-9.]*\).*/\1/p' | tail -n 1)
  echo "${v:-$2}"
}
BF16_PEAK=$(peak_of bf16 790)
TF32_PEAK=$(peak_of tf32 494.7)
FP32_PEAK=$(peak_of fp32 67)
note "      peaks (TFLOP/s): bf16 $BF16_PEAK, tf32 $TF32_PEAK, fp32 $FP32_PEAK"
step bench_gpt2_bf16 150 "$LOOM" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 20 --warmup 3 --precision bf16 --peak-tflops "$BF16_PEAK" --json
step bench_gpt2_tf32 60 "$LOOM" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 8 --warmup 2 --precision tf32 --peak-tflops "$TF32_PEAK" --json
step bench_gpt2_fp32 60 "$LOOM" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 4 --warmup 1 --precision fp32 --peak-tflops "$FP32_PEAK" --json
for name in bench_gpt2_bf16 bench_gpt2_tf32 bench_gpt2_fp32; do
  [[ -f "$OUT/$name.log" ]] && note "      $name: $(grep -o '{.*}' "$OUT/$name.log" | tail -n 1)"
done

# ---- 5. everything else, as time allows ---------------------------------------------------------
step ctest_all 240 ctest --preset cuda -j "$JOBS" --timeout 200
for name in ctest_cuda ctest_all; do
  # Skips are counted: a GPU run whose GPU tests all skipped proves nothing.
  [[ -f "$OUT/$name.log" ]] && note "      $name: $(grep -E 'tests passed|tests failed' "$OUT/$name.log" | tail -n 1), $(grep -c '(Skipped)' "$OUT/$name.log" || true) skipped"
done

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,temperature.gpu --format=csv >>"$OUT/env.log" 2>&1 || true
fi
echo "== summary (also in $SUMMARY)"
cat "$SUMMARY"
if ((${#failed[@]})); then
  echo "failed steps: ${failed[*]}"
  exit 1
fi
