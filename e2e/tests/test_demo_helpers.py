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
