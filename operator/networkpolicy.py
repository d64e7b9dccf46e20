"""NetworkPolicy: only the job's own pods may reach the agent ports.

A policy that selects a pod isolates it for ingress, so the policy also admits every other port from
anywhere (the engine's serving port, the trainer's own endpoints): the agent ports 47100-47102 are the
only hole, closed to everyone but the job's pods. The job's pods may reach each other on any port,
because torch.distributed and NCCL open ephemeral ports between ranks.

`metrics_from` (the chart's agentMetrics.allowFrom) adds one rule: those peers (a Prometheus) may reach the
agents' metrics port (TCP 47101) and nothing else of the agent; the control and transport ports stay
job-internal.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
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


def build_network_policy(job: JobRef, metrics_from: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": job_selector(job)}}]},
        {"ports": _open_ranges()},
    ]
    if metrics_from:
        ingress.append({
            "from": [copy.deepcopy(dict(peer)) for peer in metrics_from],
            "ports": [{"protocol": "TCP", "port": contract.METRICS_PORT}],
        })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, contract.network_policy_name(job.name)),
        "spec": {
            "podSelector": {"matchLabels": job_selector(job)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
