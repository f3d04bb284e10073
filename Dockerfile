# Loom in a container: Debian 12, the `loom` command built in release in a first stage with the
# packages scripts/install_deps.sh installs, and only what it needs to run in the image (its shared
# libraries and Open MPI's mpirun: install_deps.sh --runtime). CPU ranks and MPI; a GPU image
# builds on an NVIDIA CUDA base instead (docs/deploy.md). Checked with tests/deploy/container_test.sh.
#
#   docker build -t loom .
#   docker run --rm -v "$PWD/runs:/loom/runs" -v "$PWD/data:/loom/data" loom \
#     launch -- loom train configs/shakespeare.toml --resume auto
FROM debian:12-slim AS build
WORKDIR /loom
COPY . .
RUN bash scripts/install_deps.sh --no-test-tools \
 && cmake --preset release -DLOOM_TESTS=OFF \
 && cmake --build --preset release --target loom

FROM debian:12-slim
WORKDIR /loom
COPY scripts/install_deps.sh /tmp/install_deps.sh
RUN bash /tmp/install_deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install_deps.sh
COPY --from=build /loom/build/release/apps/loom /usr/local/bin/loom
COPY configs/ configs/
# SIGTERM (docker stop, Kubernetes) reaches loom as PID 1: it saves a checkpoint and exits.
ENTRYPOINT ["loom"]
CMD ["--help"]
