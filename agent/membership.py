"""This pod's place in the topology: the trainer member or the inference replica slot it holds, and the wait
for a topology file that lists it (ConfigMap volumes update lazily, so a new pod may first read an old one)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from weightsync.agent.config import AgentConfig, ConfigError, TopologyWatcher
from weightsync.crds.topology import InferenceReplicaTopology, PodMember, Topology

log = logging.getLogger("weightsync.agent")

MEMBERSHIP_WAIT = 180.0  # a new pod can start before the topology ConfigMap update reaches its volume


@dataclass
class InferenceSlot:
    """The inference replica this pod belongs to, and its own member entry (engine ranks) in it."""

    replica: InferenceReplicaTopology
    member: PodMember


def trainer_member(topo: Topology, pod: str) -> PodMember | None:
    return next((m for m in topo.trainer.pods if m.name == pod), None)


def inference_slot(topo: Topology, pod: str) -> InferenceSlot | None:
    slots = [InferenceSlot(r, m) for r in topo.inference for m in r.pods if m.name == pod]
    if len(slots) > 1:
        raise ConfigError(f"pod {pod} hosts {len(slots)} inference replicas; one replica per agent is supported")
    return slots[0] if slots else None


def wait_for_membership(cfg: AgentConfig, timeout: float) -> TopologyWatcher:
    """The topology, once it lists this pod in its role(s). A scaled-up or recreated pod may see the old
    file for a while (ConfigMap volumes update lazily): wait for it rather than crash-looping."""
    deadline = time.monotonic() + timeout
    watcher: TopologyWatcher | None = None
    while True:
        try:
            watcher = watcher or TopologyWatcher(cfg.topology_path)
            watcher.poll()
            topo = watcher.current
            ok = (not cfg.is_trainer or trainer_member(topo, cfg.pod_name) is not None) and (
                not cfg.is_inference or inference_slot(topo, cfg.pod_name) is not None)
            if ok:
                return watcher
            problem = f"pod {cfg.pod_name} is not listed as {cfg.role} in {cfg.topology_path} (generation {topo.generation})"
        except ConfigError as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise ConfigError(f"{problem}; gave up after {timeout:.0f}s")
        log.info("waiting for the topology: %s", problem)
        time.sleep(2.0)
