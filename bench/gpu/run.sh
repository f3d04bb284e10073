#!/usr/bin/env bash
# One GPU session, prepared: the GPU tests (every CUDA kernel against the CPU's, a small GPT-2 on
# the GPU against the CPU, nccl as a group of one, the trainer on runtime.device = "cuda", `loom
# train` with a sharded checkpoint, a timeline and a resume), the
# GPU's own GEMM rates, GPT-2 124M and a Llama of 1.2 B parameters training at T = 1024 and four of
# Llama 3 8B's layers at T = 4096
# (tokens/s, MFU), then the whole suite as time allows; every log kept. For a device machine with
# ~15 minutes in all:
#
#   bash bench/gpu/pack.sh                       # here, first: prebuilt programs + libraries
#   OUT=/some/dir bash bench/gpu/run.sh          # there, with carry: [".gpu_pack"]
#
# With .gpu_pack/loom-gpu.tar.xz (bench/gpu/pack.sh) it runs the programs built here, with the
# libraries packed beside them and the machine's CUDA 13 libraries; without, it configures and
# builds the cuda preset there (minutes, and it needs Debian's libraries: see LOOM_DEPS_PREFIX).
#
# Every step runs under a timeout drawn from one deadline (LOOM_GPU_DEADLINE_S, default 540 s,
# inside a 600 s call), and a failing step does not stop the ones after it: the logs of a bad run
# are what the session is for. Exits non-zero when any step failed. At most 7 files land in $OUT
# (the device tool returns 8): setup, build, gpu_tests, bench, all_tests (.log) and summary.txt.
#
# Knobs (environment):
#   LOOM_GPU_DEADLINE_S  seconds for the whole script (540)
#   LOOM_GPU_BUILD       1 to build from source even when a pack is there
#   LOOM_GPU_WERROR      ON to keep the preset's -Werror when building (default OFF)
#   LOOM_DEPS_PREFIX     a prefix holding missing build dependencies (CMAKE_PREFIX_PATH and
#                        LD_LIBRARY_PATH); .deb files carried in .debs/ are unpacked into .deps/
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

# step NAME LOG MAX_SECONDS COMMAND...: runs COMMAND, appending to $OUT/LOG.log, under
# min(MAX, time left). COMMAND may be a function of this script (exported, and run through bash).
step() {
  local name=$1 log=$2 max=$3
  shift 3
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if ((limit < 5)); then
    note "SKIP  $name: out of time"
    failed+=("$name")
    return 0
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$log.log"
  local t0=$SECONDS rc=0
  if timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >>"$OUT/$log.log" 2>&1; then
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
    echo "---- last lines of $log.log ----"
    tail -n 40 "$OUT/$log.log" || true
  fi
}

environment() {
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed files"
  [[ -f .gpu_pack/commit ]] && echo "pack built at commit $(cat .gpu_pack/commit)"
  uname -a
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv || true
  nvcc --version || echo "no nvcc on PATH"
  cmake --version | head -n 1 || true
  ninja --version || true
  c++ --version | head -n 1 || true
  ldd --version | head -n 1 || true
  for h in /usr/local/cuda/include/nccl.h /usr/include/nccl.h; do [[ -e $h ]] && echo "NCCL header: $h"; done
  python3 -c 'import nvidia.nccl; print("NCCL wheel:", list(nvidia.nccl.__path__)[0])' 2>/dev/null || true
}
export -f environment

# ---- 1. environment; the CUDA libraries' location ----------------------------------------------
step env setup 60 environment
if [[ -z ${NCCL_ROOT:-} && ! -e /usr/local/cuda/include/nccl.h && ! -e /usr/include/nccl.h ]]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
fi
CUDA_LIBS=/usr/local/cuda/lib64:/usr/local/cuda/lib
export LD_LIBRARY_PATH="$CUDA_LIBS${NCCL_ROOT:+:$NCCL_ROOT/lib}:${LD_LIBRARY_PATH:-}"

