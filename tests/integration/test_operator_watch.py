"""The operator acts on watch events, not on its periodic resync: with a resync of 10 minutes a deleted pod
is recreated and a version a trainer publishes reaches the status within seconds, and a steady job costs
no GET or LIST at all (the reconciler reads its watch caches)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from op_helpers import create_job, get_job, live_pods, separated_spec, start_operator

from weightsync.crds import contract, version_proof
from weightsync.e2e.demo import operator_key_file
from weightsync.e2e.procs import free_port
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster


def _requests(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("weightsync_operator_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="', 1)[1].split('"', 1)[0]
            out[verb] = out.get(verb, 0.0) + float(value)
    return out


def test_events_drive_reconciles_and_reads_come_from_the_caches(cluster: Any, kube: Any, namespace: str,
                                                                wsj_crd: str, op_nodes: list[str],
                                                                tmp_path: Path) -> None:
    port = free_port()
    op = start_operator(Path(cluster.kubeconfig), namespace, tmp_path, resync=600.0, metrics_port=port)
    try:
        create_job(kube, namespace, "w", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=2, gpus_per_replica=1))
        wait_until(lambda: len(live_pods(kube, namespace, "w")) == 3, timeout=60, what="pods")
        wait_until(lambda: get_job(kube, namespace, "w").get("status", {}).get("conditions"), what="status")
        time.sleep(2.0)
        before = _requests(port)

        old = live_pods(kube, namespace, "w")["w-trainer-0"]["metadata"]["uid"]
        t0 = time.monotonic()
        kube.core.delete_namespaced_pod("w-trainer-0", namespace, grace_period_seconds=0)
        wait_until(lambda: (p := live_pods(kube, namespace, "w").get("w-trainer-0")) and p["metadata"]["uid"] != old,
                   timeout=30, what="the deleted pod recreated")
        recreate_s = time.monotonic() - t0

        pod = live_pods(kube, namespace, "w")["w-trainer-0"]
        job_uid = get_job(kube, namespace, "w")["metadata"]["uid"]
        token = version_proof.job_token(operator_key_file(Path(cluster.kubeconfig)).read_bytes().strip(), namespace,
                                        "w", job_uid)
        ann = {contract.ANN_PUBLISHED_VERSION: "7"}  # what the trainer's agent writes, with its proof
        ann[contract.ANN_VERSION_PROOF] = version_proof.version_proof(token, pod["metadata"]["uid"], ann)
        t0 = time.monotonic()
        kube.core.patch_namespaced_pod("w-trainer-0", namespace, {"metadata": {"annotations": ann}})
        wait_until(lambda: get_job(kube, namespace, "w").get("status", {}).get("trainerVersion") == 7, timeout=30,
                   what="the published version in the status")
        status_s = time.monotonic() - t0
        assert recreate_s < 10 and status_s < 10, (recreate_s, status_s)  # not the 600 s resync
        after = _requests(port)
        reads = {v: after.get(v, 0.0) - before.get(v, 0.0) for v in ("get", "list")}
        assert reads == {"get": 0.0, "list": 0.0}, reads
        print(f"pod recreated in {recreate_s:.2f} s, version in status in {status_s:.2f} s, reads {reads}")
        assert op.alive()
    finally:
        op.stop()
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
