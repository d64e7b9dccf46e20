"""Desired pod annotations: target version, pause and membership generation (operator -> agent).

Rollout rule: a replica that serves traffic and is behind the trainer may start loading only while fewer
than maxUnavailable serving replicas are loading, so serving capacity stays. A replica that serves
nothing yet (new, restarted, scaled up) takes the newest version at once: loading it costs no capacity.
A replica already loading keeps its target until it is served (no retargeting mid-load).

spec.updatePolicy.strategy Atomic replaces the waves with the two-phase round of operator/atomic.py.

Only a loading replica that still serves traffic holds the budget: one that is NotReady (out of the
Service endpoints, e.g. it fell beyond maxStaleness while a hung engine blocked its load) or whose agent
reported a failed load (`contract.ANN_SYNC_ERROR`; the agent fails a hung engine's requests after
spec.transfer.timeoutSeconds) costs no capacity, so one stuck engine cannot block the rollout to the others.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec, max_unavailable_count
from weightsync.operator import atomic, podstate
from weightsync.operator.placement import Plan
from weightsync.operator.replicas import ReplicaState, VersionKey


def failed_replicas(states: list[ReplicaState], pods: Mapping[str, Mapping[str, Any]]) -> frozenset[int]:
    """Replicas with a pod whose agent reports a failed load (they are not loading, they are stuck)."""
    return frozenset(
        s.replica for s in states
        if any(podstate.sync_error(pods[n]) for n in s.pod_names if podstate.is_live(pods.get(n)))
    )


def holds_budget(s: ReplicaState, failed: Collection[int] = ()) -> bool:
    """A load that takes serving capacity away: the replica is Ready, loading, and not known to be stuck."""
    return s.serving and s.loading and s.ready and s.replica not in failed


def replica_targets(
    spec: WeightSyncJobSpec, states: list[ReplicaState], trainer_version: VersionKey | None,
    failed: Collection[int] = (),
) -> dict[int, VersionKey | None]:
    """Replica index -> (epoch, version) it should load (None: nothing published yet). `failed`: replicas
    whose last load failed (see `failed_replicas`); they do not hold the maxUnavailable budget."""
    if trainer_version is None:
        return {s.replica: s.target_key for s in states}
    budget = max_unavailable_count(spec)
    busy = sum(1 for s in states if holds_budget(s, failed))
    out: dict[int, VersionKey | None] = {}
    for s in states:
        if s.target_key == trainer_version or (s.serving and s.loading):
            out[s.replica] = s.target_key
        elif not s.serving or not s.ready:
            out[s.replica] = trainer_version  # out of the endpoints already: loading costs no capacity
        elif s.served_key is not None and s.served_key >= trainer_version:
            out[s.replica] = s.served_key
        elif busy < budget:
            out[s.replica] = trainer_version
            busy += 1
        else:
            out[s.replica] = s.target_key
    return out


def desired_annotations(
    spec: WeightSyncJobSpec,
    plan: Plan,
    states: list[ReplicaState],
    trainer_version: VersionKey | None,
    membership_generation: int,
    pods: Mapping[str, Mapping[str, Any]] | None = None,
    atomic_overdue: atomic.OverduePrepare | None = None,
    now: datetime | None = None,
) -> dict[str, dict[str, str]]:
    """Pod name -> the operator-owned annotations it should carry (`pods`: the observed pods, for sync errors).
    strategy Atomic: the targets and commit annotations of operator/atomic.py instead of waves."""
    pods = pods or {}
    commit_ann: dict[str, str] = {}
    if spec.update_policy.strategy == "Atomic":
        round_ = atomic.decide(states, pods, trainer_version, atomic_overdue, now)
        targets = round_.targets
        commit_ann = atomic.pod_annotations(round_)
    else:
        targets = replica_targets(spec, states, trainer_version, failed_replicas(states, pods))
    out: dict[str, dict[str, str]] = {}
    for p in plan.pods:
        ann = {contract.ANN_MEMBERSHIP_GENERATION: str(membership_generation)}
        if p.is_inference:
            ann[contract.ANN_PAUSED] = "true" if spec.paused else "false"
            have = podstate.pod_annotations(pods.get(p.name) or {})
            # a job switched back to Rolling: empty values, which agents read as absent (Rolling behaviour)
            ann.update({k: "" for k in contract.ATOMIC_POD_ANNOTATIONS if have.get(k)})
            ann.update(commit_ann)
            known = [v for s in p.slots if (v := targets.get(s.replica)) is not None]
            if known:
                epoch, version = min(known)
                ann[contract.ANN_TARGET_VERSION] = str(version)
                ann[contract.ANN_TARGET_EPOCH] = str(epoch)
        out[p.name] = ann
    return out
