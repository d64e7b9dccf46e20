# weightsync images: one file, two targets (`make image` builds both).
#   docker build --target operator -t ghcr.io/weightsync/weightsync-operator:0.1.0 .   kopf, kubernetes, pydantic: no torch
#   docker build --target agent    -t ghcr.io/weightsync/weightsync-agent:0.1.0 .      + torch, numpy, xxhash, nixl
# The wheel is built once (stage `builder`); each target installs it, the operator without extras and the
# agent with `[agent,gdr]`, both under constraints.txt: the exact versions the test environment runs (one
# lock for the venv and the images). Both run as UID/GID 65532 (the chart's runAsUser), start a console
# script and record their packages in /usr/share/weightsync/pip-freeze.txt.
# Downloads are kept between builds in a wheelhouse cache mount (never in a layer): `pip download` skips the
# files it finds there and `pip install --no-index` installs from it. (pip's own HTTP cache is not enough:
# behind some proxies it stores nothing.) A CA bundle for pip, where the network needs one, comes in as
# the build secret `pip_ca` (`make image` passes the host's).
# `make image` builds both with Docker or, without a Docker engine, with buildah (images/build.sh);
# `make base-image` assembles a fallback base from Debian's packages (images/base-image.sh).
# Checked in CI without a Docker engine: hadolint and tests/docker/ (pinned bases, non-root, exec-form
# entrypoints that are console scripts of pyproject.toml, COPY sources, no torch in the operator), and the
# operator image is built and inspected (tests/docker/test_built_images.py).
#
# The base is pinned to a full patch version and Debian release. To pin the digest as well (recommended
# for releases), resolve it where a registry is reachable and pass it in, e.g.
#   docker buildx imagetools inspect python:3.11.15-slim-bookworm      (or: crane digest python:3.11.15-slim-bookworm)
#   make image PYTHON_IMAGE=python:3.11.15-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm

# --- builder: the weightsync wheel, built once --------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Every folder of [tool.setuptools] package-dir (tests/docker checks that none is missing).
COPY pyproject.toml README.md constraints.txt ./
COPY weightsync ./weightsync
COPY crds ./crds
COPY operator ./operator
COPY agent ./agent
COPY e2e ./e2e
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && set -- /wheels/weightsync-*.whl && test "$#" = 1 && test -f "$1" \
    && cp constraints.txt /wheels/

# --- runtime: what both targets share ---------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 65532 weightsync \
    && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/weightsync --shell /usr/sbin/nologin weightsync
LABEL org.opencontainers.image.source="https://github.com/weightsync/weightsync" \
      org.opencontainers.image.url="https://github.com/weightsync/weightsync" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="weightsync" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
WORKDIR /home/weightsync

# --- operator: slim, no torch -------------------------------------------------------------------------------
FROM runtime AS operator
LABEL org.opencontainers.image.title="weightsync-operator" \
      org.opencontainers.image.description="The weightsync Kubernetes operator (WeightSyncJob)."
COPY --from=builder /wheels /wheels
# The wheel is this repository's own build; every dependency is pinned by constraints.txt.
# hadolint ignore=DL3013
RUN --mount=type=cache,id=weightsync-wheelhouse,target=/var/cache/wheelhouse,sharing=locked \
    --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    pip download --no-cache-dir --dest /var/cache/wheelhouse --constraint /wheels/constraints.txt \
      /wheels/weightsync-*.whl && rm -f /var/cache/wheelhouse/weightsync-*.whl \
    && pip install --no-cache-dir --no-index --find-links /var/cache/wheelhouse \
      --constraint /wheels/constraints.txt /wheels/weightsync-*.whl && rm -rf /wheels \
    && mkdir -p /usr/share/weightsync && pip freeze > /usr/share/weightsync/pip-freeze.txt
ENV PIP_NO_CACHE_DIR=1
USER 65532:65532
ENTRYPOINT ["weightsync-operator"]

# --- agent: the sidecar (and the demo trainer / engine), with torch and nixl -------------------------------
FROM runtime AS agent
LABEL org.opencontainers.image.title="weightsync-agent" \
      org.opencontainers.image.description="The weightsync agent sidecar: moves weights between trainer and inference pods."
COPY --from=builder /wheels /wheels
# hadolint ignore=DL3013
RUN --mount=type=cache,id=weightsync-wheelhouse,target=/var/cache/wheelhouse,sharing=locked \
    --mount=type=secret,id=pip_ca \
    set -eu; if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    wheel="$(echo /wheels/weightsync-*.whl)"; \
    pip download --no-cache-dir --dest /var/cache/wheelhouse --constraint /wheels/constraints.txt "${wheel}[agent,gdr]" \
    && rm -f /var/cache/wheelhouse/weightsync-*.whl \
    && pip install --no-cache-dir --no-index --find-links /var/cache/wheelhouse \
      --constraint /wheels/constraints.txt "${wheel}[agent,gdr]" && rm -rf /wheels \
    && mkdir -p /usr/share/weightsync && pip freeze > /usr/share/weightsync/pip-freeze.txt
ENV PIP_NO_CACHE_DIR=1
USER 65532:65532
ENTRYPOINT ["weightsync-agent"]
