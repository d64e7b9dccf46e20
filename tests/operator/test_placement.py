"""The placement planner: pod names, ranks and GPU counts, and the refusals."""

from __future__ import annotations

import pytest

from weightsync.crds import contract
from weightsync.operator.placement import (
    REASON_COLOCATED_NEEDS_DRA,
    REASON_DRA_DEVICE_CLASS_MISSING,
    REASON_TOO_MANY_GPUS,
    plan,
)


def test_separated_names_ranks_and_gpus(separated):
    p = plan("demo", separated())
    assert p.refusal is None
    assert p.names == ["demo-trainer-0", "demo-trainer-1", "demo-inference-0-0", "demo-inference-1-0"]
    t0, t1, i0, i1 = p.pods
    assert (t0.trainer_ranks, t1.trainer_ranks) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t0.trainer_world_size == 8 and t0.gpus == 4 and t0.role == contract.ROLE_TRAINER
    assert i0.slots[0].replica == 0 and i1.slots[0].replica == 1
    assert i0.slots[0].ranks == (0, 1) and i0.slots[0].world_size == 2 and i0.gpus == 2
    assert p.trainer_pods == ("demo-trainer-0", "demo-trainer-1")
    assert p.mode == "NCCL" and not p.use_dra


def test_one_gpu_everywhere(separated):
    spec = separated(
        trainer={"replicas": 1, "gpusPerPod": 1, "parallelism": {"tensor": 1, "pipeline": 1, "data": 1}},
        inference={"replicas": 1, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
    )
    p = plan("j", spec)
    assert [(x.name, x.gpus) for x in p.pods] == [("j-trainer-0", 1), ("j-inference-0-0", 1)]
    assert p.pods[0].trainer_ranks == (0,) and p.pods[1].slots[0].ranks == (0,)


def test_uneven_tensor_parallel_multi_pod_replica(separated):
    # 6 GPUs per replica, TP 3 (engine DP 2), spread over 2 pods of 3 GPUs each.
    spec = separated(inference={"replicas": 1, "gpusPerReplica": 6, "podsPerReplica": 2, "parallelism": {"tensor": 3}})
    p = plan("j", spec)
    inf = [x for x in p.pods if x.role == contract.ROLE_INFERENCE]
    assert [x.name for x in inf] == ["j-inference-0-0", "j-inference-0-1"]
    assert [x.slots[0].ranks for x in inf] == [(0, 1, 2), (3, 4, 5)]
    assert all(x.gpus == 3 and x.slots[0].world_size == 6 for x in inf)
    assert p.replica_pods(0) == inf


def test_many_replicas(separated):
    spec = separated(inference={"replicas": 500, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("big", spec)
    inf = [x for x in p.pods if x.role == contract.ROLE_INFERENCE]
    assert len(inf) == 500 and len(set(p.names)) == len(p.names)
    assert inf[-1].name == "big-inference-499-0" and inf[-1].replica == 499


def test_zero_inference_replicas(separated):
    p = plan("j", separated(inference={"replicas": 0}))
    assert [x.role for x in p.pods] == [contract.ROLE_TRAINER] * 2


def test_cpu_only_pods(separated):
    spec = separated(
        trainer={"replicas": 2, "gpusPerPod": 0, "parallelism": {"tensor": 1, "pipeline": 1, "data": 2}},
        inference={"replicas": 1, "gpusPerReplica": 0, "podsPerReplica": 2, "parallelism": {"tensor": 2}},
    )
    p = plan("cpu", spec)
    assert [x.gpus for x in p.pods] == [0, 0, 0, 0]
    assert [x.trainer_ranks for x in p.pods[:2]] == [(0,), (1,)]
    assert [x.slots[0].ranks for x in p.pods[2:]] == [(0,), (1,)]


def test_colocated_whole_node_hosts_several_replicas(colocated):
    p = plan("co", colocated())
    assert p.refusal is None and p.mode == "IPC"
    assert p.names == ["co-colocated-0", "co-colocated-1"]
    pod0, pod1 = p.pods
    assert pod0.role == contract.ROLE_COLOCATED and pod0.gpus == 8
    assert [s.replica for s in pod0.slots] == [0, 1, 2, 3] and [s.replica for s in pod1.slots] == [4, 5, 6, 7]
    assert pod0.trainer_ranks == tuple(range(8)) and pod1.trainer_ranks == tuple(range(8, 16))
    assert pod0.replica is None  # several replicas: no single replica label
    assert p.trainer_pods == ("co-colocated-0", "co-colocated-1")


def test_colocated_multi_pod_replica(colocated):
    spec = colocated(inference={"replicas": 1, "gpusPerReplica": 16, "podsPerReplica": 2, "parallelism": {"tensor": 16}})
    p = plan("co", spec)
    assert [(s.replica, s.index, s.ranks[0]) for x in p.pods for s in x.slots] == [(0, 0, 0), (0, 1, 8)]
    assert p.pods[0].replica == 0 and p.pods[1].replica == 0


def test_colocated_partial_node_without_dra_is_refused(colocated):
    spec = colocated(
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    p = plan("co", spec, node_gpu_count=8)
    assert p.pods == () and p.refusal is not None
    assert p.refusal.reason == REASON_COLOCATED_NEEDS_DRA
    assert "gpusPerPod is 4" in p.refusal.message and "dra.deviceClassName" in p.refusal.message


def test_colocated_partial_node_with_dra_is_planned(colocated):
    spec = colocated(
        placement={"mode": "Colocated", "dra": {"deviceClassName": "gpu.nvidia.com"}},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    p = plan("co", spec, node_gpu_count=8)
    assert p.refusal is None and p.use_dra and len(p.pods) == 2
    assert p.dra_device_class == "gpu.nvidia.com"
    # The spec's class wins over the operator's default.
    assert plan("co", spec, node_gpu_count=8, dra_device_class_default="other.example.com").dra_device_class == (
        "gpu.nvidia.com")


def _partial_node_dra(colocated, dra):
    return colocated(
        placement={"mode": "Colocated", "dra": dra},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )


def test_dra_without_a_device_class_uses_the_operators_default(colocated):
    p = plan("co", _partial_node_dra(colocated, {}), node_gpu_count=8, dra_device_class_default="gpu.nvidia.com")
    assert p.refusal is None and p.use_dra and p.dra_device_class == "gpu.nvidia.com" and len(p.pods) == 2


def test_dra_without_any_device_class_is_refused_with_both_ways_to_fix_it(colocated):
    p = plan("co", _partial_node_dra(colocated, {}), node_gpu_count=8)
    assert p.pods == () and p.refusal is not None and p.refusal.reason == REASON_DRA_DEVICE_CLASS_MISSING
    assert "spec.placement.dra.deviceClassName" in p.refusal.message
    assert "cluster.draDeviceClassName" in p.refusal.message


def test_cpu_only_colocated_with_empty_dra_needs_no_device_class(colocated):
    spec = colocated(
        placement={"mode": "Colocated", "dra": {}},
        trainer={"replicas": 2, "gpusPerPod": 0, "parallelism": {"tensor": 1, "pipeline": 1, "data": 2}},
        inference={"replicas": 2, "gpusPerReplica": 0, "engine": {"type": "Custom"}},
    )
    assert plan("co", spec).refusal is None


def test_whole_node_follows_configured_node_size(colocated):
    assert plan("co", colocated(), node_gpu_count=4).refusal is not None
    assert plan("co", colocated(), node_gpu_count=8).refusal is None


@pytest.mark.parametrize("node_gpus", [2, 4])
def test_pods_larger_than_a_node_are_refused(separated, node_gpus):
    p = plan("j", separated(), node_gpu_count=node_gpus)
    if node_gpus < 4:
        assert p.refusal is not None and p.refusal.reason == REASON_TOO_MANY_GPUS
        assert "spec.trainer.gpusPerPod" in p.refusal.message
    else:
        assert p.refusal is None


def test_auto_mode_resolution(separated, colocated):
    assert plan("j", separated(transfer={"mode": "Auto"})).mode == "NCCL"
    assert plan("j", separated(transfer={"mode": "Auto"}), rdma_available=True).mode == "GDR"
    assert plan("j", colocated(transfer={"mode": "Auto"})).mode == "IPC"
