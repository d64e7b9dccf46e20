"""StagedTensors (agent/staging/index.py): a staged rank's views are made only when read, and the sender's memo
kept with the slot holds no view (over IPC a kept view would pin memory the receiver must release)."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent.staging.index import StagedTensors


def test_views_are_made_once_and_only_when_read() -> None:
    made: list[int] = []
    seg = torch.zeros(64, dtype=torch.uint8)

    def make() -> dict[str, torch.Tensor | object]:
        made.append(1)
        return {"a": seg[:16].view(torch.float32), "b": seg[16:32].view(torch.float32)}

    memo: dict[object, object] = {}
    staged = StagedTensors(make, seg, memo)  # type: ignore[arg-type]
    assert not staged.materialized and not made
    assert staged.segment is seg and staged.memo is memo
    assert staged["a"].shape == (4,) and staged.materialized and made == [1]
    assert sorted(staged) == ["a", "b"] and len(staged) == 2 and "b" in staged and made == [1]
    with pytest.raises(KeyError):
        staged["c"]
