"""The weightsync vLLM backend's wire on CPU, both ends in one process (agent/engines/vllm_wire.py): the same code
the agent and vLLM's workers run, up to vLLM itself (tests/engine_servers runs it inside a real vLLM server).

A real gloo group through the agent's authenticated rendezvous store: the agent side packs and broadcasts, the
worker side receives into a buffer of its own, checks every tensor's digest leaf before `load_weights` sees it,
and every rank learns the bucket's outcome from the status all-reduce."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from weightsync.agent.engines import vllm_wire as w
from weightsync.agent.transports.rendezvous import LinkStore, StoreError, StoreServer

HOST = "127.0.0.1"


def _bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    x[0, 0], x[0, 1] = float("nan"), -0.0
    return [("a.int8", torch.tensor([1, -2, 3], dtype=torch.int8)), ("b.bf16", x),
            ("c.f32", torch.randn(3, 3, generator=g)), ("d.empty", torch.empty(0, 4, dtype=torch.float16)),
            ("e.f64", torch.randn(2, generator=g, dtype=torch.float64))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def test_pack_aligns_every_tensor_and_views_give_the_bytes_back() -> None:
    items = _bucket(1)
    buf, info = w.pack(items, None, torch.device("cpu"))
    assert all(off % w.ALIGNMENT == 0 for off in info.offsets)  # an int8 of 3 bytes leaves no odd offset
    got = w.views(buf[: info.nbytes], info)
    assert [n for n, _ in got] == [n for n, _ in items]
    assert all(_same(x, y) for (_, x), (_, y) in zip(got, items, strict=True))
    assert info.leaves == w.tensor_leaves(info.names, info.dtype_names, info.shapes, buf, info.offsets, info.algorithm)
    with pytest.raises(ValueError, match="differ in length"):
        w.WeightsyncUpdateInfo(names=["x"], dtype_names=[], shapes=[], offsets=[], nbytes=0)


class Pair:
    """rank 0 (the agent) and rank 1 (a vLLM worker) of one group, each in a thread of this process."""

    def __init__(self) -> None:
        self.secret = w.new_secret()
        self.server = StoreServer(HOST, 0, self.secret, timeout=30)
        self.stores = [LinkStore(HOST, self.server.port, self.secret, timeout=30) for _ in range(2)]
        group = f"weightsync/{uuid.uuid4().hex}/"
        pgs: list[Any] = [None, None]

        def make(rank: int) -> None:
            pgs[rank] = w.make_group(self.stores[rank], group, rank, 2, "gloo", HOST, 30)

        threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.agent_pg, worker_pg = pgs
        self.worker = w.WorkerReceiver(worker_pg, torch.device("cpu"))

    def bucket(self, items: list[tuple[str, torch.Tensor]], load: Callable[[list[tuple[str, torch.Tensor]]], Any],
               corrupt: bool = False) -> tuple[int, int]:
        """One bucket through the group: (the agent's status, the worker's status)."""
        buf, info = w.pack(items, None, torch.device("cpu"))
        data = buf[: info.nbytes]
        if corrupt:
            data[info.offsets[2]] ^= 0x01  # one bit of tensor c, after the leaves were computed
        got: dict[str, int] = {}
        t = threading.Thread(target=lambda: got.__setitem__("worker", self.worker.receive(info, load)))
        t.start()
        w.broadcast(self.agent_pg, data)
        agent = w.status_allreduce(self.agent_pg, w.STATUS_OK, torch.device("cpu"))
        t.join(30)
        return agent, got["worker"]

    def flush(self, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> tuple[int, int]:
        """The call before finish: the worker loads the bucket it checked last."""
        got: dict[str, int] = {}
        t = threading.Thread(target=lambda: got.__setitem__(
            "worker", self.worker.receive(w.WeightsyncUpdateInfo(flush=True), load)))
        t.start()
        agent = w.status_allreduce(self.agent_pg, w.STATUS_OK, torch.device("cpu"))
        t.join(30)
        return agent, got["worker"]

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.server.close()


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def test_a_bucket_is_received_checked_and_loaded_bit_exact(pair: Pair) -> None:
    loaded: list[tuple[str, torch.Tensor]] = []
    items, more = _bucket(2), _bucket(3)
    assert pair.bucket(items, loaded.extend) == (w.STATUS_OK, w.STATUS_OK)
    assert loaded == [], "checked and held: it loads while the next bucket is on the wire"
    assert pair.bucket(more, loaded.extend) == (w.STATUS_OK, w.STATUS_OK)
    assert [n for n, _ in loaded] == [n for n, _ in items]
    assert pair.flush(loaded.extend) == (w.STATUS_OK, w.STATUS_OK)  # before finish: the last one
    assert [n for n, _ in loaded] == [n for n, _ in items + more]
    # each bucket landed in a buffer of its own: the first one's views (vLLM's reload keeps them until their
    # layer is whole) still hold the first bucket's bytes
    assert all(_same(x, y) for (_, x), (_, y) in zip(loaded, items + more, strict=True))
    assert pair.worker.failure is None and pair.worker.loaded_tensors == 10


def test_a_corrupted_bucket_is_never_loaded_and_every_rank_learns_it(pair: Pair) -> None:
    loaded: list[tuple[str, torch.Tensor]] = []
    pair.worker.start_session()
    assert pair.bucket(_bucket(4), loaded.extend, corrupt=True) == (w.STATUS_DIGEST_MISMATCH,) * 2
    assert pair.worker.failure is not None and "'c.f32'" in pair.worker.failure and "not loaded" in pair.worker.failure
    # the rest of the session loads nothing more, and says why, up to the flush before finish
    assert pair.bucket(_bucket(5), loaded.extend) == (w.STATUS_SESSION_FAILED,) * 2
    assert pair.flush(loaded.extend) == (w.STATUS_SESSION_FAILED,) * 2 and loaded == []
    pair.worker.start_session()  # a new session starts clean
    assert pair.bucket(_bucket(6), loaded.extend) == (w.STATUS_OK,) * 2
    assert pair.flush(loaded.extend) == (w.STATUS_OK,) * 2 and len(loaded) == 5


def test_a_loader_error_is_reported_in_band_never_raised(pair: Pair) -> None:
    def refuse(tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise KeyError("model.layers.9.unknown.weight")

    assert pair.bucket(_bucket(7), refuse) == (w.STATUS_OK,) * 2
    assert pair.flush(refuse) == (w.STATUS_LOAD_FAILED,) * 2
    assert pair.worker.failure is not None and "KeyError" in pair.worker.failure


def test_the_rendezvous_needs_the_groups_secret() -> None:
    server = StoreServer(HOST, 0, w.new_secret(), timeout=5)
    try:
        intruder = LinkStore(HOST, server.port, w.new_secret(), timeout=2)
        with pytest.raises(StoreError):
            intruder.set("weightsync/x/0", b"addr")
        intruder.close()
    finally:
        server.close()


@pytest.mark.gpu
def test_a_cuda_bucket_is_packed_on_the_device_with_on_device_leaves() -> None:
    """A CUDA agent (backend weightsync, NCCL): the bucket is packed on its GPU and its leaves are the on-device
    weighted sums (no device-to-host copy); a worker checks the same algorithm."""
    dev = torch.device("cuda", 0)
    items = [(n, t.to(dev)) for n, t in _bucket(8)]
    buf, info = w.pack(items, None, dev)
    assert buf.device == dev and info.algorithm == w.leaf_algorithm(dev) != w.leaf_algorithm(torch.device("cpu"))
    assert all(_same(x.cpu(), y.cpu()) for (_, x), (_, y) in zip(w.views(buf[: info.nbytes], info), items, strict=True))
    assert info.leaves == w.tensor_leaves(info.names, info.dtype_names, info.shapes, buf, info.offsets, info.algorithm)


@pytest.mark.gpu
def test_an_nccl_group_between_two_gpus_moves_and_checks_a_bucket() -> None:
    """The agent on one GPU, a vLLM worker on another (NCCL refuses two ranks on one GPU): the same wire."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks of one group on one GPU)")
    secret = w.new_secret()
    server = StoreServer(HOST, 0, secret, timeout=60)
    stores = [LinkStore(HOST, server.port, secret, timeout=60) for _ in range(2)]
    group = f"weightsync/{uuid.uuid4().hex}/"
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        torch.cuda.set_device(rank)
        pgs[rank] = w.make_group(stores[rank], group, rank, 2, "nccl", HOST, 60)

    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    worker = w.WorkerReceiver(pgs[1], torch.device("cuda", 1))
    items = [(n, t.to("cuda:0")) for n, t in _bucket(9)]
    buf, info = w.pack(items, None, torch.device("cuda", 0))
    loaded: list[tuple[str, torch.Tensor]] = []
    got: dict[str, int] = {}

    def recv() -> None:
        torch.cuda.set_device(1)
        got["worker"] = worker.receive(info, loaded.extend)

    t = threading.Thread(target=recv)
    t.start()
    w.broadcast(pgs[0], buf[: info.nbytes])
    assert w.status_allreduce(pgs[0], w.STATUS_OK, torch.device("cuda", 0)) == w.STATUS_OK
    t.join(60)
    assert got["worker"] == w.STATUS_OK
    assert all(_same(x.cpu(), y.cpu()) for (_, x), (_, y) in zip(loaded, items, strict=True))
    for s in stores:
        s.close()
    server.close()


