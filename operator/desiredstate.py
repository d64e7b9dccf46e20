"""The job's desired-state ConfigMap (crds/desired.py): built from the per-pod desired annotations, and
read back as the operator's memory of what it asked (pure functions).

The rollout logic (rollout.py, atomic.py, status.py) reads the desired annotations on the pods it is given,
as it did when they were written on the pods. `overlay` hands it pods whose operator-owned annotations are
the ConfigMap's (copies: the cached objects are never changed), so that logic did not change with the
channel. Without a ConfigMap yet (a new job, or pods made by an older operator) the pods' own annotations
stand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.crds import contract, desired
from weightsync.crds.desired import overlay
from weightsync.operator.common import JobRef, metadata

__all__ = ["build_desired_configmap", "overlay"]


def build_desired_configmap(job: JobRef, per_pod: Mapping[str, Mapping[str, str]],
                            report_to: str | None = None) -> dict[str, Any]:
    """The ConfigMap for pod name -> desired annotations, and where agents push their reports (raises
    desired.DesiredTooLarge)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, contract.desired_configmap_name(job.name)),
        "data": desired.encode(per_pod, report_to),
    }
