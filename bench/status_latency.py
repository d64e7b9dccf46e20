"""Status latency: from an inference agent committing a version to the WeightSyncJob status showing it.

    .venv/bin/python bench/status_latency.py [--versions 50] [--pods 8] > bench/results/status-latency.json

What runs for real: etcd + kube-apiserver + scheduler + controller-manager (e2e/cluster.py), the
operator as a process (`weightsync-operator`), and the agents' own Kubernetes link (agent/podstatus.py
PodLink: the watch on its own pod and the coalescing annotation / pods/status writer), one per pod, each
with its own API connection. What is played: the kubelet (pods are marked Running/Ready once, as the
process runtime would) and the data plane (an agent "commits" version v the moment its pod is targeted
at v). So the number is the control-plane loop only: agent write -> apiserver -> operator watch ->
reconcile -> status patch -> watch, which is what `kubectl get wsj` users wait for after a load.

For each version v: the trainer's PodLink reports published v; the operator targets the inference pods;
each inference PodLink sees its target and reports served v (t_commit); the latency of v is the first
time the job's status.servedVersion >= v (seen through a watch) minus the last pod's t_commit (servedVersion
is the minimum over Ready replicas, so it can only move once the last replica committed).

API writes: counted by the agents (PodLink.stats) and by the API server (apiserver_request_total, all
clients) over the measured versions, per version and per inference pod.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes

from weightsync.agent.podstate import Desired
from weightsync.agent.podstatus import PodLink
from weightsync.crds import contract
from weightsync.e2e import demo
from weightsync.e2e.environment import Environment, start_environment

log = logging.getLogger("weightsync.bench.status_latency")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def apiserver_requests(api: kubernetes.client.ApiClient, reads: bool = False) -> dict[str, float]:
    """apiserver_request_total by resource/subresource (all clients): writes (PATCH/PUT/POST), or reads
    (GET/LIST) when READS."""
    resp = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    resp.read()
    out: dict[str, float] = {}
    for line in (resp.data or b"").decode().splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_raw, value = line[len("apiserver_request_total{"):].rsplit("} ", 1)
        labels = dict(part.split("=", 1) for part in labels_raw.split(",") if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        verbs = ("GET", "LIST") if reads else ("PATCH", "PUT", "POST", "APPLY")
        if labels.get("verb") not in verbs:
            continue
        key = f"{labels.get('resource')}/{labels.get('subresource') or '-'}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Kubelet:
    """What the process runtime would report once the containers run: Running, an IP, Ready."""

    def __init__(self, core: kubernetes.client.CoreV1Api, namespace: str) -> None:
        self.core = core
        self.namespace = namespace

    def mark_ready(self, name: str, ip: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conds = [{"type": t, "status": "True", "lastTransitionTime": now}
                 for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")]
        body = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
                           "startTime": now, "conditions": conds}}
        self.core.patch_namespaced_pod_status(name, self.namespace, body)


class InferenceAgentLink:
    """One inference agent's pod link; 'loads' instantly and records when it committed each version."""

    def __init__(self, env: Environment, namespace: str, pod: str) -> None:
        self.api = env.api_client()
        self.pod = pod
        self.served: int | None = None
        self.commits: dict[int, float] = {}
        self.lock = threading.Lock()
        self.link = PodLink(namespace, pod, self._on_desired, api=kubernetes.client.CoreV1Api(self.api))

    def start(self) -> InferenceAgentLink:
        self.link.start()
        # What a fresh agent reports: nothing served, synced (no version yet), engine not paused.
        self.link.update(engine_paused=False, synced=True, synced_reason="NoVersionPublished",
                         synced_message="the trainer has not published a version yet")
        self._on_desired(self.link.desired)
        return self

    def _on_desired(self, d: Desired) -> None:
        with self.lock:
            v = d.target_version
            if v is None or (self.served is not None and self.served >= v):
                return
            self.served = v
            self.commits[v] = time.monotonic()
        self.link.update(served_version=v, synced=True, synced_reason="UpToDate",
                         synced_message=f"serving {v}",
                         last_sync={"version": v, "durationSeconds": 0.0, "bytes": 1, "mode": "NCCL"})

    def close(self) -> None:
        self.link.close()
        self.api.close()


class StatusWatch:
    """Records the first time the job's status.servedVersion reached each value (a watch on the job)."""

    def __init__(self, env: Environment, namespace: str, name: str) -> None:
        self.api = env.api_client()
        self.namespace = namespace
        self.name = name
        self.first_seen: dict[int, float] = {}
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)

    def start(self) -> StatusWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        custom = kubernetes.client.CustomObjectsApi(self.api)
        while not self._stop.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(custom.list_namespaced_custom_object, contract.GROUP, contract.VERSION,
                                   self.namespace, contract.PLURAL, field_selector=f"metadata.name={self.name}",
                                   timeout_seconds=30):
                    now = time.monotonic()
                    served = ((ev["object"] or {}).get("status") or {}).get("servedVersion")
                    if served is None:
                        continue
                    with self.cond:
                        for v in range(1, int(served) + 1):
                            self.first_seen.setdefault(v, now)
                        self.cond.notify_all()
                    if self._stop.is_set():
                        break
            except Exception as exc:  # reconnect
                log.debug("status watch restarted: %s", exc)
                time.sleep(0.1)

    def wait_for(self, version: int, timeout: float) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: version in self.first_seen, timeout):
                raise demo.DemoError(f"status.servedVersion did not reach {version} within {timeout:.0f}s")
            return self.first_seen[version]

    def close(self) -> None:
        self._stop.set()
        self.api.close()


