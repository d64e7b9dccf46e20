"""Which version each inference replica serves, as its agents report it to this trainer agent (ServedTracker).

A trainer's `wait_served` (answered by agent/transfer/intake.py) blocks on it: an RL loop goes on once every
inference replica serves the version it published. Only the pods that load weights into their engine count
(loading_pods), and only what authenticated inference agents report on their control link with the weight
server (agent/transfer/serve.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightsync.agent.wire import protocol as P
from weightsync.crds.topology import InferenceReplicaTopology, Topology


def loading_pods(replica: InferenceReplicaTopology, full_tensors: bool) -> list[str]:
    """The pods of an inference replica whose agents load weights into the engine: every pod, or for an
    engine that takes full tensors over HTTP (SGLang, vLLM) only the pod holding the replica's rank 0."""
    if full_tensors:
        return [m.name for m in replica.pods if 0 in m.ranks]
    return [m.name for m in replica.pods]


@dataclass(frozen=True)
class FleetServed:
    """What each inference replica serves, as reported to this trainer agent by the inference agents."""

    replicas: dict[int, int | None]              # replica -> the version all its loading pods serve (None: not yet)
    pods: dict[int, dict[str, int | None]]       # replica -> loading pod -> the version its agent last reported
    epochs: dict[int, int] = field(default_factory=dict)  # replica -> the trainer epoch of its version

    def reaches(self, version: int, trainer_epoch: int = 0, only_serving: bool = False) -> bool:
        """Every inference replica serves `version` of `trainer_epoch` or newer, in (epoch, version) order
        (true when the topology has no replica): a replica still on an older trainer epoch does not count.
        `only_serving`: replicas that serve nothing (pod gone, agent restarting, engine not loaded yet) are
        left out, but at least one replica must serve it (an RL loop goes on while a replica is replaced)."""
        replicas = {r: v for r, v in self.replicas.items() if v is not None} if only_serving else self.replicas
        if only_serving and not replicas:
            return False
        return all(v is not None and (self.epochs.get(r, 0), v) >= (trainer_epoch, version)
                   for r, v in replicas.items())

    @property
    def version(self) -> int | None:
        """The lowest version served by every replica (None while some replica serves nothing)."""
        return P.lowest_served(self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": [{"replica": r, "served": v, "pods": self.pods.get(r, {})}
                             for r, v in sorted(self.replicas.items())],
                "served_version": self.version}


class ServedTracker:
    """Which version each inference agent committed, from its ws.served reports on its control link.

    Only authenticated inference agents (job token) report, and only versions they committed themselves, so
    nothing an app container writes counts. A report is bound to the link it came on: a new link from the
    same pod (a restarted agent, or a reconnect, after which the agent reports again) replaces it, and a
    closed link drops it. Thread-safe; `wait` wakes on every report."""

    def __init__(self) -> None:
        self._links: dict[str, int] = {}  # pod -> its newest control link
        self._reports: dict[str, tuple[int, int] | None] = {}  # pod -> (epoch, version) on that link (None: withdrawn)
        self._cond = threading.Condition()

    def link_opened(self, pod: str, key: int) -> None:
        """A new control link from `pod`: what it reported on an older link no longer counts."""
        with self._cond:
            self._links[pod] = key
            self._reports.pop(pod, None)
            self._cond.notify_all()

    def link_closed(self, pod: str, key: int) -> None:
        with self._cond:
            if self._links.get(pod) == key:
                del self._links[pod]
                self._reports.pop(pod, None)
                self._cond.notify_all()

    def report(self, pod: str, key: int, version: int | None, trainer_epoch: int = 0) -> None:
        with self._cond:
            if self._links.get(pod) == key:  # a late frame from a replaced link is ignored
                self._reports[pod] = None if version is None else (trainer_epoch, version)
                self._cond.notify_all()

    def fleet(self, topo: Topology, full_tensors: bool) -> FleetServed:
        with self._cond:
            reports = dict(self._reports)
        replicas: dict[int, int | None] = {}
        epochs: dict[int, int] = {}
        pods: dict[int, dict[str, int | None]] = {}
        for rep in topo.inference:
            keys = {name: reports.get(name) for name in loading_pods(rep, full_tensors)}
            pods[rep.replica] = {name: k[1] if k else None for name, k in keys.items()}
            low = None if not keys or any(k is None for k in keys.values()) else min(k for k in keys.values() if k)
            replicas[rep.replica] = low[1] if low else None
            if low:
                epochs[rep.replica] = low[0]
        return FleetServed(replicas, pods, epochs)

    def wait(self, version: int, timeout: float, topo: Callable[[], Topology], full_tensors: bool,
             cancelled: Callable[[], bool] = lambda: False,
             trainer_epoch: Callable[[], int] = lambda: 0, only_serving: bool = False) -> tuple[bool, FleetServed]:
        """Block until every inference replica of the current topology (with `only_serving`, every one that
        serves something, at least one) serves `version` (of the current trainer epoch) or newer, at most
        `timeout` s (or until `cancelled()`); returns (reached, what is served)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            state = self.fleet(topo(), full_tensors)
            if state.reaches(version, trainer_epoch(), only_serving):
                return True, state
            remaining = deadline - time.monotonic()
            if remaining <= 0 or cancelled():
                return False, state
            with self._cond:
                self._cond.wait(min(remaining, 0.5))  # also re-reads the topology (scaled replicas)
