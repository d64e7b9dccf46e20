"""The placement planner: which pods a WeightSyncJob has, their names, ranks and GPU counts.

Pure: a function of the validated spec and the operator's view of the cluster (GPUs per node, whether a
DRA DeviceClass is used). Every other builder (pods, topology, RBAC, status) consumes its Plan, so the
set of owned pods is decided in exactly one place.

Counting rules follow `weightsync.crds.models` (one rank per GPU; CPU-only pods run one trainer rank per
pod and `tensor / podsPerReplica` inference ranks per pod).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from weightsync.crds import contract
from weightsync.crds.models import PlacementMode, TransferMode, WeightSyncJobSpec, effective_transfer_mode

# Reasons of the refusal conditions (CamelCase, as metav1.Condition wants).
REASON_COLOCATED_NEEDS_DRA = "ColocatedNeedsWholeNodeOrDRA"
REASON_TOO_MANY_GPUS = "GPUsExceedNode"
REASON_DRA_DEVICE_CLASS_MISSING = "DRADeviceClassMissing"


def dra_device_class(spec: WeightSyncJobSpec, default: str = "") -> str:
    """The DeviceClass a job's ResourceClaims request: spec.placement.dra.deviceClassName, else the operator's
    default (OperatorConfig.dra_device_class_name); "" when the job uses no DRA or neither is set."""
    dra = spec.placement.dra
    if dra is None:
        return ""
    return dra.device_class_name or default


@dataclass(frozen=True)
class InferenceSlot:
    """The ranks of one inference replica that live in one pod."""

    replica: int
    index: int              # pod index within the replica
    ranks: tuple[int, ...]  # ranks within the replica
    world_size: int         # ranks of the replica
    pods_per_replica: int


@dataclass(frozen=True)
class PodPlan:
    """One owned pod: its identity, its ranks and its GPUs."""

    name: str
    role: str                       # contract.ROLE_*
    index: int                      # trainer / colocated: pod index; inference: pod index within replica
    gpus: int
    trainer_ranks: tuple[int, ...] = ()   # global trainer ranks (trainer and colocated pods)
    trainer_world_size: int = 0
    trainer_pods: int = 0
    slots: tuple[InferenceSlot, ...] = ()  # inference ranks (inference: one slot; colocated: one or more)

    @property
    def replica(self) -> int | None:
        """The inference replica of this pod when it hosts exactly one (used for labels and env)."""
        replicas = {s.replica for s in self.slots}
        return next(iter(replicas)) if len(replicas) == 1 else None

    @property
    def is_inference(self) -> bool:
        return self.role in (contract.ROLE_INFERENCE, contract.ROLE_COLOCATED)


@dataclass(frozen=True)
class Refusal:
    """The spec is valid for the API server but cannot be placed on this cluster."""

    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    job: str
    placement: PlacementMode
    mode: TransferMode             # effective transfer mode (Auto resolved)
    pods: tuple[PodPlan, ...] = ()
    use_dra: bool = False
    dra_device_class: str = ""     # resolved DeviceClass when use_dra
    refusal: Refusal | None = None
    inference_replicas: int = 0
    trainer_pods: tuple[str, ...] = field(default=())

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pods]

    def by_name(self) -> dict[str, PodPlan]:
        return {p.name: p for p in self.pods}

    def replica_pods(self, replica: int) -> list[PodPlan]:
        return list(self._replica_index.get(replica, ()))

    @cached_property
    def _replica_index(self) -> dict[int, list[PodPlan]]:
        """Replica -> its pods in plan order, built once (a scan per replica was O(pods x replicas) a pass)."""
        out: dict[int, list[PodPlan]] = {}
        for p in self.pods:
            for r in dict.fromkeys(s.replica for s in p.slots):
                out.setdefault(r, []).append(p)
        return out


def _trainer_pods(job: str, spec: WeightSyncJobSpec, role: str) -> list[PodPlan]:
    t = spec.trainer
    rpp = t.ranks_per_pod
    out = []
    for i in range(t.replicas):
        name = contract.trainer_pod_name(job, i) if role == contract.ROLE_TRAINER else contract.colocated_pod_name(job, i)
        out.append(
            PodPlan(
                name=name, role=role, index=i, gpus=t.gpus_per_pod,
                trainer_ranks=tuple(range(i * rpp, (i + 1) * rpp)),
                trainer_world_size=t.replicas * rpp, trainer_pods=t.replicas,
            )
        )
    return out


def _inference_slots(spec: WeightSyncJobSpec) -> list[InferenceSlot]:
    inf = spec.inference
    rpp = inf.ranks_per_pod
    slots = []
    for r in range(inf.replicas):
        for j in range(inf.pods_per_replica):
            slots.append(
                InferenceSlot(
                    replica=r, index=j, ranks=tuple(range(j * rpp, (j + 1) * rpp)),
                    world_size=inf.ranks_per_replica, pods_per_replica=inf.pods_per_replica,
                )
            )
    return slots


def plan(
    job: str, spec: WeightSyncJobSpec, node_gpu_count: int = 8, rdma_available: bool = False,
    dra_device_class_default: str = "",
) -> Plan:
    """Compute the job's pods, or a Refusal when the cluster cannot host the spec as written.
    `dra_device_class_default` is the operator's DeviceClass for jobs whose `placement.dra` names none."""
    mode = effective_transfer_mode(spec, rdma_available=rdma_available)
    base = Plan(job=job, placement=spec.placement.mode, mode=mode, inference_replicas=spec.inference.replicas)

    if spec.placement.mode == "Colocated":
        use_dra = spec.placement.dra is not None
        g = spec.trainer.gpus_per_pod
        if g > 0 and not use_dra and g != node_gpu_count:
            return Plan(
                job=job, placement=base.placement, mode=mode, inference_replicas=base.inference_replicas,
                refusal=Refusal(
                    REASON_COLOCATED_NEEDS_DRA,
                    f"Colocated without DRA shares GPUs through the device plugin, which only works for whole-node "
                    f"pods: spec.trainer.gpusPerPod is {g} but GPU nodes have {node_gpu_count}. Set "
                    f"spec.trainer.gpusPerPod={node_gpu_count} (and inference sizes to match), or set "
                    f"spec.placement.dra.deviceClassName (or `dra: {{}}` with the Helm chart value "
                    f"cluster.draDeviceClassName) to share the GPUs through a ResourceClaim.",
                ),
            )
        device_class = dra_device_class(spec, dra_device_class_default)
        if g > 0 and use_dra and not device_class:
            return Plan(
                job=job, placement=base.placement, mode=mode, inference_replicas=base.inference_replicas,
                refusal=Refusal(
                    REASON_DRA_DEVICE_CLASS_MISSING,
                    "spec.placement.dra names no DeviceClass and the operator has no default: set "
                    "spec.placement.dra.deviceClassName (e.g. gpu.nvidia.com) or the Helm chart value "
                    "cluster.draDeviceClassName.",
                ),
            )
        if g > node_gpu_count:
            return _too_many(base, "spec.trainer.gpusPerPod", g, node_gpu_count)
        pods = _trainer_pods(job, spec, contract.ROLE_COLOCATED)
        slots = _inference_slots(spec)
        per_pod = max(1, len(slots) // max(1, len(pods)))
        placed = []
        for p in pods:
            mine = tuple(slots[p.index * per_pod:(p.index + 1) * per_pod])
            placed.append(replace(p, slots=mine))
        return Plan(
            job=job, placement=base.placement, mode=mode, pods=tuple(placed), use_dra=use_dra,
            dra_device_class=device_class if use_dra else "", inference_replicas=base.inference_replicas, trainer_pods=tuple(p.name for p in placed),
        )

    # Separated
    if spec.trainer.gpus_per_pod > node_gpu_count:
        return _too_many(base, "spec.trainer.gpusPerPod", spec.trainer.gpus_per_pod, node_gpu_count)
    if spec.inference.gpus_per_pod > node_gpu_count:
        return _too_many(
            base, "spec.inference.gpusPerReplica / podsPerReplica", spec.inference.gpus_per_pod, node_gpu_count
        )
    trainers = _trainer_pods(job, spec, contract.ROLE_TRAINER)
    inference = [
        PodPlan(
            name=contract.inference_pod_name(job, s.replica, s.index), role=contract.ROLE_INFERENCE,
            index=s.index, gpus=spec.inference.gpus_per_pod, slots=(s,),
        )
        for s in _inference_slots(spec)
    ]
    return Plan(
        job=job, placement=base.placement, mode=mode, pods=tuple(trainers + inference),
        inference_replicas=base.inference_replicas, trainer_pods=tuple(p.name for p in trainers),
    )


def _too_many(base: Plan, what: str, gpus: int, node_gpus: int) -> Plan:
    return Plan(
        job=base.job, placement=base.placement, mode=base.mode, inference_replicas=base.inference_replicas,
        refusal=Refusal(
            REASON_TOO_MANY_GPUS,
            f"{what} asks for {gpus} GPUs per pod but GPU nodes have {node_gpus}: such a pod can never be "
            f"scheduled. Use at most {node_gpus} GPUs per pod (more pods per replica instead).",
        ),
    )
