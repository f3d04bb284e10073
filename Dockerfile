# Loom in a container: Debian 12 with the packages scripts/install_deps.sh installs, the `loom`
# command built in release. CPU ranks and MPI; a GPU image builds on an NVIDIA CUDA base instead
# (docs/deploy.md).
#
#   docker build -t loom .
#   docker run --rm -v "$PWD/runs:/loom/runs" -v "$PWD/data:/loom/data" loom \
#     launch -- loom train configs/shakespeare.toml --resume auto
FROM debian:12-slim
WORKDIR /loom
COPY . .
RUN bash scripts/install_deps.sh --no-test-tools \
 && cmake --preset release -DLOOM_TESTS=OFF \
 && cmake --build --preset release --target loom \
 && cp build/release/apps/loom /usr/local/bin/loom \
 && rm -rf build
# SIGTERM (docker stop, Kubernetes) reaches loom as PID 1: it saves a checkpoint and exits.
ENTRYPOINT ["loom"]
CMD ["--help"]
