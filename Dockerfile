# latentsweep project image: the `latentsweep` CLI (workers, study creation), the MLflow server and optuna-dashboard.
#
# CPU (default):   docker build -t latentsweep:local .
# GPU workers:     docker build -t latentsweep:cuda \
#                    --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                    --build-arg TORCH_INDEX=https://pypi.org/simple .
#                  (PyPI's Linux torch wheels are CUDA builds; or use a download.pytorch.org/whl/cuXXX index that
#                  matches the host driver), then run with `docker run --gpus all ...` or a compose device reservation.
# No registry:     deploy/base-image.sh, then --build-arg BASE_IMAGE=latentsweep-base:bookworm (deploy/README.md).
#
# Two stages: `builder` fills a virtual environment, the final stage copies it and the source. Only `builder` sees
# deploy/build-env/ (empty elsewhere; on a machine that needs a local CA bundle, pip settings or local wheels,
# deploy/build-env.sh fills it), so none of that reaches the image.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# CUDA and Debian base images ship no Python: install the distribution's python3 when the base has none. Everything
# goes into a virtual environment, because recent distributions refuse pip installs into the system Python (PEP 668).
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# pip reads this file when it exists (a missing PIP_CONFIG_FILE is ignored); see deploy/build-env/README.md.
COPY deploy/build-env/ /build-env/
ENV PIP_CONFIG_FILE=/build-env/pip.conf
RUN python3 -m venv /opt/venv

# torch first, from its own index (CPU wheels by default): the largest layer, rebuilt only when these args change.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /app
# The other dependencies, read from pyproject.toml alone, so a source change does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
        print('\n'.join(deps))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY . .
# The build's by-products and the build settings stay in this stage.
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info deploy/build-env

FROM base

COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY --from=builder /app /app
RUN useradd --create-home --uid 10001 latentsweep \
    && mkdir -p /state /mlflow-artifacts \
    && chown latentsweep /state /mlflow-artifacts

# Unprivileged at run time (uid 10001: 1000 is taken by `ubuntu` in Ubuntu 24.04 bases).
# /state: a worker's scratch files (trial checkpoints before their upload to MLflow); /mlflow-artifacts: the
# tracking server's artifact store. Both exist here so the named volumes mounted there inherit the owner.
USER 10001
ENV LATENTSWEEP_STATE_DIR=/state
CMD ["latentsweep", "--help"]
