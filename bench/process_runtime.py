"""Process runtime latencies: pod create -> Running -> Ready, delete -> gone, and the runtime's idle CPU.

    python bench/process_runtime.py --pods 8 [--json out.json]

Starts its own local control plane + simulated process nodes + runtime (weightsync.e2e.environment),
creates PODS pods at once (each `python3 -c sleep`), and reports percentiles in JSON. Timings are
benchmarks, never test thresholds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from weightsync.crds.contract import LABEL_PROCESS_NODE
from weightsync.e2e.runtime.kube import ApiError, KubeClient, endpoint_from_kubeconfig, pod_path

JSON = dict[str, Any]


def _summary(values: list[float]) -> JSON:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50_s": round(statistics.median(ordered), 3),
        "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max_s": round(ordered[-1], 3),
    }


def _ready(pod: JSON) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def run(pods: int, idle_s: float) -> JSON:
    from weightsync.e2e.environment import start_environment

    env = start_environment()
    try:
        runtime = env.start_runtime()
        if runtime is None:
            raise SystemExit("the process runtime did not start (no process nodes?)")
        api = KubeClient(endpoint_from_kubeconfig(str(env.kubeconfig)))
        ns = f"bench-runtime-{os.getpid()}"
        api.post("/api/v1/namespaces", {"metadata": {"name": ns}})
        deadline = time.monotonic() + 60
        while True:
            try:
                api.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default")
                break
            except ApiError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        created: dict[str, float] = {}
        running: dict[str, float] = {}
        ready: dict[str, float] = {}
        for i in range(pods):
            name = f"p{i}"
            api.post(f"/api/v1/namespaces/{ns}/pods", {
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {LABEL_PROCESS_NODE: "true"},
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "main", "image": "x", "command": ["python3", "-c", "import time; time.sleep(3600)"]}],
                },
            })
            created[name] = time.monotonic()
        deadline = time.monotonic() + 300
        while len(ready) < pods and time.monotonic() < deadline:
            for pod in api.get(f"/api/v1/namespaces/{ns}/pods")["items"]:
                name, now = pod["metadata"]["name"], time.monotonic()
                if (pod.get("status") or {}).get("phase") == "Running":
                    running.setdefault(name, now)
                if _ready(pod):
                    ready.setdefault(name, now)
            time.sleep(0.05)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(idle_s)
        idle_cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        deleted: dict[str, float] = {}
        gone: dict[str, float] = {}
        for name in created:
            api.delete(pod_path(ns, name))
            deleted[name] = time.monotonic()
        deadline = time.monotonic() + 120
        while len(gone) < pods and time.monotonic() < deadline:
            present = {p["metadata"]["name"] for p in api.get(f"/api/v1/namespaces/{ns}/pods")["items"]}
            for name in created:
                if name not in present:
                    gone.setdefault(name, time.monotonic())
            time.sleep(0.05)
        api.delete(f"/api/v1/namespaces/{ns}")
        return {
            "benchmark": "process_runtime",
            "pods": pods,
            "cpus": os.cpu_count(),
            "create_to_running": _summary([running[n] - created[n] for n in running]),
            "create_to_ready": _summary([ready[n] - created[n] for n in ready]),
            "delete_to_gone": _summary([gone[n] - deleted[n] for n in gone]),
            "idle_cpu_fraction_with_pods": round(idle_cpu, 4),
            "note": "idle CPU is this whole process (runtime threads + node heartbeats) over "
            f"{idle_s:g}s with {pods} running pods",
        }
    finally:
        env.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/process_runtime.py", description=__doc__)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args.pods, args.idle_seconds)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
