#!/usr/bin/env bash
# `mpirun -np 2 loom train` as a user runs it: the job trains, writes one run directory whose
# checkpoints verify, and speaks once — one "loom train:" line and one "done:" line, from world
# rank 0, not one per process. Then `loom launch` around the same mpirun, with rank 0's process
# killed after step 3: mpirun ends the job, the launcher restarts it from step_2, and it ends
# with the same step_4 checkpoint, bit for bit. And a sharded checkpoint written by the two
# processes, resumed, ends the same way. And context parallelism, expert parallelism and a
# mixture split by tensor parallelism over the two processes.
#   mpi_train_test.sh LOOM_BINARY MPIRUN [MPIRUN_ARGS...]   (ctest passes them; see CMakeLists.txt)
set -euo pipefail
loom=$1
shift
mpirun=("$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$loom" data synth --out "$dir/data" --train-tokens 20000 --val-tokens 4000 2>/dev/null
cat >"$dir/cfg.toml" <<TOML
[model]
vocab_size = 256
seq_len = 16
d_model = 16
n_layers = 1
n_heads = 2
[data]
train = "$dir/data/train_*.bin"
val = "$dir/data/val_*.bin"
[train]
steps = 4
batch_size = 4
micro_batch_size = 2
warmup_steps = 1
eval_every = 2
save_every = 2
keep_checkpoints = 1
TOML
"$@" -np 2 "$loom" train "$dir/cfg.toml" --run-dir "$dir/run" --quiet 2>"$dir/err" >/dev/null || {
  cat "$dir/err"
  exit 1
}
fail() { echo "FAIL: $*"; cat "$dir/err"; exit 1; }
[[ $(grep -c '^loom train:' "$dir/err") == 1 ]] || fail "expected one 'loom train:' line"
[[ $(grep -c '^done: step 4' "$dir/err") == 1 ]] || fail "expected one 'done: step 4' line"
grep -q '(2 ranks: dp 2' "$dir/err" || fail "expected the job to run as 2 ranks"
[[ $(ls "$dir/run/checkpoints") == step_4 ]] || fail "expected only step_4 (keep_checkpoints = 1)"
"$loom" checkpoint verify "$dir/run" | grep -q '^ok ' || fail "the checkpoint does not verify"

digests() { grep -o '"xxh3_64": *"[0-9a-f]*"' "$1/state.json"; }
LOOM_TEST_FAULT=kill@3 "$loom" launch --restart-delay 0 -- "$@" -np 2 "$loom" train "$dir/cfg.toml" \
  --run-dir "$dir/relaunched" --resume auto --quiet 2>"$dir/err" >/dev/null || fail "loom launch failed"
grep -q 'attempt 1 failed after .*; newest checkpoint step_2 (new)' "$dir/err" ||
  fail "expected the first attempt to fail after saving step_2"
grep -q 'attempt 2 succeeded' "$dir/err" || fail "expected the second attempt to succeed"
[[ "$(digests "$dir/relaunched/checkpoints/step_4")" == "$(digests "$dir/run/checkpoints/step_4")" ]] ||
  fail "the relaunched job's step_4 differs from the uninterrupted job's"

# Sharded: each process writes its own shard at step 2; resumed from it, the job ends as above.
"$@" -np 2 "$loom" train "$dir/cfg.toml" --run-dir "$dir/sharded" --quiet --stop-after 2 \
  --set train.checkpoint_format=sharded 2>"$dir/err" >/dev/null || fail "the sharded save failed"
[[ -f "$dir/sharded/checkpoints/step_2/shard_0.safetensors" && -f "$dir/sharded/checkpoints/step_2/shard_1.safetensors" ]] ||
  fail "expected one shard file per process"
"$@" -np 2 "$loom" train "$dir/cfg.toml" --run-dir "$dir/sharded" --quiet --resume auto 2>"$dir/err" >/dev/null ||
  fail "the resume from the sharded checkpoint failed"
[[ "$(digests "$dir/sharded/checkpoints/step_4")" == "$(digests "$dir/run/checkpoints/step_4")" ]] ||
  fail "the job resumed from shards differs from the uninterrupted job"
# Context parallelism over two processes: each sequence split between them, the attention's keys
# and values exchanged over MPI; the run ends with the checkpoint of the same layout on two
# thread ranks, bit for bit.
"$@" -np 2 "$loom" train "$dir/cfg.toml" --run-dir "$dir/cp_mpi" --quiet --set parallel.cp=2 \
  2>"$dir/err" >/dev/null || fail "the context-parallel job failed"
grep -q '(2 ranks: dp 1, pp 1, tp 1, cp 2' "$dir/err" || fail "expected the job to run as cp 2"
"$loom" train "$dir/cfg.toml" --run-dir "$dir/cp_threads" --quiet --ranks 2 --set parallel.cp=2 \
  2>"$dir/err" >/dev/null || fail "the context-parallel thread ranks failed"
[[ "$(digests "$dir/cp_mpi/checkpoints/step_4")" == "$(digests "$dir/cp_threads/checkpoints/step_4")" ]] ||
  fail "context parallelism over MPI differs from thread ranks"
# same_over_mpi NAME WHAT ARGS...: the job with ARGS as 2 MPI processes (run dir NAME_mpi) and as
# 2 thread ranks (NAME_threads) ends with the same step_4 checkpoint, bit for bit.
same_over_mpi() {
  local name=$1 what=$2
  shift 2
  "${mpirun[@]}" -np 2 "$loom" train "$dir/cfg.toml" --run-dir "$dir/${name}_mpi" --quiet "$@" \
    2>"$dir/err" >/dev/null || fail "$what over MPI failed"
  "$loom" train "$dir/cfg.toml" --run-dir "$dir/${name}_threads" --quiet --ranks 2 "$@" \
    2>"$dir/err" >/dev/null || fail "$what on thread ranks failed"
  [[ "$(digests "$dir/${name}_mpi/checkpoints/step_4")" == "$(digests "$dir/${name}_threads/checkpoints/step_4")" ]] ||
    fail "$what over MPI differs from thread ranks"
}
# The ring exchange (parallel.cp_comm = "ring"): the blocks and their gradients' running sums go
# rank to rank as MPI messages; the same bits as the ring on thread ranks.
same_over_mpi ring "the cp ring" --set parallel.cp=2 --set parallel.cp_comm=ring
echo "ok: one job, two ranks, one voice; killed and relaunched, the same checkpoint; sharded, the same; cp over MPI as over threads, all-gather and ring"
# Expert parallelism over two processes: a Llama mixture's 4 experts split between them, the
# tokens, their choices (i32) and weights all-gathered and the outputs reduce-scattered over MPI;
# the same bits as on two thread ranks.
mixture=(--set model.arch=llama --set model.ffn_hidden=16 --set model.moe_experts=4
  --set model.moe_top_k=2)
same_over_mpi ep "expert parallelism" "${mixture[@]}" --set parallel.ep=2 --set parallel.zero=1
# And with the all-to-all dispatcher (MPI_Alltoall of the padded rows and their experts).
same_over_mpi a2a "the all-to-all dispatcher" "${mixture[@]}" --set parallel.ep=2 \
  --set parallel.zero=1 --set parallel.ep_dispatch=all_to_all
# The mixture split by tensor parallelism (sequence parallel): each process half of every
# expert's width, the rows gathered and the partial outputs reduce-scattered over MPI.
same_over_mpi moe_tp "a tensor-parallel mixture" "${mixture[@]}" --set parallel.tp=2 \
  --set parallel.sequence_parallel=true
