"""Operator scale: from `kubectl create` of a WeightSyncJob to all its pods created, scheduled by the real
kube-scheduler, and the first status; and the cost of a no-op (steady-state) reconcile; for growing
inference replica counts.

    .venv/bin/python bench/operator_scale.py --replicas 8 32 64 > bench/results/operator-scale.json

What runs for real: etcd, kube-apiserver, kube-scheduler, kube-controller-manager (e2e/cluster.py), the
simulated GPU nodes (e2e/nodes.py, no process runtime: pods are only placed), and the operator as a
process (`weightsync-operator --namespace NS`). Each size: one 8-GPU trainer pod plus R one-GPU
inference replicas, in a fresh namespace; pods are force-deleted afterwards to free the GPUs.
The no-op reconcile cost comes from the operator's own histogram over a window of periodic resyncs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from weightsync.crds import contract
from weightsync.e2e.environment import start_environment
from weightsync.e2e.procs import free_port

REPO = Path(__file__).resolve().parents[1]
OPERATOR_BIN = Path(sys.executable).parent / "weightsync-operator"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--resync", type=float, default=1.0, help="operator resync period during the no-op window")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady state measured")
    args = ap.parse_args()
    nodes = math.ceil((max(args.replicas) + 8) / 8) + 1
    work = Path(tempfile.mkdtemp(prefix="weightsync-bench-operator-"))
    env = start_environment(node_count=nodes, process_nodes=False)
    try:
        env.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"))
        deadline = time.monotonic() + 90
        while env.kubectl("get", f"crd/{contract.CRD_NAME}", "-o",
                          "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                          check=False).stdout.strip() != "True":
            if time.monotonic() > deadline:
                raise RuntimeError("CRD not Established")
            time.sleep(0.2)
        api = env.api_client()
        results = [measure(env, api, r, work, args.resync, args.window) for r in args.replicas]
    finally:
        env.stop()
    print(json.dumps({
        "benchmark": "operator_scale",
        "command": "python bench/operator_scale.py --replicas " + " ".join(map(str, args.replicas)),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "nodes": {"count": nodes, "gpus_per_node": 8},
        "resync_seconds": args.resync,
        "window_seconds": args.window,
        "results": results,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
