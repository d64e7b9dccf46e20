"""Multi-process harness for the agent data plane: real processes, real TCP links, real gloo, real
shared memory. Every process computes the plan itself (so the hash comparison is real) and every
destination compares each received tensor bit for bit with the trainer's full tensor sliced to its box.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.plan import Box, TensorShard, build_plan
from weightsync.agent.plan.buckets import itemsize, to_dtype
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import SyncHooks
from weightsync.agent.transports.base import Pending, Transport, TransportContext
from weightsync.agent.transports.ipc import IpcTransport
from weightsync.agent.transports.nccl import NcclTransport, make_store
from weightsync.agent.wire.link import LinkListener, Mailbox, connect

TOKEN = "test-job-token-0123456789abcdef"
HOST = "127.0.0.1"


def full_tensor(name: str, dtype: str, shape: Sequence[int], version: int) -> torch.Tensor:
    """The trainer's full tensor of `name` at `version`: random bytes, any dtype, reproducible anywhere."""
    numel = 1
    for s in shape:
        numel *= s
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1000003 + version) % (1 << 62))
    raw = torch.randint(0, 256, (numel * itemsize(dtype),), dtype=torch.uint8, generator=g)
    return raw.view(to_dtype(dtype)).reshape(tuple(shape))


def slice_of(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[box.slices_within(Box.full(tuple(t.shape)))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@dataclass
class Scenario:
    sources: list[list[TensorShard]]
    needs: list[list[TensorShard]]
    bucket_bytes: int
    transport: str = "nccl"  # "nccl" (gloo on CPU) or "ipc"
    versions: list[int] = field(default_factory=lambda: [1])
    timeout: float = 30.0
    # faults
    dst_bucket_bytes: dict[int, int] = field(default_factory=dict)  # a destination computes another plan
    wrong_token: set[int] = field(default_factory=set)  # destination ranks that connect with a bad token
    die_at_bucket: tuple[int, int] | None = None  # (src rank, bucket k): that sender dies mid-bucket
    accept_timeout: float = 20.0
    into: bool = False  # senders stage in the plan's arena, receivers receive into arena tensors
    hooks: bool = False  # a checksum hook ships per-bucket metadata over the links
    device: str = "cpu"  # "cuda": CUDA IPC / NCCL (gpu-marked tests)


class SumHooks(SyncHooks):
    """A toy checksum: the byte sum of every bucket travels with it and is checked on arrival."""

    def on_send_bucket(self, version: int, bucket: Any, data: torch.Tensor) -> dict[str, Any] | None:
        return {"sum": int(data.to(torch.int64).sum())}

    def on_recv_bucket(self, version: int, bucket: Any, data: torch.Tensor, meta: dict[str, Any] | None) -> None:
        if meta is None or int(data.to(torch.int64).sum()) != meta["sum"]:
            raise RuntimeError(f"bucket {bucket.index} checksum mismatch")


def arena_tensors(layout: Any, device: str = "cpu") -> dict[str, torch.Tensor]:
    from weightsync.agent.plan.buckets import allocate, entry_view

    flat = allocate(max(layout.nbytes, 1), device)
    return {e.name: entry_view(flat, e) for e in layout.entries}


class DyingTransport(Transport):
    """Wraps a transport; the process dies (os._exit) right after starting its k-th send, while the
    bucket's bytes are still moving."""

    def __init__(self, inner: Transport, at: int) -> None:
        self.inner = inner
        self.at = at
        self.sent = 0
        self.name = inner.name  # type: ignore[misc]

    def bind(self, ctx: TransportContext) -> None:
        self.inner.bind(ctx)

    def send_buffer(self, slot: int) -> torch.Tensor:
        return self.inner.send_buffer(slot)

    def start_send(self, bucket: Any, slot: int) -> Pending[None]:
        p = self.inner.start_send(bucket, slot)
        if self.sent == self.at:
            os._exit(17)  # the bucket's bytes are still on their way
        self.sent += 1
        return p

    def start_recv(self, bucket: Any, slot: int) -> Pending[torch.Tensor]:
        return self.inner.start_recv(bucket, slot)

    def release_recv(self, bucket: Any, slot: int) -> None:
        self.inner.release_recv(bucket, slot)


def rank_device(scn: Scenario, role: str, rank: int) -> str:
    """The device of one endpoint: `scn.device`, except "cuda:spread" (NCCL): one GPU per process, trainer
    ranks first, as NCCL needs (two ranks of a communicator may not share a GPU)."""
    if scn.device != "cuda:spread":
        return scn.device
    index = rank if role == "src" else len(scn.sources) + rank
    torch.cuda.set_device(index % torch.cuda.device_count())
    return f"cuda:{index % torch.cuda.device_count()}"


def _transport(kind: str, store: Any, timeout: float) -> Transport:
    if kind == "ipc":
        return IpcTransport()
    return NcclTransport(store, host=HOST, timeout=timeout)


def _sender(scn: Scenario, rank: int, port: int, out: Any) -> None:
    faulthandler.dump_traceback_later(scn.timeout * 3, exit=True)
    res: dict[str, Any] = {"role": "src", "rank": rank, "ok": False}
    try:
        store = make_store(HOST, port, is_master=False, timeout=scn.timeout)
        plan = build_plan(scn.sources, scn.needs, scn.bucket_bytes)
        listener = LinkListener(HOST, 0, TOKEN)
        store.set(f"link/src{rank}", str(listener.port))
        peers: dict[int, Mailbox] = {}
        for _ in plan.dsts_of(rank):
            mb = Mailbox(listener.accept(timeout=scn.accept_timeout))
            h, _ = mb.get("hello", timeout=scn.timeout)
            peers[int(h["dst"])] = mb
        transport = _transport(scn.transport, store, scn.timeout)
        if scn.die_at_bucket is not None and scn.die_at_bucket[0] == rank:
            transport = DyingTransport(transport, scn.die_at_bucket[1])
        device = rank_device(scn, "src", rank)
        sender = WeightSender(plan, rank, transport, peers, timeout=scn.timeout, device=device,
                              hooks=SumHooks() if scn.hooks else None)
        mine = {s.name: s for s in plan.sources[rank]}
        res["versions"] = []
        staged = arena_tensors(plan.arena("src", rank), device) if scn.into else None
        for v in scn.versions:
            tensors = {n: slice_of(full_tensor(n, s.dtype, s.global_shape, v), s.box).to(device)
                       for n, s in mine.items()}
            if staged is not None:
                for n, t in tensors.items():
                    staged[n].copy_(t)
                tensors = staged
            stats = sender.send_version(v, tensors)
            res["versions"].append(stats.to_dict())
        res["ok"] = True
        res["rejected"] = listener.rejected
        transport.close()
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["error_type"] = type(exc).__name__
        res["trace"] = traceback.format_exc()
    out.put(res)


def _receiver(scn: Scenario, rank: int, port: int, out: Any) -> None:
    faulthandler.dump_traceback_later(scn.timeout * 3, exit=True)
    res: dict[str, Any] = {"role": "dst", "rank": rank, "ok": False, "committed": [], "buckets_seen": 0}
    try:
        store = make_store(HOST, port, is_master=False, timeout=scn.timeout)
        plan = build_plan(scn.sources, scn.needs, scn.dst_bucket_bytes.get(rank, scn.bucket_bytes))
        token = "not-the-job-token" if rank in scn.wrong_token else TOKEN
        peers: dict[int, Mailbox] = {}
        for s in plan.srcs_of(rank):
            sport = int(store.get(f"link/src{s}"))
            mb = Mailbox(connect(HOST, sport, token, timeout=scn.timeout))
            mb.send("hello", dst=rank)
            peers[s] = mb
        transport = _transport(scn.transport, store, scn.timeout)
        device = rank_device(scn, "dst", rank)
        receiver = WeightReceiver(plan, rank, transport, peers, timeout=scn.timeout, device=device,
                                  hooks=SumHooks() if scn.hooks else None)
        dest = arena_tensors(plan.arena("dst", rank), device) if scn.into else None
        needs = {s.name: s for s in plan.needs[rank]}
        res["checked"] = 0
        res["mismatches"] = []
        for v in scn.versions:
            got: dict[str, torch.Tensor] = {}
            dup: list[str] = []

            def on_bucket(items: list[tuple[str, torch.Tensor]], got: dict[str, torch.Tensor] = got,
                          dup: list[str] = dup) -> None:
                res["buckets_seen"] += 1
                for n, t in items:
                    if n in got:
                        dup.append(n)
                    got[n] = t.clone().cpu()

            if dest is not None:
                for t in dest.values():
                    t.zero_()
            stats = receiver.receive_version(on_bucket, expected_version=v, into=dest)
            res.setdefault("stats", []).append(stats.to_dict())
            # "commit": only after receive_version returned; verify every tensor bit for bit first.
            if dup:
                res["mismatches"].append(f"handed twice: {dup[:5]}")
            if set(got) != {n for n, s in needs.items() if s.box.numel}:
                res["mismatches"].append(f"v{v}: names differ: missing {sorted(set(needs) - set(got))[:5]} "
                                         f"extra {sorted(set(got) - set(needs))[:5]}")
            for n, s in needs.items():
                if n in got:
                    want = slice_of(full_tensor(n, s.dtype, s.global_shape, v), s.box)
                    if not same_bits(got[n], want):
                        res["mismatches"].append(f"v{v}: {n} differs")
                    res["checked"] += 1
            res["committed"].append(v)
        res["ok"] = True
        transport.close()
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["error_type"] = type(exc).__name__
        res["trace"] = traceback.format_exc()
    out.put(res)


PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.device_mesh", "weightsync.agent.transfer.send",
           "weightsync.agent.transfer.receive",
           "weightsync.agent.layout.rules", "wsagent_helpers"]


def forkserver_context() -> Any:
    """Children fork from a clean, single-threaded server that imported torch once (fast on a busy
    2-core machine), not from the test process (whose OpenMP / store threads make a plain fork unsafe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_scenario(scn: Scenario, deadline: float = 90.0) -> dict[tuple[str, int], dict[str, Any]]:
    """Run every source and destination rank of `scn` in its own process; return their reports."""
    ctx = forkserver_context()
    store = make_store(HOST, 0, is_master=True, timeout=scn.timeout)
    out = ctx.Queue()
    procs = []
    for r in range(len(scn.sources)):
        procs.append(ctx.Process(target=_sender, args=(scn, r, store.port, out), daemon=True))
    for r in range(len(scn.needs)):
        procs.append(ctx.Process(target=_receiver, args=(scn, r, store.port, out), daemon=True))
    for p in procs:
        p.start()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    end = time.monotonic() + deadline
    try:
        while len(results) < len(procs) and time.monotonic() < end:
            try:
                r = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    # drain what is left, then stop: dead processes (fault tests) never report
                    with contextlib.suppress(queue.Empty):
                        while True:
                            r = out.get(timeout=0.5)
                            results[(r["role"], r["rank"])] = r
                    break
                continue
            results[(r["role"], r["rank"])] = r
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
    for p, key in zip(procs, [("src", r) for r in range(len(scn.sources))] +
                      [("dst", r) for r in range(len(scn.needs))], strict=True):
        results.setdefault(key, {"role": key[0], "rank": key[1], "ok": False, "error": "no report",
                                 "exitcode": p.exitcode})
        results[key]["exitcode"] = p.exitcode
    return results


def dtensor_worker(rank: int, port: int, out: Any) -> None:
    """One of 4 ranks: a real DTensor Shard(0) of a 10x3 tensor; report what shard_from_dtensor says."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.agent.layout.rules import shard_from_dtensor

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(full, mesh, [Shard(0)])
        shard, local = shard_from_dtensor("w", dt)
        ok = torch.equal(local, full[shard.box.slices_within(Box.full((10, 3)))])
        out.put((rank, shard.box.offset, shard.box.shape, shard.global_shape, ok))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}", None, None, False))


__all__ = [
    "HOST",
    "TOKEN",
    "DyingTransport",
    "Scenario",
    "SyncHooks",
    "forkserver_context",
    "full_tensor",
    "run_scenario",
    "same_bits",
    "slice_of",
]
