"""The topology ConfigMap: ranks, pod IPs, transport groups and the membership generation.

The generation moves only when membership moves (the set of pods, their uids, ranks, IPs or nodes), so
agents rebuild transport groups (NCCL communicators, NIXL peers) only then, never on an unrelated spec
edit such as bucketSizeMB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec
from weightsync.crds.topology import (
    InferenceReplicaTopology,
    PodMember,
    Topology,
    TrainerTopology,
    TransportGroup,
)
from weightsync.operator.common import JobRef, metadata, stable_hash
from weightsync.operator.placement import Plan


def _observed(pod: Mapping[str, Any] | None) -> tuple[str | None, str | None, str | None]:
    """(ip, node, uid) of a live pod; a terminating pod counts as absent."""
    if not pod or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None, None, None
    return (
        (pod.get("status") or {}).get("podIP") or None,
        (pod.get("spec") or {}).get("nodeName") or None,
        (pod.get("metadata") or {}).get("uid") or None,
    )


def membership_hash(plan: Plan, pods: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for p in plan.pods:
        ip, node, uid = _observed(pods.get(p.name))
        rows.append([p.name, list(p.trainer_ranks), [[s.replica, list(s.ranks)] for s in p.slots], ip, node, uid])
    return stable_hash(rows)


def _groups(plan: Plan) -> list[TransportGroup]:
    if plan.mode == "IPC":
        if plan.placement == "Colocated":
            return [TransportGroup(name=f"pod-{p.name}", members=[p.name]) for p in plan.pods]
        return [TransportGroup(name="node", members=[p.name for p in plan.pods])]
    groups = []
    for r in range(plan.inference_replicas):
        members = list(plan.trainer_pods) + [p.name for p in plan.replica_pods(r) if p.name not in plan.trainer_pods]
        groups.append(TransportGroup(name=f"replica-{r}", members=members))
    return groups


def build_topology(
    job: JobRef, spec: WeightSyncJobSpec, plan: Plan, pods: Mapping[str, Mapping[str, Any]], generation: int
) -> Topology:
    trainer_members = []
    for p in plan.pods:
        if not p.trainer_ranks:
            continue
        ip, node, _ = _observed(pods.get(p.name))
        trainer_members.append(PodMember(name=p.name, index=p.index, ranks=list(p.trainer_ranks), ip=ip, node=node))
    replicas = []
    for r in range(plan.inference_replicas):
        members = []
        world = spec.inference.ranks_per_replica
        for p in plan.replica_pods(r):
            ip, node, _ = _observed(pods.get(p.name))
            for s in p.slots:
                if s.replica == r:
                    members.append(PodMember(name=p.name, index=s.index, ranks=list(s.ranks), ip=ip, node=node))
                    world = s.world_size
        replicas.append(
            InferenceReplicaTopology(replica=r, tensor=spec.inference.parallelism.tensor, world_size=world, pods=members)
        )
    t = spec.trainer
    return Topology(
        job=job.name,
        namespace=job.namespace,
        generation=generation,
        placement=plan.placement,
        mode=plan.mode,
        bucket_size_mb=spec.transfer.bucket_size_mb,
        verify=spec.transfer.verify,
        trainer=TrainerTopology(
            world_size=t.replicas * t.ranks_per_pod, tensor=t.parallelism.tensor, pipeline=t.parallelism.pipeline,
            data=t.parallelism.data, pods=trainer_members,
        ),
        inference=replicas,
        groups=_groups(plan),
    )


def previous_generation(cm: Mapping[str, Any] | None) -> tuple[int, str | None]:
    """(generation, membership hash) recorded on the existing ConfigMap, or (0, None)."""
    if not cm:
        return 0, None
    ann = (cm.get("metadata") or {}).get("annotations") or {}
    try:
        gen = int(ann.get(contract.ANN_MEMBERSHIP_GENERATION, "0"))
    except ValueError:
        gen = 0
    return gen, ann.get(contract.ANN_MEMBERSHIP_HASH)


def next_generation(previous: Mapping[str, Any] | None, new_hash: str) -> int:
    """Unchanged membership keeps the generation; a change (or the first ConfigMap) moves it up by one."""
    gen, old_hash = previous_generation(previous)
    return gen if old_hash == new_hash else gen + 1


def build_topology_configmap(
    job: JobRef,
    spec: WeightSyncJobSpec,
    plan: Plan,
    pods: Mapping[str, Mapping[str, Any]],
    previous: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ConfigMap for the current membership; `previous` is the existing ConfigMap (for the generation)."""
    h = membership_hash(plan, pods)
    gen = next_generation(previous, h)
    topo = build_topology(job, spec, plan, pods, gen)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            job,
            contract.topology_configmap_name(job.name),
            annotations={contract.ANN_MEMBERSHIP_HASH: h, contract.ANN_MEMBERSHIP_GENERATION: str(gen)},
        ),
        "data": {contract.TOPOLOGY_FILE: topo.to_json()},
    }


def generation_of(cm: Mapping[str, Any]) -> int:
    return previous_generation(cm)[0]


def topology_of(cm: Mapping[str, Any]) -> Topology:
    return Topology.from_json((cm.get("data") or {})[contract.TOPOLOGY_FILE])

