"""Transports per transport group, created once per (group, membership generation, epoch) and reused.

Why an epoch on top of the generation: an agent container can restart without its pod's IP changing,
so the operator keeps the generation, yet the process groups of the dead process are useless. The
inference agent names an epoch (its session, the trainer agents' sessions, and a counter it bumps after
every failed fetch) and sends it with each transfer; both ends key their transports by it, so a restart
or a failure always leads to fresh groups on both sides instead of a hang on a stale one.

NCCL mode: the first member of each group (trainer pod 0) hosts the TCPStore on its transport port; all
groups live under `<job>/<group>/g<generation>/<epoch>/` prefixes in it. IPC mode needs no store.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from weightsync.agent.plan import TransferPlan
from weightsync.agent.transports.base import TRANSPORTS, Transport, WorldMap
from weightsync.agent.transports.ipc import IpcTransport
from weightsync.agent.transports.nccl import NcclTransport, make_store
from weightsync.crds.topology import Topology, TransportGroup

log = logging.getLogger(__name__)

KEEP_PER_GROUP = 2  # transports kept per group name (the current epoch and the one before)


def epoch_of(session: str, attempt: int, trainer_sessions: Sequence[str]) -> str:
    doc = "|".join([session, str(attempt), *sorted(trainer_sessions)])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def default_groups(topo: Topology) -> list[TransportGroup]:
    """The operator's convention when a topology lists no groups: one group per inference replica."""
    trainers = [p.name for p in topo.trainer.pods]
    out = []
    for rep in topo.inference:
        out.append(TransportGroup(name=f"replica-{rep.replica}",
                                  members=trainers + [p.name for p in rep.pods if p.name not in trainers]))
    return out


def group_for(topo: Topology, replica: int, pod: str) -> TransportGroup:
    """The transport group a replica's transfers use: the group holding this pod and the replica's pods."""
    rep = next((r for r in topo.inference if r.replica == replica), None)
    if rep is None:
        raise ValueError(f"replica {replica} is not in the topology")
    wanted = {p.name for p in rep.pods} | {pod}
    for g in topo.groups or default_groups(topo):
        if wanted <= set(g.members):
            return g
    for g in default_groups(topo):
        if g.name == f"replica-{replica}":
            return g
    raise ValueError(f"no transport group holds pods {sorted(wanted)}")


class TransportCache:
    """The transports this agent uses, by (group, generation, epoch)."""

    def __init__(self, *, mode: str, job: str, pod_ip: str, transport_port: int, timeout: float = 600.0,
                 shm_prefix: str = "weightsync") -> None:
        self.mode = mode
        self.job = job
        self.pod_ip = pod_ip
        self.transport_port = transport_port
        self.timeout = timeout
        self.shm_prefix = shm_prefix
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int, str, str], Transport] = {}
        self._order: list[tuple[str, int, str, str]] = []
        self._master: dist.TCPStore | None = None

    def host_store(self) -> None:
        """Trainer pod 0 in NCCL mode: host the rendezvous store every group of the job uses."""
        if self.mode != "NCCL" or self._master is not None:
            return
        self._master = make_store(self.pod_ip, self.transport_port, is_master=True, timeout=self.timeout)
        log.info("rendezvous store hosted at %s:%s", self.pod_ip, self.transport_port)

    def get(self, group: dict[str, Any], plan: TransferPlan, *, role: str) -> tuple[Transport, WorldMap | None]:
        """The transport for `group` ({name, generation, epoch, store: [host, port]}), created on first use.
        Sender and receiver ends are separate transports even in one (colocated) process."""
        key = (str(group["name"]), int(group["generation"]), str(group["epoch"]), role)
        with self._lock:
            t = self._cache.get(key)
            if t is not None:
                return t, None
            t = self._create(group, key)
            self._cache[key] = t
            self._order.append(key)
            same = [k for k in self._order if k[0] == key[0] and k[3] == role]
            for old in same[:-KEEP_PER_GROUP]:
                self._order.remove(old)
                stale = self._cache.pop(old)
                try:
                    stale.close()
                except Exception:
                    log.debug("closing a stale transport failed", exc_info=True)
            return t, None

    def _create(self, group: dict[str, Any], key: tuple[str, int, str, str]) -> Transport:
        if self.mode == "IPC":
            return IpcTransport(prefix=self.shm_prefix)
        if self.mode == "NCCL":
            host, port = group["store"]
            base = make_store(str(host), int(port), is_master=False, timeout=self.timeout)
            store = dist.PrefixStore(f"{self.job}/{key[0]}/g{key[1]}/{key[2]}/", base)
            return NcclTransport(store, generation=key[1], host=self.pod_ip, timeout=self.timeout)
        factory = TRANSPORTS.get(self.mode.lower())
        if factory is None:
            raise ValueError(f"transfer mode {self.mode} has no transport (known: {sorted(TRANSPORTS)})")
        return factory()

    def drop(self, group_name: str) -> None:
        """Forget every transport of a group (after a failure: the next attempt gets a new epoch anyway)."""
        with self._lock:
            for k in [k for k in self._order if k[0] == group_name]:
                self._order.remove(k)
                t = self._cache.pop(k)
                try:
                    t.abort("dropped")
                    t.close()
                except Exception:
                    log.debug("closing a transport failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            for t in self._cache.values():
                try:
                    t.close()
                except Exception:
                    log.debug("closing a transport failed", exc_info=True)
            self._cache.clear()
            self._order.clear()
