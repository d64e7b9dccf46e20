#!/usr/bin/env bash
# Run the e2e suite against the kind cluster: E2E_CLUSTER=kind (the kubeconfig comes from
# `kind get kubeconfig`), markers `e2e or kind` by default. Extra arguments go to pytest.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: e2e/kind/run-e2e.sh [-h] [PYTEST_ARGS...]

  e2e/kind/run-e2e.sh                         the e2e suite and the kind GPU tests
  e2e/kind/run-e2e.sh -k gpu                  one test
  PYTEST_MARKERS=kind e2e/kind/run-e2e.sh     only the kind GPU tests
Environment: KIND_CLUSTER_NAME [weightsync], PYTEST_MARKERS ['e2e or kind'], VENV [.venv];
WEIGHTSYNC_KIND_JOB_NAMESPACE / WEIGHTSYNC_KIND_RELEASE_NAMESPACE / WEIGHTSYNC_KIND_IMAGE_TAG follow
WATCH_NAMESPACES (first one) / RELEASE_NAMESPACE / IMAGE_TAG of install.sh.
USAGE
}
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { usage; exit 0; }

# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need "${KIND}" "install kind"
require_cluster
VENV="${VENV:-${REPO_ROOT}/.venv}"
[[ -x "${VENV}/bin/pytest" ]] || die "${VENV}/bin/pytest not found: run \`make setup\` first"

export E2E_CLUSTER=kind KIND_CLUSTER_NAME KIND
unset WEIGHTSYNC_KUBECONFIG KUBECONFIG_E2E
export WEIGHTSYNC_KIND_JOB_NAMESPACE="${WEIGHTSYNC_KIND_JOB_NAMESPACE:-${WATCH_NAMESPACES%%,*}}"
export WEIGHTSYNC_KIND_RELEASE_NAMESPACE="${WEIGHTSYNC_KIND_RELEASE_NAMESPACE:-${RELEASE_NAMESPACE}}"
export WEIGHTSYNC_KIND_IMAGE_TAG="${WEIGHTSYNC_KIND_IMAGE_TAG:-${IMAGE_TAG}}"
cd "${REPO_ROOT}"
log "pytest -m '${PYTEST_MARKERS:-e2e or kind}' e2e/tests against kind cluster ${KIND_CLUSTER_NAME}"
exec "${VENV}/bin/pytest" -m "${PYTEST_MARKERS:-e2e or kind}" e2e/tests "$@"