# ---- 2. programs: unpack the pack, or build from source ----------------------------------------
if [[ -f .gpu_pack/loom-gpu.tar.xz && ${LOOM_GPU_BUILD:-0} != 1 ]]; then
  BIN=$PWD/.gpu_run/bin
  unpack() {
    rm -rf .gpu_run && mkdir -p .gpu_run && tar -C .gpu_run -xJf .gpu_pack/loom-gpu.tar.xz &&
      ls -la .gpu_run/bin && LD_LIBRARY_PATH="$PWD/.gpu_run/lib:$LD_LIBRARY_PATH" ldd .gpu_run/bin/loom
  }
  export -f unpack
  step unpack build 60 unpack
  export LD_LIBRARY_PATH="$PWD/.gpu_run/lib:$LD_LIBRARY_PATH"
else
  BIN=$PWD/build/cuda/bin-links
  if [[ -x scripts/install_deps.sh ]]; then
    step deps setup 90 scripts/install_deps.sh   # no registry is reachable on some machines
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
      export LD_LIBRARY_PATH="$p/lib/x86_64-linux-gnu:$p/lib/x86_64-linux-gnu/openblas-pthread:$p/lib:$LD_LIBRARY_PATH"
    done
  fi
  [[ -n ${NCCL_ROOT:-} ]] && CONFIGURE_ARGS+=("-DNCCL_ROOT=$NCCL_ROOT")
  step configure setup 120 cmake --preset cuda "${CONFIGURE_ARGS[@]}"
  # ninja -k 0: build every target that can be built
  step build build 300 cmake --build --preset cuda -j "$JOBS" -- -k 0
  note "      build: $(grep -c 'warning:' "$OUT/build.log" || true) warning lines, $(grep -c 'error:' "$OUT/build.log" || true) error lines"
  mkdir -p "$BIN"
  for t in loom cuda_backend_test cuda_kernels_test gpt2_cuda_test nccl_link_test nccl_backend_test train_test; do
    f=$(find build/cuda -type f -name "$t" -perm -u+x | head -n 1)
    [[ -n $f ]] && ln -sf "$PWD/$f" "$BIN/$t"
  done
fi
export BIN

# ---- 3. the GPU tests, alone on the GPU --------------------------------------------------------
gpu_tests() {
  local rc=0
  for t in cuda_backend_test cuda_kernels_test gpt2_cuda_test nccl_link_test nccl_backend_test; do
    echo "-- $t"
    "$BIN/$t" --gtest_brief=1 || rc=1
  done
  echo "-- train_test (GPU cases)"
  "$BIN/train_test" --gtest_filter='*Cuda*:*Gpu*' || rc=1
  return $rc
}
export -f gpu_tests
step gpu_tests gpu_tests 180 gpu_tests
# `loom train` on the GPU as a user runs it: bf16, a sharded checkpoint at step 4, the timeline
# of steps 2-3 and TensorBoard events, then a resume to step 8 and the checkpoints verified; the
# last step's record (step time split, MFU against the GPU's measured rate) goes to the log.
gpu_train_cli() {
  local dir
  dir=$(mktemp -d)
  "$BIN/loom" data synth --out "$dir/data" --train-tokens 400000 --val-tokens 20000 || return 1
  cat >"$dir/cfg.toml" <<TOML
[model]
vocab_size = 256
seq_len = 256
d_model = 256
n_layers = 4
n_heads = 4
[data]
train = "$dir/data/train_*.bin"
val = "$dir/data/val_*.bin"
[train]
steps = 8
batch_size = 16
micro_batch_size = 8
warmup_steps = 2
eval_every = 4
save_every = 4
checkpoint_format = "sharded"
[runtime]
device = "cuda"
matmul_precision = "bf16"
[metrics]
tensorboard = true
trace_from_step = 2
TOML
  "$BIN/loom" train "$dir/cfg.toml" --run-dir "$dir/run" --stop-after 4 --quiet &&
    "$BIN/loom" train "$dir/cfg.toml" --run-dir "$dir/run" --resume auto --quiet &&
    "$BIN/loom" checkpoint verify "$dir/run" &&
    ls "$dir/run" "$dir/run/checkpoints/step_8" && tail -n 1 "$dir/run/metrics.jsonl"
  local rc=$?
  rm -rf "$dir"
  return $rc
}
export -f gpu_train_cli
step gpu_train_cli gpu_tests 60 gpu_train_cli
count() { grep -oE "^\[  $1 *\] [0-9]+ test" "$OUT/gpu_tests.log" 2>/dev/null | awk '{s += $(NF-1)} END {print s + 0}'; }
note "      gpu_tests: $(count PASSED) passed, $(count FAILED) failed, $(count SKIPPED) skipped"

