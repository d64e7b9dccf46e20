"""The served version's content digest on the pod: written with the version (under its proof), removed when
unknown; the Atomic path carries it from prepare to commit."""

from __future__ import annotations

import torch

from weightsync.agent import atomic
from weightsync.agent.inference.loop import checked_digest
from weightsync.agent.podstate import Observed, annotations_for
from weightsync.crds import contract


def test_the_digest_travels_with_the_served_version() -> None:
    d = "c" * 32
    ann = annotations_for(Observed(served_version=3, served_epoch=1, served_digest=d))
    assert ann[contract.ANN_SERVED_DIGEST] == d and contract.ANN_SERVED_DIGEST in contract.VERSION_PROOF_KEYS
    assert annotations_for(Observed(served_version=3))[contract.ANN_SERVED_DIGEST] is None  # unknown: removed
    assert contract.ANN_SERVED_DIGEST not in annotations_for(Observed())  # nothing served: left alone


def test_only_a_checked_digest_is_reported() -> None:
    class Res:
        digest = "d" * 32
        digest_checked = True

    assert checked_digest(Res()) == "d" * 32
    Res.digest_checked = False
    assert checked_digest(Res()) is None
    assert checked_digest(None) is None


def test_a_prepared_version_keeps_its_digest_and_labels_the_engine_at_commit() -> None:
    hold = atomic.HoldingAdapter(epoch=0)
    hold.begin_update(4)
    hold.load_bucket([("w", torch.ones(2))])
    hold.label_digest = "e" * 32  # as fetch_version sets it once every piece was checked
    hold.commit(4)
    held = hold.complete
    assert held is not None and held.digest == "e" * 32 and hold.label_digest is None

    class Engine:
        label_digest: str | None = None
        labels: list[str | None] = []

        def pause(self) -> None: ...
        def resume(self) -> None: ...
        def begin_update(self, version: int) -> None: ...
        def load_bucket(self, tensors: object) -> None: ...
        def abort(self, version: int, reason: str) -> None: ...
        def served_version(self) -> int | None:
            return None

        def commit(self, version: int) -> None:
            self.labels.append(self.label_digest)

    eng = Engine()
    atomic.commit_held(held, eng, pause_generation=False)
    assert eng.labels == ["e" * 32]
