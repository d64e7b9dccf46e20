#!/usr/bin/env bash
# helm install (or upgrade) the chart with the images loaded by build-and-load.sh, serving
# WATCH_NAMESPACES (created if missing), and wait for the operator's rollout. Idempotent.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: e2e/kind/install.sh [-h] [-- EXTRA_HELM_ARGS...]

Environment (defaults in brackets):
  KIND_CLUSTER_NAME   [weightsync]
  RELEASE_NAME        helm release [weightsync]
  RELEASE_NAMESPACE   the operator's namespace [weightsync-system]
  WATCH_NAMESPACES    comma-separated namespaces the operator serves, or "all" for every namespace
                      [weightsync-kind]. Keep it off the e2e suite's test namespaces (t-*): each test
                      runs its own operator process there.
  IMAGE_TAG           [the chart's appVersion]
  HELM, KUBECTL       the binaries [on PATH]
USAGE
}
extra=()
while (( $# )); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) usage >&2; exit 2 ;;
  esac
done

# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need "${HELM}" "install helm v3"
need "${KUBECTL}" "install kubectl"
need "${KIND}" "install kind"
require_cluster

watch_args=()
if [[ "${WATCH_NAMESPACES}" != all ]]; then
  IFS=',' read -r -a namespaces <<<"${WATCH_NAMESPACES}"
  (( ${#namespaces[@]} > 0 )) || die "WATCH_NAMESPACES is empty (use \"all\" for every namespace)"
  for ns in "${namespaces[@]}"; do
    kctl create namespace "${ns}" --dry-run=client -o yaml | kctl apply -f - >/dev/null
  done
  watch_args=(--set "watchNamespaces={${WATCH_NAMESPACES}}")
fi

log "installing ${RELEASE_NAME} into ${RELEASE_NAMESPACE} (images ${OPERATOR_IMAGE}, ${AGENT_IMAGE}; watching ${WATCH_NAMESPACES})"
"${HELM}" upgrade --install "${RELEASE_NAME}" "${CHART_DIR}" \
  --kube-context "${KUBE_CONTEXT}" --namespace "${RELEASE_NAMESPACE}" --create-namespace \
  --set image.repository="${OPERATOR_IMAGE_REPO}" --set image.tag="${IMAGE_TAG}" \
  --set agent.image.repository="${AGENT_IMAGE_REPO}" --set agent.image.tag="${IMAGE_TAG}" \
  "${watch_args[@]}" "${extra[@]}" --wait --timeout 5m
kctl -n "${RELEASE_NAMESPACE}" rollout status deployment \
  -l "app.kubernetes.io/instance=${RELEASE_NAME}" --timeout=180s
kctl -n "${RELEASE_NAMESPACE}" get deployment,pods -l "app.kubernetes.io/instance=${RELEASE_NAME}" -o wide
log "installed; next: e2e/kind/run-e2e.sh"