def test_a_bucket_that_lies_in_one_buffer_goes_without_a_pack() -> None:
    """The receive slot holds a bucket as aligned views of one buffer: its bytes go on the wire as they lie."""
    items = _bucket(10)
    packed, info = w.pack(items, None, torch.device("cpu"))
    slot = w.views(packed[: info.nbytes], info)  # views of one buffer, like a receive slot's
    placed = w.in_place(slot, torch.device("cpu"), max_slack=2.0)  # tiny tensors: mostly alignment gaps
    assert placed is not None
    region, placed_info = placed
    assert region.data_ptr() == packed.data_ptr()
    assert [o for o, (_, t) in zip(placed_info.offsets, slot, strict=True) if t.numel()] == [
        o for o, (_, t) in zip(info.offsets, slot, strict=True) if t.numel()]
    assert placed_info.leaves == info.leaves
    assert w.in_place(items, torch.device("cpu")) is None  # separate tensors: packed
    assert w.in_place([slot[0], slot[-1]], torch.device("cpu"), max_slack=0.0) is None  # mostly gaps: packed


def test_receive_buffers_are_reused_only_once_no_view_is_left(pair: Pair) -> None:
    held: list[tuple[str, torch.Tensor]] = []  # like vLLM's reload holding a layer's tensors

    def nothing(tensors: list[tuple[str, torch.Tensor]]) -> None:
        return None

    assert pair.bucket(_bucket(11), held.extend) == (w.STATUS_OK,) * 2
    first = pair.worker.pool[0][0].untyped_storage().data_ptr()
    assert pair.bucket(_bucket(12), held.extend) == (w.STATUS_OK,) * 2  # loads bucket 11: its views are kept
    assert pair.worker.pool[1][0].untyped_storage().data_ptr() != first  # the first buffer was still viewed
    assert pair.flush(nothing) == (w.STATUS_OK,) * 2
    assert all(_same(x, y) for (_, x), (_, y) in zip(held, _bucket(11), strict=True))
    held.clear()  # the layer was processed: the views are gone
    seen: list[int] = []
    assert pair.bucket(_bucket(13), lambda t: seen.append(t[0][1].untyped_storage().data_ptr())) == (w.STATUS_OK,) * 2
    assert pair.flush(lambda t: seen.append(t[0][1].untyped_storage().data_ptr())) == (w.STATUS_OK,) * 2
    assert seen == [first]  # reused, no fresh allocation
