"""Where a bucket sits in a sender's tensors, or lands in a receiver's `into`, is worked out once per piece and kept
while the caller passes the same memory (agent/transfer/sync.py `memory_key`), not per piece and version; new memory,
or the same addresses in other storages, is worked out again. Sender and receiver are threads over real links and
the real IPC transport (/dev/shm)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from weightsync.agent.plan import TensorShard, TransferPlan, build_plan
from weightsync.agent.plan.buckets import entry_view
from weightsync.agent.transfer import receive, send
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import memory_key
from weightsync.agent.transports.ipc import IpcTransport
from weightsync.agent.wire.link import LinkListener, connect

NAMES = {"a": (4,), "b": (100,), "c": (7, 3)}


def _plan() -> TransferPlan:
    shards = [TensorShard.full(n, "float32", shape) for n, shape in NAMES.items()]
    return build_plan([shards], [shards], 1 << 20)


def _arena(plan: TransferPlan, role: str) -> dict[str, torch.Tensor]:
    """Tensors laid out like the plan's buckets, in one storage: buckets sent from / received into them in place."""
    layout = plan.arena(role, 0)
    flat = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8)
    return {e.name: entry_view(flat, e) for e in layout.entries}


def _values(version: int) -> dict[str, torch.Tensor]:
    return {n: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * version + i
            for i, (n, shape) in enumerate(NAMES.items())}


class Pair:
    """One sender and one receiver of `plan` over a real link and the IPC transport."""

    def __init__(self, plan: TransferPlan) -> None:
        lst = LinkListener("127.0.0.1", 0, "tok")
        client = connect("127.0.0.1", lst.port, "tok")
        server = lst.accept(timeout=5)
        lst.close()
        prefix = f"weightsync-test-{os.getpid()}-places"
        self.transports = [IpcTransport(prefix=prefix), IpcTransport(prefix=prefix)]
        self.sender = WeightSender(plan, 0, self.transports[0], {0: server}, timeout=10)
        self.receiver = WeightReceiver(plan, 0, self.transports[1], {0: client}, timeout=10)

    def move(self, version: int, tensors: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
        errors: list[BaseException] = []

        def go() -> None:
            try:
                self.sender.send_version(version, tensors)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        self.receiver.receive_version(None, expected_version=version, into=into)
        t.join(10)
        assert not errors, errors

    def close(self) -> None:
        for t in self.transports:
            t.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(_plan())
    yield p
    p.close()


def _count_in_place(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Counts the module's calls of in_place (the per-piece work the memo saves)."""
    calls = [0]
    real: Callable[..., Any] = module.in_place

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(module, "in_place", counted)
    return calls


def _fill(tensors: dict[str, torch.Tensor], version: int) -> None:
    for n, v in _values(version).items():
        tensors[n].copy_(v)


def test_places_are_worked_out_once_while_the_memory_stays_put(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = pair.sender.plan
    sent, recv = _count_in_place(monkeypatch, send), _count_in_place(monkeypatch, receive)
    src, dst = _arena(plan, "src"), _arena(plan, "dst")
    for v in (1, 2, 3):
        _fill(src, v)
        pair.move(v, src, dst)
        for n, want in _values(v).items():
            assert torch.equal(dst[n], want), (v, n)
        if v == 1:
            first = (sent[0], recv[0])
            assert first == (len(plan.buckets), len(plan.buckets))  # worked out per bucket, once
    assert (sent[0], recv[0]) == first  # versions 2 and 3: nothing worked out again

    # new memory on both sides: worked out again, and the bytes go to the new tensors, never the old ones
    src2, dst2 = _arena(plan, "src"), _arena(plan, "dst")
    _fill(src2, 4)
    pair.move(4, src2, dst2)
    assert (sent[0], recv[0]) == (2 * first[0], 2 * first[1])
    for n, want in _values(4).items():
        assert torch.equal(dst2[n], want), n
        assert torch.equal(dst[n], _values(3)[n]), n  # the previous destination is left as it was


def test_the_same_addresses_in_other_storages_are_worked_out_again(pair: Pair) -> None:
    """A bucket in place spans one storage. Tensors at the very same addresses, but each its own storage (freed and
    made again, or separate mappings), must not reuse that: the key tells them apart and each version lands whole."""
    plan = pair.sender.plan
    src = _arena(plan, "src")
    layout = plan.arena("dst", 0)
    memory = bytearray(max(layout.nbytes, 1))
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    one_storage = {e.name: entry_view(whole, e) for e in layout.entries}
    own_storages = {e.name: torch.frombuffer(memory, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
                    .view(torch.float32).reshape(e.shape) for e in layout.entries}
    assert all(own_storages[n].data_ptr() == one_storage[n].data_ptr() for n in NAMES)
    assert memory_key(one_storage.values()) != memory_key(own_storages.values())
    for v, into in ((1, one_storage), (2, own_storages), (3, one_storage)):
        _fill(src, v)
        pair.move(v, src, into)
        for n, want in _values(v).items():
            assert torch.equal(into[n], want), (v, n)
