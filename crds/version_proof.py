"""Version proofs: what lets the operator believe a version written on a pod.

Any principal allowed to patch a pod (an app container given an API token, a user with pod RBAC) can
write `weightsync.io/published-version=100000` on it. Versions are therefore only believed with a proof:
an HMAC-SHA256, keyed by the job's token, over the pod's uid and every version annotation. Only the
agent holds the token (mounted into the agent container alone); the operator, which may not read Secrets,
derives the same token from its own key (`job_token`), so it can check a proof without reading the job's
Secret. The pod uid binds a proof to one pod incarnation: copying a valid set of annotations onto another
pod, or onto a re-created pod of the same name, does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from weightsync.crds import contract

_PROOF_DOMAIN = b"weightsync.io/version-proof/v1"
_TOKEN_DOMAIN = b"weightsync.io/job-token/v1"
_KEY_ID_DOMAIN = b"weightsync.io/operator-key-id/v1"
MIN_KEY_BYTES = 32


def job_token(operator_key: bytes, namespace: str, name: str, uid: str) -> str:
    """The job's transfer token (64 hex characters), derived from the operator key and the job's identity:
    a re-created job of the same name (new uid) gets a new token."""
    msg = b"\n".join((_TOKEN_DOMAIN, namespace.encode(), name.encode(), uid.encode()))
    return hmac.new(operator_key, msg, hashlib.sha256).hexdigest()


def key_id(operator_key: bytes) -> str:
    """A public fingerprint of the operator key (recorded on each job whose token it derived)."""
    return hashlib.sha256(_KEY_ID_DOMAIN + operator_key).hexdigest()[:16]


def version_values(annotations: Mapping[str, str | None]) -> dict[str, str]:
    """The proven annotations as the proof sees them (absent = empty)."""
    return {k: str(annotations.get(k) or "") for k in contract.VERSION_PROOF_KEYS}


def version_proof(token: bytes | str, pod_uid: str, annotations: Mapping[str, str | None]) -> str:
    key = token.encode() if isinstance(token, str) else token
    values = version_values(annotations)
    # Only the annotations present are in the message: adding a key to VERSION_PROOF_KEYS later keeps the
    # proofs of agents that do not write it valid, while adding, removing or changing any present one
    # still changes the message.
    msg = b"\n".join([_PROOF_DOMAIN, pod_uid.encode()] + [f"{k}={values[k]}".encode() for k in sorted(values)
                                                           if values[k]])
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify(token: bytes | str, pod_uid: str, annotations: Mapping[str, str | None]) -> bool:
    """True when the pod's version annotations carry a valid proof (no version annotation at all needs none)."""
    values = version_values(annotations)
    if not any(values.values()):
        return True
    given = str(annotations.get(contract.ANN_VERSION_PROOF) or "")
    return bool(pod_uid) and hmac.compare_digest(given, version_proof(token, pod_uid, annotations))
