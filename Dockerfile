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

# Stage 1: kvray's wheel, built from the sources. The image installs the wheel alone, so it
# runs exactly what `pip install kvray-*.whl` installs anywhere: a file the wheel lacks fails
# this build, not a replica at start. (tests/test_packaging.py builds the same wheel.)
FROM rayproject/ray:${RAY_VERSION}-${PYTHON}-${CUDA} AS wheel
WORKDIR /home/ray/kvray
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users workers/ workers/
COPY --chown=ray:users cluster/ cluster/
COPY --chown=ray:users proto/ proto/
RUN pip wheel --no-cache-dir --no-deps -w dist .

# Stage 2: the serving image.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON}-${CUDA}

ARG RAY_VERSION
ARG CUDA
ARG TORCH_VERSION=2.13.0

# torch first, from PyTorch's index for the matching CUDA: installing kvray afterwards finds
# torch satisfied and cannot pull PyPI's default build instead. Its own layer, so code changes
# do not re-download ~3 GB.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${CUDA}"

# Not a directory holding the sources: `python -m` imports from the working directory first.
WORKDIR /home/ray

# The wheel is mounted from stage 1, not copied: no layer keeps it. Pinning ray keeps pip from
# replacing the base image's Ray (the cluster's Ray must match). The `otel` extra: the OTLP
# exporter, for tracing (--otlp-endpoint, the chart's otlpEndpoint). Then every module of the
# install is imported (cluster/install_check.py), and the CLI's entry point run.
RUN --mount=type=bind,from=wheel,source=/home/ray/kvray/dist,target=/tmp/kvray-dist \
    pip install --no-cache-dir "$(echo /tmp/kvray-dist/kvray-*.whl)[otel]" \
        "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
    && python -m cluster.install_check \
    && kvray --help > /dev/null

# The CPU kernels compiled now, not on a CPU replica's first request: the library lands in the
# user's cache (~/.cache/kvray/kernels), keyed by the sources, the compiler and the CPU's
# flags, so a node whose CPU differs from the build machine's still builds its own at start.
# Prints the state the engine will log ("CPU kernels: on (AVX-512)", or "off: <reason>").
RUN python -m workers.device.layers.cpu_kernels

# Ray's images run as the unprivileged user `ray`; KubeRay starts `ray start` in this image.
USER ray