# ---- 4. speed: the GPU's dense GEMM rates (cuBLASLt, 8192³), then GPT-2 124M at T = 1024, batch
# 16: bf16 GEMM inputs (fp32 weights and everything else; MFU against the measured bf16 rate, the
# issue's ~790 TFLOP/s when the measurement failed), then TF32, then pure fp32. The fp8 E4M3
# tensor cores' block-scaled GEMM (cuda::gemm_fp8) last: a cuBLASLt without it fails only that
# line. -------------------------------------------------------------
peaks() {
  for p in bf16 fp16 tf32 fp32 fp8; do "$BIN/loom" bench gemm --device cuda --precision "$p" --n 8192 --iters 10 || return 1; done
}
export -f peaks
step gemm_peak bench 60 peaks
# The memory's own rate (device-to-device copies, read + write): what the profile's GB/s of the
# streaming kernels (LayerNorm, GELU, cross-entropy, AdamW...) are read against.
step memory_peak bench 30 "$BIN/loom" bench memory --device cuda --mib 2048 --iters 10
peak_of() {
  local v
  v=$(grep "\"precision\": \"$1\", \"n\"" "$OUT/bench.log" 2>/dev/null | sed -n 's/.*"tflops": \([0-9.]*\).*/\1/p' | tail -n 1)
  echo "${v:-$2}"
}
BF16_PEAK=$(peak_of bf16 790)
TF32_PEAK=$(peak_of tf32 494.7)
FP32_PEAK=$(peak_of fp32 67)
MEMORY_PEAK=$(grep '"copy_mib"' "$OUT/bench.log" 2>/dev/null | sed -n 's/.*"gb_per_s": \([0-9.]*\).*/\1/p' | tail -n 1)
note "      peaks (TFLOP/s): bf16 $BF16_PEAK, tf32 $TF32_PEAK, fp32 $FP32_PEAK; memory ${MEMORY_PEAK:-?} GB/s"
# The last figure bench.log holds (of shape $2, when given), labelled, into the summary.
figure() {
  local line
  line=$(grep -o '{.*"tokens_per_s".*}' "$OUT/bench.log" 2>/dev/null | grep -F "\"shape\":\"${2:-}" | tail -n 1)
  note "      $1: ${line:-no figure}"
}
step gpt2_bf16 bench 150 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 20 --warmup 3 --precision bf16 --peak-tflops "$BF16_PEAK" --json
figure "bf16, flash attention"
# Llama 3.2 1B's shape (`--shape llama-1b`: 1.24 B parameters, d_model 2048, 16 layers, 32 query
# heads sharing 8 key/value heads, SwiGLU of 8192, vocabulary 128256, tied head) at T = 1024,
# batch 4, bf16 GEMM inputs: RMSNorm, the rotary embedding with grouped-query heads and the
# SwiGLU at a real model's size, the attention on the flash kernels (head size 64). Its weights,
# gradients and Adam moments take ~20 GB; most of the step's time limit is the host initialising
# them (~1.2 B normal draws) before the first step.
step llama1b_bf16 bench 90 "$BIN/loom" bench train --shape llama-1b --device cuda --batch 4 --seq 1024 \
  --steps 10 --warmup 2 --precision bf16 --peak-tflops "$BF16_PEAK" --json
