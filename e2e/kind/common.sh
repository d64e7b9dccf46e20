#!/usr/bin/env bash
# shellcheck disable=SC2034  # the defaults are used by the scripts that source this file
# Shared by the e2e/kind/ scripts (sourced, not run): defaults, logging, preflight checks.
# Every default can be overridden from the environment.
set -euo pipefail

KIND_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${KIND_DIR}/../.." && pwd)"
CHART_DIR="${REPO_ROOT}/helm/weightsync-operator"

KIND_CLUSTER_NAME="${KIND_CLUSTER_NAME:-weightsync}"
KUBE_CONTEXT="kind-${KIND_CLUSTER_NAME}"
KIND="${KIND:-kind}"
NVKIND="${NVKIND:-nvkind}"
KUBECTL="${KUBECTL:-kubectl}"
HELM="${HELM:-helm}"
DOCKER="${DOCKER:-docker}"

# The images `make image` builds: the chart's repositories and its appVersion (what helm install pulls).
chart_app_version() { sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "${CHART_DIR}/Chart.yaml"; }
IMAGE_TAG="${IMAGE_TAG:-$(chart_app_version)}"
OPERATOR_IMAGE_REPO="${OPERATOR_IMAGE_REPO:-ghcr.io/weightsync/weightsync-operator}"
AGENT_IMAGE_REPO="${AGENT_IMAGE_REPO:-ghcr.io/weightsync/weightsync-agent}"
OPERATOR_IMAGE="${OPERATOR_IMAGE_REPO}:${IMAGE_TAG}"
AGENT_IMAGE="${AGENT_IMAGE_REPO}:${IMAGE_TAG}"

# The chart's release and the namespaces its operator watches (the e2e suite's own test namespaces are
# served by an operator process per test, so the chart must not watch every namespace).
RELEASE_NAME="${RELEASE_NAME:-weightsync}"
RELEASE_NAMESPACE="${RELEASE_NAMESPACE:-weightsync-system}"
WATCH_NAMESPACES="${WATCH_NAMESPACES:-weightsync-kind}"

log() { printf '[e2e/kind] %s\n' "$*" >&2; }
die() { printf '[e2e/kind] error: %s\n' "$*" >&2; exit 1; }

# need TOOL HINT: fail with HINT unless TOOL (a command or a path) can be run.
need() {
  command -v "$1" >/dev/null 2>&1 || die "'$1' not found: $2 (see e2e/kind/README.md, prerequisites)"
}

# The cluster exists (kind knows it).
cluster_exists() { "${KIND}" get clusters 2>/dev/null | grep -qx "${KIND_CLUSTER_NAME}"; }

require_cluster() {
  cluster_exists || die "no kind cluster named '${KIND_CLUSTER_NAME}': run e2e/kind/create-cluster.sh first (or set KIND_CLUSTER_NAME)"
}

kctl() { "${KUBECTL}" --context "${KUBE_CONTEXT}" "$@"; }
