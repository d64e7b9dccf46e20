"""Receive memory is bounded by buckets in flight, not by peers: a destination rank's sources share its
`num_slots` receive buffers, which are kept across versions (agent/staging/slots.py ReceiveSlots)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from weightsync.agent.plan import BucketPlan, TensorShard, build_plan
from weightsync.agent.staging import segments
from weightsync.agent.staging.slots import ReceiveSlots, SharedSlotAllocator
from weightsync.agent.transfer.groups import RoutingTransport
from weightsync.agent.transports.base import Done, Pending, Transport, TransportContext, dst


class IntoOnly(Transport):
    """An inner transport that records where it was asked to receive (the bytes are written by hand)."""

    name = "into-only"

    def __init__(self, src: int) -> None:
        self.src = src
        self.into: list[int] = []
        self.own_slot_used = False

    def bind(self, ctx: TransportContext) -> None:
        pass

    def send_buffer(self, slot: int) -> torch.Tensor:
        raise AssertionError("receive only")

    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        raise AssertionError("receive only")

    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        self.own_slot_used = True
        return Done(torch.full((bucket.nbytes,), self.src, dtype=torch.uint8))

    def start_recv_into(self, bucket: BucketPlan, slot: int, out: torch.Tensor) -> Pending[torch.Tensor] | None:
        self.into.append(out.data_ptr())
        out.fill_(self.src)
        return Done(out)

    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        pass


def _plan(sources: int) -> object:
    srcs = [[TensorShard.of("w", "float32", (sources * 64, 64), (r * 64, 0), (64, 64))] for r in range(sources)]
    needs = [[TensorShard.full("w", "float32", (sources * 64, 64))]]
    return build_plan(srcs, needs, 8 << 10)


def test_every_source_receives_into_the_destinations_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    plan = _plan(4)
    alloc = SharedSlotAllocator("wsslots")
    slots = ReceiveSlots(alloc)
    inner = {s: IntoOnly(s) for s in range(4)}
    for _version in range(3):  # the same two buffers serve every version
        rt = RoutingTransport(dict(inner), slots)
        rt.bind(TransportContext(plan, dst(0), {}, torch.device("cpu"), 5.0))  # type: ignore[arg-type]
        for k, b in enumerate(plan.buckets_to(0)):
            data = rt.start_recv(b, k % rt.num_slots).wait(1.0)
            assert int(data[0]) == b.src
            rt.release_recv(b, k % rt.num_slots)
    used = {p for t in inner.values() for p in t.into}
    assert len(used) == rt.num_slots == 2, "four sources, yet only the destination's two slots are written"
    assert not any(t.own_slot_used for t in inner.values())
    assert alloc.segments == 2 and len(list(tmp_path.iterdir())) == 2
    # a bigger plan grows the slots once; the old segments are handed back for release
    big = _plan(2)
    big_bucket = build_plan(big.sources, big.needs, 64 << 10)  # type: ignore[attr-defined]
    RoutingTransport(dict(inner), slots).bind(TransportContext(big_bucket, dst(0), {}, torch.device("cpu"), 5.0))  # type: ignore[arg-type]
    gc.collect()
    assert len(alloc.reap()) == 2 and alloc.segments == 2


def test_without_shared_slots_each_source_uses_its_own() -> None:
    plan = _plan(2)
    inner = {s: IntoOnly(s) for s in range(2)}
    rt = RoutingTransport(dict(inner))
    rt.bind(TransportContext(plan, dst(0), {}, torch.device("cpu"), 5.0))  # type: ignore[arg-type]
    for k, b in enumerate(plan.buckets_to(0)):
        rt.start_recv(b, k % 2).wait(1.0)
    assert all(t.own_slot_used and not t.into for t in inner.values())


class _Mapping:
    """What an IPC reader holds: one mapping of a shared-memory file (`.tensor`)."""

    def __init__(self, path: Path, size: int) -> None:
        self.tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def test_a_file_mapped_twice_is_found_in_both_mappings_until_the_last_goes(tmp_path: Path) -> None:
    # two local destination ranks each map the same trainer staging file (IPC, FSDP 2 -> TP 2 in one pod):
    # a tensor in either mapping is handed to the engine in place, and dropping one keeps the other
    path = tmp_path / "wsipc-stage-x"
    path.write_bytes(bytes(4096))
    first, second = _Mapping(path, 4096), _Mapping(path, 4096)
    shared = segments.SharedSegments()
    shared.add(segments.MappedFile(str(path), first))
    shared.add(segments.MappedFile(str(path), second))
    a, b = first.tensor[256:512], second.tensor[1024:2048]
    assert [(s.name, off) for s, off in (shared.locate(a), shared.locate(b)) if s] == [(path.name, 256),
                                                                                      (path.name, 1024)]
    shared.forget(path.name, holder=second)
    assert shared.locate(b) is None and shared.locate(a) is not None and shared.take_gone() == []
    shared.forget(path.name, holder=first)
    assert shared.locate(a) is None and shared.take_gone() == [path.name]