figure "llama-1b, bf16" llama-1b
# Llama 3 8B's layers, four of them (`--shape llama-8b-4l`: d_model 4096, 32 query heads of 128
# sharing 8, SwiGLU of 14336; 1.4 B parameters with the tied 128256-token embedding) at T = 4096,
# batch 2: the flash kernels at head size 128 (their dK/dV kernel spills a little: the figure to
# tune against), and the layout report's activation estimate against the measured peak.
step llama8b_layers_bf16 bench 90 "$BIN/loom" bench train --shape llama-8b-4l --device cuda \
  --batch 2 --seq 4096 --steps 6 --warmup 2 --precision bf16 --peak-tflops "$BF16_PEAK" --json
figure "llama-8b-4l, bf16" llama-8b-4l
# The same with attention through batched GEMMs and a (B·NH, T, T) score matrix: what the fused
# kernels (kernels/cuda/flash_attention.cu) buy.
step gpt2_bf16_gemm_attention bench 60 env LOOM_CUDA_FLASH_ATTENTION=0 "$BIN/loom" bench train \
  --shape gpt2-124m --device cuda --batch 16 --seq 1024 --steps 8 --warmup 2 --precision bf16 \
  --peak-tflops "$BF16_PEAK" --json
figure "bf16, attention through GEMMs"
# Where the bf16 step's time goes, by op kind (CUDA events around each op: a separate run, so
# that the events do not touch the figure above).
step gpt2_bf16_profile bench 60 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 16 \
  --seq 1024 --steps 5 --warmup 2 --precision bf16 --profile
# The MLP's GELU in its own passes instead of the GEMMs' epilogues (nn/mlp.h): what the
# cuBLASLt GELU_AUX_BIAS / DGELU epilogues buy.
step gpt2_bf16_gelu_apart bench 40 env LOOM_CUDA_GELU_EPILOGUE=0 "$BIN/loom" bench train \
  --shape gpt2-124m --device cuda --batch 16 --seq 1024 --steps 8 --warmup 2 --precision bf16 \
  --peak-tflops "$BF16_PEAK" --json
figure "bf16, GELU apart from the GEMMs"
# The weights' 16-bit copies (nn/rounded_weights.h: cast once a step) against GEMMs that cast the
# fp32 weights at every call (LOOM_CUDA_WEIGHT_COPIES=0), at 2 sequences a step, where the casts
# weigh ~8x what they do at 16.
step gpt2_bf16_b2 bench 30 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 2 \
  --seq 1024 --steps 10 --warmup 2 --precision bf16 --peak-tflops "$BF16_PEAK" --json
figure "bf16, batch 2, weight copies"
step gpt2_bf16_b2_cast bench 30 env LOOM_CUDA_WEIGHT_COPIES=0 "$BIN/loom" bench train \
  --shape gpt2-124m --device cuda --batch 2 --seq 1024 --steps 10 --warmup 2 --precision bf16 \
  --peak-tflops "$BF16_PEAK" --json
figure "bf16, batch 2, weights cast at each GEMM"
# fp8 (runtime.matmul_precision = "fp8"): the Linears' operands quantized in blocks of 128 by
# kernels/cuda/fp8.cu (the CPU's bits) before bf16 GEMMs: the quantization passes' cost; then the
# same on the E4M3 tensor cores (cuda::gemm_fp8, LOOM_CUDA_FP8_TENSOR_CORES=1: off by default
# until this machine's gpu_tests pass Fp8TensorCoreGemmIsTheQuantizedOperandsProduct).
step gpt2_fp8 bench 40 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 16 \
  --seq 1024 --steps 8 --warmup 2 --precision fp8 --peak-tflops "$BF16_PEAK" --json
