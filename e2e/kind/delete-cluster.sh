#!/usr/bin/env bash
# Delete the kind cluster (and with it everything installed in it). Idempotent: no cluster, nothing to do.
set -euo pipefail
usage() { echo "usage: e2e/kind/delete-cluster.sh [-h]   (KIND_CLUSTER_NAME [weightsync])"; }
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { usage; exit 0; }
[[ $# -eq 0 ]] || { usage >&2; exit 2; }

# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need "${KIND}" "install kind"
if cluster_exists; then
  log "deleting kind cluster ${KIND_CLUSTER_NAME}"
  "${KIND}" delete cluster --name "${KIND_CLUSTER_NAME}"
else
  log "no kind cluster named ${KIND_CLUSTER_NAME}: nothing to delete"
fi
