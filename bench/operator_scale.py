"""Operator scale, two modes.

Replica mode: from `kubectl create` of a WeightSyncJob to all its pods created, scheduled by the real
kube-scheduler, and the first status; and the cost of a no-op (steady-state) reconcile; for growing
inference replica counts.

    .venv/bin/python bench/operator_scale.py --replicas 8 32 64 > bench/results/operator-scale.json

What runs for real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager (e2e/cluster.py), the
simulated GPU nodes (e2e/nodes.py, no process runtime: pods are only placed), and the operator as a
process (`weightsync-operator --namespace NS`). Each size: one 8-GPU trainer pod plus R one-GPU
inference replicas, in a fresh namespace; pods are force-deleted afterwards to free the GPUs.
The no-op reconcile cost comes from the operator's own histogram over a window of periodic resyncs.

Fleet mode: a thousand GPU nodes, thousands of pods, a hundred jobs.

    .venv/bin/python bench/operator_scale.py --nodes 1000 --pods 2000 --jobs 100 --json

N kwok nodes (8 GPUs each, e2e/kwok.py: one kwok process keeps them Ready and runs their pods), J jobs of
P/J pods (one 8-GPU trainer pod, the rest one-GPU inference replicas) created at once, the operator as a
process, and the agents played by one process (FakeAgents: what each agent's PodLink reads and writes,
built with the agent's own functions: the target from the job's desired-state ConfigMap, the report on the
pod; an agent "loads" a version the moment its pod is targeted). It reports:

* `api_requests_per_version_per_pod`: every request the API server counted (apiserver_request_total, all
  clients, WATCH and kwok's node leases and node status left out) while every job moved through
  `--versions` versions, divided by versions x pods; by request, and the operator's own share
  (`operator_api_requests_per_version_per_pod`, from weightsync_operator_api_requests_total);
* `operator_rss_bytes` (and the peak) of the operator process with every job running;
* `restart_converge_s`: the operator is stopped, every trainer publishes a new version meanwhile, the
  operator is started: seconds from its start until every job's status shows that version
  (`restart_rollout_s`: until every job also serves it);
* `publish_to_status_p99_s_256_pods` (p50 too): one more job with `--big-pods` inference pods, from the
  trainer's publish annotation to status.servedVersion (seen through a watch), over `--big-versions`.

An older operator can be measured with the same script: put a tree whose `weightsync` package is the
older code first on PYTHONPATH (the operator process inherits it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightsync.agent.podstate import Observed, annotations_for, condition_for, desired_for
from weightsync.agent.podstatus import push_report
from weightsync.crds import contract, desired, report_push, version_proof
from weightsync.e2e.environment import Environment, start_environment
from weightsync.e2e.procs import free_port

REPO = Path(__file__).resolve().parents[1]
OPERATOR_BIN = Path(sys.executable).parent / "weightsync-operator"
log = logging.getLogger("weightsync.bench.operator_scale")


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("weightsync_operator_") and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def total(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def slow_passes(log_path: Path | None, offset: int) -> list[dict[str, Any]]:
    """The operator's `reconcile.slow` lines logged since byte `offset` (passes whose request -> end took over
    workqueue.SLOW_PASS_S): which job, and whether the time went to waiting, running or the status write."""
    if log_path is None or not log_path.exists():
        return []
    with log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        if "reconcile.slow" not in line:
            continue
        fields = dict(kv.split("=", 1) for kv in line.split("reconcile.slow", 1)[1].split() if "=" in kv)
        out.append({"job": fields.get("job"),
                    **{k: float(fields[k]) for k in ("wait_s", "run_s", "status_write_s") if k in fields}})
    return out


def job_spec(replicas: int) -> dict[str, Any]:
    c = {"name": "main", "image": "busybox:1.36", "command": ["sleep", "3600"]}
    return {
        "placement": {"mode": "Separated"},
        "transfer": {"mode": "NCCL", "bucketSizeMB": 64},
        "trainer": {"replicas": 1, "gpusPerPod": 8, "parallelism": {"tensor": 8, "pipeline": 1, "data": 1},
                    "template": {"spec": {"containers": [dict(c, name="trainer")]}}},
        "inference": {"replicas": replicas, "gpusPerReplica": 1, "parallelism": {"tensor": 1},
                      "engine": {"type": "SGLang"}, "template": {"spec": {"containers": [dict(c, name="engine")]}}},
    }


def measure(env: Any, kube_api: Any, replicas: int, work: Path, resync: float, window: float) -> dict[str, Any]:
    import kubernetes

    core: Any = kubernetes.client.CoreV1Api(kube_api)
    custom: Any = kubernetes.client.CustomObjectsApi(kube_api)
    ns = f"bench-{replicas}-{os.getpid()}"
    core.create_namespace({"metadata": {"name": ns}})
    deadline = time.monotonic() + 60
    while True:
        try:
            core.read_namespaced_service_account("default", ns)
            break
        except kubernetes.client.exceptions.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    port = free_port()
    log_path = work / f"operator-{ns}.log"
    envv = {**os.environ, "KUBECONFIG": str(env.kubeconfig), "WEIGHTSYNC_RESYNC_SECONDS": str(resync)}
    with log_path.open("wb") as out:
        proc = subprocess.Popen([str(OPERATOR_BIN), "--namespace", ns, "--metrics-port", str(port), "--health-port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=envv, cwd=str(REPO))
    try:
        deadline = time.monotonic() + 60
        while "operator started" not in log_path.read_text(errors="replace"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"operator did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # watches established
        pods_wanted = replicas + 1
        before = metrics(port)
        t0 = time.monotonic()
        custom.create_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, contract.PLURAL, {
            "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "scale"},
            "spec": job_spec(replicas)})
        created = scheduled = status = None
        while scheduled is None or status is None:
            now = time.monotonic() - t0
            if now > 300:
                raise RuntimeError(f"size {replicas}: not settled after 300 s")
            pods = core.list_namespaced_pod(ns, label_selector=f"{contract.LABEL_JOB}=scale").items
            if created is None and len(pods) == pods_wanted:
                created = now
            if scheduled is None and len(pods) == pods_wanted and all(p.spec.node_name for p in pods):
                scheduled = now
            if status is None:
                job = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, ns, contract.PLURAL, "scale")
                if (job.get("status") or {}).get("conditions"):
                    status = now
            time.sleep(0.05)
        settle = metrics(port)
        time.sleep(max(2.0, 2 * resync))  # let the last pod events drain
        w0 = metrics(port)
        time.sleep(window)
        w1 = metrics(port)
        count = total(w1, "weightsync_operator_reconcile_duration_seconds_count") - total(w0, "weightsync_operator_reconcile_duration_seconds_count")
        secs = total(w1, "weightsync_operator_reconcile_duration_seconds_sum") - total(w0, "weightsync_operator_reconcile_duration_seconds_sum")
        changed = total(w1, 'weightsync_operator_reconciles_total{result="changed"}') - total(w0, 'weightsync_operator_reconciles_total{result="changed"}')
        return {
            "inference_replicas": replicas,
            "pods": pods_wanted,
            "all_pods_created_s": round(created or 0, 3),
            "all_pods_scheduled_s": round(scheduled, 3),
            "first_status_s": round(status, 3),
            "reconciles_until_scheduled": int(total(settle, "weightsync_operator_reconcile_duration_seconds_count")
                                              - total(before, "weightsync_operator_reconcile_duration_seconds_count")),
            "noop_reconciles_in_window": int(count),
            "noop_reconciles_that_changed_something": int(changed),
            "noop_reconcile_mean_ms": round(1000 * secs / count, 2) if count else None,
            "reconcile_errors": int(total(w1, "weightsync_operator_reconcile_errors_total")),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        for p in core.list_namespaced_pod(ns).items:
            core.delete_namespaced_pod(p.metadata.name, ns, grace_period_seconds=0)
        core.delete_namespace(ns)


# --- fleet mode: --nodes N --pods P --jobs J on kwok nodes -------------------------------------------------
KWOK_GRACE = ["--node-monitor-grace-period=3m", "--node-startup-grace-period=5m"]
BIG_NS, FLEET_NS = "big", "fleet"
UNCOUNTED = ("leases", "nodes")  # kwok renews node leases and node status all the time: not our load


def kwok_job_spec(inference: int) -> dict[str, Any]:
    """One 8-GPU trainer pod and INFERENCE one-GPU replicas on kwok nodes, every replica may load at once."""
    from weightsync.e2e.kwok import KWOK_TOLERATION, LABEL_KWOK_NODE

    spec = job_spec(inference)
    for role in ("trainer", "inference"):
        tpl = spec[role]["template"]["spec"]
        tpl["tolerations"] = [KWOK_TOLERATION]
        tpl["nodeSelector"] = {LABEL_KWOK_NODE: "true"}
    spec["updatePolicy"] = {"maxUnavailable": "100%"}
    return spec


def apiserver_requests(api: Any) -> dict[str, float]:
    """apiserver_request_total (every client) by `verb resource/subresource`, WATCH and UNCOUNTED left out."""
    resp = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    resp.read()
    out: dict[str, float] = {}
    for line in (resp.data or b"").decode().splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        raw, value = line[len("apiserver_request_total{"):].rsplit("} ", 1)
        labels = {k: v.strip('"') for k, v in (part.split("=", 1) for part in raw.split(",") if "=" in part)}
        if labels.get("verb") == "WATCH" or labels.get("resource") in UNCOUNTED:
            continue
        key = f"{labels.get('verb')} {labels.get('resource')}/{labels.get('subresource') or '-'}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def operator_requests(port: int) -> dict[str, float]:
    """The operator's own weightsync_operator_api_requests_total by `verb kind` ({} for an operator without it)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("weightsync_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="', 1)[1].split('"', 1)[0]
            kind = labels.split('kind="', 1)[1].split('"', 1)[0]
            if verb != "watch" and "Peering" not in kind:
                out[f"{verb} {kind}"] = out.get(f"{verb} {kind}", 0.0) + float(value)
    return out


def rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident set of PID in bytes, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


class FakeAgents:
    """The agents of every pod, played by one process: one pod watch and one ConfigMap watch per namespace
    (as the real agents' own pod and desired-state watches add up to), the target read as a real agent's
    PodLink reads it (`desired_for`: the job's desired-state ConfigMap, else the pod's annotations), and
    for each pod the writes a real agent's PodLink sends, built by the agent's own code
    (agent/podstatus.py): the Synced condition once the pod runs, then one annotation patch per version it
    is targeted at ("loads" instantly)."""

    def __init__(self, api_factory: Callable[[], Any], namespaces: list[str], workers: int = 16,
                 operator_key: bytes | None = None, push: bool = True, write_delay: float = 10.0) -> None:
        import kubernetes

        # As the real agents: versions carry the proof made with the job's token (derived here from the
        # operator key, as the operator derives it), and with `push` a report goes to the operator first
        # (crds/report_push.py, the agent's own push_report) and the pod write follows write_delay later,
        # coalesced (PodLink); refused or unanswered: the pod is written at once.
        self.operator_key = operator_key
        self.push = push
        self.write_delay = write_delay
        self.pods: dict[tuple[str, str], tuple[str, str]] = {}  # (namespace, pod) -> (pod uid, job uid)
        self.pending: dict[tuple[str, str], tuple[float, dict[str, str | None]]] = {}  # deferred pod writes
        self.seq = 0
        self.pushes = {"taken": 0, "not_taken": 0}
        self.last_report: dict[tuple[str, str], tuple[str, dict[str, str | None]]] = {}  # pod -> job, report
        self.report_to: dict[tuple[str, str], str | None] = {}  # (namespace, ConfigMap) -> report address
        self.busy = 0  # reports and writes submitted and not done

        self.api = api_factory()
        self.api.configuration.connection_pool_maxsize = workers + 4
        self.core: Any = kubernetes.client.CoreV1Api(self.api)
        self.namespaces = namespaces
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.lock = threading.Lock()
        self.started: set[tuple[str, str]] = set()
        self.served: dict[tuple[str, str], int] = {}
        self.commits: dict[tuple[str, str, int], float] = {}  # (namespace, pod, version) -> target seen
        self.reported: dict[tuple[str, str, int], float] = {}  # ... -> the agent's report written
        self.errors = 0
        self.publish_times: dict[int, float] = {}
        self.pod_ann: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}  # running inference pods: job, annotations
        self.desired: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, ConfigMap name) -> data
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._watch, args=(ns, api_factory, kind), daemon=True)
                        for ns in namespaces for kind in ("pod", "config_map")]
        self.threads.append(threading.Thread(target=self._deferred_writes, daemon=True))

    def start(self) -> FakeAgents:
        for t in self.threads:
            t.start()
        return self

    def _watch(self, ns: str, api_factory: Callable[[], Any], kind: str) -> None:
        import kubernetes

        api = api_factory()
        core: Any = kubernetes.client.CoreV1Api(api)
        list_fn = getattr(core, f"list_namespaced_{kind}")
        seen = self._seen if kind == "pod" else self._configmap_seen
        rv = ""
        while not self.stop_flag.is_set():
            try:
                if not rv:
                    page = json.loads(list_fn(ns, _preload_content=False).data)
                    for obj in page.get("items", []):
                        seen(obj)
                    rv = page["metadata"]["resourceVersion"]
                resp = list_fn(ns, watch=True, resource_version=rv, timeout_seconds=60,
                               allow_watch_bookmarks=True, _preload_content=False)
                buf = b""
                for chunk in resp.stream(None):  # each chunk as it arrives
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        ev = json.loads(line)
                        if ev["type"] == "ERROR":
                            rv = ""
                            break
                        rv = ev["object"]["metadata"].get("resourceVersion") or rv
                        if ev["type"] in ("ADDED", "MODIFIED"):
                            seen(ev["object"])
                    if self.stop_flag.is_set():
                        return
            except Exception as exc:  # reconnect; a 410 lists again
                log.debug("fake agents' watch restarted: %r", exc)
                rv = "" if "410" in str(exc) else rv
                time.sleep(0.2)

    def _seen(self, pod: dict[str, Any]) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        key = (meta["namespace"], meta["name"])
        owner: dict[str, Any] = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), {})
        with self.lock:
            self.pods[key] = (str(meta.get("uid") or ""), str(owner.get("uid") or ""))
        if (meta.get("labels") or {}).get(contract.LABEL_ROLE) != contract.ROLE_INFERENCE or meta.get("deletionTimestamp"):
            return
        if status.get("phase") != "Running":
            return
        job = (meta.get("labels") or {}).get(contract.LABEL_JOB, "")
        with self.lock:
            self.pod_ann[key] = (job, dict(meta.get("annotations") or {}))
        self._consider(key)

    def _configmap_seen(self, cm: dict[str, Any]) -> None:
        meta = cm["metadata"]
        key = (meta["namespace"], meta["name"])
        with self.lock:
            self.desired[key] = dict(cm.get("data") or {})
            pods = [k for k, (job, _) in self.pod_ann.items()
                    if k[0] == key[0] and contract.desired_configmap_name(job) == key[1]]
            url = desired.report_to(self.desired[key])
            had = self.report_to.get(key)
            self.report_to[key] = url
            # a new operator instance holds no report: push the last one of each pod again (PodLink)
            again = [(k, job, ann) for k, (job, ann) in self.last_report.items()
                     if had is not None and url not in (None, had) and k[0] == key[0]
                     and contract.desired_configmap_name(job) == key[1]]
        for k, job, ann in again:
            self._submit(self._push, k, job, ann)
        for k in pods:
            self._consider(k)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self.lock:
            self.busy += 1

        def run() -> None:
            try:
                fn(*args)
            finally:
                with self.lock:
                    self.busy -= 1
        self.pool.submit(run)

    def wait_idle(self, timeout: float = 120.0) -> float:
        """Until no report or write is under way (a measurement starts after the start-up burst: one
        Synced condition write per pod), the deferred pod writes of reports taken by the operator still
        waiting (they land during the measurement, as in steady state); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with self.lock:
                if not self.busy:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError(f"fake agents still busy after {timeout:.0f} s")

    def _consider(self, key: tuple[str, str]) -> None:
        """What a real agent does with its desired state: report Synced once, load a newer target."""
        with self.lock:
            job, ann = self.pod_ann[key]
            target = desired_for(key[1], ann, self.desired.get((key[0], contract.desired_configmap_name(job))))
            first = key not in self.started
            self.started.add(key)
            v = target.target_version
            load = v is not None and self.served.get(key, 0) < v
            if load:
                assert v is not None
                self.served[key] = v
                self.commits[(key[0], key[1], v)] = time.monotonic()
        if first:
            self._submit(self._report, key, job, Observed(engine_paused=False, synced=True,
                                                               synced_reason="NoVersionPublished"), True)
        if load:
            assert v is not None
            self._submit(self._report, key, job, Observed(
                served_version=v, synced=True, synced_reason="UpToDate",
                last_sync={"version": v, "durationSeconds": 0.0, "bytes": 1, "mode": "NCCL"}), v == 1)

    def publish(self, jobs: list[tuple[str, str]], version: int) -> None:
        """What each trainer agent sends when its trainer published VERSION (trainer pod 0 of each job)."""
        obs = Observed(published_version=version)
        list(self.pool.map(lambda k: self._report((k[0], contract.trainer_pod_name(k[1], 0)), k[1], obs, False),
                           jobs))

    def _signed(self, key: tuple[str, str], job: str, obs: Observed) -> dict[str, str | None]:
        ann = annotations_for(obs)
        with self.lock:
            uid, job_uid = self.pods.get(key, ("", ""))
        if self.operator_key is not None and any(ann.get(k) for k in contract.VERSION_PROOF_KEYS):
            token = version_proof.job_token(self.operator_key, key[0], job, job_uid)
            ann[contract.ANN_VERSION_PROOF] = version_proof.version_proof(token, uid, ann)
        return ann

    def _push(self, key: tuple[str, str], job: str, ann: dict[str, str | None]) -> bool:
        with self.lock:
            url = desired.report_to(self.desired.get((key[0], contract.desired_configmap_name(job))))
            uid, job_uid = self.pods.get(key, ("", ""))
            self.seq += 1
            seq = time.time_ns() + self.seq
        if not self.push or url is None or self.operator_key is None or not uid:
            return False
        token = version_proof.job_token(self.operator_key, key[0], job, job_uid)
        code, _ = push_report(url, report_push.build(token, key[0], job, key[1], uid, seq, ann))
        with self.lock:
            self.pushes["taken" if code == 200 else "not_taken"] += 1
        return code == 200

    def _report(self, key: tuple[str, str], job: str, obs: Observed, condition: bool) -> None:
        """What PodLink._write sends: the report to the operator, else (or write_delay later, coalesced) the
        annotations on the pod; the Synced condition only when it changed, at once."""
        try:
            ann = self._signed(key, job, obs)
            taken = any(k in contract.REPORTED_POD_ANNOTATIONS for k in ann) and self._push(key, job, ann)
            now = time.monotonic()
            with self.lock:
                self.last_report[key] = (job, ann)
            if taken:
                with self.lock:
                    due = self.pending.get(key, (now + self.write_delay * random.uniform(1.0, 1.5), {}))[0]
                    self.pending[key] = (due, ann)
            else:
                self.core.patch_namespaced_pod(key[1], key[0], {"metadata": {"annotations": ann}},
                                               _content_type="application/merge-patch+json", _preload_content=False)
            if obs.served_version is not None:
                with self.lock:
                    self.reported[(key[0], key[1], obs.served_version)] = time.monotonic()
            cond = condition_for(obs, dt.datetime.now(dt.timezone.utc))
            if condition and cond is not None:
                self.core.patch_namespaced_pod_status(
                    key[1], key[0], {"status": {"conditions": [cond]}},
                    _content_type="application/strategic-merge-patch+json", _preload_content=False)
        except Exception as exc:
            with self.lock:
                self.errors += 1
            log.warning("fake agent write failed pod=%s/%s: %r", key[0], key[1], exc)

    def _deferred_writes(self) -> None:
        while not self.stop_flag.wait(0.05):
            now = time.monotonic()
            with self.lock:
                due = [(k, ann) for k, (t, ann) in self.pending.items() if t <= now]
                for k, _ in due:
                    del self.pending[k]
            for k, ann in due:
                self._submit(self._write_pod, k, ann)

    def _write_pod(self, key: tuple[str, str], ann: dict[str, str | None]) -> None:
        try:
            self.core.patch_namespaced_pod(key[1], key[0], {"metadata": {"annotations": ann}},
                                           _content_type="application/merge-patch+json", _preload_content=False)
        except Exception as exc:
            with self.lock:
                self.errors += 1
            log.warning("fake agent deferred write failed pod=%s/%s: %r", key[0], key[1], exc)

    def target_seen(self, namespace: str, versions: range) -> dict[str, Any]:
        """p50 over VERSIONS of publish -> the first and the last pod of NAMESPACE seeing its target (how
        long the operator took to target the pods), and -> the last agent's report written (the rest of
        publish -> status is the operator reading the reports and writing the status)."""
        first, last, reported = [], [], []
        with self.lock:
            for v in versions:
                seen = [t for (ns, _, ver), t in self.commits.items() if ns == namespace and ver == v]
                done = [t for (ns, _, ver), t in self.reported.items() if ns == namespace and ver == v]
                if seen and v in self.publish_times:
                    first.append(min(seen) - self.publish_times[v])
                    last.append(max(seen) - self.publish_times[v])
                if done and v in self.publish_times:
                    reported.append(max(done) - self.publish_times[v])
        if not first:
            return {}
        out: dict[str, Any] = {"publish_to_first_target_p50_s": round(statistics.median(first), 3),
               "publish_to_last_target_p50_s": round(statistics.median(last), 3)}
        if reported:
            out["publish_to_last_report_p50_s"] = round(statistics.median(reported), 3)
            out["publish_to_last_report_s_each"] = [round(x, 3) for x in reported]
        out["publish_to_last_target_s_each"] = [round(x, 3) for x in last]
        return out

    def close(self) -> None:
        self.stop_flag.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


class JobWatch:
    """Every job's status in the given namespaces, seen through one watch each (no polling requests)."""

    def __init__(self, api_factory: Callable[[], Any], namespaces: list[str]) -> None:
        self.cond = threading.Condition()
        self.status: dict[tuple[str, str], dict[str, Any]] = {}
        self.first_served: dict[tuple[str, str, int], float] = {}
        self.restarts: list[float] = []  # when a watch (re)started: a restart is a gap in what is seen
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(ns, api_factory), daemon=True) for ns in namespaces]
        for t in self.threads:
            t.start()

    def _run(self, ns: str, api_factory: Callable[[], Any]) -> None:
        import kubernetes

        custom: Any = kubernetes.client.CustomObjectsApi(api_factory())
        rv = ""
        while not self.stop_flag.is_set():
            self.restarts.append(time.monotonic())
            try:
                w = kubernetes.watch.Watch()
                kwargs = {"resource_version": rv} if rv else {}
                for ev in w.stream(custom.list_namespaced_custom_object, contract.GROUP, contract.VERSION, ns,
                                   contract.PLURAL, timeout_seconds=300, **kwargs):
                    rv = w.resource_version or rv
                    now = time.monotonic()
                    obj = ev["object"] or {}
                    key = (ns, obj["metadata"]["name"])
                    st = obj.get("status") or {}
                    with self.cond:
                        if ev["type"] == "DELETED":
                            self.status.pop(key, None)
                        else:
                            self.status[key] = st
                        served = st.get("servedVersion")
                        if served is not None:
                            for v in range(1, int(served) + 1):
                                self.first_served.setdefault((*key, v), now)
                        self.cond.notify_all()
            except Exception as exc:
                log.debug("job watch restarted: %r", exc)
                rv = "" if "410" in str(exc) else rv
                time.sleep(0.2)

    def wait(self, pred: Callable[[dict[tuple[str, str], dict[str, Any]]], bool], timeout: float, what: str) -> float:
        t0 = time.monotonic()
        with self.cond:
            if not self.cond.wait_for(lambda: pred(self.status), timeout):
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        return time.monotonic() - t0

    def close(self) -> None:
        self.stop_flag.set()


