#!/usr/bin/env bash
# Create a kind cluster whose workers have the host's GPUs (nvkind), install the NVIDIA device plugin (or
# the GPU operator) and label the GPU nodes the way the weightsync operator expects. Idempotent: an
# existing cluster is kept, labels and the helm releases are re-applied.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: e2e/kind/create-cluster.sh [-h]

Environment (defaults in brackets):
  KIND_CLUSTER_NAME       cluster name [weightsync]
  GPU_WORKERS             GPU worker nodes; the host's GPUs are split evenly between them [1]
  RACKS                   distinct topology.weightsync.io/rack values over the workers [1]
  GPU_STACK               device-plugin | gpu-operator [device-plugin]
  DEVICE_PLUGIN_VERSION   nvdp/nvidia-device-plugin chart version [0.17.1]
  GPU_OPERATOR_VERSION    nvidia/gpu-operator chart version (GPU_STACK=gpu-operator) [v25.3.0]
  WITH_GFD                1: also deploy GPU feature discovery with the device plugin (nvidia.com/gpu.product
                          labels, needed by tests/cluster/test_cluster_scheduling.py) [0]
  KIND_NODE_IMAGE         kindest/node image (Kubernetes >= 1.29 for native sidecars) [nvkind's default]
  WAIT_SECONDS            how long to wait for GPUs to be advertised [300]
  KIND, NVKIND, KUBECTL, HELM, DOCKER   the binaries [on PATH]
USAGE
}
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { usage; exit 0; }
[[ $# -eq 0 ]] || { usage >&2; exit 2; }

# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

GPU_WORKERS="${GPU_WORKERS:-1}"
RACKS="${RACKS:-1}"
GPU_STACK="${GPU_STACK:-device-plugin}"
DEVICE_PLUGIN_VERSION="${DEVICE_PLUGIN_VERSION:-0.17.1}"
GPU_OPERATOR_VERSION="${GPU_OPERATOR_VERSION:-v25.3.0}"
WITH_GFD="${WITH_GFD:-0}"
WAIT_SECONDS="${WAIT_SECONDS:-300}"

[[ "${GPU_WORKERS}" =~ ^[1-9][0-9]*$ ]] || die "GPU_WORKERS must be a positive integer (got '${GPU_WORKERS}')"
[[ "${RACKS}" =~ ^[1-9][0-9]*$ ]] || die "RACKS must be a positive integer (got '${RACKS}')"
case "${GPU_STACK}" in device-plugin|gpu-operator) ;; *) die "GPU_STACK must be device-plugin or gpu-operator (got '${GPU_STACK}')" ;; esac

need "${DOCKER}" "install Docker (nvkind runs kind on Docker)"
need "${KIND}" "install kind >= v0.24 (https://kind.sigs.k8s.io)"
need "${NVKIND}" "go install github.com/NVIDIA/nvkind/cmd/nvkind@latest"
need "${KUBECTL}" "install kubectl (or use the pinned one: python -m weightsync.e2e.binaries)"
need "${HELM}" "install helm v3"
need nvidia-smi "install the NVIDIA driver on the host"

"${DOCKER}" info >/dev/null 2>&1 || die "'${DOCKER} info' failed: is the Docker daemon running and reachable?"
host_gpus="$(nvidia-smi -L | grep -c '^GPU ' || true)"
(( host_gpus >= GPU_WORKERS )) || die "the host has ${host_gpus} GPU(s), fewer than GPU_WORKERS=${GPU_WORKERS}"
log "host GPUs: ${host_gpus}; GPU workers: ${GPU_WORKERS} ($(( host_gpus / GPU_WORKERS )) GPU(s) each)"

# 1. The cluster.
if cluster_exists; then
  log "cluster '${KIND_CLUSTER_NAME}' exists: keeping it"
