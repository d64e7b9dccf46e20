"""The pure helpers of the demo and the e2e suite (no cluster)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJob
from weightsync.e2e import demo


@pytest.mark.parametrize("example", ["separated", "colocated"])
def test_demo_examples_are_valid_cpu_only_jobs_on_process_nodes(example):
    body = demo.load_example(example)
    job = WeightSyncJob.from_k8s(body)
    assert job.spec.trainer.gpus_per_pod == 0 and job.spec.inference.gpus_per_replica == 0
    assert job.spec.inference.engine.type == "Custom"
    assert job.spec.transfer.mode == ("NCCL" if example == "separated" else "IPC")
    assert body["spec"]["trainer"]["template"]["spec"]["nodeSelector"] == {contract.LABEL_PROCESS_NODE: "true"}
    assert demo.trainer_versions(body) == 5


def test_without_process_nodes_the_selector_is_dropped():
    body = demo.load_example("separated", process_nodes=False, name_override="x")
    assert body["metadata"]["name"] == "x"
    for role in ("trainer", "inference"):
        assert "nodeSelector" not in body["spec"][role]["template"]["spec"]


def test_trainer_args_and_demo_env_are_replaced_not_duplicated():
    body = demo.set_trainer_args(demo.load_example("separated"), versions=9, interval=0.5, seed=3)
    argv = body["spec"]["trainer"]["template"]["spec"]["containers"][0]["command"]
    assert argv.count("--versions") == 1 and argv[argv.index("--versions") + 1] == "9"
    assert argv[argv.index("--interval") + 1] == "0.5" and argv[-2:] == ["--seed", "3"]
    assert demo.trainer_versions(body) == 9
    demo.set_demo_env(body, WEIGHTSYNC_DEMO_HIDDEN="128")
    demo.set_demo_env(body, WEIGHTSYNC_DEMO_HIDDEN="256")
    env = body["spec"]["inference"]["template"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "WEIGHTSYNC_DEMO_HIDDEN"] == ["256"]


def test_container_pid_reads_the_process_runtime_container_id():
    pod = {"status": {
        "initContainerStatuses": [{"name": contract.AGENT_CONTAINER, "state": {"running": {}},
                                   "containerID": "process://4242", "restartCount": 2}],
        "containerStatuses": [{"name": "engine", "state": {"waiting": {}}, "containerID": "process://7"}],
    }}
    assert demo.agent_pid(pod) == 4242 and demo.agent_restarts(pod) == 2
    assert demo.container_pid(pod, "engine") is None  # not running


def test_status_line_names_versions_counts_and_conditions():
    job = {"status": {"trainerVersion": 4, "servedVersion": 3, "replicas": {"inference": 2, "synced": 1, "ready": 2},
                      "conditions": [{"type": "Synced", "status": "False", "reason": "ReplicasBehind"},
                                     {"type": "Progressing", "status": "True", "reason": "RollingOut"}]}}
    line = demo.status_line(job)
    assert "trainerVersion=4 servedVersion=3 synced=1/2 ready=2" in line
    assert "Synced=False" in line and "Progressing=True(RollingOut)" in line


def test_bit_exact_report_needs_every_engine_on_the_version():
    ok = demo.BitExactReport(version=5, tensors=7, engines={"a": 5, "b": 5})
    assert ok.ok
    assert not demo.BitExactReport(version=5, tensors=7, engines={"a": 5, "b": 4}).ok
    assert not demo.BitExactReport(version=5, tensors=7, engines={"a": 5}, mismatches={"a": ["fc1.weight"]}).ok


def test_private_pod_cidr_is_a_loopback_slash_16():
    cidr = demo.private_pod_cidr()
    first, second, *_ = cidr.split(".")
    assert first == "127" and 101 <= int(second) <= 249 and cidr.endswith(".0.0/16")


def test_percentile_nearest_rank():
    path = Path(__file__).resolve().parents[2] / "bench" / "status_latency.py"
    spec = importlib.util.spec_from_file_location("status_latency", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["status_latency"] = mod
    spec.loader.exec_module(mod)
    values = [float(i) for i in range(1, 101)]
    assert mod.percentile(values, 50) == 50.0 and mod.percentile(values, 99) == 99.0
    assert mod.percentile([3.0], 99) == 3.0


def _job(name="demo", trainer=None, served=None, synced=None, ready=None, progressing=None):
    conds = [{"type": t, "status": s, **({"reason": r} if r else {})}
             for t, s, r in (("Synced", synced, None), ("Ready", ready, None),
                             ("Progressing", "True" if progressing else None, progressing)) if s is not None]
    status = {k: v for k, v in (("trainerVersion", trainer), ("servedVersion", served)) if v is not None}
    if conds:
        status["conditions"] = conds
    return {"metadata": {"name": name}, **({"status": status} if status else {})}


def _pod(role, served=None, ready=True):
    ann = {contract.ANN_SERVED_VERSION: str(served)} if served is not None else {}
    return {"metadata": {"labels": {contract.LABEL_ROLE: role}, "annotations": ann},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_progress_table_prints_a_header_then_one_line_per_change():
    table = demo.ProgressTable()
    assert table.update(0.1, _job(), {}) == []  # nothing to show yet
    pods = {"demo-trainer-0": _pod("trainer", ready=False), "demo-inference-0-0": _pod("inference", ready=False),
            "demo-inference-1-0": _pod("inference", ready=False)}
    lines = table.update(0.6, _job(synced="Unknown", ready="False"), pods)
    assert [line.split() for line in lines] == [
        ["TIME", "TRAINER", "SERVED", "SYNCED", "READY", "PODS", "inference-0-0", "inference-1-0", "STATE"],
        ["0.6s", "-", "-", "Unknown", "False", "0/3", "-", "-"]]
    assert table.update(1.0, _job(synced="Unknown", ready="False"), pods) == []  # unchanged: no line

    pods = {n: _pod(p["metadata"]["labels"][contract.LABEL_ROLE], served=(1 if "inference" in n else None))
            for n, p in pods.items()}
    pods["demo-inference-1-0"] = _pod("inference", served=None)
    lines = table.update(16.3, _job(trainer=2, served=1, synced="False", ready="True", progressing="RollingOut"), pods)
    assert [line.split() for line in lines] == [
        ["16.3s", "2", "1", "False", "True", "3/3", "1", "-", "RollingOut"]]
    # The columns line up with the header (fixed widths from the header's pod names).
    header = demo.progress_header(("inference-0-0", "inference-1-0"))
    assert lines[0].index("RollingOut") == header.index("STATE")
    assert lines[0].index("1  ") == header.index("SERVED")

    # A new set of inference pods (scale-down) repeats the header.
    pods.pop("demo-inference-1-0")
    lines = table.update(20.0, _job(trainer=2, served=2, synced="True", ready="True"), pods)
    assert lines[0].split()[-2:] == ["inference-0-0", "STATE"] and len(lines) == 2
    assert lines[1].split() == ["20.0s", "2", "2", "True", "True", "2/2", "1"]


def test_progress_row_reads_each_inference_pods_served_version_annotation():
    pods = {"j-trainer-0": _pod("trainer"), "j-colocated-0": _pod("colocated", served=7),
            "j-inference-0-0": _pod("inference", served=6)}
    row = demo.progress_row(_job(name="j", trainer=7, served=6, synced="False", ready="True"), pods)
    assert row.engines == (("colocated-0", "7"), ("inference-0-0", "6"))  # the trainer pod has no column
    assert (row.trainer, row.served, row.synced, row.ready, row.pods) == ("7", "6", "False", "True", "3/3")


def test_replica_lines_show_each_replicas_version_progress_and_error():
    job = {"status": {"inferenceReplicas": [
        {"index": 0, "pods": ["j-inference-0-0"], "servedVersion": 7, "targetVersion": 7, "ready": True,
         "lastSyncSeconds": 0.25},
        {"index": 1, "pods": ["j-inference-1-0", "j-inference-1-1"], "servedVersion": 6, "targetVersion": 7,
         "ready": False, "progress": {"version": 7, "bucket": 3, "buckets": 8, "bytes": 300, "totalBytes": 800},
         "lastError": "EngineUnreachable"},
    ]}}
    lines = demo.replica_lines(job)
    assert lines[0].split() == ["INDEX", "PODS", "SERVED", "TARGET", "READY", "PROGRESS", "LAST-SYNC", "LAST-ERROR"]
    assert lines[1].split() == ["0", "j-inference-0-0", "7", "7", "True", "-", "0.250s", "-"]
    assert lines[2].split() == ["1", "j-inference-1-0,j-inference-1-1", "6", "7", "False", "v7", "bucket", "3/8",
                                "300/800B", "-", "EngineUnreachable"]
    assert [ln.split() for ln in demo.replica_lines({"status": {}})] == [lines[0].split()]
