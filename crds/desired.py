"""The job's desired-state ConfigMap: what the operator asks of each pod (operator -> agents), in one object.

Why one object per job and not annotations on every pod: a new version used to cost one pod patch per
inference pod (256 pods: 256 writes, sent 8 at a time, before the last agent even knew). Now it is one
ConfigMap write that every agent of the job sees through its watch at once. The pods keep what only they
can say (the agent's observed state, under the version proof) and what a person sets on one pod
(`weightsync.io/inject-fault`).

Layout: one data key per pod name, its value a compact JSON object of the desired annotations it replaces,
named without the `weightsync.io/` prefix, e.g. `{"membership-generation":"3","paused":"false",
"target-epoch":"0","target-version":"7"}`. Empty values are left out (an agent reads a missing key as
absent, as it did with annotations). Only the operator may write it; the agents' Role may only read it.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightsync.crds import contract

PREFIX = f"{contract.GROUP}/"
# A ConfigMap holds at most 1 MiB; about 100 bytes per pod leaves room for some 9,000 pods per job.
MAX_DATA_BYTES = 900 * 1024
_INSTANCE = re.compile(r"(instance=[0-9a-f]{1,32})?")


class DesiredTooLarge(ValueError):
    """The job has more pods than one desired-state ConfigMap can describe."""


def encode_pod(annotations: Mapping[str, str]) -> str:
    """One pod's desired annotations as the compact value of its data key."""
    short = {k[len(PREFIX):]: str(v) for k, v in annotations.items()
             if k in contract.DESIRED_POD_ANNOTATIONS and v not in (None, "")}
    return json.dumps(short, separators=(",", ":"), sort_keys=True)


def encode(per_pod: Mapping[str, Mapping[str, str]], report_to: str | None = None) -> dict[str, str]:
    """Pod name -> desired annotations, as the ConfigMap's data (bounded: see MAX_DATA_BYTES); REPORT_TO:
    where the active operator takes the agents' reports (contract.DESIRED_REPORT_TO_KEY; None: nowhere,
    agents write their pods only)."""
    data = {name: encode_pod(ann) for name, ann in sorted(per_pod.items())}
    if report_to:
        data[contract.DESIRED_REPORT_TO_KEY] = report_to
    size = sum(len(k) + len(v) for k, v in data.items())
    if size > MAX_DATA_BYTES:
        raise DesiredTooLarge(f"the desired state of {len(data)} pods takes {size} bytes, over the "
                              f"{MAX_DATA_BYTES} a ConfigMap can hold: split the job")
    return data


def report_to(data: Mapping[str, str] | None) -> str | None:
    """Where to push reports, when the ConfigMap names a place that looks like one:
    http://<host>:<port>/v1/reports[?instance=<hex>] (the instance changes with every operator process)."""
    raw = (data or {}).get(contract.DESIRED_REPORT_TO_KEY)
    if not raw or len(raw) > 512:
        return None
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError:
        return None
    if (parts.scheme != "http" or not parts.hostname or port is None or parts.path != contract.REPORT_PATH
            or parts.fragment or parts.username or not _INSTANCE.fullmatch(parts.query)):
        return None
    return raw


def decode_pod(data: Mapping[str, str] | None, pod: str) -> dict[str, str] | None:
    """The desired annotations of POD (full names); None when the ConfigMap does not name the pod. A value
    that is not a JSON object of strings is ignored as a whole (only the operator writes this object)."""
    raw = (data or {}).get(pod)
    if raw is None:
        return None
    try:
        short = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(short, dict):
        return {}
    out = {PREFIX + str(k): v for k, v in short.items() if isinstance(v, str)}
    return {k: v for k, v in out.items() if k in contract.DESIRED_POD_ANNOTATIONS}


def patch_for(want: Mapping[str, str], have: Mapping[str, str] | None) -> dict[str, str | None]:
    """A JSON merge patch of `data` from HAVE to WANT: changed keys, and null for pods no longer wanted."""
    have = have or {}
    patch: dict[str, str | None] = {k: v for k, v in want.items() if have.get(k) != v}
    patch.update({k: None for k in have if k not in want})
    return patch


def overlay(pods: Mapping[str, Mapping[str, Any]], cm: Mapping[str, Any] | None) -> dict[str, Any]:
    """PODS (name -> pod as JSON) with their desired annotations replaced by what the ConfigMap CM asks of
    each (a pod CM does not name carries none): copies, the given objects are not changed. CM None (not
    written yet): the pods as they are."""
    if cm is None:
        return dict(pods)
    data = cm.get("data") or {}
    out: dict[str, Any] = {}
    for name, pod in pods.items():
        meta = pod.get("metadata") or {}
        ann = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in contract.DESIRED_POD_ANNOTATIONS}
        ann.update(decode_pod(data, name) or {})
        out[name] = {**pod, "metadata": {**meta, "annotations": ann}}
    return out
