"""What an agent reads from and writes on its own pod, as pure functions: the desired state (from the job's
desired-state ConfigMap entry or the pod's annotations) and the observed state (the annotations and the Synced
condition it implies). No API calls: agent/podstatus.py (PodLink) sends and watches; the operator's side of these
annotations is operator/podstate.py."""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract, desired

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Desired:
    """What the operator asks of this pod."""

    target_version: int | None = None
    paused: bool = False
    target_epoch: int = 0  # the trainer epoch of target_version
    # strategy Atomic (agent/atomic.py): (epoch, version) of commit-version / committed-version; None: Rolling
    commit: tuple[int, int] | None = None
    committed: tuple[int, int] | None = None
    inject_fault: str | None = None  # contract.ANN_INJECT_FAULT (tests, chaos drills)


@dataclass(frozen=True)
class Observed:
    """What the agent reports about this pod. None leaves a field unreported."""

    served_version: int | None = None
    served_digest: str | None = None  # the content digest of served_version (None: unknown, removed)
    published_version: int | None = None
    served_epoch: int | None = None
    published_epoch: int | None = None
    engine_paused: bool | None = None
    last_sync: dict[str, Any] | None = None
    sync_error: str | None = None
    sync_progress: dict[str, Any] | None = None  # the load under way (None: none, the annotation is removed)
    prepared_version: int | None = None  # Atomic: the version held prepared (None: none, removed)
    prepared_epoch: int | None = None
    synced: bool | None = None
    synced_reason: str = ""
    synced_message: str = ""


def desired_from_annotations(annotations: dict[str, str] | None) -> Desired:
    ann = annotations or {}
    raw = ann.get(contract.ANN_TARGET_VERSION)
    target: int | None = None
    if raw not in (None, ""):
        try:
            target = int(str(raw))
        except ValueError:
            log.warning("ignoring non-integer %s=%r", contract.ANN_TARGET_VERSION, raw)
    epoch = nonnegative(ann.get(contract.ANN_TARGET_EPOCH)) or 0
    return Desired(target, str(ann.get(contract.ANN_PAUSED, "")).lower() == "true", epoch,
                   commit=_key(ann, contract.ANN_COMMIT_VERSION, contract.ANN_COMMIT_EPOCH),
                   committed=_key(ann, contract.ANN_COMMITTED_VERSION, contract.ANN_COMMITTED_EPOCH),
                   inject_fault=ann.get(contract.ANN_INJECT_FAULT) or None)


def desired_for(pod: str, pod_annotations: dict[str, str] | None, configmap_data: dict[str, str] | None) -> Desired:
    """What the operator asks of POD: its entry in the job's desired-state ConfigMap (None: not seen, the
    pod's own annotations stand), plus what is set on the pod itself (inject-fault)."""
    ann = dict(pod_annotations or {})
    if configmap_data is not None:
        ann = {k: v for k, v in ann.items() if k not in contract.DESIRED_POD_ANNOTATIONS}
        ann.update(desired.decode_pod(configmap_data, pod) or {})
    return desired_from_annotations(ann)


def _key(ann: dict[str, str], version_key: str, epoch_key: str) -> tuple[int, int] | None:
    version = nonnegative(ann.get(version_key))
    return None if version is None else (nonnegative(ann.get(epoch_key)) or 0, version)


def nonnegative(raw: str | None) -> int | None:
    try:
        value = int(str(raw)) if raw not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


def synced_state(latest: int | None, served: int | None, max_staleness: int) -> tuple[bool, str, str]:
    """Is a replica serving `served` close enough to the newest version `latest`? (status, reason, message)"""
    if latest is None:
        return True, "NoVersionPublished", "the trainer has not published a version yet"
    lag = latest - (served or 0)
    if lag <= max_staleness:
        return True, "UpToDate", f"serving {served}, newest {latest}, maxStaleness {max_staleness}"
    return False, "Stale", f"serving {served}, newest {latest}: {lag} versions behind, maxStaleness {max_staleness}"


def annotations_for(obs: Observed) -> dict[str, str | None]:
    """The annotation values this observation implies (None deletes an annotation)."""
    out: dict[str, str | None] = {}
    if obs.served_version is not None:
        out[contract.ANN_SERVED_VERSION] = str(obs.served_version)
    if obs.published_version is not None:
        out[contract.ANN_PUBLISHED_VERSION] = str(obs.published_version)
        out[contract.ANN_PUBLISHED_EPOCH] = str(obs.published_epoch or 0)
    if obs.served_version is not None:
        out[contract.ANN_SERVED_EPOCH] = str(obs.served_epoch or 0)
        out[contract.ANN_SERVED_DIGEST] = obs.served_digest or None
    prepared = obs.prepared_version is not None
    out[contract.ANN_PREPARED_VERSION] = str(obs.prepared_version) if prepared else None
    out[contract.ANN_PREPARED_EPOCH] = str(obs.prepared_epoch or 0) if prepared else None
    if obs.engine_paused is not None:
        out[contract.ANN_ENGINE_PAUSED] = "true" if obs.engine_paused else "false"
    if obs.last_sync is not None:
        out[contract.ANN_LAST_SYNC] = json.dumps(obs.last_sync, sort_keys=True, separators=(",", ":"))
    out[contract.ANN_SYNC_ERROR] = obs.sync_error[:1024] if obs.sync_error else None
    out[contract.ANN_SYNC_PROGRESS] = (json.dumps(obs.sync_progress, sort_keys=True, separators=(",", ":"))
                                       if obs.sync_progress else None)
    return out


def annotation_patch(want: dict[str, str | None], written: dict[str, str | None]) -> dict[str, str | None]:
    """Only the keys whose value differs from what was last written."""
    return {k: v for k, v in want.items() if written.get(k) != v or k not in written}


def condition_for(obs: Observed, now: dt.datetime) -> dict[str, Any] | None:
    if obs.synced is None:
        return None
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": contract.POD_CONDITION_SYNCED,
        "status": "True" if obs.synced else "False",
        "reason": obs.synced_reason or ("Synced" if obs.synced else "NotSynced"),
        "message": obs.synced_message,
        "lastProbeTime": None,
        "lastTransitionTime": stamp,
    }
