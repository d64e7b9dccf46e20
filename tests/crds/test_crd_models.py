"""Unit tests of the pydantic models: defaults, helpers, status patches (no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from invalid_cases import colocated, separated
from pydantic import ValidationError

from weightsync.crds import contract
from weightsync.crds.models import (
    Condition,
    LastSync,
    ReplicaCounts,
    WeightSyncJob,
    WeightSyncJobSpec,
    WeightSyncJobStatus,
    effective_transfer_mode,
    max_unavailable_count,
    set_condition,
    validation_messages,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _spec(obj: dict) -> WeightSyncJobSpec:
    return WeightSyncJob.from_k8s(obj).spec


def test_defaults_of_a_minimal_job() -> None:
    obj = separated()
    del obj["spec"]["transfer"]
    del obj["spec"]["trainer"]["parallelism"]["pipeline"]
    spec = _spec(obj)
    assert spec.transfer.mode == "Auto"
    assert spec.transfer.bucket_size_mb == 512
    assert spec.transfer.verify == "None"
    assert spec.transfer.timeout_seconds == 600
    assert spec.transfer.delta_sync is None
    assert spec.transfer.rdma_resource_name is None  # None: the operator's configured RDMA resource
    assert spec.trainer.parallelism.pipeline == 1
    assert spec.inference.pods_per_replica == 1
    assert spec.inference.engine.port == 30000
    assert spec.inference.engine.url is None
    assert spec.update_policy.pause_generation is True
    assert spec.update_policy.max_unavailable == "25%"
    assert spec.update_policy.max_staleness == 1
    assert spec.paused is False
    assert spec.placement.topology_key is None and spec.placement.dra is None


def test_round_trip_is_camel_case_and_stable() -> None:
    job = WeightSyncJob.from_k8s(separated())
    out = job.to_dict()
    assert out["apiVersion"] == contract.API_VERSION and out["kind"] == contract.KIND
    # contract spells API_VERSION out (for its literal type): it must still be GROUP/VERSION
    assert f"{contract.GROUP}/{contract.VERSION}" == contract.API_VERSION
    assert out["spec"]["transfer"]["bucketSizeMB"] == 512
    assert out["spec"]["inference"]["gpusPerReplica"] == 2
    assert "deltaSync" not in out["spec"]["transfer"]
    assert WeightSyncJob.from_k8s(out).to_dict() == out


def test_from_k8s_ignores_server_fields_and_keeps_templates_verbatim() -> None:
    obj = separated()
    obj["metadata"].update(namespace="ns", generation=3, uid="u", resourceVersion="7", managedFields=[{}])
    obj["spec"]["trainer"]["template"]["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    obj["status"] = {"observedGeneration": 2, "trainerVersion": 5, "conditions": []}
    job = WeightSyncJob.from_k8s(obj)
    assert (job.name, job.namespace, job.generation) == ("wsj-sep", "ns", 3)
    assert job.spec.trainer.template == obj["spec"]["trainer"]["template"]
    assert job.status is not None and job.status.trainer_version == 5


def test_unknown_spec_field_is_refused() -> None:
    obj = separated()
    obj["spec"]["transfer"]["bucketSize"] = 64
    with pytest.raises(ValidationError) as err:
        WeightSyncJob.from_k8s(obj)
    assert any("bucketSize" in line for line in validation_messages(err.value))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        job = WeightSyncJob.from_k8s(doc)
        assert job.name and len(job.name) <= 40


def test_examples_cover_the_three_modes() -> None:
    modes = {}
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            job = WeightSyncJob.from_k8s(doc)
            modes[path.name] = (job.spec.placement.mode, effective_transfer_mode(job.spec))
    assert modes["separated-nccl.yaml"] == ("Separated", "NCCL")
    assert modes["colocated-ipc.yaml"] == ("Colocated", "IPC")
    assert modes["separated-gdr.yaml"] == ("Separated", "GDR")


@pytest.mark.parametrize(
    ("placement", "mode", "rdma", "expected"),
    [
        ({"mode": "Colocated"}, "Auto", False, "IPC"),
        ({"mode": "Colocated"}, "Auto", True, "IPC"),
        ({"mode": "Separated"}, "Auto", False, "NCCL"),
        ({"mode": "Separated"}, "Auto", True, "GDR"),
        ({"mode": "Separated"}, "NCCL", True, "NCCL"),
        ({"mode": "Separated"}, "GDR", False, "GDR"),
        ({"mode": "Separated", "topologyKey": "kubernetes.io/hostname"}, "IPC", False, "IPC"),
    ],
)
def test_effective_transfer_mode(placement: dict, mode: str, rdma: bool, expected: str) -> None:
    obj = colocated() if placement["mode"] == "Colocated" else separated()
    obj["spec"]["placement"] = placement
    obj["spec"]["transfer"] = {"mode": mode}
    assert effective_transfer_mode(_spec(obj), rdma_available=rdma) == expected


@pytest.mark.parametrize(
    ("replicas", "value", "expected"),
    [
        (4, "25%", 1),
        (8, "25%", 2),
        (10, "25%", 2),   # rounded down
        (3, "25%", 1),    # at least one so the rollout progresses
        (1, "100%", 1),
        (4, "100%", 4),
        (4, 2, 2),
        (4, 9, 4),        # clamped to the replica count
        (0, "25%", 0),
    ],
)
def test_max_unavailable_count(replicas: int, value: int | str, expected: int) -> None:
    obj = separated()
    obj["spec"]["inference"]["replicas"] = replicas
    obj["spec"]["updatePolicy"] = {"maxUnavailable": value}
    assert max_unavailable_count(_spec(obj)) == expected


@pytest.mark.parametrize("value", ["0%", "101%", "25", "abc", 0, -1, True])
def test_max_unavailable_refused(value: object) -> None:
    obj = separated()
    obj["spec"]["updatePolicy"] = {"maxUnavailable": value}
    with pytest.raises(ValidationError, match="maxUnavailable"):
        WeightSyncJob.from_k8s(obj)


def test_rank_counts() -> None:
    spec = _spec(separated())
    assert (spec.trainer.world_size, spec.trainer.ranks_per_pod) == (8, 4)
    assert (spec.inference.ranks_per_replica, spec.inference.ranks_per_pod, spec.inference.gpus_per_pod) == (2, 2, 2)
    cpu = separated()
    cpu["spec"]["trainer"].update(replicas=2, gpusPerPod=0, parallelism={"tensor": 2, "data": 1})
    cpu["spec"]["inference"].update(gpusPerReplica=0, podsPerReplica=2, parallelism={"tensor": 2})
    spec = _spec(cpu)
    assert (spec.trainer.world_size, spec.trainer.ranks_per_pod) == (2, 1)
    assert (spec.inference.ranks_per_replica, spec.inference.ranks_per_pod, spec.inference.gpus_per_pod) == (2, 1, 0)


def test_single_gpu_colocated_job_is_valid() -> None:
    obj = colocated()
    obj["spec"]["trainer"].update(replicas=1, gpusPerPod=1, parallelism={"tensor": 1, "pipeline": 1, "data": 1})
    obj["spec"]["inference"].update(replicas=1, gpusPerReplica=1, parallelism={"tensor": 1})
    assert _spec(obj).placement.mode == "Colocated"


def test_colocated_multi_pod_replica_is_valid() -> None:
    obj = colocated()
    # 2 pods x 8 GPUs; one replica of 16 GPUs spread over 2 pods (one per colocated pod)
    obj["spec"]["inference"].update(replicas=1, gpusPerReplica=16, podsPerReplica=2, parallelism={"tensor": 16})
    _spec(obj)


def test_cpu_colocated_counts_pods() -> None:
    obj = colocated()
    obj["spec"]["trainer"].update(replicas=2, gpusPerPod=0, parallelism={"tensor": 1, "pipeline": 1, "data": 2})
    obj["spec"]["inference"].update(replicas=2, gpusPerReplica=0, parallelism={"tensor": 1},
                                    engine={"type": "Custom"})  # a CPU-only colocated engine is a Custom one
    _spec(obj)
    obj["spec"]["inference"]["replicas"] = 1
    with pytest.raises(ValidationError, match=r"spec\.inference\.replicas"):
        _spec(obj)


def test_status_patch_is_camel_case_without_nones() -> None:
    t0 = datetime(2026, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc)
    conds = set_condition([], contract.COND_READY, "False", "PodsPending", "2 pods pending", 3, now=t0)
    status = WeightSyncJobStatus(
        observed_generation=3, mode="NCCL", trainer_version=7, replicas=ReplicaCounts(inference=2, synced=1, ready=2),
        last_sync=LastSync(version=6, duration_seconds=1.5, bytes=1024, mode="NCCL"), conditions=conds,
    )
    patch = status.to_patch()
    assert patch == {
        "status": {
            "observedGeneration": 3,
            "mode": "NCCL",
            "trainerVersion": 7,
            "replicas": {"inference": 2, "synced": 1, "ready": 2},
            "lastSync": {"version": 6, "durationSeconds": 1.5, "bytes": 1024, "mode": "NCCL"},
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "PodsPending", "message": "2 pods pending",
                 "observedGeneration": 3, "lastTransitionTime": "2026-01-02T03:04:05Z"},
            ],
        }
    }
    assert WeightSyncJobStatus.model_validate(patch["status"]) == status


def test_set_condition_moves_transition_time_only_on_status_change() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    t1 = t0 + timedelta(minutes=5)
    conds = set_condition([], "Ready", "False", "Starting", now=t0)
    conds = set_condition(conds, "Synced", "Unknown", "NoVersion", now=t0)
    same = set_condition(conds, "Ready", "False", "PodsPending", "1 pending", observed_generation=2, now=t1)
    ready = next(c for c in same if c.type == "Ready")
    assert ready.last_transition_time == t0 and ready.reason == "PodsPending" and ready.observed_generation == 2
    flipped = set_condition(same, "Ready", "True", "AllReady", now=t1)
    assert next(c for c in flipped if c.type == "Ready").last_transition_time == t1
    assert [c.type for c in flipped] == ["Ready", "Synced"]
    assert conds[0].status == "False"  # the input list is not modified


def test_condition_reason_must_be_camel_case() -> None:
    with pytest.raises(ValidationError, match="reason"):
        Condition.model_validate(
            {"type": "Ready", "status": "True", "reason": "not ok", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        )


class _View(Mapping[str, Any]):
    """A read-only mapping like kopf's Body / Spec views."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        value = self._data[key]
        return _View(value) if isinstance(value, dict) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_from_k8s_accepts_mapping_views_and_copies_templates() -> None:
    obj = separated()
    job = WeightSyncJob.from_k8s(_View(obj))
    assert job.to_dict()["spec"]["trainer"]["template"] == obj["spec"]["trainer"]["template"]
    assert type(job.spec.trainer.template["spec"]) is dict
    job.spec.trainer.template["spec"]["containers"].append({"name": "x"})
    assert len(obj["spec"]["trainer"]["template"]["spec"]["containers"]) == 1


def test_from_k8s_does_not_modify_its_input() -> None:
    obj = separated()
    before = copy.deepcopy(obj)
    WeightSyncJob.from_k8s(obj)
    assert obj == before
