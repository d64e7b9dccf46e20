"""Pieces every builder shares: the job's identity, owner references, labels and a stable hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract


@dataclass(frozen=True)
class JobRef:
    """The identity of a WeightSyncJob: enough to name, label and own objects."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        meta = body.get("metadata") or {}
        return cls(
            name=str(meta["name"]), namespace=str(meta.get("namespace") or ""), uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
        )


def owner_reference(job: JobRef) -> dict[str, Any]:
    """Controller owner reference: the garbage collector deletes every owned object with the job, so the
    operator needs no finalizer."""
    return {
        "apiVersion": contract.API_VERSION,
        "kind": contract.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(job: JobRef, role: str | None = None) -> dict[str, str]:
    labels = {contract.LABEL_JOB: job.name, contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
    if role:
        labels[contract.LABEL_ROLE] = role
    return labels


def job_selector(job: JobRef) -> dict[str, str]:
    """Selects exactly the job's pods (and nothing the user labels alike: managed-by is ours)."""
    return {contract.LABEL_JOB: job.name, contract.LABEL_MANAGED_BY: contract.MANAGED_BY}


def metadata(job: JobRef, name: str, role: str | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": job_labels(job, role),
        "ownerReferences": [owner_reference(job)],
    }
    meta.update(extra)
    return meta


def stable_hash(value: Any, length: int = 16) -> str:
    """A short hash of a JSON-able value, independent of dict ordering."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:length]
