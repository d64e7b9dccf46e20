"""Trainer epochs (issue 15, F4): a restarted trainer publishing from version 1 again starts a new epoch in
its agent's staging store (old versions dropped, versions ordered by (epoch, version)); the same trainer
going backwards is still an error. Real shared-memory staging, one process."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent.staging import segments
from weightsync.agent.staging.index import StagingError
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.transfer.served import ServedTracker
from weightsync.crds.topology import InferenceReplicaTopology, PodMember, Topology, TrainerTopology


def _publish(store: StagedVersions, version: int, session: str, rank: int = 0) -> None:
    data = torch.full((4,), float(version))
    seg = store.stage(rank, version, segments.tensor_nbytes(data), "cpu", session=session)
    seg.view(0, data.dtype, data.shape).copy_(data)
    metas = [{"name": "w", "dtype": segments.dtype_name(data.dtype), "shape": [4], "global_shape": [4],
              "global_offset": [0], "offset": 0, "nbytes": segments.tensor_nbytes(data)}]
    store.publish(rank, version, seg.name, metas, {})


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))  # the staging volume (the pod's emptyDir)
    s = StagedVersions([0], f"weightsync-test-epoch-{id(object())}", keep=2)
    yield s
    s.close()


def test_the_same_trainer_going_backwards_is_an_error(store: StagedVersions) -> None:
    _publish(store, 5, "run-a")
    with pytest.raises(StagingError, match="versions must increase"):
        _publish(store, 3, "run-a")
    assert store.trainer_epoch == 0 and store.latest() == 5


def test_a_new_trainer_session_starts_a_new_epoch_and_drops_the_old_versions(store: StagedVersions) -> None:
    _publish(store, 4, "run-a")
    _publish(store, 5, "run-a")
    _publish(store, 1, "run-b")  # the trainer restarted
    assert store.trainer_epoch == 1
    assert store.latest() == 1 and store.get(5) is None and store.get(4) is None
    with store.reading(1) as sv:
        assert torch.equal(sv.ranks[0].tensors()["w"], torch.full((4,), 1.0))
    _publish(store, 2, "run-b")
    assert store.trainer_epoch == 1 and store.latest() == 2


def test_a_restarted_agent_recognises_a_restarted_trainer_from_its_pod(store: StagedVersions) -> None:
    """The agent restarted too: its store is empty, but its proven pod annotation says epoch 2 published 9."""
    store.resume(2, 9)
    _publish(store, 10, "run-a")  # the same trainer going on (it reconnected): same epoch
    assert store.trainer_epoch == 2
    fresh = StagedVersions([0], f"weightsync-test-epoch-b-{id(store)}")
    try:
        fresh.resume(2, 9)
        _publish(fresh, 1, "run-b")
        assert fresh.trainer_epoch == 3 and fresh.latest() == 1
    finally:
        fresh.close()


def test_a_version_being_read_keeps_its_bytes_until_the_transfer_ends(store: StagedVersions) -> None:
    _publish(store, 7, "run-a")
    with store.reading(7) as sv:
        _publish(store, 1, "run-b")
        _publish(store, 2, "run-b")
        _publish(store, 3, "run-b")
        assert torch.equal(sv.ranks[0].tensors()["w"], torch.full((4,), 7.0)), "its slot must not be reused"


def test_wait_served_counts_only_replicas_in_the_trainer_epoch() -> None:
    t = Topology(job="j", namespace="default", generation=1, placement="Separated", mode="NCCL", bucket_size_mb=1,
                 trainer=TrainerTopology(world_size=1, tensor=1, pipeline=1, data=1,
                                         pods=[PodMember(name="j-trainer-0", index=0, ranks=[0])]),
                 inference=[InferenceReplicaTopology(replica=0, tensor=1, world_size=1,
                                                     pods=[PodMember(name="j-inference-0-0", index=0, ranks=[0])])])
    tr = ServedTracker()
    tr.link_opened("j-inference-0-0", 1)
    tr.report("j-inference-0-0", 1, 9, trainer_epoch=0)
    assert tr.fleet(t, False).reaches(3, trainer_epoch=0)
    assert not tr.fleet(t, False).reaches(3, trainer_epoch=1), "version 9 of the old run is not version 3 of the new"
    tr.report("j-inference-0-0", 1, 3, trainer_epoch=1)
    assert tr.fleet(t, False).reaches(3, trainer_epoch=1)
