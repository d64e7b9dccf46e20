"""The agent's link to the API server: desired state in (the job's desired-state ConfigMap), observed state
out (annotations and the Synced condition on its own Pod).

Desired state comes from one object per job (crds/desired.py): a new version is one write the operator
makes, seen by every agent's watch at once, instead of one patch per pod. Observed state goes on the Pod:
the per-job Role lets an agent get/watch/patch only its own pod (resourceNames + a `metadata.name=<pod>`
field selector), and per-pod detail belongs on pods, not in an unbounded job status. A watch delivers a
new target version within milliseconds, unlike a projected file. Until the ConfigMap exists (an older
operator) the desired annotations on the pod itself are read, as before.

Writes are coalesced: the writer thread sends only what changed since the last successful write, so a
version costs at most one annotation patch and (only when synced flips) one pods/status patch. Everything
here is optional: without an API server the agent takes its target from the trainer's announcements.
What the desired and observed states are, and the annotations and condition they map to, is
agent/podstate.py (pure); this module is the link that watches and writes them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.podstate import (
    Desired,
    Observed,
    annotation_patch,
    annotations_for,
    condition_for,
    desired_for,
    nonnegative,
)
from weightsync.crds import contract, desired, report_push, version_proof

log = logging.getLogger(__name__)
# After the operator took a report, its pod write waits this long (times 1 to 1.5): reports of that interval
# go in one write, and a fleet's writes do not meet the operator's status write on the API server.
REPORT_WRITE_DELAY_S = 10.0


def report_write_delay(env: dict[str, str] | None = None) -> float:
    """contract.ENV_REPORT_WRITE_DELAY: seconds (0..60; default REPORT_WRITE_DELAY_S)."""
    raw = (os.environ if env is None else env).get(contract.ENV_REPORT_WRITE_DELAY, "")
    try:
        value = float(raw) if raw else REPORT_WRITE_DELAY_S
    except ValueError:
        log.warning("ignoring %s=%r: not a number of seconds", contract.ENV_REPORT_WRITE_DELAY, raw)
        return REPORT_WRITE_DELAY_S
    return max(0.0, min(value, 60.0))


def push_report(url: str, body: bytes, timeout: float = 1.0) -> tuple[int, str]:
    """POST one report to the operator: (HTTP status, message); (0, why) when there was no answer."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    try:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)
        try:
            conn.request("POST", parts.path + (f"?{parts.query}" if parts.query else ""), body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read(4096)
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as err:
        return 0, str(err)
    try:
        message = str(json.loads(raw).get("message", ""))
    except (ValueError, AttributeError):
        message = raw[:200].decode(errors="replace")
    return resp.status, message


def load_kube_config() -> Any:
    """A CoreV1Api from KUBECONFIG when set, else the in-cluster config (the pod's projected token)."""
    from kubernetes import client, config

    if os.environ.get("KUBECONFIG"):
        config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    else:
        config.load_incluster_config()
    return client.CoreV1Api()


@dataclass
class WriteStats:
    counts: dict[str, int] = field(default_factory=lambda: {"annotations": 0, "status": 0})
    seconds: list[float] = field(default_factory=list)


class PodLink:
    """Watches this pod's annotations and writes its observed state, each in its own thread."""

    def __init__(self, namespace: str, name: str, on_desired: Callable[[Desired], None],
                 metrics: AgentMetrics | None = None, api: Any = None, token: bytes | None = None,
                 desired_configmap: str | None = None, job: str | None = None,
                 write_delay: float | None = None) -> None:
        self.namespace = namespace
        self.name = name
        # Reports pushed to the operator first (crds/report_push.py): where (the ConfigMap's report-to), for
        # which job, and how long an acknowledged report may wait for its (coalesced) pod write.
        self.job = job
        self.report_to: str | None = None
        self.write_delay = report_write_delay() if write_delay is None else write_delay
        self._seq = 0
        self._pushed: dict[str, str | None] | None = None  # the reported annotations the operator last took
        self._deferred_until: float | None = None  # when a taken report's pod write is due (None: none waits)
        self._repush = False  # push the current report even if nothing changed (a new operator instance)
        self._forced = 0  # flush() under way: nothing waits
        # the job's desired-state ConfigMap (contract.desired_configmap_name); None: the pod's annotations only
        self.desired_configmap = desired_configmap
        self._pod_ann: dict[str, str] = {}
        self._cm_data: dict[str, str] | None = None  # None: not seen (yet): the pod's own annotations stand
        self._cm_rv: str | None = None
        self._desired_lock = threading.Lock()
        self.on_desired = on_desired
        self.metrics = metrics
        self.api = api
        # With the job's token every version written carries a proof (crds/version_proof.py) and versions
        # found on the pod that this agent did not write are never signed: they are removed.
        self.token = token
        self.uid = ""
        self._mine: dict[str, str | None] = {}  # the version annotations this agent wrote (or verified at start)
        self._write_rv = 0  # resourceVersion of the pod after this agent's last annotation write
        self._in_flight: dict[str, str | None] = {}  # the annotation patch being sent
        self._rewrite_versions = False
        self.desired = Desired()
        self.stats = WriteStats()
        self._want = Observed()
        self._written_ann: dict[str, str | None] = {}
        self._written_cond: tuple[str, str] | None = None
        self._created: dt.datetime | None = None  # the pod's creationTimestamp
        self._cond = threading.Condition()
        self._dirty = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> PodLink:
        if self.api is None:
            self.api = load_kube_config()
        pod = self.api.read_namespaced_pod(self.name, self.namespace)
        if self.desired_configmap is not None:
            self._seed_configmap()
        self._seed(pod)
        loops = [(self._watch_loop, "pod-watch"), (self._write_loop, "pod-write")]
        if self.desired_configmap is not None:
            loops.append((self._configmap_loop, "desired-watch"))
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("watching own pod namespace=%s pod=%s", self.namespace, self.name)
        return self

    def _seed(self, pod: Any) -> None:
        ann = dict(pod.metadata.annotations or {})
        first = not self.uid
        self.uid = str(pod.metadata.uid or "")
        created = pod.metadata.creation_timestamp
        self._created = created if isinstance(created, dt.datetime) else None
        self._written_ann = {k: v for k, v in ann.items() if k.startswith(f"{contract.GROUP}/")}
        if self.token is not None and not first:
            with self._cond:  # a re-read after a lost watch: the next write restores whatever is not ours
                self._rewrite_versions = True
                self._dirty = True
                self._cond.notify_all()
        elif self.token is not None:
            if version_proof.verify(self.token, self.uid, ann):
                self._mine = {k: ann.get(k) for k in contract.VERSION_PROOF_KEYS}
            else:  # written by someone else: dropped with the next write (which this forces)
                log.warning("versions on own pod carry no valid proof, removing them: %s",
                            {k: ann.get(k) for k in contract.VERSION_PROOF_KEYS if ann.get(k)})
                self._mine = {}
                with self._cond:
                    self._dirty = True
        for c in (pod.status.conditions or []) if pod.status else []:
            if c.type == contract.POD_CONDITION_SYNCED:
                self._written_cond = (c.status, c.reason or "")
        self._apply(ann)
        self._rv = pod.metadata.resource_version

    def _apply(self, annotations: dict[str, str] | None) -> None:
        """The pod's annotations changed (inject-fault lives there; and everything while no ConfigMap)."""
        with self._desired_lock:
            self._pod_ann = dict(annotations or {})
            self._recompute()

    def _apply_configmap(self, data: dict[str, str] | None) -> None:
        with self._desired_lock:
            self._cm_data = dict(data or {})
            report_to = desired.report_to(self._cm_data)
            if report_to != self.report_to:
                self._new_operator(report_to)
            self._recompute()

    def _recompute(self) -> None:
        d = desired_for(self.name, self._pod_ann, self._cm_data)
        if d != self.desired:
            self.desired = d
            try:
                self.on_desired(d)
            except Exception:
                log.exception("desired-state callback failed")

    def _new_operator(self, report_to: str | None) -> None:
        """Another operator instance (a restart, a new leader) holds none of this agent's reports: push the
        current one again; no report address any more: write the pod now."""
        with self._cond:
            had = self.report_to
            self.report_to = report_to
            self._pushed = None
            if had is not None:
                self._repush = report_to is not None
                self._deferred_until = None if report_to is None else self._deferred_until
                self._dirty = True
                self._cond.notify_all()

    def _seed_configmap(self) -> None:
        """Read the desired-state ConfigMap once (absent: the operator has not written it yet, or an older
        operator does not: the pod's annotations stand until the watch sees it)."""
        from kubernetes.client.exceptions import ApiException

        assert self.desired_configmap is not None
        try:
            cm = self.api.read_namespaced_config_map(self.desired_configmap, self.namespace)
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            if exc.status == 403:
                log.warning("may not read the desired-state ConfigMap %s (an older operator's Role?): "
                            "reading the desired state from the pod's annotations", self.desired_configmap)
            self._cm_rv = None
            return
        self._cm_rv = cm.metadata.resource_version
        self._apply_configmap(cm.data)

    def _configmap_loop(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            w = watch.Watch()
            try:
                kwargs: dict[str, Any] = {"resource_version": self._cm_rv} if self._cm_rv else {}
                for ev in w.stream(self.api.list_namespaced_config_map, self.namespace,
                                   field_selector=f"metadata.name={self.desired_configmap}",
                                   timeout_seconds=120, allow_watch_bookmarks=True, **kwargs):
                    if self._stop.is_set():
                        return
                    if ev["type"] in ("ADDED", "MODIFIED"):  # DELETED: keep the last desired state
                        self._apply_configmap(ev["object"].data)
                    self._cm_rv = w.resource_version or self._cm_rv
            except ApiException as exc:
                if exc.status == 410:  # too old: re-read and start over
                    self._cm_rv = None  # a watch without one starts with the object as it is now
                else:
                    log.warning("desired-state watch failed status=%s: %s", exc.status, exc.reason)
                    self._stop.wait(30.0 if exc.status == 403 else 1.0)
            except Exception as exc:
                log.warning("desired-state watch interrupted: %s", exc)
                self._stop.wait(1.0)

    def _watch_loop(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for ev in w.stream(self.api.list_namespaced_pod, self.namespace,
                                   field_selector=f"metadata.name={self.name}", resource_version=self._rv,
                                   timeout_seconds=120, allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        return
                    obj = ev["object"]
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        if not self._older_than_own_write(obj.metadata.resource_version):
                            self._heal(obj.metadata.annotations)
                        self._apply(obj.metadata.annotations)
                    self._rv = w.resource_version or self._rv
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: re-read and start over
                    self._seed(self.api.read_namespaced_pod(self.name, self.namespace))
                else:
                    log.warning("pod watch failed status=%s: %s", exc.status, exc.reason)
                    time.sleep(1.0)
            except Exception as exc:
                log.warning("pod watch interrupted: %s", exc)
                time.sleep(1.0)

    def own_versions(self) -> dict[str, int | None]:
        """What this agent wrote (or found proven at start) on its pod: a restarted agent resumes from it.
        Keys: published, published_epoch, served, served_epoch."""
        keys = {"published": contract.ANN_PUBLISHED_VERSION, "published_epoch": contract.ANN_PUBLISHED_EPOCH,
                "served": contract.ANN_SERVED_VERSION, "served_epoch": contract.ANN_SERVED_EPOCH}
        return {name: nonnegative(self._mine.get(key)) for name, key in keys.items()}

    def _older_than_own_write(self, resource_version: str | None) -> bool:
        """A watch event from before this agent's last write shows values it has since replaced: not
        someone else's change. (resourceVersions are etcd revisions; one that is not a number is never
        taken as older.)"""
        try:
            return int(str(resource_version)) < self._write_rv
        except ValueError:
            return False

    def _heal(self, annotations: dict[str, str] | None) -> None:
        """Someone else changed a version annotation or the proof this agent wrote: write ours again (the
        operator ignores the changed values meanwhile, their proof no longer verifies)."""
        if self.token is None:
            return
        ann = annotations or {}
        with self._cond:
            changed = [k for k in (*contract.VERSION_PROOF_KEYS, contract.ANN_VERSION_PROOF)
                       if k in self._written_ann and ann.get(k) != self._written_ann.get(k)
                       and not (k in self._in_flight and ann.get(k) == self._in_flight[k])]
            if not changed:
                return
            log.warning("version annotations on own pod changed by someone else, writing them again: %s",
                        {k: ann.get(k) for k in changed})
            self._rewrite_versions = True  # the next write sends every version annotation and the proof
            self._dirty = True
            self._cond.notify_all()

    def report(self, obs: Observed) -> None:
        with self._cond:
            self._want = obs
            self._dirty = True
            self._cond.notify_all()

    def update(self, **fields: Any) -> None:
        with self._cond:
            self._want = replace(self._want, **fields)
            self._dirty = True
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                wait = None if self._deferred_until is None else max(0.0, self._deferred_until - time.monotonic())
                self._cond.wait_for(lambda: self._dirty or self._stop.is_set(), wait)
                if self._stop.is_set():
                    return
                self._dirty = False
                obs = self._want
            try:
                self._write(obs)
            except Exception as exc:
                log.warning("pod status write failed, will retry: %s", exc)
                with self._cond:
                    self._dirty = True
                self._stop.wait(1.0)

    def _timed(self, kind: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        self.stats.counts[kind] += 1
        self.stats.seconds.append(took)
        if self.metrics:
            self.metrics.api_writes.labels(kind).inc()
            self.metrics.api_write_seconds.labels(kind).observe(took)

    def _wanted(self, obs: Observed) -> dict[str, str | None]:
        want = annotations_for(obs)
        if self.token is None:
            return want
        for k in contract.VERSION_PROOF_KEYS:
            if k in want:
                self._mine[k] = want[k]
            want[k] = self._mine.get(k)  # never leave (and so sign) a value this agent did not write
        proven = {k: want[k] for k in contract.VERSION_PROOF_KEYS}
        want[contract.ANN_VERSION_PROOF] = (version_proof.version_proof(self.token, self.uid, proven)
                                            if any(proven.values()) else None)
        return want

    def _push(self, reported: dict[str, str | None]) -> bool:
        """Send the reported annotations to the operator (True: it took them). One POST, short deadline;
        anything but 200 and the pod is written at once instead."""
        url, token, job = self.report_to, self.token, self.job
        if url is None or token is None or job is None or not self.uid:
            return False
        if reported == self._pushed:
            return True
        self._seq = max(self._seq + 1, time.time_ns())
        body = report_push.build(token, self.namespace, job, self.name, self.uid, self._seq, reported)
        t0 = time.perf_counter()
        code, message = push_report(url, body)
        result = "taken" if code == 200 else "failed" if code == 0 else "refused"
        if self.metrics:
            self.metrics.reports_pushed.labels(result).inc()
            self.metrics.report_push_seconds.observe(time.perf_counter() - t0)
        if code != 200:
            log.info("report not taken by the operator (%s %s): writing the pod", code or "no answer", message,
                     extra={"status": code})
            return False
        self._pushed = reported
        return True

    def _write(self, obs: Observed) -> None:
        want = self._wanted(obs)
        patch = annotation_patch(want, self._written_ann)
        rewrite = False
        with self._cond:
            if self._rewrite_versions:
                self._rewrite_versions, rewrite = False, True
                patch.update({k: want.get(k) for k in (*contract.VERSION_PROOF_KEYS, contract.ANN_VERSION_PROOF)})
        with self._cond:
            repush, self._repush = self._repush, False
        if not rewrite and (repush or any(k in contract.REPORTED_POD_ANNOTATIONS for k in patch)):
            full = {**self._written_ann, **patch}
            reported = {k: full.get(k) for k in contract.REPORTED_POD_ANNOTATIONS}
            # Atomic (the desired state carries commit keys): a pod's served version switches together with
            # its readiness, so its pod is written at once as well; Rolling: within write_delay (times 1 to
            # 1.5, so a fleet's writes spread out), coalesced.
            atomic = self.desired.commit is not None or self.desired.committed is not None
            if any(reported.values()) and self._push(reported) and not atomic and patch:
                now = time.monotonic()
                if self._deferred_until is None:
                    self._deferred_until = now + self.write_delay * random.uniform(1.0, 1.5)
                if not self._forced and now < self._deferred_until:
                    patch = {}  # the operator has it; the pod follows, coalesced
        if patch:
            body = {"metadata": {"annotations": patch}}
            written: list[Any] = []
            with self._cond:
                self._in_flight = dict(patch)  # the watch may show this write before the patch call returns
            try:
                self._timed("annotations", lambda: written.append(self.api.patch_namespaced_pod(
                    self.name, self.namespace, body, _content_type="application/merge-patch+json")))
                with self._cond:
                    self._written_ann.update(patch)
                    if not annotation_patch(want, self._written_ann):
                        self._deferred_until = None
                    rv = getattr(getattr(written[0], "metadata", None), "resource_version", None)
                    with contextlib.suppress(TypeError, ValueError):
                        self._write_rv = max(self._write_rv, int(str(rv)))
            finally:
                with self._cond:
                    self._in_flight = {}
        cond = condition_for(obs, dt.datetime.now(dt.timezone.utc))
        if cond is not None and (cond["status"], cond["reason"]) != self._written_cond:
            if self._written_cond is not None and self._written_cond[0] == cond["status"]:
                # only the reason changed: lastTransitionTime stays when the status last changed (the
                # Kubernetes convention; the operator's Atomic drain check compares it with Ready's)
                del cond["lastTransitionTime"]
            elif self._written_cond is None and cond["status"] == "False" and self._created is not None:
                # the pod's first synced condition, False: the gate has never been True on this pod
                cond["lastTransitionTime"] = self._created.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            status_body = {"status": {"conditions": [cond]}}  # strategic merge by type keeps the other conditions
            self._timed("status", lambda: self.api.patch_namespaced_pod_status(
                self.name, self.namespace, status_body, _content_type="application/strategic-merge-patch+json"))
            self._written_cond = (cond["status"], cond["reason"])

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything reported so far was written on the pod, a report the operator took
        included (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._forced += 1
            self._dirty = True
            self._cond.notify_all()
        try:
            while time.monotonic() < deadline:
                with self._cond:
                    if not self._dirty:
                        obs = self._want
                        if not annotation_patch(self._wanted(obs), self._written_ann):
                            return True
                time.sleep(0.02)
            return False
        finally:
            with self._cond:
                self._forced -= 1

    def close(self) -> None:
        if self._deferred_until is not None and self._threads and not self._stop.is_set():
            self.flush(timeout=2.0)  # a report only the operator has: write it before going
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
