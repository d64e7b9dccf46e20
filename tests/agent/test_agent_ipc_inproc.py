"""IPC transport in one process (sender and receiver threads over real links and real /dev/shm):
handle reuse across versions and the refusal to release a bucket whose views leaked."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from weightsync.agent.link import LinkListener, connect
from weightsync.agent.plan import TensorShard, build_plan
from weightsync.agent.sync import PeerFailed, SyncError, WeightReceiver, WeightSender
from weightsync.agent.transports.ipc import IpcTransport


def _pair(plan: Any, prefix: str, strict: bool = False) -> tuple[WeightSender, WeightReceiver, IpcTransport,
                                                                  IpcTransport]:
    lst = LinkListener("127.0.0.1", 0, "tok")
    client = connect("127.0.0.1", lst.port, "tok")
    server = lst.accept(timeout=5)
    lst.close()
    ts, tr = IpcTransport(prefix=prefix), IpcTransport(prefix=prefix, close_each_bucket=strict)
    return (WeightSender(plan, 0, ts, {0: server}, timeout=10), WeightReceiver(plan, 0, tr, {0: client}, timeout=10),
            ts, tr)


def _run(sender: WeightSender, version: int, tensors: dict[str, torch.Tensor]) -> list[BaseException]:
    errors: list[BaseException] = []

    def go() -> None:
        try:
            sender.send_version(version, tensors)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return errors


@pytest.mark.parametrize("strict", [False, True])
def test_handles_are_mapped_once_and_segments_cleaned_up(strict: bool) -> None:
    shards = [TensorShard.full(f"w{i}", "float32", (256,)) for i in range(8)]
    plan = build_plan([shards], [shards], 2048)  # 8 KiB of tensors in 2 KiB buckets: 4 buckets
    prefix = f"weightsync-test-{os.getpid()}-{strict}"
    sender, receiver, ts, tr = _pair(plan, prefix, strict)
    for v in (1, 2, 3):
        tensors = {s.name: torch.full((256,), float(v * 100 + i)) for i, s in enumerate(shards)}
        errors = _run(sender, v, tensors)
        got: dict[str, torch.Tensor] = {}
        receiver.receive_version(lambda items, got=got: got.update((n, t.clone()) for n, t in items),
                                 expected_version=v)
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        assert not errors
    # one mapping per owner slot, reused by 12 buckets over 3 versions; strict: one per bucket
    assert tr.handles_opened == (12 if strict else 2)
    assert not tr._maps if strict else len(tr._maps) == 2
    ts.close()
    tr.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def test_a_leaked_view_is_refused_not_left_dangling() -> None:
    shards = [TensorShard.full("w", "float32", (64,))]
    plan = build_plan([shards], [shards], 1024)
    sender, receiver, ts, tr = _pair(plan, f"weightsync-test-{os.getpid()}-leak")
    errors = _run(sender, 1, {"w": torch.ones(64)})
    kept: list[torch.Tensor] = []
    with pytest.raises(PeerFailed, match="still alive after on_bucket returned"):
        receiver.receive_version(lambda items: kept.extend(t for _, t in items))
    assert float(kept[0].sum()) == 64.0  # the leaked view still points at mapped memory
    ts.close()
    tr.close()
    del errors


def test_sender_rejects_tensors_that_do_not_match_the_plan() -> None:
    shards = [TensorShard.full("w", "float32", (64,))]
    plan = build_plan([shards], [shards], 1024)
    sender, receiver, ts, tr = _pair(plan, f"weightsync-test-{os.getpid()}-bad")
    with pytest.raises(SyncError, match="'w' is float32\\[32\\], the plan says float32\\[64\\]"):
        sender.send_version(1, {"w": torch.ones(32)})
    with pytest.raises(PeerFailed, match="aborted"):
        receiver.receive_version(lambda items: None)
    ts.close()
    tr.close()
