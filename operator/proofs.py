"""Which versions written on pods the operator believes (see crds/version_proof.py for the proof itself).

The job's token is derived from the operator key, so the operator checks an agent's proof without reading
the job's Secret. A job is held to proofs once the operator created its token under the running key
(`status.versionProofKey`); a job whose token predates the key (or was made under another key) cannot be
checked, and its versions are believed as before, with a warning.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from weightsync.crds import contract, version_proof
from weightsync.operator.common import JobRef

log = logging.getLogger(__name__)

Obj = dict[str, Any]


def token_for(operator_key: bytes | None, job: JobRef) -> str | None:
    """The token for a new job's Secret (None: no operator key, a random token)."""
    if operator_key is None:
        return None
    return version_proof.job_token(operator_key, job.namespace, job.name, job.uid)


def enforced_key(operator_key: bytes | None, status: Mapping[str, Any], created_now: bool) -> str | None:
    """The key id to record in the status when the job's versions must carry proofs, else None."""
    if operator_key is None:
        return None
    kid = version_proof.key_id(operator_key)
    return kid if created_now or status.get("versionProofKey") == kid else None


def believed(pods: Mapping[str, Obj], token: str) -> tuple[dict[str, Obj], list[str]]:
    """The pods with unproven version annotations removed, and the names of the pods that had them.

    A pod whose proof does not verify keeps everything else (readiness, conditions, sync errors); only its
    versions are dropped, so a forged `published-version` or `served-version` moves nothing."""
    out: dict[str, Obj] = {}
    forged: list[str] = []
    for name, pod in pods.items():
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if version_proof.verify(token, str(meta.get("uid") or ""), ann):
            out[name] = pod
            continue
        forged.append(name)
        clean = copy.copy(pod)
        clean["metadata"] = {**meta, "annotations": {k: v for k, v in ann.items()
                                                     if k not in contract.VERSION_PROOF_KEYS}}
        out[name] = clean
    return out, sorted(forged)
