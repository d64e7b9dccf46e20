"""Desired pod annotations: target version, pause and membership generation (operator -> agent).

Rollout rule: a replica that serves traffic and is behind the trainer may start loading only while fewer
than maxUnavailable serving replicas are loading, so serving capacity stays. A replica that serves
nothing yet (new, restarted, scaled up) takes the newest version at once: loading it costs no capacity.
A replica already loading keeps its target until it is served (no retargeting mid-load).
"""

from __future__ import annotations

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec, max_unavailable_count
from weightsync.operator.placement import Plan
from weightsync.operator.replicas import ReplicaState


def replica_targets(spec: WeightSyncJobSpec, states: list[ReplicaState], trainer_version: int | None) -> dict[int, int | None]:
    """Replica index -> version it should load (None: nothing published yet)."""
    if trainer_version is None:
        return {s.replica: s.target for s in states}
    budget = max_unavailable_count(spec)
    busy = sum(1 for s in states if s.serving and s.loading)
    out: dict[int, int | None] = {}
    for s in states:
        if s.target == trainer_version or (s.serving and s.loading):
            out[s.replica] = s.target
        elif not s.serving:
            out[s.replica] = trainer_version
        elif s.served is not None and s.served >= trainer_version:
            out[s.replica] = s.served
        elif busy < budget:
            out[s.replica] = trainer_version
            busy += 1
        else:
            out[s.replica] = s.target
    return out


def desired_annotations(
    spec: WeightSyncJobSpec,
    plan: Plan,
    states: list[ReplicaState],
    trainer_version: int | None,
    membership_generation: int,
) -> dict[str, dict[str, str]]:
    """Pod name -> the operator-owned annotations it should carry."""
    targets = replica_targets(spec, states, trainer_version)
    out: dict[str, dict[str, str]] = {}
    for p in plan.pods:
        ann = {contract.ANN_MEMBERSHIP_GENERATION: str(membership_generation)}
        if p.is_inference:
            ann[contract.ANN_PAUSED] = "true" if spec.paused else "false"
            versions = [targets.get(s.replica) for s in p.slots]
            known = [v for v in versions if v is not None]
            if known:
                ann[contract.ANN_TARGET_VERSION] = str(min(known))
        out[p.name] = ann
    return out