def ready(st: dict[str, Any]) -> bool:
    return any(c.get("type") == contract.COND_READY and c.get("status") == "True" for c in st.get("conditions") or [])


def all_jobs(names: list[tuple[str, str]], test: Callable[[dict[str, Any]], bool]) -> Callable[[Any], bool]:
    return lambda status: all(k in status and test(status[k]) for k in names)


class Operator:
    """The operator as a process serving NAMESPACES (PYTHONPATH passes through: point it at an older tree
    to measure that one)."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], work: Path, resync: float,
                 key_file: Path | None = None, report_push: bool = True) -> None:
        self.kubeconfig, self.namespaces, self.work, self.resync = kubeconfig, namespaces, work, resync
        self.key_file = key_file
        self.report_port = free_port() if report_push else 0
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.log_path: Path | None = None

    def start(self) -> float:
        """Start; returns the monotonic time of the spawn."""
        self.runs += 1
        log_path = self.log_path = self.work / f"operator-{self.runs}.log"
        # Settings as environment variables: an older operator (PYTHONPATH) ignores the ones it lacks.
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "WEIGHTSYNC_RESYNC_SECONDS": str(self.resync),
               "WEIGHTSYNC_REPORT_PORT": str(self.report_port), "WEIGHTSYNC_REPORT_ADDRESS": "127.0.0.1"}
        if self.key_file is not None:
            env["WEIGHTSYNC_OPERATOR_KEY_FILE"] = str(self.key_file)
        scope = [a for ns in self.namespaces for a in ("--namespace", ns)]
        t0 = time.monotonic()
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen([str(OPERATOR_BIN), *scope, "--metrics-port", str(self.port),
                                          "--health-port", "0", "--log-format", "plain"],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
        deadline = time.monotonic() + 120
        while "operator started" not in log_path.read_text(errors="replace"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"operator did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        return t0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cycle(watch: JobWatch, jobs: list[tuple[str, str]], versions: range, timeout: float, agents: FakeAgents,
          note: bool = False) -> list[float]:
    """Publish each version on every job's trainer and wait until every job's status serves it; returns each
    job's publish -> status latency for every version (and, with NOTE, notes when the agents saw their
    targets, for `agents.target_seen`)."""
    latencies: list[float] = []
    for v in versions:
        t_publish = time.monotonic()
        if note:
            agents.publish_times[v] = t_publish
        agents.publish(jobs, v)
        def served(st: dict[str, Any], v: int = v) -> bool:
            return int(st.get("servedVersion") or 0) >= v

        watch.wait(all_jobs(jobs, served), timeout, f"version {v} served")
        with watch.cond:
            latencies += [watch.first_served[(*k, v)] - t_publish for k in jobs]
        time.sleep(0.2)
    return latencies


def wait_pods_running(core: Any, ns: str, count: int, timeout: float) -> float:
    def running() -> int:
        page = json.loads(core.list_namespaced_pod(ns, _preload_content=False).data)
        return sum(1 for p in page["items"] if (p.get("status") or {}).get("phase") == "Running")

    t0 = time.monotonic()
    while (n := running()) < count:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{n}/{count} pods Running in {ns} after {timeout:.0f} s")
        time.sleep(2.0)
    return time.monotonic() - t0


def per(d: dict[str, float], n: float) -> dict[str, float]:
    return {k: round(v / n, 3) for k, v in sorted(d.items())}


def fleet(args: argparse.Namespace) -> dict[str, Any]:
    """The fleet measurement; see the module docstring."""
    import kubernetes

    from weightsync.e2e.cluster import LocalCluster
    from weightsync.e2e.demo import wait_established
    from weightsync.e2e.kwok import KwokController, create_nodes, kwok_fleet, ready_node_count, wait_for

    per_job = args.pods // args.jobs
    if per_job < 2:
        raise SystemExit("--pods must be at least 2 x --jobs (one trainer and one inference pod per job)")
    work = Path(tempfile.mkdtemp(prefix="weightsync-bench-fleet-"))
    out: dict[str, Any] = {"benchmark": "operator_scale_fleet", "nodes": args.nodes, "pods": per_job * args.jobs,
                           "jobs": args.jobs, "pods_per_job": per_job, "big_job_inference_pods": args.big_pods}
    timings: dict[str, float] = {}
    with LocalCluster(kubeconfig=work / "kubeconfig", extra_controller_manager_args=KWOK_GRACE) as cluster:
        # The CRD of the tree the operator runs (an older operator refuses fields a newer CRD defaults).
        crd = Path(contract.__file__).resolve().parent / f"{contract.GROUP}_{contract.PLURAL}.yaml"
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
        wait_established(cluster.kubectl, contract.CRD_NAME)
        kwok = KwokController(cluster.kubeconfig, cluster.log_dir).start()
        api = cluster.api_client()
        api.configuration.connection_pool_maxsize = 24
        core: Any = kubernetes.client.CoreV1Api(api)
        custom: Any = kubernetes.client.CustomObjectsApi(api)
        agents: FakeAgents | None = None
        watch: JobWatch | None = None
        key = os.urandom(32).hex().encode()
        key_file = work / "operator.key"
        key_file.write_bytes(key)
        op = Operator(cluster.kubeconfig, [FLEET_NS, BIG_NS], work, args.resync, key_file, args.report_push == "on")
        try:
            timings["nodes_created_s"] = create_nodes(api, kwok_fleet(args.nodes))
            timings["nodes_ready_s"] = wait_for(lambda: ready_node_count(api) == args.nodes, timeout=900,
                                                what=f"{args.nodes} kwok nodes Ready", interval=3.0)
            for ns in (FLEET_NS, BIG_NS):
                core.create_namespace({"metadata": {"name": ns}})
                wait_for(lambda ns=ns: bool(core.list_namespaced_service_account(ns).items), 60, "default SA", 0.2)
            agents = FakeAgents(cluster.api_client, [FLEET_NS, BIG_NS], workers=args.agent_writers,
                                operator_key=key, push=args.report_push == "on",
                                write_delay=args.report_write_delay).start()
            watch = JobWatch(cluster.api_client, [FLEET_NS, BIG_NS])
            op.start()

            # 1. J jobs of P/J pods each, from nothing to every job Ready.
            jobs = [(FLEET_NS, f"job-{i}") for i in range(args.jobs)]
            t0 = time.monotonic()
            for _, name in jobs:
                custom.create_namespaced_custom_object(contract.GROUP, contract.VERSION, FLEET_NS, contract.PLURAL, {
                    "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": name},
                    "spec": kwok_job_spec(per_job - 1)})
            timings["jobs_created_s"] = time.monotonic() - t0
            wait_pods_running(core, FLEET_NS, per_job * args.jobs, args.timeout)
            timings["all_pods_running_s"] = time.monotonic() - t0
            watch.wait(all_jobs(jobs, ready), args.timeout, "every job Ready")
            timings["all_jobs_ready_s"] = time.monotonic() - t0

            # 2. Versions on every job at once: requests per version and pod, publish -> status per job.
            cycle(watch, jobs, range(1, 2), args.timeout, agents)  # warm-up (first condition change)
            time.sleep(2.0)
            out["fleet_warmup_drain_s"] = round(agents.wait_idle(), 2)
            a0, o0 = apiserver_requests(api), operator_requests(op.port)
            t1 = time.monotonic()
            lat = cycle(watch, jobs, range(2, 2 + args.versions), args.timeout, agents)
            time.sleep(2.0)  # the last status writes land
            a1, o1 = apiserver_requests(api), operator_requests(op.port)
            n = args.versions * per_job * args.jobs
            out["fleet_versions"] = args.versions
            out["fleet_version_round_s"] = round((time.monotonic() - t1 - 2.0) / args.versions, 3)
            out["fleet_publish_to_status_s"] = {"p50": round(statistics.median(lat), 3),
                                                "p99": round(percentile(lat, 99), 3), "max": round(max(lat), 3)}
            out["api_requests_per_version_per_pod"] = round(sum(delta(a1, a0).values()) / n, 3)
            out["api_requests_per_version_per_pod_by_request"] = per(delta(a1, a0), n)
            out["operator_api_requests_per_version_per_pod"] = (round(sum(delta(o1, o0).values()) / n, 3)
                                                                if o1 else None)
            out["operator_api_requests_per_version_per_pod_by_request"] = per(delta(o1, o0), n) if o1 else None
            cur, peak = rss(op.pid)
            out["operator_rss_bytes"], out["operator_peak_rss_bytes"] = cur, peak
            last = 1 + args.versions

            # 3. Restart with everything running; a version published while it was down.
            op.stop()
            agents.publish(jobs, last + 1)
            t_start = op.start()
            watch.wait(all_jobs(jobs, lambda st: st.get("trainerVersion") == last + 1), args.timeout,
                       "every job's status shows the version published while the operator was down")
            out["restart_converge_s"] = round(time.monotonic() - t_start, 3)
            watch.wait(all_jobs(jobs, lambda st: st.get("servedVersion") == last + 1), args.timeout,
                       "every job serves that version")
            out["restart_rollout_s"] = round(time.monotonic() - t_start, 3)

            # 4. One job of B inference pods: publish -> status, and requests per version and pod.
            big = [(BIG_NS, "big")]
            custom.create_namespaced_custom_object(contract.GROUP, contract.VERSION, BIG_NS, contract.PLURAL, {
                "apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "big"},
                "spec": kwok_job_spec(args.big_pods)})
            wait_pods_running(core, BIG_NS, args.big_pods + 1, args.timeout)
            watch.wait(all_jobs(big, ready), args.timeout, "the big job Ready")
            cycle(watch, big, range(1, 3), args.timeout, agents)  # warm-up
            time.sleep(2.0)
            out["big_warmup_drain_s"] = round(agents.wait_idle(), 2)
            a0, o0 = apiserver_requests(api), operator_requests(op.port)
            r0 = metrics(op.port)
            log_from = op.log_path.stat().st_size if op.log_path is not None else 0
            lat = cycle(watch, big, range(3, 3 + args.big_versions), args.timeout, agents, note=True)
            r1 = metrics(op.port)
            out["big_breakdown"] = agents.target_seen(BIG_NS, range(3, 3 + args.big_versions))
            first = agents.publish_times[3]
            out["big_breakdown"]["publish_s_since_first"] = [
                round(agents.publish_times[v] - first, 2) for v in range(3, 3 + args.big_versions)]
            out["big_breakdown"]["job_watch_restarts_s_since_first"] = [
                round(t - first, 2) for t in watch.restarts if t >= first]
            passes = total(r1, "weightsync_operator_reconcile_duration_seconds_count") - total(
                r0, "weightsync_operator_reconcile_duration_seconds_count")
            busy = total(r1, "weightsync_operator_reconcile_duration_seconds_sum") - total(
                r0, "weightsync_operator_reconcile_duration_seconds_sum")
            out["big_breakdown"]["operator_passes_per_version"] = round(passes / args.big_versions, 2)
            out["big_breakdown"]["operator_pass_mean_s"] = round(busy / passes, 3) if passes else None
            for name, figure in (("weightsync_operator_reconcile_wait_seconds", "operator_wait_mean_s"),
                                 ("weightsync_operator_status_write_seconds", "status_write_mean_s"),
                                 ("weightsync_operator_gc_pause_seconds", "gc_full_pause_mean_s")):
                k = total(r1, f"{name}_count") - total(r0, f"{name}_count")
                got = total(r1, f"{name}_sum") - total(r0, f"{name}_sum")
                out["big_breakdown"][figure] = round(got / k, 3) if k else None
            gc_n = total(r1, "weightsync_operator_gc_pause_seconds_count") - total(
                r0, "weightsync_operator_gc_pause_seconds_count")
            quick = total(r1, 'weightsync_operator_gc_pause_seconds_bucket{le="0.25"}') - total(
                r0, 'weightsync_operator_gc_pause_seconds_bucket{le="0.25"}')
            out["big_breakdown"]["gc_full_collections"] = gc_n
            out["big_breakdown"]["gc_full_over_0_25_s"] = gc_n - quick  # they stop every thread of the operator
            out["big_breakdown"]["slow_passes"] = slow_passes(op.log_path, log_from)
            time.sleep(2.0)
            a1, o1 = apiserver_requests(api), operator_requests(op.port)
            n = args.big_versions * (args.big_pods + 1)
            out[f"publish_to_status_p50_s_{args.big_pods}_pods"] = round(statistics.median(lat), 3)
            out[f"publish_to_status_p99_s_{args.big_pods}_pods"] = round(percentile(lat, 99), 3)
            out[f"publish_to_status_s_{args.big_pods}_pods_each"] = [round(x, 3) for x in lat]
            out["big_versions"] = args.big_versions
            out["big_api_requests_per_version_per_pod"] = round(sum(delta(a1, a0).values()) / n, 3)
            out["big_api_requests_per_version_per_pod_by_request"] = per(delta(a1, a0), n)
            out["big_operator_api_requests_per_version_per_pod"] = (round(sum(delta(o1, o0).values()) / n, 3)
                                                                    if o1 else None)
            cur, peak = rss(op.pid)
            out["operator_rss_bytes_end"], out["operator_peak_rss_bytes_end"] = cur, peak
            out["fake_agent_write_errors"] = agents.errors
            out["report_push"] = {"enabled": args.report_push == "on", "write_delay_s": args.report_write_delay,
                                  **agents.pushes}
        finally:
            out["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
            op.stop()
            if agents is not None:
                agents.close()
            if watch is not None:
                watch.close()
            kwok.stop()
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                      "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))]


def apply_crd(env: Environment) -> None:
    """Apply this tree's WeightSyncJob CRD and wait until the API server serves it."""
    env.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"))
    deadline = time.monotonic() + 90
    while env.kubectl("get", f"crd/{contract.CRD_NAME}", "-o",
                      "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                      check=False).stdout.strip() != "True":
        if time.monotonic() > deadline:
            raise RuntimeError("CRD not Established")
        time.sleep(0.2)


def replicas_mode(args: argparse.Namespace) -> dict[str, Any]:
    nodes = math.ceil((max(args.replicas) + 8) / 8) + 1
    work = Path(tempfile.mkdtemp(prefix="weightsync-bench-operator-"))
    env = start_environment(node_count=nodes, process_nodes=False)
    try:
        apply_crd(env)
        api = env.api_client()
        results = [measure(env, api, r, work, args.resync, args.window) for r in args.replicas]
    finally:
        env.stop()
    return {
        "benchmark": "operator_scale",
        "command": "python bench/operator_scale.py --replicas " + " ".join(map(str, args.replicas)),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "nodes": {"count": nodes, "gpus_per_node": 8},
        "resync_seconds": args.resync,
        "window_seconds": args.window,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=None,
                    help="replica mode: one job per size on simulated nodes (default 8 32 64)")
    ap.add_argument("--nodes", type=int, default=None, help="fleet mode: this many kwok GPU nodes (8 GPUs each)")
    ap.add_argument("--pods", type=int, default=2000, help="fleet mode: pods over all jobs")
    ap.add_argument("--jobs", type=int, default=100, help="fleet mode: WeightSyncJobs (one trainer pod each)")
    ap.add_argument("--versions", type=int, default=3, help="fleet mode: versions measured on every job")
    ap.add_argument("--big-pods", type=int, default=256, help="fleet mode: inference pods of the one big job")
    ap.add_argument("--big-versions", type=int, default=20, help="fleet mode: versions measured on the big job")
    ap.add_argument("--timeout", type=float, default=900.0, help="fleet mode: bound on each wait (s)")
    ap.add_argument("--agent-writers", type=int, default=16,
                    help="fleet mode: concurrent writes of the simulated agents (real agents write from one "
                         "process each)")
    ap.add_argument("--report-push", choices=["on", "off"], default="on",
                    help="fleet mode: agents push their reports to the operator before their pod write (on, as "
                         "the agent does when the operator advertises a report address) or write their pods only")
    ap.add_argument("--report-write-delay", type=float, default=10.0,
                    help="fleet mode: seconds a pushed report waits for its (coalesced) pod write, as "
                         "WEIGHTSYNC_REPORT_WRITE_DELAY_SECONDS")
    ap.add_argument("--json", action="store_true", help="print one JSON object (the replica mode always does)")
    ap.add_argument("--resync", type=float, default=None,
                    help="operator resync period (default: 1 s in replica mode, for its no-op window; 30 s in fleet mode)")
    ap.add_argument("--window", type=float, default=10.0, help="replica mode: seconds of steady state measured")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.nodes is not None and args.replicas is not None:
        ap.error("--replicas and --nodes are two modes: pick one")
    if args.nodes is None:
        args.replicas = args.replicas or [8, 32, 64]
        args.resync = 1.0 if args.resync is None else args.resync
        print(json.dumps(replicas_mode(args), indent=2))
        return 0
    args.resync = 30.0 if args.resync is None else args.resync
    result = fleet(args)
    result["command"] = ("python bench/operator_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("operator_rss_bytes", "restart_converge_s", "api_requests_per_version_per_pod",
                    f"publish_to_status_p99_s_{args.big_pods}_pods"):
            print(f"{key}: {result.get(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
