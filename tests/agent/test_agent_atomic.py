"""The inference agent's side of updatePolicy.strategy Atomic (agent/atomic.py): what to do next, the
readiness gate, and holding a version in host memory until the commit."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent import atomic
from weightsync.agent.atomic import CommitState, decide
from weightsync.agent.engines.base import EngineError, load_version
from weightsync.agent.podstate import Observed, annotations_for, desired_from_annotations
from weightsync.crds import contract


def test_decide():
    c1 = CommitState((0, 1), (0, 1))
    assert decide((0, 1), None, (0, 1), CommitState()) == atomic.ROLLING
    assert decide((0, 1), None, (0, 2), c1) == atomic.PREPARE
    assert decide((0, 1), (0, 2), (0, 2), c1) == atomic.WAIT  # prepared: waits for the commit
    assert decide((0, 1), (0, 2), (0, 3), c1) == atomic.PREPARE  # superseded: prepares the newer one
    assert decide((0, 1), (0, 2), (0, 2), CommitState((0, 2), (0, 1))) == atomic.WAIT  # draining: loads nothing
    assert decide((0, 1), (0, 2), (0, 2), CommitState((0, 2), (0, 2))) == atomic.COMMIT_HELD
    assert decide((0, 1), None, (0, 2), CommitState((0, 2), (0, 2))) == atomic.LOAD  # lost its copy
    assert decide(None, None, (0, 2), CommitState((0, 2), (0, 2))) == atomic.LOAD  # a joining replica


def test_ready_only_on_the_committed_version_and_never_while_switching():
    assert atomic.ready((0, 1), CommitState((0, 1), (0, 1)))[0] is True
    ok, reason, _ = atomic.ready((0, 1), CommitState((0, 2), (0, 1)))
    assert not ok and reason == contract.REASON_ATOMIC_SWITCHING
    ok, reason, _ = atomic.ready((0, 1), CommitState((0, 2), (0, 2)))
    assert not ok and reason == contract.REASON_NOT_COMMITTED
    assert atomic.ready((0, 2), CommitState((0, 2), (0, 2)))[1] == contract.REASON_COMMITTED


def test_commit_annotations_and_prepared_report_on_the_pod():
    d = desired_from_annotations({contract.ANN_TARGET_VERSION: "3", contract.ANN_COMMIT_VERSION: "3",
                                  contract.ANN_COMMITTED_VERSION: "2", contract.ANN_COMMITTED_EPOCH: "1",
                                  contract.ANN_COMMIT_EPOCH: "1"})
    assert d.commit == (1, 3) and d.committed == (1, 2)
    assert desired_from_annotations({contract.ANN_COMMITTED_VERSION: ""}).committed is None  # Rolling
    ann = annotations_for(Observed(served_version=2, prepared_version=3, prepared_epoch=1))
    assert ann[contract.ANN_PREPARED_VERSION] == "3" and ann[contract.ANN_PREPARED_EPOCH] == "1"
    assert annotations_for(Observed(served_version=2))[contract.ANN_PREPARED_VERSION] is None
    assert contract.ANN_PREPARED_VERSION in contract.VERSION_PROOF_KEYS  # a container cannot forge it


class Recorder:
    def __init__(self, fail_at_bucket: int | None = None) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.rank = 0
        self.fail_at = fail_at_bucket

    def pause(self): self.calls.append("pause")
    def resume(self): self.calls.append("resume")
    def begin_update(self, v): self.calls.append(f"begin {v}")

    def load_bucket(self, tensors):
        if self.fail_at is not None and len([c for c in self.calls if c.startswith("bucket")]) == self.fail_at:
            raise EngineError("engine refused the bucket")
        self.calls.append(f"bucket rank{self.rank}")
        self.loaded.update({n: t.clone() for n, t in tensors})

    def commit(self, v): self.calls.append(f"commit {v}")
    def abort(self, v, reason): self.calls.append(f"abort {v}")
    def served_version(self): return None


def _buckets():
    from weightsync.agent.transfer.fetch import RankedBucket

    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)
    return [RankedBucket([("a", a)], 0), RankedBucket([("b", b)], 1)], {"a": a.clone(), "b": b.clone()}


def test_holding_adapter_keeps_the_version_off_the_engine_then_commit_loads_it_bit_exact():
    hold = atomic.HoldingAdapter(epoch=0)
    buckets, expect = _buckets()
    load_version(hold, 7, buckets, pause_generation=False)
    for b in buckets:  # the receiver reuses its buffers: the held copy must not change
        for _, t in b:
            t.zero_()
    assert hold.complete is not None and hold.complete.key == (0, 7)
    assert hold.complete.nbytes == 6 * 4 + 3 * 2
    engine = Recorder()
    atomic.commit_held(hold.complete, engine, pause_generation=True)
    assert engine.calls == ["pause", "begin 7", "bucket rank0", "bucket rank1", "commit 7", "resume"]
    assert all(torch.equal(engine.loaded[n], expect[n]) for n in expect)


def test_a_failed_prepare_holds_nothing_and_a_failed_commit_is_aborted_and_resumed():
    hold = atomic.HoldingAdapter(epoch=0, fault="prepare")
    buckets, _ = _buckets()
    with pytest.raises(RuntimeError, match="injected prepare fault"):
        load_version(hold, 7, buckets, pause_generation=False)
    assert hold.complete is None
    hold = atomic.HoldingAdapter(epoch=0)
    load_version(hold, 7, _buckets()[0], pause_generation=False)
    assert hold.complete is not None
    engine = Recorder(fail_at_bucket=1)
    with pytest.raises(EngineError):
        atomic.commit_held(hold.complete, engine, pause_generation=True)
    assert engine.calls[-2:] == ["abort 7", "resume"]


def test_a_prepare_longer_than_the_timeout_fails():
    hold = atomic.HoldingAdapter(epoch=0, timeout=0.5)
    hold.started -= 1.0  # the transfer took a second already
    with pytest.raises(EngineError, match=r"timeoutSeconds=0\.5s"):
        load_version(hold, 7, _buckets()[0], pause_generation=False)
    assert hold.complete is None
