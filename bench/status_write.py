"""What a job status write costs the API server, by size: a whole status with the most replica entries the
CRD allows against a PATCH of one field; and by the list type of status.inferenceReplicas.

    .venv/bin/python bench/status_write.py --json

Why: at 256 inference pods the slow version's time went to one status PATCH (0.5-0.8 s against a mean of
0.06-0.09 s; docs/performance.md). If the status's size made it slow, the operator should send only what
changed. This measures that on an idle local control plane (the real etcd and kube-apiserver, the CRD
with its schema and CEL rules): the median and the slowest of N PATCHes of each kind, and the bytes sent.

By list type (`whole_status_by_list_type`): the same whole-status PATCHes with status.inferenceReplicas as
a map list keyed by `index` (releases before had it so) and as an atomic list (the CRD now), alternated
`--rounds` times on the same control plane (the CRD re-applied, the job created again). The API server
recomputes the object's managedFields on every write: a map list has a managed field per entry and field,
an atomic list one. Reported with the stored object's and its managedFields' sizes.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from operator_scale import (  # bench/ is the script's own directory: first on sys.path
    REPO,
    apply_crd,
    kwok_job_spec,
)

from weightsync.crds import contract
from weightsync.crds.models import MAX_REPLICAS_IN_STATUS
from weightsync.e2e.environment import start_environment


def whole_status(version: int) -> dict[str, Any]:
    """A status as the operator writes it for a large job: every replica entry the CRD allows."""
    reps = [{"index": i, "ready": True, "servedVersion": version, "servedEpoch": 0, "targetVersion": version,
             "servedDigest": "0123456789abcdef0123456789abcdef", "lastSyncSeconds": 0.25}
            for i in range(MAX_REPLICAS_IN_STATUS)]
    return {"trainerVersion": version, "servedVersion": version, "inferenceReplicas": reps}


def crd_with_list_type(list_type: str) -> dict[str, Any]:
    """This tree's CRD with status.inferenceReplicas as a `map` list keyed by index or an `atomic` list."""
    crd = copy.deepcopy(yaml.safe_load((REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml").read_text()))
    for version in crd["spec"]["versions"]:
        node = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["inferenceReplicas"]
        node.pop("x-kubernetes-list-map-keys", None)
        node["x-kubernetes-list-type"] = list_type
        if list_type == "map":
            node["x-kubernetes-list-map-keys"] = ["index"]
    return crd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/status_write.py", description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=40, help="PATCHes of each kind")
    p.add_argument("--rounds", type=int, default=2, help="map / atomic list type pairs, alternated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="weightsync-bench-status-"))
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
            stored: dict[str, Any] = {}
            for i in range(args.writes):
                t0 = time.perf_counter()
                stored = api.patch_namespaced_custom_object_status(contract.GROUP, contract.VERSION, "bench",
                                                                   contract.PLURAL, "big", patch(i))
                took.append(time.perf_counter() - t0)
            return {"median_s": round(statistics.median(took), 4), "max_s": round(max(took), 4),
                    "mean_s": round(sum(took) / len(took), 4), "bytes": len(json.dumps(patch(0))),
                    "stored_bytes": len(json.dumps(stored)),
                    "managed_fields_bytes": len(json.dumps((stored.get("metadata") or {}).get("managedFields")))}

        def by_list_type(list_type: str) -> dict[str, float]:
            path = work / f"crd-{list_type}.yaml"
            path.write_text(yaml.safe_dump(crd_with_list_type(list_type), sort_keys=False))
            env.kubectl("delete", contract.PLURAL, "big", "-n", "bench", "--ignore-not-found", "--wait=true")
            env.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
            env.kubectl("wait", "--for=condition=Established", f"crd/{contract.CRD_NAME}", "--timeout=60s")
            time.sleep(2.0)  # the API server swaps in the new schema's handler after Established
            env.kubectl("apply", "-f", "-", input=json.dumps(body))
            # a version counter that keeps growing across rounds: every write changes every entry
            return {"list_type": list_type, **timed(lambda i: {"status": whole_status(i + 1)})}

        out = {
            "benchmark": "status_write",
            "command": f"python bench/status_write.py --writes {args.writes} --rounds {args.rounds}"
                       + (" --json" if args.json else ""),
            "writes": args.writes,
            "whole_status": timed(lambda i: {"status": whole_status(i + 1)}),
            "one_field": timed(lambda i: {"status": {"trainerVersion": 1000 + i}}),
            "whole_status_by_list_type": [by_list_type(lt) for _ in range(args.rounds) for lt in ("map", "atomic")],
            "machine": {"python": platform.python_version()},
        }
    finally:
        env.stop()
    print(json.dumps(out, indent=2) if args.json else
          f"whole status ({out['whole_status']['bytes']} B): median {out['whole_status']['median_s'] * 1e3:.1f} ms; "
          f"one field: median {out['one_field']['median_s'] * 1e3:.1f} ms; by list type: "
          + ", ".join(f"{r['list_type']} {r['median_s'] * 1e3:.1f} ms" for r in out["whole_status_by_list_type"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
