# syntax=docker/dockerfile:1
# The kvray serving image: Ray's CUDA base image + the CUDA build of torch + kvray.
# One image for every pod of the Helm chart (head and engine workers; CPU-only installs too).
#
#   docker build -t ghcr.io/<you>/kvray:0.1.0 .
#   docker build --build-arg CUDA=cu126 -t ... .     # older drivers: another CUDA build
#
# Keep RAY_VERSION equal to the chart's ray.version (tests/helm/test_image.py checks it) and to
# the Ray of the KubeRay cluster: head and workers must run the same Ray.

ARG RAY_VERSION=2.60.0
ARG PYTHON=py311
# Ray publishes rayproject/ray:<version>-<python>-cu<XY> images (and -gpu, an alias of one).
ARG CUDA=cu128
FROM rayproject/ray:${RAY_VERSION}-${PYTHON}-${CUDA}

ARG RAY_VERSION
ARG CUDA
ARG TORCH_VERSION=2.13.0

# torch first, from PyTorch's index for the matching CUDA: installing kvray afterwards finds
# torch satisfied and cannot pull PyPI's default build instead. Its own layer, so code changes
# do not re-download ~3 GB.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${CUDA}"

WORKDIR /home/ray/kvray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users workers/ workers/
COPY --chown=ray:users cluster/ cluster/
COPY --chown=ray:users proto/ proto/

# Pinning ray keeps pip from replacing the base image's Ray (the cluster's Ray must match).
# The `otel` extra: the OTLP exporter, for tracing (--otlp-endpoint, the chart's otlpEndpoint).
RUN pip install --no-cache-dir ".[otel]" "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
    && python -c "import cluster.app, workers, kvray.v1.llm_pb2_grpc" \
    && kvray --help > /dev/null

# The CPU kernels compiled now, not on a CPU replica's first request: the library lands in the
# user's cache (~/.cache/kvray/kernels), keyed by the sources, the compiler and the CPU's
# flags, so a node whose CPU differs from the build machine's still builds its own at start.
# Prints the state the engine will log ("CPU kernels: on (AVX-512)", or "off: <reason>").
RUN python -m workers.device.layers.cpu_kernels

# Ray's images run as the unprivileged user `ray`; KubeRay starts `ray start` in this image.
USER ray
WORKDIR /home/ray
