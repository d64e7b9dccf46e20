"""NetworkPolicy: only the job's own pods may reach the agent ports.

A policy that selects a pod isolates it for ingress, so the policy also admits every other port from
anywhere (the engine's serving port, the trainer's own endpoints): the agent ports 47100-47102 are the
only hole, closed to everyone but the job's pods. The job's pods may reach each other on any port,
because torch.distributed and NCCL open ephemeral ports between ranks.
"""

from __future__ import annotations

from typing import Any

from weightsync.crds import contract
from weightsync.operator.common import JobRef, job_selector, metadata

MAX_PORT = 65535


def _open_ranges() -> list[dict[str, Any]]:
    low, high = min(contract.AGENT_PORTS), max(contract.AGENT_PORTS)
    if high - low + 1 != len(contract.AGENT_PORTS):
        raise ValueError("contract.AGENT_PORTS must be contiguous for the NetworkPolicy port ranges")
    ranges = []
    for proto in ("TCP", "UDP", "SCTP"):
        if low > 1:
            ranges.append({"protocol": proto, "port": 1, "endPort": low - 1})
        if high < MAX_PORT:
            ranges.append({"protocol": proto, "port": high + 1, "endPort": MAX_PORT})
    return ranges


def build_network_policy(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, contract.network_policy_name(job.name)),
        "spec": {
            "podSelector": {"matchLabels": job_selector(job)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": job_selector(job)}}]},
                {"ports": _open_ranges()},
            ],
        },
    }
