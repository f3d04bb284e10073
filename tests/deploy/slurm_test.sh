#!/usr/bin/env bash
# deploy/slurm/train.sbatch on a real Slurm: a one-node cluster started here (munged, slurmctld and
# slurmd from Debian's Slurm 22.05, all in a temporary directory on ports of their own, stopped
# at the end), the template submitted with sbatch as docs/deploy.md says, on CPU ranks: two tasks
# under `srun --mpi=pmix`, supervised by `loom launch`. Three jobs:
#   1. it trains to the end, the two tasks as one job of two ranks, and its checkpoint is bit for
#      bit `loom train --ranks 2`'s (thread ranks);
#   2. rank 0's task killed after step 3 (LOOM_TEST_FAULT=kill@3, passed on by sbatch and srun):
#      srun's --kill-on-bad-exit ends the step, loom launch runs it again from step_2, and the job
#      ends with the same checkpoint;
#   3. preempted: SIGTERM to the job's tasks while it trains (scancel --signal=TERM: how the
#      template's `#SBATCH --signal=TERM@120` reaches them before the time limit): every rank
#      stops at the same step with a checkpoint, srun exits 143 and loom launch does not restart
#      it; the next job resumes from it and ends bit for bit as the uninterrupted run.
# The sbatch command line sets what this machine has instead of the template's two nodes of
# eight GPUs: --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0.
#   slurm_test.sh LOOM_BINARY SOURCE_DIR   (ctest passes them; tests/deploy/CMakeLists.txt)
# Exits 77 (ctest: skipped) when Slurm or munge is not installed or this is not root (slurmd
# runs jobs as their user and needs root for that).
set -euo pipefail
loom=$(realpath "$1")
src=$(realpath "$2")
for tool in munged slurmctld slurmd sbatch scancel squeue scontrol; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (Debian: slurmctld slurmd slurm-client munge)"; exit 77; }
done
[[ $(id -u) == 0 ]] || { echo "SKIP: slurmd needs root"; exit 77; }

