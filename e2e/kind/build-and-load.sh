#!/usr/bin/env bash
# Build both images (`make image`: the Dockerfile's operator and agent targets) and load them into the
# kind cluster's nodes, so nothing is pulled from a registry. Re-running rebuilds (cached layers) and
# reloads.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: e2e/kind/build-and-load.sh [-h] [--no-build]

  --no-build   only load images that are already built
Environment: KIND_CLUSTER_NAME [weightsync], IMAGE_TAG [the chart's appVersion], OPERATOR_IMAGE_REPO,
AGENT_IMAGE_REPO [the chart's repositories], DOCKER [docker], KIND [kind]
USAGE
}
build=1
for arg in "$@"; do
  case "${arg}" in
    -h|--help) usage; exit 0 ;;
    --no-build) build=0 ;;
    *) usage >&2; exit 2 ;;
  esac
done

# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need "${DOCKER}" "install Docker"
need "${KIND}" "install kind"
need make "install make"
require_cluster

if (( build )); then
  log "building ${OPERATOR_IMAGE} and ${AGENT_IMAGE} (the agent image has torch: several GB, the first build takes a while)"
  make -C "${REPO_ROOT}" image DOCKER="${DOCKER}" IMAGE_TAG="${IMAGE_TAG}" \
    OPERATOR_IMAGE_REPO="${OPERATOR_IMAGE_REPO}" AGENT_IMAGE_REPO="${AGENT_IMAGE_REPO}"
fi
for image in "${OPERATOR_IMAGE}" "${AGENT_IMAGE}"; do
  "${DOCKER}" image inspect "${image}" >/dev/null 2>&1 || die "image ${image} not built (run without --no-build)"
  log "loading ${image} into kind cluster ${KIND_CLUSTER_NAME}"
  "${KIND}" load docker-image "${image}" --name "${KIND_CLUSTER_NAME}"
done
log "loaded; next: e2e/kind/install.sh"