else
  log "creating cluster '${KIND_CLUSTER_NAME}' with nvkind"
  values="numWorkers: ${GPU_WORKERS}"$'\n'"racks: ${RACKS}"
  [[ -n "${KIND_NODE_IMAGE:-}" ]] && values+=$'\n'"image: ${KIND_NODE_IMAGE}"
  "${NVKIND}" cluster create --name "${KIND_CLUSTER_NAME}" \
    --config-template "${KIND_DIR}/nvkind-config.yaml.tmpl" --config-values - --wait 5m <<<"${values}"
fi
kctl cluster-info >/dev/null || die "cannot reach the cluster through context ${KUBE_CONTEXT}"

# 2. Labels the operator selects on (crds/contract.py; the chart's cluster.gpuNodeSelector), re-applied
#    so that an older cluster gets them too.
mapfile -t workers < <(kctl get nodes -l '!node-role.kubernetes.io/control-plane' -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort)
(( ${#workers[@]} > 0 )) || die "the cluster has no worker nodes"
i=0
for node in "${workers[@]}"; do
  kctl label node "${node}" --overwrite \
    nvidia.com/gpu.present=true "topology.weightsync.io/rack=rack-$(( i % RACKS ))" >/dev/null
  log "labelled ${node}: nvidia.com/gpu.present=true topology.weightsync.io/rack=rack-$(( i % RACKS ))"
  i=$(( i + 1 ))
done

# 3. The GPU stack.
if [[ "${GPU_STACK}" == device-plugin ]]; then
  "${HELM}" repo add nvdp https://nvidia.github.io/k8s-device-plugin --force-update >/dev/null
  "${HELM}" repo update nvdp >/dev/null
  gfd_args=()
  [[ "${WITH_GFD}" == 1 ]] && gfd_args=(--set gfd.enabled=true)
  log "installing nvdp/nvidia-device-plugin ${DEVICE_PLUGIN_VERSION}"
  "${HELM}" upgrade --install nvidia-device-plugin nvdp/nvidia-device-plugin \
    --kube-context "${KUBE_CONTEXT}" --namespace nvidia-device-plugin --create-namespace \
    --version "${DEVICE_PLUGIN_VERSION}" "${gfd_args[@]}" --wait --timeout 5m
else
  "${HELM}" repo add nvidia https://helm.ngc.nvidia.com/nvidia --force-update >/dev/null
  "${HELM}" repo update nvidia >/dev/null
  kctl create namespace gpu-operator --dry-run=client -o yaml | kctl apply -f - >/dev/null
  kctl label namespace gpu-operator pod-security.kubernetes.io/enforce=privileged --overwrite >/dev/null
  log "installing nvidia/gpu-operator ${GPU_OPERATOR_VERSION} (driver and toolkit from the host)"
  "${HELM}" upgrade --install gpu-operator nvidia/gpu-operator \
    --kube-context "${KUBE_CONTEXT}" --namespace gpu-operator --version "${GPU_OPERATOR_VERSION}" \
    --set cdi.enabled=true --set driver.enabled=false --set toolkit.enabled=false \
    --set operator.runtimeClass=nvidia --wait --timeout 10m
fi

# 4. Every worker advertises its GPUs.
deadline=$(( SECONDS + WAIT_SECONDS ))
for node in "${workers[@]}"; do
  until gpus="$(kctl get node "${node}" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" && [[ "${gpus:-0}" -gt 0 ]]; do
    (( SECONDS < deadline )) || die "${node} advertises no nvidia.com/gpu after ${WAIT_SECONDS}s; see the troubleshooting section of e2e/kind/README.md"
    sleep 5
  done
  log "${node}: nvidia.com/gpu=${gpus}"
done
kctl get nodes -L nvidia.com/gpu.present,topology.weightsync.io/rack,nvidia.com/gpu.product
log "ready: export KUBECONFIG=\$(mktemp) && ${KIND} get kubeconfig --name ${KIND_CLUSTER_NAME} > \$KUBECONFIG; next: e2e/kind/build-and-load.sh"