dir=$(mktemp -d)
cleanup() {
  for pid in "$dir"/slurmd.pid "$dir"/slurmctld.pid "$dir"/munge/pid; do
    [[ -f $pid ]] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 0.5
  [[ -n ${LOOM_KEEP_TEST_DIR:-} ]] && echo "kept $dir" || rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/out-*.txt "$dir"/log/*; do [[ -f $f ]] && { echo "---- $f"; tail -n 30 "$f"; }; done
  exit 1
}

# ---- the cluster: one node, localhost, with this machine's two CPUs counted as 8 ---------------
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
chmod 755 "$dir" "$dir/munge"
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
  --pid-file="$dir/munge/pid" --log-file="$dir/munge/log" --seed-file="$dir/munge/seed" ||
  fail "munged did not start"
port=$((20000 + RANDOM % 20000))
cat >"$dir/slurm.conf" <<CONF
ClusterName=loomtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
# A rank killed (job 2): the other one, waiting in a collective, gets SIGKILL this long after
# srun's --kill-on-bad-exit SIGTERM (Slurm's default is 30 s).
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" -N localhost || fail "slurmd did not start"
for _ in $(seq 100); do
  sinfo -h -o %T 2>/dev/null | grep -q '^idle' && break
  sleep 0.2
done
sinfo -h -o %T | grep -q '^idle' || fail "the node did not come up: $(sinfo -h -o '%T %E' 2>&1)"

# ---- the job ---------------------------------------------------------------------------------
"$loom" data synth --out "$dir/data" --train-tokens 20000 --val-tokens 4000 2>/dev/null
config() {  # config FILE STEPS D_MODEL SAVE_EVERY
  cat >"$1" <<TOML
[model]
vocab_size = 256
seq_len = 32
d_model = $3
n_layers = 2
n_heads = 2
[data]
train = "$dir/data/train_*.bin"
val = "$dir/data/val_*.bin"
[train]
steps = $2
batch_size = 4
micro_batch_size = 2
warmup_steps = 1
eval_every = $4
save_every = $4
keep_checkpoints = 1
TOML
}
config "$dir/short.toml" 4 16 2
# ~1000 steps/s here, but the preempted job runs with LOOM_TEST_FAULT=slow@3 (rank 0 sleeps
# 20 ms a step from step 3 on: at most 50 steps/s, 60 s to the end), so the signal lands before
# it ends however slowly this machine delivers it — under load it once took longer than all of
# the 8000 steps this run had then. The reference and the resumed job run at full speed (the
# fault strikes only in a run that started at step 0): fewer steps, less for a busy machine to
# slow down past the job's 150 s.
long_steps=3000
config "$dir/long.toml" $long_steps 64 100000

# submit NAME CONFIG RUN [sbatch options...]: the template as docs/deploy.md submits it, on what
# this machine has; its output in $dir/out-NAME.txt. With --wait, a job that has not ended in
# 150 s fails the test (instead of waiting for ctest's timeout, which leaves the daemons behind).
submit() {
  local name=$1 cfg=$2 run=$3
  shift 3
  (cd "$src" && CONFIG=$cfg RUN_DIR=$run LOOM=$loom DEVICE=cpu \
    timeout 150 sbatch --parsable --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 \
    --output="$dir/out-$name.txt" "$@" deploy/slurm/train.sbatch)
}
digests() { grep -o '"xxh3_64": *"[0-9a-f]*"' "$1/state.json"; }
reference() {  # reference CONFIG RUN: the same training on two thread ranks, outside Slurm
  "$loom" train "$1" --run-dir "$2" --ranks 2 --quiet 2>"$dir/log/reference.txt" >/dev/null ||
    fail "the reference run failed: $(cat "$dir/log/reference.txt")"
}

# 1. to the end
reference "$dir/short.toml" "$dir/ref-short"
submit plain "$dir/short.toml" "$dir/plain" --wait >/dev/null || fail "the job failed"
out=$dir/out-plain.txt
[[ $(grep -c '^loom train:' "$out") == 1 ]] || fail "expected one 'loom train:' line"
grep -q '(2 ranks: dp 2' "$out" || fail "expected the two tasks to run as one job of two ranks"
[[ $(grep -c '^done: step 4' "$out") == 1 ]] || fail "expected one 'done: step 4' line"
grep -q 'attempt 1 succeeded' "$out" || fail "expected loom launch's first attempt to succeed"
"$loom" checkpoint verify "$dir/plain" | grep -q '^ok ' || fail "the checkpoint does not verify"
[[ "$(digests "$dir/plain/checkpoints/step_4")" == "$(digests "$dir/ref-short/checkpoints/step_4")" ]] ||
  fail "the Slurm job's step_4 differs from loom train --ranks 2's"

# 2. a rank killed after step 3, the step run again from step_2
LOOM_TEST_FAULT=kill@3 submit killed "$dir/short.toml" "$dir/killed" --wait >/dev/null ||
  fail "the job with a killed rank failed"
out=$dir/out-killed.txt
grep -q 'attempt 1 failed after .*; newest checkpoint step_2 (new)' "$out" ||
  fail "expected the first attempt to fail after saving step_2"
grep -q 'attempt 2 succeeded' "$out" || fail "expected the second attempt to succeed"
[[ "$(digests "$dir/killed/checkpoints/step_4")" == "$(digests "$dir/ref-short/checkpoints/step_4")" ]] ||
  fail "the restarted job's step_4 differs from the uninterrupted run's"

# 3. preempted while training, then resumed by the next job
reference "$dir/long.toml" "$dir/ref-long"
job=$(LOOM_TEST_FAULT=slow@3 submit preempted "$dir/long.toml" "$dir/preempted")
for _ in $(seq 600); do  # until it has trained a few steps (metrics.jsonl: a line a step)
  [[ -f $dir/preempted/metrics.jsonl && $(grep -c '"step"' "$dir/preempted/metrics.jsonl") -ge 3 ]] && break
  sleep 0.1
done
signalled_at=$(grep -c '"step"' "$dir/preempted/metrics.jsonl")
scancel --signal=TERM "$job" || fail "scancel failed"
for _ in $(seq 600); do
  [[ -z $(squeue -h -j "$job" 2>/dev/null) ]] && break
  sleep 0.1
done
[[ -z $(squeue -h -j "$job" 2>/dev/null) ]] || fail "the preempted job did not end within 60 s"
out=$dir/out-preempted.txt
stop=$(grep -o "stopped by SIGTERM after step [0-9]* of $long_steps" "$out" | grep -o 'step [0-9]*' | grep -o '[0-9]*') ||
  fail "expected the job to stop on SIGTERM (did it end before the signal?)"
[[ $(grep -c '^stopped by SIGTERM' "$out") == 1 ]] || fail "expected one 'stopped by SIGTERM' line"
[[ -f $dir/preempted/checkpoints/step_$stop/state.json ]] || fail "no checkpoint at step $stop"
grep -q 'exit status 143: its ranks were stopped by SIGTERM: not restarting' "$out" ||
  fail "expected loom launch to see the stop and not restart"
grep -q 'attempt 2' "$out" && fail "loom launch restarted a job the scheduler stopped"
submit resumed "$dir/long.toml" "$dir/preempted" --wait >/dev/null || fail "the resumed job failed"
grep -q "^resumed from .*/checkpoints/step_$stop\$" "$dir/out-resumed.txt" ||
  fail "expected the next job to resume from step_$stop"
grep -q "^done: step $long_steps" "$dir/out-resumed.txt" || fail "expected the resumed job to reach step $long_steps"
[[ "$(digests "$dir/preempted/checkpoints/step_$long_steps")" == "$(digests "$dir/ref-long/checkpoints/step_$long_steps")" ]] ||
  fail "the preempted and resumed job's step_$long_steps differs from the uninterrupted run's"
echo "ok: sbatch deploy/slurm/train.sbatch on Slurm $(sinfo -V | cut -d' ' -f2): two tasks as one job, bit for bit thread ranks;" \
  "a killed rank restarted from step_2; signalled after step $signalled_at, stopped at step $stop, resumed, bit for bit"