def run(versions: int, pods: int, warmup: int, work: Path) -> dict[str, Any]:
    env = start_environment(kubeconfig=work / "kubeconfig", node_count=2, process_nodes=False)
    links: list[InferenceAgentLink] = []
    operator: demo.OperatorProcess | None = None
    try:
        demo.install_crd(env)
        ns = "bench"
        demo.ensure_namespace(env, ns)
        operator = demo.start_operator(env.kubeconfig, ns, work / "logs", resync_seconds=30.0)
        body = demo.load_example("separated", process_nodes=False, name_override="bench")
        body["spec"]["inference"]["replicas"] = pods
        body["spec"]["updatePolicy"]["maxUnavailable"] = pods  # every replica may load at once
        demo.apply(env, body, ns)
        with env.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            names = demo.poll(lambda: (p := demo.job_pods(api, ns, "bench")) and len(p) == pods + 1
                              and all(x["spec"].get("nodeName") for x in p.values()) and sorted(p), 120,
                              f"{pods + 1} pods scheduled")
            kubelet = Kubelet(core, ns)
            for i, name in enumerate(names):
                kubelet.mark_ready(name, f"127.77.0.{i + 10}")
            trainer_api = env.api_client()
            trainer = PodLink(ns, contract.trainer_pod_name("bench", 0), lambda d: None,
                              api=kubernetes.client.CoreV1Api(trainer_api)).start()
            links = [InferenceAgentLink(env, ns, n).start() for n in names if "-inference-" in n]
            status = StatusWatch(env, ns, "bench").start()
            demo.poll(lambda: demo.condition(demo.get_job(kubernetes.client.CustomObjectsApi(api), ns, "bench"),
                                             contract.COND_READY).get("status") == "True", 60, "job Ready")

            latencies: list[float] = []
            end_to_end: list[float] = []
            before_writes: dict[str, float] = {}
            before_reads: dict[str, float] = {}
            before_agent = 0
            t_start = 0.0
            for v in range(1, warmup + versions + 1):
                if v == warmup + 1:
                    before_writes = apiserver_requests(api)
                    before_reads = apiserver_requests(api, reads=True)
                    before_agent = sum(sum(x.link.stats.counts.values()) for x in links)
                    t_start = time.monotonic()
                t_publish = time.monotonic()
                trainer.update(published_version=v)
                seen = status.wait_for(v, 60.0)
                last_commit = max(x.commits[v] for x in links if v in x.commits)
                if len([x for x in links if v in x.commits]) != pods:
                    raise demo.DemoError(f"status showed version {v} before every replica committed it")
                if v > warmup:
                    latencies.append(seen - last_commit)
                    end_to_end.append(seen - t_publish)
                time.sleep(0.05)
            elapsed = time.monotonic() - t_start
            for x in links:
                x.link.flush(5.0)
            trainer.flush(5.0)
            time.sleep(1.0)  # let the operator's last status write land before counting
            after_writes = apiserver_requests(api)
            after_reads = apiserver_requests(api, reads=True)
            reads = {k: after_reads.get(k, 0.0) - before_reads.get(k, 0.0) for k in after_reads}
            reads = {k: v for k, v in reads.items() if v > 0}
            agent_writes = sum(sum(x.link.stats.counts.values()) for x in links) - before_agent
            delta = {k: after_writes.get(k, 0.0) - before_writes.get(k, 0.0) for k in after_writes}
            delta = {k: v for k, v in delta.items() if v > 0}
            pod_writes = delta.get("pods/-", 0.0) + delta.get("pods/status", 0.0)
            status.close()
            trainer.close()
            trainer_api.close()
            return {
                "benchmark": "status-latency",
                "what": "agent commits version v -> WeightSyncJob status.servedVersion >= v (control plane only)",
                "versions": versions,
                "warmup_versions": warmup,
                "inference_pods": pods,
                "latency_s": {
                    "p50": round(statistics.median(latencies), 4),
                    "p99": round(percentile(latencies, 99), 4),
                    "max": round(max(latencies), 4),
                    "mean": round(statistics.fmean(latencies), 4),
                },
                "publish_to_status_s": {
                    "what": "trainer reports published v -> operator targets v -> agents commit -> status",
                    "p50": round(statistics.median(end_to_end), 4),
                    "p99": round(percentile(end_to_end, 99), 4),
                },
                "api_writes_per_version_per_pod": {
                    "agent": round(agent_writes / versions / pods, 3),
                    "all_clients_pods": round(pod_writes / versions / pods, 3),
                },
                "api_writes_per_version": {k: round(v / versions, 3) for k, v in sorted(delta.items())},
                "api_reads_per_version": {k: round(v / versions, 3) for k, v in sorted(reads.items())},
                "versions_per_second": round(versions / elapsed, 2),
                "cpus": os.cpu_count(),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
    finally:
        for x in links:
            x.close()
        if operator is not None:
            operator.stop()
        env.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=50)
    p.add_argument("--pods", type=int, default=8, help="inference pods (one replica each)")
    p.add_argument("--warmup", type=int, default=3, help="versions run first and not measured")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-status-") as tmp:
        try:
            result = run(args.versions, args.pods, args.warmup, Path(tmp))
        except demo.DemoError as exc:
            print(f"status_latency: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
