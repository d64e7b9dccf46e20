"""What a job status write costs the API server, by size: a whole status with the most replica entries the
CRD allows against a PATCH of one field.

    .venv/bin/python bench/status_write.py --json

Why: at 256 inference pods the slow version's time went to one status PATCH (0.5-0.8 s against a mean of
0.06-0.09 s; docs/performance.md). If the status's size made it slow, the operator should send only what
changed. This measures that on an idle local control plane (the real etcd and kube-apiserver, the CRD
with its schema and CEL rules): the median and the slowest of N PATCHes of each kind, and the bytes sent.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from operator_scale import apply_crd, kwok_job_spec  # bench/ is the script's own directory: first on sys.path
from weightsync.crds import contract
from weightsync.crds.models import MAX_REPLICAS_IN_STATUS
from weightsync.e2e.environment import start_environment


def whole_status(version: int) -> dict[str, Any]:
    """A status as the operator writes it for a large job: every replica entry the CRD allows."""
    reps = [{"index": i, "ready": True, "servedVersion": version, "servedEpoch": 0, "targetVersion": version,
             "servedDigest": "0123456789abcdef0123456789abcdef", "lastSyncSeconds": 0.25}
            for i in range(MAX_REPLICAS_IN_STATUS)]
    return {"trainerVersion": version, "servedVersion": version, "inferenceReplicas": reps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/status_write.py", description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=40, help="PATCHes of each kind")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    env = start_environment(node_count=0, process_nodes=False)
    try:
        apply_crd(env)
        env.kubectl("create", "namespace", "bench")
        body = {"apiVersion": f"{contract.GROUP}/{contract.VERSION}", "kind": contract.KIND,
                "metadata": {"name": "big", "namespace": "bench"}, "spec": kwok_job_spec(256)}
        env.kubectl("apply", "-f", "-", input=json.dumps(body))
        api = client.CustomObjectsApi(env.api_client())

        def timed(patch: Callable[[int], dict[str, Any]]) -> dict[str, float]:
            took = []
            for i in range(args.writes):
                t0 = time.perf_counter()
                api.patch_namespaced_custom_object_status(contract.GROUP, contract.VERSION, "bench",
                                                          contract.PLURAL, "big", patch(i))
                took.append(time.perf_counter() - t0)
            return {"median_s": round(statistics.median(took), 4), "max_s": round(max(took), 4),
                    "bytes": len(json.dumps(patch(0)))}

        out = {
            "benchmark": "status_write",
            "command": "python bench/status_write.py" + (" --json" if args.json else ""),
            "writes": args.writes,
            "whole_status": timed(lambda i: {"status": whole_status(i + 1)}),
            "one_field": timed(lambda i: {"status": {"trainerVersion": 1000 + i}}),
            "machine": {"python": platform.python_version()},
        }
    finally:
        env.stop()
    print(json.dumps(out, indent=2) if args.json else
          f"whole status ({out['whole_status']['bytes']} B): median {out['whole_status']['median_s'] * 1e3:.1f} ms; "
          f"one field: median {out['one_field']['median_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
