"""Per-replica view of the observed pods: the unit that rollout and status reason about.

An inference replica may span several pods (multi-node engines) and a Colocated pod may host several
replicas; a replica serves version v only when every one of its pods does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.operator import podstate
from weightsync.operator.placement import Plan

VersionKey = tuple[int, int]
"""(trainer epoch, version): how versions are ordered. A restarted trainer publishing 1 again starts a new
epoch, so its version 1 is newer than version 100 of the epoch before."""


def versions_behind(newest: VersionKey, served: VersionKey) -> int:
    """How far `served` trails `newest`: the version difference within one trainer epoch; a replica still
    on an older epoch is one version behind (it lacks the new epoch's versions, which it loads next)."""
    if served[0] == newest[0]:
        return max(0, newest[1] - served[1])
    return 1 if served < newest else 0


@dataclass(frozen=True)
class ReplicaState:
    replica: int
    pod_names: tuple[str, ...]
    complete: bool              # every planned pod exists and is not terminating
    ready: bool                 # every pod Ready (includes the synced readiness gate)
    synced_condition: bool      # every pod reports weightsync.io/synced=True
    served: int | None          # lowest served version over the pods; None if any pod serves nothing
    target: int | None          # lowest target version currently annotated on the pods
    paused_confirmed: bool
    served_key: VersionKey | None = None  # (epoch, version) of `served`
    target_key: VersionKey | None = None  # (epoch, version) of `target`

    def __post_init__(self) -> None:  # states built with versions only are of epoch 0
        if self.served_key is None and self.served is not None:
            object.__setattr__(self, "served_key", (0, self.served))
        if self.target_key is None and self.target is not None:
            object.__setattr__(self, "target_key", (0, self.target))

    @property
    def loading(self) -> bool:
        """Asked to load a version it does not serve yet."""
        return self.target_key is not None and (self.served_key is None or self.served_key < self.target_key)

    @property
    def serving(self) -> bool:
        return self.complete and self.served is not None


def _min_key(values: Sequence[VersionKey | None]) -> VersionKey | None:
    if not values or any(v is None for v in values):
        return None
    return min(v for v in values if v is not None)


def served_key(pod: Mapping[str, Any]) -> VersionKey | None:
    v = podstate.served_version(pod)
    return None if v is None else (podstate.served_epoch(pod), v)


def target_key(pod: Mapping[str, Any]) -> VersionKey | None:
    v = podstate.target_version(pod)
    return None if v is None else (podstate.target_epoch(pod), v)


def published_key(pod: Mapping[str, Any]) -> VersionKey | None:
    v = podstate.published_version(pod)
    return None if v is None else (podstate.published_epoch(pod), v)


def replica_states(plan: Plan, pods: Mapping[str, Mapping[str, Any]]) -> list[ReplicaState]:
    out = []
    for r in range(plan.inference_replicas):
        names = tuple(p.name for p in plan.replica_pods(r))
        live = [pods[n] for n in names if podstate.is_live(pods.get(n))]
        complete = bool(names) and len(live) == len(names)
        served = _min_key([served_key(p) for p in live]) if complete else None
        target = _min_key([target_key(p) for p in live]) if live else None
        out.append(
            ReplicaState(
                replica=r,
                pod_names=names,
                complete=complete,
                ready=complete and all(podstate.is_ready(p) for p in live),
                synced_condition=complete and all(podstate.is_synced(p) for p in live),
                served=served[1] if served else None,
                target=target[1] if target else None,
                paused_confirmed=complete and all(podstate.engine_paused(p) for p in live),
                served_key=served,
                target_key=target,
            )
        )
    return out


def trainer_version(plan: Plan, pods: Mapping[str, Mapping[str, Any]], previous: int | None = None,
                    previous_epoch: int = 0) -> VersionKey | None:
    """(epoch, version): the newest version every trainer pod has published in the newest trainer epoch
    (each pod stages only its own shards, so a version is complete when all have it). Never moves backwards
    in (epoch, version) order: a restarted trainer pod has no annotation yet, and one still in the old epoch
    while the others started a new one holds the new epoch back until it publishes there too."""
    prev: VersionKey | None = None if previous is None else (previous_epoch, previous)
    keys = []
    for name in plan.trainer_pods:
        pod = pods.get(name)
        keys.append(published_key(pod) if podstate.is_live(pod) and pod is not None else None)
    current: VersionKey | None = None
    if keys and all(k is not None for k in keys):
        epoch = max(k[0] for k in keys if k is not None)
        if all(k is not None and k[0] == epoch for k in keys):
            current = (epoch, min(k[1] for k in keys if k is not None))
    if current is None:
        return prev
    return current if prev is None else max(prev, current)
