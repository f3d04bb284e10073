#!/usr/bin/env bash
# The Dockerfile built and run as docs/deploy.md says, by hand (not in ctest: it builds an image,
# minutes, and needs a container engine):
#   1. `build -t loom-test .` from this checkout;
#   2. `run IMAGE` prints loom's help (loom is the entry point);
#   3. the quick start's corpus made inside the container (`data synth`) onto a mounted data/;
#   4. docs/deploy.md's command, `run -v runs:/loom/runs -v data:/loom/data IMAGE launch -- loom
#      train CONFIG --resume auto`, trained to the end (the reference);
#   5. the same in a container stopped with `stop` mid-run: SIGTERM to PID 1 (loom launch), passed
#      on to loom train, which saves a checkpoint at the end of its step; the container exits
#      143; run again, it resumes from that checkpoint and ends with the reference's checkpoint,
#      bit for bit;
#   6. `mpirun -np 2 loom train` inside the image (--entrypoint mpirun): one job of two ranks.
#
#   tests/deploy/container_test.sh
# Environment:
#   ENGINE        the engine command (default: docker when its daemon answers, else podman)
#   RUN_ARGS      extra options for `ENGINE run` and `ENGINE build` (e.g. ulimits a sandbox needs)
#   BASE_ROOTFS   when no registry is reachable: a Debian 12 root file system (debootstrap
#                 --variant=minbase bookworm DIR) imported as debian:12-slim, built with --pull=never
#   STEPS         training steps of the check (default 120; configs/quickstart.toml has 300)
# On the development machine (no Docker daemon, no registry; podman with runc, no cgroup v2):
#   ENGINE="podman --cgroup-manager=cgroupfs --runtime=runc" \
#   RUN_ARGS="--network=host --ulimit nofile=20000:20000 --ulimit nproc=1000:1000" \
#   BASE_ROOTFS=/tmp/rootfs tests/deploy/container_test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ -z ${ENGINE:-} ]]; then
  if docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
read -r -a engine <<<"$ENGINE"
read -r -a run_args <<<"${RUN_ARGS:-}"
STEPS=${STEPS:-120}
image=loom-test
dir=$(mktemp -d)
name=loom-test-$$
trap '"${engine[@]}" rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do [[ -f $f ]] && { echo "---- $f"; tail -n 20 "$f"; }; done; exit 1; }
t0=$SECONDS

build_args=()
if [[ -n ${BASE_ROOTFS:-} ]]; then
  tar -C "$BASE_ROOTFS" -c . | "${engine[@]}" import - debian:12-slim >/dev/null 2>&1 || fail "import of $BASE_ROOTFS failed"
  build_args+=(--pull=never)
fi
"${engine[@]}" build "${build_args[@]}" "${run_args[@]}" -t "$image" . >"$dir/build.log" 2>&1 || fail "the image did not build"
echo "built $image in $((SECONDS - t0)) s: $("${engine[@]}" image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')"

"${engine[@]}" run --rm "${run_args[@]}" "$image" >"$dir/help.log" 2>&1 || fail "loom --help failed in the container"
grep -q 'train' "$dir/help.log" || fail "expected loom's help"

mkdir -p "$dir/data" "$dir/ref" "$dir/stopped"
mounts() { echo "-v $dir/$1:/loom/runs -v $dir/data:/loom/data"; }
"${engine[@]}" run --rm "${run_args[@]}" -v "$dir/data:/loom/data" "$image" data synth --out data/synth \
  >"$dir/synth.log" 2>&1 || fail "data synth failed in the container"
train=(launch --restart-delay 0 -- loom train configs/quickstart.toml --resume auto
       --set "train.steps=$STEPS" --set train.save_every=100000 --set train.eval_every=100000)

# shellcheck disable=SC2046  # mounts: word-split on purpose
"${engine[@]}" run --rm "${run_args[@]}" $(mounts ref) "$image" "${train[@]}" >"$dir/ref.log" 2>&1 ||
  fail "the reference run failed"
grep -q "^done: step $STEPS" "$dir/ref.log" || fail "expected the reference to reach step $STEPS"

# shellcheck disable=SC2046
"${engine[@]}" run -d --name "$name" "${run_args[@]}" $(mounts stopped) "$image" "${train[@]}" >/dev/null ||
  fail "the container did not start"
for _ in $(seq 600); do
  [[ -f $dir/stopped/quickstart/metrics.jsonl && $(grep -c '"step"' "$dir/stopped/quickstart/metrics.jsonl") -ge 10 ]] && break
  sleep 0.1
done
"${engine[@]}" stop -t 60 "$name" >/dev/null || fail "stop failed"
code=$("${engine[@]}" inspect --format '{{.State.ExitCode}}' "$name")
"${engine[@]}" logs "$name" >"$dir/stopped.log" 2>&1
"${engine[@]}" rm "$name" >/dev/null
[[ $code == 143 ]] || fail "expected the stopped container to exit 143, got $code"
stop=$(grep -o "stopped by SIGTERM after step [0-9]* of $STEPS" "$dir/stopped.log" | grep -o 'step [0-9]*' | grep -o '[0-9]*') ||
  fail "expected loom train to stop on SIGTERM with a checkpoint"
# shellcheck disable=SC2046
"${engine[@]}" run --rm "${run_args[@]}" $(mounts stopped) "$image" "${train[@]}" >"$dir/resumed.log" 2>&1 ||
  fail "the resumed run failed"
grep -q "^resumed from .*/checkpoints/step_$stop\$" "$dir/resumed.log" || fail "expected a resume from step_$stop"
digests() { grep -o '"xxh3_64": *"[0-9a-f]*"' "$1/state.json"; }
[[ "$(digests "$dir/stopped/quickstart/checkpoints/step_$STEPS")" == "$(digests "$dir/ref/quickstart/checkpoints/step_$STEPS")" ]] ||
  fail "the stopped and resumed run's step_$STEPS differs from the uninterrupted one's"
# 6. Open MPI in the image: two MPI processes, one job of two ranks.
mkdir -p "$dir/mpi"
# shellcheck disable=SC2046
"${engine[@]}" run --rm "${run_args[@]}" $(mounts mpi) -e OMPI_MCA_btl_vader_single_copy_mechanism=none \
  --entrypoint mpirun "$image" --allow-run-as-root --oversubscribe -np 2 loom train configs/quickstart.toml \
  --set train.steps=40 --set runtime.threads_per_rank=1 >"$dir/mpi.log" 2>&1 || fail "mpirun -np 2 loom train failed in the container"
grep -q '(2 ranks: dp 2' "$dir/mpi.log" && grep -q '^done: step 40' "$dir/mpi.log" ||
  fail "expected mpirun's two processes to train as one job of two ranks"

echo "ok: $ENGINE: built, loom is the entry point, data synth onto a volume; stopped after step $stop" \
  "(exit 143, checkpoint), resumed, step_$STEPS bit for bit the uninterrupted run's; mpirun -np 2 in the image" \
  "($((SECONDS - t0)) s in all)"
