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

    @property
    def loading(self) -> bool:
        """Asked to load a version it does not serve yet."""
        return self.target is not None and (self.served is None or self.served < self.target)

    @property
    def serving(self) -> bool:
        return self.complete and self.served is not None


def _min_or_none(values: Sequence[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return min(v for v in values if v is not None)


def replica_states(plan: Plan, pods: Mapping[str, Mapping[str, Any]]) -> list[ReplicaState]:
    out = []
    for r in range(plan.inference_replicas):
        names = tuple(p.name for p in plan.replica_pods(r))
        live = [pods[n] for n in names if podstate.is_live(pods.get(n))]
        complete = bool(names) and len(live) == len(names)
        out.append(
            ReplicaState(
                replica=r,
                pod_names=names,
                complete=complete,
                ready=complete and all(podstate.is_ready(p) for p in live),
                synced_condition=complete and all(podstate.is_synced(p) for p in live),
                served=_min_or_none([podstate.served_version(p) for p in live]) if complete else None,
                target=_min_or_none([podstate.target_version(p) for p in live]) if live else None,
                paused_confirmed=complete and all(podstate.engine_paused(p) for p in live),
            )
        )
    return out


def trainer_version(plan: Plan, pods: Mapping[str, Mapping[str, Any]], previous: int | None = None) -> int | None:
    """The newest version every trainer pod has published (each pod stages only its own shards, so a version
    is complete when all have it). Never moves backwards: a restarted trainer pod has no annotation yet."""
    values = []
    for name in plan.trainer_pods:
        pod = pods.get(name)
        values.append(podstate.published_version(pod) if podstate.is_live(pod) and pod is not None else None)
    current = _min_or_none(values) if values else None
    if current is None:
        return previous
    return current if previous is None else max(previous, current)
