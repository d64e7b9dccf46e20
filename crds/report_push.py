"""Reports pushed by an agent straight to the active operator: its observed state without waiting for the
API server.

Why: an agent's report (served version, digest, proof, last sync) is an annotation on its own pod, and the
operator reads it from its pod watch. At 256 inference pods that is 256 pod writes per version, and the job's
status waits for the last of them: seconds on a busy API server. So an agent first sends the same
annotations to the operator (one small HTTP POST), the operator lays them over the cached pod at once
(operator/reports.py), and the agent's pod write, still the durable record, follows a few seconds later,
coalesced with whatever it reports meanwhile.

Nothing here is trusted more than the pod annotation it stands for: the version keys still need the
agent's version proof (crds/version_proof.py), checked by the operator exactly as on the pod, and the
whole report carries an HMAC under the job's token over the pod's identity, a sequence number and every
annotation, so nobody without the token can push anything, and a replayed report is never newer than the
one it copies. Bounded: at most MAX_BODY_BYTES, only the keys an agent reports, bounded values.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract

_REPORT_DOMAIN = b"weightsync.io/report-push/v1"
MAX_BODY_BYTES = 64 * 1024
MAX_VALUE_CHARS = 8 * 1024
_MAX_NAME_CHARS = 253


class BadReport(ValueError):
    """A pushed report that is not well formed (the operator answers 400)."""


@dataclass(frozen=True)
class PushedReport:
    namespace: str
    job: str
    pod: str
    uid: str
    seq: int  # the agent's own order of its reports (nanoseconds; larger is newer)
    annotations: dict[str, str | None]  # contract.REPORTED_POD_ANNOTATIONS only; None: removed
    mac: str


def _message(namespace: str, job: str, pod: str, uid: str, seq: int,
             annotations: Mapping[str, str | None]) -> bytes:
    body = json.dumps({"namespace": namespace, "job": job, "pod": pod, "uid": uid, "seq": seq,
                       "annotations": dict(annotations)}, sort_keys=True, separators=(",", ":"))
    return _REPORT_DOMAIN + b"\n" + body.encode()


def report_mac(token: bytes | str, namespace: str, job: str, pod: str, uid: str, seq: int,
               annotations: Mapping[str, str | None]) -> str:
    key = token.encode() if isinstance(token, str) else token
    return hmac.new(key, _message(namespace, job, pod, uid, seq, annotations), hashlib.sha256).hexdigest()


def build(token: bytes | str, namespace: str, job: str, pod: str, uid: str, seq: int,
          annotations: Mapping[str, str | None]) -> bytes:
    """The request body of one report (only the reported keys of ANNOTATIONS go)."""
    reported = {k: annotations[k] for k in contract.REPORTED_POD_ANNOTATIONS if k in annotations}
    mac = report_mac(token, namespace, job, pod, uid, seq, reported)
    return json.dumps({"namespace": namespace, "job": job, "pod": pod, "uid": uid, "seq": seq,
                       "annotations": reported, "mac": mac}, separators=(",", ":")).encode()


def _name(raw: Any, what: str) -> str:
    if not isinstance(raw, str) or not raw or len(raw) > _MAX_NAME_CHARS:
        raise BadReport(f"{what}: a non-empty string of at most {_MAX_NAME_CHARS} characters")
    return raw


def parse(raw: bytes) -> PushedReport:
    """A request body as a report (raises BadReport: size, JSON, fields, keys, value sizes)."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadReport(f"report of {len(raw)} bytes, over {MAX_BODY_BYTES}")
    try:
        doc = json.loads(raw)
    except ValueError as err:
        raise BadReport(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise BadReport("not a JSON object")
    seq = doc.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BadReport("seq: a non-negative integer")
    ann = doc.get("annotations")
    if not isinstance(ann, dict):
        raise BadReport("annotations: an object")
    allowed = set(contract.REPORTED_POD_ANNOTATIONS)
    for k, v in ann.items():
        if k not in allowed:
            raise BadReport(f"annotations: {k!r} is not something an agent reports")
        if v is not None and (not isinstance(v, str) or len(v) > MAX_VALUE_CHARS):
            raise BadReport(f"annotations: {k} must be null or a string of at most {MAX_VALUE_CHARS} characters")
    mac = doc.get("mac")
    if not isinstance(mac, str) or len(mac) != 64:
        raise BadReport("mac: 64 hex characters")
    return PushedReport(_name(doc.get("namespace"), "namespace"), _name(doc.get("job"), "job"),
                        _name(doc.get("pod"), "pod"), _name(doc.get("uid"), "uid"), seq, dict(ann), mac)


def verify(token: bytes | str, report: PushedReport) -> bool:
    """The report was made with the job's token, for exactly this pod, sequence and annotations."""
    want = report_mac(token, report.namespace, report.job, report.pod, report.uid, report.seq, report.annotations)
    return hmac.compare_digest(report.mac, want)
