"""A real inference agent process with its Kubernetes side on, against a real kube-apiserver: it reports
served version, last sync and the synced condition on its own Pod, and pauses / resumes its engine when
the pod's paused annotation flips (what the operator writes for spec.paused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from podprocs import Cluster, engine_version, get_json, wait_for

from weightsync.crds import contract


def _gated_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {contract.ANN_PAUSED: "false"}},
            "spec": {"schedulingGates": [{"name": "weightsync.io/test-hold"}],
                     "containers": [{"name": "engine", "image": "example.invalid/engine:1"}]}}


def _kube_pair(c: Cluster, cluster: Any, kube: Any, namespace: str, **env: str) -> tuple[Any, Any]:
    """A trainer pod and an inference pod whose agent talks to the API server (ENV on it), both started with
    the engine; the trainer is started by the test."""
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    kube.core.create_namespaced_pod(namespace, _gated_pod(i.name))
    c.start_agent(t)
    c.start_agent(i, **{contract.ENV_KUBE_ENABLED: "true", "KUBECONFIG": str(cluster.kubeconfig),
                        contract.ENV_NAMESPACE: namespace, **env})
    c.start_engine(i)
    return t, i


def test_agent_reports_on_its_pod_and_follows_pause(cluster: Any, kube: Any, namespace: str, tmp_path: Path,
                                                     clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL")
    clusters.append(c)
    t, i = _kube_pair(c, cluster, kube, namespace, **{contract.ENV_MAX_STALENESS: "0"})
    c.start_trainer(t, "--versions", "3", "--interval", "0.5")

    def pod() -> Any:
        return kube.core.read_namespaced_pod(i.name, namespace)

    def synced(p: Any) -> str | None:
        return next((x.status for x in (p.status.conditions or []) if x.type == contract.POD_CONDITION_SYNCED), None)

    wait_for(lambda: engine_version(i) == 3, 90, "engine at v3", c)
    wait_for(lambda: (pod().metadata.annotations or {}).get(contract.ANN_SERVED_VERSION) == "3", 30,
             "served-version annotation 3", c)
    # the condition is its own patch, after the annotations' (one API round trip later)
    p = wait_for(lambda: synced(x := pod()) == "True" and x, 15, "pod condition synced=True", c)
    last = json.loads(p.metadata.annotations[contract.ANN_LAST_SYNC])
    assert last["version"] == 3 and last["mode"] == "NCCL" and last["bytes"] > 0 and last["durationSeconds"] > 0
    assert contract.ANN_SYNC_ERROR not in p.metadata.annotations

    # spec.paused -> the operator's annotation -> the engine pauses, and the pod says so
    kube.core.patch_namespaced_pod(i.name, namespace, {"metadata": {"annotations": {contract.ANN_PAUSED: "true"}}},
                                   _content_type="application/merge-patch+json")
    wait_for(lambda: get_json(f"{i.demo_url}/version")[1]["paused"] is True, 30, "engine paused", c)
    wait_for(lambda: pod().metadata.annotations.get(contract.ANN_ENGINE_PAUSED) == "true", 30,
             "engine-paused annotation", c)
    code, _ = get_json(f"{i.demo_url}/predict?x=1")
    assert code == 503
    kube.core.patch_namespaced_pod(i.name, namespace, {"metadata": {"annotations": {contract.ANN_PAUSED: "false"}}},
                                   _content_type="application/merge-patch+json")
    wait_for(lambda: get_json(f"{i.demo_url}/version")[1]["paused"] is False, 30, "engine resumed", c)
    wait_for(lambda: pod().metadata.annotations.get(contract.ANN_ENGINE_PAUSED) == "false", 30,
             "engine-paused annotation cleared", c)
    assert get_json(f"{i.demo_url}/predict?x=1")[0] == 200

    # a target beyond anything published: the replica is stale (maxStaleness 0) and says why
    kube.core.patch_namespaced_pod(i.name, namespace, {"metadata": {"annotations": {contract.ANN_TARGET_VERSION: "9"}}},
                                   _content_type="application/merge-patch+json")
    wait_for(lambda: synced(pod()) == "False", 30, "synced=False for a stale replica", c)
    cond = next(x for x in pod().status.conditions if x.type == contract.POD_CONDITION_SYNCED)
    assert cond.reason == "Stale" and "6 versions behind" in cond.message
    assert engine_version(i) == 3  # nothing newer exists: it keeps serving what it has


def test_a_load_reports_its_progress_on_the_pod_and_removes_it_when_done(cluster: Any, kube: Any, namespace: str,
                                                                        tmp_path: Path, clusters: list[Cluster]) -> None:
    """Issue 16: the load under way is visible (annotation weightsync.io/sync-progress -> the job's
    status.inferenceReplicas[].progress): bucket i of n and bytes, then removed once the version commits."""
    import threading

    from kubernetes import watch

    c = Cluster(tmp_path, mode="NCCL")
    clusters.append(c)
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "2048"  # fc2 is 16 MiB: a load spans many 1 MiB buckets
    # these loads are short: show their progress anyway
    t, i = _kube_pair(c, cluster, kube, namespace, WEIGHTSYNC_PROGRESS_AFTER_SECONDS="0")
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def record() -> None:
        w = watch.Watch()
        for ev in w.stream(kube.core.list_namespaced_pod, namespace, field_selector=f"metadata.name={i.name}",
                           timeout_seconds=120):
            raw = (ev["object"].metadata.annotations or {}).get(contract.ANN_SYNC_PROGRESS)
            if raw and (not seen or seen[-1] != json.loads(raw)):
                seen.append(json.loads(raw))
            if stop.is_set():
                w.stop()

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    c.start_trainer(t, "--versions", "2", "--interval", "0.5")
    wait_for(lambda: engine_version(i) == 2, 120, "engine at v2", c)
    wait_for(lambda: contract.ANN_SYNC_PROGRESS not in (kube.core.read_namespaced_pod(i.name, namespace)
                                                       .metadata.annotations or {}), 30, "progress removed", c)
    stop.set()
    assert seen, "no progress was reported during the loads"
    for p in seen:
        assert 1 <= p["bucket"] <= p["buckets"] and 0 < p["bytes"] <= p["totalBytes"], p
    assert all(p["bucket"] < p["buckets"] and p["totalBytes"] >= 16 << 20 for p in seen), seen  # the last
    # bucket writes no progress: the version's report (which removes it) follows at once
    assert {p["version"] for p in seen} <= {1, 2}


def test_a_short_load_costs_one_pod_write_per_version(cluster: Any, kube: Any, namespace: str, tmp_path: Path,
                                                      clusters: list[Cluster]) -> None:
    """At hundreds of pods the agents' writes are most of the API server's work per version: a load done
    within WEIGHTSYNC_PROGRESS_AFTER_SECONDS (1 s) writes no progress, only the version's report."""
    import urllib.request

    c = Cluster(tmp_path, mode="NCCL")
    clusters.append(c)
    t, i = _kube_pair(c, cluster, kube, namespace)

    def writes() -> float:
        text = urllib.request.urlopen(f"{i.metrics_url}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('weightsync_agent_api_writes_total{kind="annotations"}'))

    c.start_trainer(t, "--versions", "6", "--interval", "1.5")
    wait_for(lambda: engine_version(i) == 2, 120, "engine at v2", c)
    wait_for(lambda: (kube.core.read_namespaced_pod(i.name, namespace).metadata.annotations or {})
             .get(contract.ANN_SERVED_VERSION) == "2", 30, "v2 reported", c)
    before = writes()
    wait_for(lambda: engine_version(i) == 6, 120, "engine at v6", c)
    wait_for(lambda: (kube.core.read_namespaced_pod(i.name, namespace).metadata.annotations or {})
             .get(contract.ANN_SERVED_VERSION) == "6", 30, "v6 reported", c)
    assert writes() - before == 4  # versions 3, 4, 5, 6: one annotation patch each
