"""Pod builder: the user's template plus everything weightsync needs, as one manifest.

Added to every owned pod: the agent as a native sidecar (an initContainer with restartPolicy Always),
shared volumes (agent socket dir, memory-backed staging volume, never the app's /dev/shm, the topology
ConfigMap, the token Secret on the agent only), the contract env on every container, GPU requests, the
readiness gate on inference-serving pods, GPU node affinity and topologyKey packing, the per-job
ServiceAccount and a controller owner reference. Pure: same inputs, same manifest.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec
from weightsync.crds.template_policy import template_violations
from weightsync.operator.common import JobRef, job_selector, metadata, stable_hash
from weightsync.operator.config import OperatorConfig
from weightsync.operator.placement import Plan, PodPlan

VOL_SOCKET = "weightsync-socket"
VOL_SHM = "weightsync-shm"
VOL_TOPOLOGY = "weightsync-topology"
VOL_TOKEN = "weightsync-token"
VOL_KUBE_API = "weightsync-kube-api-access"
OUR_VOLUMES = (VOL_SOCKET, VOL_SHM, VOL_TOPOLOGY, VOL_TOKEN, VOL_KUBE_API)
DRA_CLAIM = "weightsync-gpus"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class TemplateError(ValueError):
    """The user's template cannot be combined with what weightsync injects (reported as InvalidTemplate)."""


def resource_claim_template_name(job: str) -> str:
    return f"{job}-gpus"


# --- env ---------------------------------------------------------------------------------------------------
def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def contract_env(
    job: JobRef, spec: WeightSyncJobSpec, plan: Plan, role: str, rank: int, world_size: int,
    replica: int | None,
) -> list[dict[str, Any]]:
    """The contract env: the same names on every container so the app, the client library and the agent
    agree on who they are. RANK is the pod's first rank in its role (trainer) or replica (inference);
    WORLD_SIZE counts ranks, so with one rank per pod they are the pod index and the pod count."""
    engine = spec.inference.engine
    env: list[dict[str, Any]] = [
        {"name": contract.ENV_JOB, "value": job.name},
        _field_env(contract.ENV_NAMESPACE, "metadata.namespace"),
        _field_env(contract.ENV_POD_NAME, "metadata.name"),
        _field_env(contract.ENV_POD_IP, "status.podIP"),
        {"name": contract.ENV_ROLE, "value": role},
        {"name": contract.ENV_RANK, "value": str(rank)},
        {"name": contract.ENV_WORLD_SIZE, "value": str(world_size)},
    ]
    if replica is not None:
        env.append({"name": contract.ENV_REPLICA, "value": str(replica)})
    env += [
        {"name": contract.ENV_TOPOLOGY_PATH, "value": f"{contract.TOPOLOGY_DIR}/{contract.TOPOLOGY_FILE}"},
        {"name": contract.ENV_SOCKET_DIR, "value": contract.SOCKET_DIR},
        {"name": contract.ENV_APP_SOCKET, "value": f"{contract.SOCKET_DIR}/{contract.AGENT_SOCKET_NAME}"},
        {"name": contract.ENV_CONTROL_PORT, "value": str(contract.CONTROL_PORT)},
        {"name": contract.ENV_METRICS_PORT, "value": str(contract.METRICS_PORT)},
        {"name": contract.ENV_TRANSPORT_PORT, "value": str(contract.TRANSPORT_PORT)},
        {"name": contract.ENV_TRANSFER_MODE, "value": plan.mode},
        {"name": contract.ENV_BUCKET_SIZE_MB, "value": str(spec.transfer.bucket_size_mb)},
        {"name": contract.ENV_VERIFY, "value": spec.transfer.verify},
        {"name": contract.ENV_TIMEOUT_SECONDS, "value": str(spec.transfer.timeout_seconds)},
        {"name": contract.ENV_ENGINE_TYPE, "value": engine.type},
    ]
    if role != contract.ROLE_TRAINER:
        # Engine-side settings only where an engine runs: changing the engine's port or the update policy
        # must not mark trainer pods outdated (the trainer agent only needs the engine type).
        env += [
            {"name": contract.ENV_ENGINE_URL, "value": engine.url or f"http://127.0.0.1:{engine.port}"},
            {"name": contract.ENV_PAUSE_GENERATION, "value": "true" if spec.update_policy.pause_generation else "false"},
            {"name": contract.ENV_MAX_STALENESS, "value": str(spec.update_policy.max_staleness)},
        ]
        if engine.lora is not None:  # only when set: other jobs keep their env (and spec hash)
            env.append({"name": contract.ENV_LORA,
                        "value": json.dumps(engine.lora.model_dump(by_alias=True), sort_keys=True)})
    staging = spec.transfer.staging
    if role == contract.ROLE_TRAINER and staging is not None and staging.mode == "Ring":
        # Only when Ring: other jobs keep their env (and spec hash); only the trainer agent stages.
        env += [
            {"name": contract.ENV_STAGING, "value": "ring"},
            {"name": contract.ENV_STAGING_DEPTH, "value": str(staging.depth)},
        ]
    if spec.transfer.fan_out == "Relay" and plan.mode in ("NCCL", "GDR"):
        # Only when Relay (and between pods): other jobs keep their env (and spec hash). Trainer agents form
        # the chains, inference agents forward along them.
        env.append({"name": contract.ENV_FAN_OUT, "value": "Relay"})
    delta = spec.transfer.delta_sync
    if delta is not None and delta.enabled:
        # Only when enabled: a job without deltaSync keeps the env (and the spec hash) it always had, so an
        # operator upgrade does not mark its pods outdated. The agent reads an absent variable as "false".
        env += [
            {"name": contract.ENV_DELTA_SYNC, "value": "true"},
            {"name": contract.ENV_DELTA_MAX_CHANGED_FRACTION, "value": repr(float(delta.max_changed_fraction))},
        ]
    return env