figure "fp8 (quantized on the GPU, bf16 GEMMs)"
step gpt2_fp8_tensor_cores bench 40 env LOOM_CUDA_FP8_TENSOR_CORES=1 "$BIN/loom" bench train \
  --shape gpt2-124m --device cuda --batch 16 --seq 1024 --steps 8 --warmup 2 --precision fp8 \
  --peak-tflops "$BF16_PEAK" --json
figure "fp8 on the E4M3 tensor cores"
# Context parallelism's attention (`loom bench attention`): one cp rank's zigzag rows over every
# key on the flash kernels, against the whole sequence's, at Llama 3 8B's heads (32 query heads
# of 128 sharing 8) and T = 32768 for cp 2, 4 and 8: how near a rank's time comes to 1/cp of one
# device's (cp_*_efficiency 1), and the rows' TFLOP/s; and the same rows as the ring computes
# them, block by block with key positions and merged (ring_*_vs_rows: its compute against the
# gathered rows', the transfers aside). With cp 2 also the whole sequence under document masking
# (documents of 4096 tokens: 1/8 of the causal pairs; doc_fwd_ms / doc_bwd_ms against
# whole_fwd_ms / whole_bwd_ms: what the flash kernels' skipped tiles save); with cp 4 the whole
# sequence under a sliding window of 4096 (Mistral 7B v0.1's: ~1/4 of the causal pairs).
cp_attention() {
  for cp in 2 4 8; do
    docs=0
    window=0
    if [ "$cp" = 2 ]; then docs=4096; fi
    if [ "$cp" = 4 ]; then window=4096; fi
    "$BIN/loom" bench attention --device cuda --precision bf16 --seq 32768 --heads 32 \
      --kv-heads 8 --head-dim 128 --cp "$cp" --documents "$docs" --window "$window" --iters 3 \
      --json || return 1
  done
}
export -f cp_attention
step cp_attention bench 45 cp_attention
grep '"cp_fwd_efficiency"' "$OUT/bench.log" 2>/dev/null | tail -n 3 | while read -r line; do
  note "      cp attention: $line"
done
step gpt2_tf32 bench 60 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 8 --warmup 2 --precision tf32 --peak-tflops "$TF32_PEAK" --json
figure "tf32"
step gpt2_fp32 bench 60 "$BIN/loom" bench train --shape gpt2-124m --device cuda --batch 16 --seq 1024 \
  --steps 4 --warmup 1 --precision fp32 --peak-tflops "$FP32_PEAK" --json
figure "fp32"
# A mixture of experts (`--shape moe-s`: 8 SwiGLU experts 1024 wide a block, top 2; docs/moe.md)
# at bf16, 64 sequences of 256: the routing's wait a block and the experts' small GEMMs on a GPU.
step moe_bf16 bench 40 "$BIN/loom" bench train --shape moe-s --device cuda --batch 64 --seq 256 \
  --steps 8 --warmup 2 --precision bf16 --peak-tflops "$BF16_PEAK" --json
figure "mixture of experts (moe-s), bf16" moe-s

# ---- 5. everything else, as time allows (a source build only) ----------------------------------
if [[ -d build/cuda && ! -f .gpu_pack/loom-gpu.tar.xz ]] || [[ ${LOOM_GPU_BUILD:-0} == 1 ]]; then
  step all_tests all_tests 240 ctest --preset cuda -j "$JOBS" --timeout 200
  [[ -f "$OUT/all_tests.log" ]] && note "      all_tests: $(grep -E 'tests passed|tests failed' "$OUT/all_tests.log" | tail -n 1)"
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,temperature.gpu --format=csv >>"$OUT/setup.log" 2>&1 || true
fi
echo "== summary (also in $SUMMARY)"
cat "$SUMMARY"
if ((${#failed[@]})); then
  echo "failed steps: ${failed[*]}"
  exit 1
fi
