# One file, two targets:
#   docker build --target operator -t weightsync-operator .   (slim: kopf, kubernetes, pydantic)
#   docker build --target agent    -t weightsync-agent .      (adds torch and nixl for the transports)
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY weightsync ./weightsync
COPY crds ./crds
COPY operator ./operator
COPY agent ./agent
COPY e2e ./e2e

FROM base AS operator
RUN pip install . && useradd --uid 65532 --no-create-home weightsync
USER 65532
ENTRYPOINT ["weightsync-operator"]

FROM base AS agent
RUN pip install '.[agent,gdr]' && useradd --uid 65532 --no-create-home weightsync
USER 65532
ENTRYPOINT ["weightsync-agent"]