def _merge_env(existing: Iterable[dict[str, Any]] | None, ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours win over a user variable of the same name (the contract must not be spoofed by a template)."""
    names = {e["name"] for e in ours}
    return [e for e in (existing or []) if e.get("name") not in names] + ours


# --- volumes ---------------------------------------------------------------------------------------------------
def _volumes(job: JobRef, spec: WeightSyncJobSpec) -> list[dict[str, Any]]:
    return [
        {"name": VOL_SOCKET, "emptyDir": {}},
        # staging: the trainer's staged versions and the receive slots live here (sizing: docs/performance.md);
        # no sizeLimit, since what it holds scales with the model, which the operator does not know: it counts
        # against the pod's memory like any tmpfs
        {"name": VOL_SHM, "emptyDir": {"medium": "Memory"}},
        {"name": VOL_TOPOLOGY, "configMap": {"name": contract.topology_configmap_name(job.name)}},
        # 0444: the kubelet writes Secret files root-owned and the agent runs as its image's non-root user (a
        # user template rarely sets fsGroup); only the agent container mounts this volume.
        {"name": VOL_TOKEN, "secret": {"secretName": contract.token_secret_name(job.name), "defaultMode": 0o444}},
        _kube_api_volume(),
    ]


def _kube_api_volume() -> dict[str, Any]:
    """What the ServiceAccount admission plugin would mount in every container, as one volume that only the
    agent (and containers the user names) mounts: the pod itself sets automountServiceAccountToken false."""
    return {
        "name": VOL_KUBE_API,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace",
                                            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ],
        },
    }


KUBE_API_MOUNT = {"name": VOL_KUBE_API, "mountPath": contract.SERVICE_ACCOUNT_DIR, "readOnly": True}


def api_token_containers(template_meta: dict[str, Any], names: list[str]) -> set[str]:
    """App containers the template opts in to the Kubernetes API token (ANN_API_TOKEN_CONTAINERS)."""
    raw = str((template_meta.get("annotations") or {}).get(contract.ANN_API_TOKEN_CONTAINERS, ""))
    wanted = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(wanted - set(names))
    if unknown:
        raise TemplateError(f"annotation {contract.ANN_API_TOKEN_CONTAINERS} names container(s) {unknown} that the "
                            f"pod does not have (its containers: {names})")
    return wanted


def _app_mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    taken = {m.get("mountPath") for m in container.get("volumeMounts") or []}
    mounts: list[dict[str, Any]] = [
        {"name": VOL_SOCKET, "mountPath": contract.SOCKET_DIR},
        {"name": VOL_SHM, "mountPath": contract.STAGING_DIR},
        {"name": VOL_TOPOLOGY, "mountPath": contract.TOPOLOGY_DIR, "readOnly": True},
    ]
    return [m for m in mounts if m["mountPath"] not in taken]


DEV_SHM = "/dev/shm"


def _at_dev_shm(mount: dict[str, Any]) -> bool:
    return str(mount.get("mountPath", "")).rstrip("/") == DEV_SHM


def shared_dev_shm(containers: Iterable[dict[str, Any]]) -> str | None:
    """The volume the app containers of a Colocated GPU pod mount at /dev/shm, if any (None: they all use the
    pod's own). Why one for all: the agent, the trainer and the engine pass torch CUDA IPC handles, and torch
    keeps each export's reference count in a file in the exporter's /dev/shm that the receiver opens by name,
    so a container with a /dev/shm of its own cannot open the others' handles. Raises TemplateError when
    containers mount different volumes there."""
    names = {str(m.get("name")): str(c.get("name")) for c in containers for m in c.get("volumeMounts") or []
             if _at_dev_shm(m)}
    if len(names) > 1:
        mounts = ", ".join(f"{vol!r} in {ctr!r}" for vol, ctr in sorted(names.items()))
        raise TemplateError(f"containers mount different volumes at {DEV_SHM} ({mounts}); a Colocated job with GPUs "
                            "passes CUDA IPC handles between its containers, and they need one /dev/shm: mount the "
                            "same volume in each, or none")
    return next(iter(names), None)


def _mount_dev_shm(containers: Iterable[dict[str, Any]], volume: str) -> None:
    """Mount `volume` at /dev/shm in every container that does not mount one there yet."""
    for c in containers:
        mounts = c.setdefault("volumeMounts", [])
        if not any(_at_dev_shm(m) for m in mounts):
            mounts.append({"name": volume, "mountPath": DEV_SHM})


def _agent_mounts() -> list[dict[str, Any]]:
    return [
        {"name": VOL_SOCKET, "mountPath": contract.SOCKET_DIR},
        {"name": VOL_SHM, "mountPath": contract.STAGING_DIR},
        {"name": VOL_TOPOLOGY, "mountPath": contract.TOPOLOGY_DIR, "readOnly": True},
        {"name": VOL_TOKEN, "mountPath": contract.TOKEN_DIR, "readOnly": True},
        KUBE_API_MOUNT,
    ]


# --- resources -------------------------------------------------------------------------------------------------
def _set_resource(container: dict[str, Any], name: str, count: int | None) -> None:
    res = container.setdefault("resources", {})
    for part in ("requests", "limits"):
        values = res.setdefault(part, {}) if count is not None else res.get(part)
        if values is None:
            continue
        if count is None:
            values.pop(name, None)
        else:
            values[name] = str(count)
    if not res.get("requests"):
        res.pop("requests", None)
    if not res.get("limits"):
        res.pop("limits", None)
    if not res:
        container.pop("resources", None)


def _add_claim(container: dict[str, Any]) -> None:
    res = container.setdefault("resources", {})
    claims = res.setdefault("claims", [])
    if not any(c.get("name") == DRA_CLAIM for c in claims):
        claims.append({"name": DRA_CLAIM})


def _add_env(container: dict[str, Any], name: str, value: str) -> None:
    container["env"] = _merge_env(container.get("env"), [{"name": name, "value": value}])


# --- affinity --------------------------------------------------------------------------------------------------
def _affinity(
    job: JobRef, spec: WeightSyncJobSpec, pod: PodPlan, cfg: OperatorConfig, user: dict[str, Any] | None
) -> dict[str, Any] | None:
    aff = copy.deepcopy(user) if user else {}
    if pod.gpus > 0 and cfg.gpu_node_selector:
        exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(cfg.gpu_node_selector.items())]
        node = aff.setdefault("nodeAffinity", {})
        req = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []})
        terms = req.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({"matchExpressions": []})
        # Node selector terms are ORed; our requirement must hold in each of them.
        for term in terms:
            term.setdefault("matchExpressions", []).extend(copy.deepcopy(exprs))
    key = spec.placement.topology_key
    if key:
        # Pack every pod of the job into one domain of `key`. The first pod matches its own selector, which
        # kube-scheduler accepts for required affinity, so the group can start anywhere.
        pa = aff.setdefault("podAffinity", {})
        pa.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {"labelSelector": {"matchLabels": job_selector(job)}, "topologyKey": key}
        )
    elif pod.role == contract.ROLE_INFERENCE and spec.inference.replicas > 1:
        # Without packing, spread the inference replicas over nodes so one node loss costs one replica.
        paa = aff.setdefault("podAntiAffinity", {})
        paa.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {
                "weight": 50,
                "podAffinityTerm": {
                    "labelSelector": {"matchLabels": {**job_selector(job), contract.LABEL_ROLE: contract.ROLE_INFERENCE}},
                    "topologyKey": "kubernetes.io/hostname",
                },
            }
        )
    return aff or None


# --- the agent -------------------------------------------------------------------------------------------------
def agent_container(
    job: JobRef, spec: WeightSyncJobSpec, plan: Plan, pod: PodPlan, cfg: OperatorConfig, env: list[dict[str, Any]]
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": contract.AGENT_CONTAINER,
        "image": cfg.agent_image,
        "imagePullPolicy": cfg.agent_image_pull_policy,
        "command": ["weightsync-agent"],
        "restartPolicy": "Always",  # native sidecar: starts before the app, lives as long as the pod
        "env": [
            *env,
            {"name": contract.ENV_TOKEN_PATH, "value": f"{contract.TOKEN_DIR}/{contract.TOKEN_FILE}"},
            {"name": contract.ENV_KUBE_ENABLED, "value": "true"},
        ],
        "ports": [
            {"name": "ws-control", "containerPort": contract.CONTROL_PORT, "protocol": "TCP"},
            {"name": "ws-metrics", "containerPort": contract.METRICS_PORT, "protocol": "TCP"},
            {"name": "ws-transport", "containerPort": contract.TRANSPORT_PORT, "protocol": "TCP"},
        ],
        "volumeMounts": _agent_mounts(),
        "resources": {"requests": {"cpu": cfg.agent_cpu_request, "memory": cfg.agent_memory_request}},
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": contract.METRICS_PORT},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
    }
    if plan.mode == "GDR":
        _set_resource(c, spec.transfer.rdma_resource_name or cfg.rdma_resource_name, 1)
    c["securityContext"] = agent_security_context(plan.mode)
    return c


def agent_security_context(mode: str) -> dict[str, Any]:
    """Pod Security `restricted` for the injected agent (non-root, no privilege escalation, every capability
    dropped, RuntimeDefault seccomp), so it never stands between a job and a restricted namespace. GDR alone
    adds IPC_LOCK, to pin memory for RDMA; `restricted` and `baseline` refuse that (PodSecurityRefused)."""
    caps: dict[str, list[str]] = {"drop": ["ALL"]}
    if mode == "GDR":
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": caps, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


# --- what a template may ask for -------------------------------------------------------------------------------
def check_template_policy(job: JobRef, spec: WeightSyncJobSpec, cfg: OperatorConfig) -> None:
    """Refuse host access (unless the namespace is allowed) and the agent's ports in either template: the
    chart's admission policy refuses them at `kubectl apply`; this catches a cluster without the policy or
    a job stored before it. Raises TemplateError naming every refused field."""
    allow = job.namespace in cfg.host_access_namespaces
    refused = [v for role, t in (("trainer", spec.trainer.template), ("inference", spec.inference.template))
               for v in template_violations(role, t, allow_host_access=allow)]
    if refused:
        raise TemplateError("; ".join(refused))


def _gpu_count(container: dict[str, Any], resource: str) -> set[str]:
    res = container.get("resources") or {}
    return {str(v) for part in ("requests", "limits") if (v := (res.get(part) or {}).get(resource)) is not None}


def check_gpu_requests(spec: WeightSyncJobSpec, pspec: dict[str, Any], trainer_names: list[str], first_gpus: int,
                       resource: str) -> None:
    """The operator owns GPU requests: it gives gpusPerPod / gpusPerReplica to the first app container (the
    others see them through NVIDIA_VISIBLE_DEVICES or the DRA claim). A template that also asks for GPUs
    is honoured when it asks for exactly that, refused otherwise, instead of being silently rewritten; an
    initContainer never gets GPUs (it would hold them, or pass them through, behind the operator's back)."""
    refused = []
    first = pspec["containers"][0]["name"]
    for c in pspec["containers"]:
        asked = _gpu_count(c, resource)
        want = str(first_gpus) if c["name"] == first else "0"
        if asked and asked != {want}:
            role = "trainer" if c["name"] in trainer_names else "inference"
            source = "spec.trainer.gpusPerPod" if role == "trainer" else "spec.inference.gpusPerReplica"
            refused.append(
                f"spec.{role}.template.spec.containers[name={c['name']}].resources: asks for "
                f"{'/'.join(sorted(asked))} {resource}, but weightsync assigns {want} to this container "
                f"({source} goes to the pod's first container): remove the request or make it {want}")
    trainer_inits = {c.get("name") for c in spec.trainer.template["spec"].get("initContainers") or []}
    for c in pspec.get("initContainers") or []:
        if _gpu_count(c, resource) - {"0"}:
            role = "trainer" if c.get("name") in trainer_inits else "inference"
            refused.append(
                f"spec.{role}.template.spec.initContainers[name={c.get('name')}].resources: "
                f"initContainers get no {resource}: GPUs are assigned from gpusPerPod / gpusPerReplica only")
    if refused:
        raise TemplateError("; ".join(refused))


# --- the pod ---------------------------------------------------------------------------------------------------
def _template_for(spec: WeightSyncJobSpec, pod: PodPlan) -> tuple[dict[str, Any], list[str], list[str]]:
    """The base template and which of its containers come from the trainer / the inference template."""
    if pod.role == contract.ROLE_TRAINER:
        t = copy.deepcopy(spec.trainer.template)
        return t, [c["name"] for c in t["spec"]["containers"]], []
    if pod.role == contract.ROLE_INFERENCE:
        t = copy.deepcopy(spec.inference.template)
        return t, [], [c["name"] for c in t["spec"]["containers"]]
    # Colocated: the trainer template is the base; the inference containers, init containers and volumes join it.
    t = copy.deepcopy(spec.trainer.template)
    inf = copy.deepcopy(spec.inference.template)
    tc = [c["name"] for c in t["spec"]["containers"]]
    ic = [c["name"] for c in inf["spec"]["containers"]]
    clash = set(tc) & set(ic)
    if clash:
        raise TemplateError(
            f"Colocated pods hold the trainer and inference containers together, but both templates define "
            f"container(s) {sorted(clash)}: give them distinct names"
        )
    t["spec"]["containers"] += inf["spec"]["containers"]
    t["spec"]["initContainers"] = (t["spec"].get("initContainers") or []) + (inf["spec"].get("initContainers") or [])
    vols = {v.get("name") for v in t["spec"].get("volumes") or []}
    for v in inf["spec"].get("volumes") or []:
        if v.get("name") in vols:
            raise TemplateError(f"Colocated: volume {v.get('name')!r} is defined in both templates; rename one")
        t["spec"].setdefault("volumes", []).append(v)
    meta = t.setdefault("metadata", {})
    for key in ("labels", "annotations"):
        merged = {**(inf.get("metadata") or {}).get(key, {}), **(meta.get(key) or {})}
        if merged:
            meta[key] = merged
    return t, tc, ic


def build_pod(
    job: JobRef,
    spec: WeightSyncJobSpec,
    plan: Plan,
    pod: PodPlan,
    cfg: OperatorConfig,
    desired_annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The full manifest of one owned pod. Raises TemplateError when the template conflicts with ours."""
    template, trainer_names, _ = _template_for(spec, pod)
    tmeta = template.get("metadata") or {}
    pspec: dict[str, Any] = template["spec"]

    for v in pspec.get("volumes") or []:
        if v.get("name") in OUR_VOLUMES:
            raise TemplateError(f"volume name {v.get('name')!r} is reserved by weightsync; rename it in the template")
    for c in (pspec.get("initContainers") or []) + pspec["containers"]:
        if c.get("name") == contract.AGENT_CONTAINER:
            raise TemplateError(f"container name {contract.AGENT_CONTAINER!r} is reserved for the injected agent")

    slot = pod.slots[0] if pod.slots else None
    trainer_env = contract_env(
        job, spec, plan, contract.ROLE_TRAINER, pod.trainer_ranks[0] if pod.trainer_ranks else 0,
        pod.trainer_world_size, None,
    )
    inference_env = contract_env(
        job, spec, plan, contract.ROLE_INFERENCE, slot.ranks[0] if slot else 0, slot.world_size if slot else 0,
        pod.replica,
    )
    if pod.role == contract.ROLE_TRAINER:
        agent_env = trainer_env
    elif pod.role == contract.ROLE_INFERENCE:
        agent_env = inference_env
    else:
        agent_env = contract_env(
            job, spec, plan, contract.ROLE_COLOCATED, pod.trainer_ranks[0] if pod.trainer_ranks else 0,
            pod.trainer_world_size, pod.replica,
        )

    use_claim = plan.use_dra and pod.gpus > 0
    first_app = pspec["containers"][0]["name"]
    with_token = api_token_containers(tmeta, [c["name"] for c in pspec["containers"]])
    check_gpu_requests(spec, pspec, trainer_names, pod.gpus if not use_claim else 0, cfg.gpu_resource)
    for c in pspec["containers"]:
        env = trainer_env if c["name"] in trainer_names else inference_env
        c["env"] = _merge_env(c.get("env"), env)
        c["volumeMounts"] = (c.get("volumeMounts") or []) + _app_mounts(c)
        if c["name"] in with_token and not any(m.get("mountPath") == contract.SERVICE_ACCOUNT_DIR
                                               for m in c["volumeMounts"]):
            c["volumeMounts"].append(dict(KUBE_API_MOUNT))
        _set_resource(c, cfg.gpu_resource, None)  # GPUs are ours to assign
        if pod.gpus > 0:
            if use_claim:
                _add_claim(c)
            elif c["name"] == first_app:
                _set_resource(c, cfg.gpu_resource, pod.gpus)
            elif pod.role == contract.ROLE_COLOCATED:
                # Device-plugin fallback (whole-node pods only): the other containers see the node's GPUs.
                _add_env(c, "NVIDIA_VISIBLE_DEVICES", "all")

    agent = agent_container(job, spec, plan, pod, cfg, agent_env)
    if pod.gpus > 0:
        if use_claim:
            _add_claim(agent)
        else:
            _add_env(agent, "NVIDIA_VISIBLE_DEVICES", "all")
        if pod.role == contract.ROLE_COLOCATED:
            # Colocated: the agent hands the engine CUDA IPC handles of buckets on the GPUs they share (named
            # by GPU UUID, so indices may differ); CUDA IPC between containers needs them in one PID namespace.
            _add_env(agent, contract.ENV_AGENT_DEVICE, "cuda")
            pspec["shareProcessNamespace"] = True
            dev_shm = shared_dev_shm(pspec["containers"])
            if dev_shm is not None:
                _mount_dev_shm([*pspec["containers"], agent], dev_shm)
    pspec["initContainers"] = [agent, *(pspec.get("initContainers") or [])]
    pspec["volumes"] = (pspec.get("volumes") or []) + _volumes(job, spec)
    if use_claim:
        pspec["resourceClaims"] = [
            {"name": DRA_CLAIM, "resourceClaimTemplateName": resource_claim_template_name(job.name)}
        ]

    pspec["serviceAccountName"] = contract.service_account_name(job.name)
    pspec.pop("serviceAccount", None)
    # The agent reports through its own pod with the job's ServiceAccount. Only the agent mounts the token
    # (VOL_KUBE_API): with it an app container could annotate its pod (e.g. a forged published version).
    pspec["automountServiceAccountToken"] = False
    pspec["hostname"] = pod.name
    pspec["subdomain"] = contract.service_name(job.name)
    if pod.is_inference:
        gates = [g for g in pspec.get("readinessGates") or [] if g.get("conditionType") != contract.POD_CONDITION_SYNCED]
        pspec["readinessGates"] = [*gates, {"conditionType": contract.POD_CONDITION_SYNCED}]
    aff = _affinity(job, spec, pod, cfg, pspec.get("affinity"))
    if aff:
        pspec["affinity"] = aff
    if pod.gpus > 0:
        tols = pspec.get("tolerations") or []
        if GPU_TOLERATION not in tols:
            pspec["tolerations"] = [*tols, GPU_TOLERATION]

    labels = {**(tmeta.get("labels") or {})}
    meta = metadata(job, pod.name, pod.role)
    labels.update(meta["labels"])
    labels[contract.LABEL_RANK] = str(pod.index)
    if pod.replica is not None:
        labels[contract.LABEL_REPLICA] = str(pod.replica)
    meta["labels"] = labels
    annotations = dict(tmeta.get("annotations") or {})
    manifest: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pspec}
    annotations[contract.ANN_SPEC_HASH] = stable_hash({"labels": labels, "annotations": annotations, "spec": pspec})
    annotations.update(desired_annotations or {})
    meta["annotations"] = annotations
    return manifest


def build_pods(
    job: JobRef, spec: WeightSyncJobSpec, plan: Plan, cfg: OperatorConfig,
    desired_annotations: dict[str, dict[str, str]] | None = None,
) -> list[dict[str, Any]]:
    desired_annotations = desired_annotations or {}
    check_template_policy(job, spec, cfg)  # the templates, once per job (not once per pod)
    return [build_pod(job, spec, plan, p, cfg, desired_annotations.get(p.name)) for p in plan.pods]
