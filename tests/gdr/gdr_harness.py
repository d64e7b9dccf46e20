"""Multi-process harness for the GDR transport: real processes, real HMAC links, real NIXL over UCX.

Trainer source ranks each run one LinkListener; every inference replica has its own plan (its ranks
only), and each source rank serves each replica with its own WeightSender + GdrTransport, so replicas
join and leave independently. A destination "commits" a version only after receive_version returned,
after comparing every tensor bit for bit with the trainer's full tensor sliced to its box; a failed
version leaves the previously committed tensors in place (the engine stand-in keeps them).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout
from weightsync.agent.plan import Box, TensorShard, build_plan
from weightsync.agent.plan.buckets import entry_view, itemsize, to_dtype
from weightsync.agent.transfer.digest import Digest, DigestHooks
from weightsync.agent.transfer.groups import RoutingTransport
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import SyncHooks
from weightsync.agent.transfer.verify import ChecksumHooks, RetryPolicy
from weightsync.agent.transports.base import Pending, Transport, TransportContext
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.agent.transports.gdr import GdrTransport
from weightsync.agent.wire.link import LinkListener, Mailbox, connect

TOKEN = "gdr-test-token-0123456789abcdef"
HOST = "127.0.0.1"
KB = 1024
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _seed(name: str, version: int, salt: int = 0) -> int:
    return (zlib.crc32(name.encode()) * 1000003 + version * 7919 + salt) % (1 << 62)


def full_tensor(name: str, dtype: str, shape: Sequence[int], version: int, change: float = 1.0) -> torch.Tensor:
    """The trainer's full tensor at `version`: random bytes (any bit pattern, NaNs and -0.0 included).

    change=1.0: every version is fresh random bytes. change<1: version v is version v-1 with that
    fraction of its elements replaced by random bit patterns (an optimizer step), for delta sync."""
    numel = 1
    for s in shape:
        numel *= s
    isz = itemsize(dtype)
    if change >= 1.0 or version <= 1:
        g = torch.Generator().manual_seed(_seed(name, version if change >= 1.0 else 1))
        raw = torch.randint(0, 256, (numel * isz,), dtype=torch.uint8, generator=g)
        return raw.view(to_dtype(dtype)).reshape(tuple(shape))
    prev = full_tensor(name, dtype, shape, version - 1, change).clone()
    g = torch.Generator().manual_seed(_seed(name, version, 1))
    k = max(1, int(numel * change)) if numel else 0
    words = prev.reshape(-1).view(_RAW[isz])
    if k:
        idx = torch.randperm(numel, generator=g)[:k]
        words[idx] = words[idx] ^ torch.randint(1, 127, (k,), generator=g).to(words.dtype)
    return prev


def slice_of(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[box.slices_within(Box.full(tuple(t.shape)))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def llama_metas(layers: int = 2, hidden: int = 16, inter: int = 32, vocab: int = 64, *,
                dtype: str = "bfloat16") -> list[TensorMeta]:
    m = [TensorMeta("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        m += [
            TensorMeta(f"{p}.input_layernorm.weight", "float32", (hidden,)),
            TensorMeta(f"{p}.self_attn.q_proj.weight", dtype, (hidden, hidden)),
            TensorMeta(f"{p}.self_attn.k_proj.weight", dtype, (hidden // 2, hidden)),
            TensorMeta(f"{p}.self_attn.v_proj.weight", dtype, (hidden // 2, hidden)),
            TensorMeta(f"{p}.self_attn.o_proj.weight", dtype, (hidden, hidden)),
            TensorMeta(f"{p}.mlp.gate_proj.weight", dtype, (inter, hidden)),
            TensorMeta(f"{p}.mlp.up_proj.weight", dtype, (inter, hidden)),
            TensorMeta(f"{p}.mlp.down_proj.weight", dtype, (hidden, inter)),
        ]
    m.append(TensorMeta("model.norm.weight", "float32", (hidden,)))
    m.append(TensorMeta("lm_head.weight", dtype, (vocab, hidden)))
    return m


@dataclass
class Replica:
    """One inference replica: what each of its ranks needs, the versions it receives, and faults."""

    needs: list[list[TensorShard]]
    versions: list[int]
    join_after: tuple[int, int] | None = None  # (replica, version): start once that replica committed it
    corrupt: dict[int, tuple[int, int]] = field(default_factory=dict)  # dst rank -> (version, times)


@dataclass
class GdrScenario:
    sources: list[list[TensorShard]]
    replicas: list[Replica]
    bucket_bytes: int = 4 * KB
    num_slots: int = 2
    delta: DeltaConfig | None = None
    verify: bool = False
    change: float = 1.0  # see full_tensor
    timeout: float = 60.0
    hold: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # replica -> (version, other, v)
    arena: bool = False  # tensors live in plan arenas: zero-copy send from staging, receive into place
    routed: bool = False  # as the agent process: one GdrTransport per source rank behind a RoutingTransport
    digest: bool = False  # as the agent process: piece digests sent with every bucket and checked (agent/transfer/digest.py)


def tp_sources(metas: list[TensorMeta], tp: int, *, fsdp: int = 1, tied: bool = False) -> list[list[TensorShard]]:
    return [trainer_layout(metas, tp_size=tp, tp_rank=r // fsdp, fsdp_size=fsdp, fsdp_rank=r % fsdp,
                           tie_word_embeddings=tied) for r in range(tp * fsdp)]


def tp_needs(metas: list[TensorMeta], tp: int, *, tied: bool = False) -> list[list[TensorShard]]:
    return [inference_layout(metas, tp, r, tie_word_embeddings=tied) for r in range(tp)]


class CorruptingTransport(Transport):
    """Wraps a receiving transport and flips one byte of every bucket it delivers (also of buckets
    fetched again) while `times` > 0 and the current version is the armed one: a bad wire."""

    def __init__(self, inner: GdrTransport, times: int) -> None:
        self.inner = inner
        self.times = times
        self.armed = False
        self.name = inner.name
        self.num_slots = inner.num_slots
        self.corrupted = 0

    def _maybe_corrupt(self, data: torch.Tensor) -> torch.Tensor:
        if self.armed and self.times > 0 and data.numel():
            self.times -= 1
            self.corrupted += 1
            data[data.numel() // 2] ^= 0x10
        return data

    def bind(self, ctx: TransportContext) -> None:
        self.inner.bind(ctx)

    def send_buffer(self, slot: int) -> torch.Tensor:
        return self.inner.send_buffer(slot)

    def start_send(self, bucket: Any, slot: int) -> Pending[None]:
        return self.inner.start_send(bucket, slot)

    def start_recv(self, bucket: Any, slot: int) -> Pending[torch.Tensor]:
        inner = self.inner.start_recv(bucket, slot)
        outer = self

        class _P(Pending[torch.Tensor]):
            def wait(self, timeout: float | None = None) -> torch.Tensor:
                return outer._maybe_corrupt(inner.wait(timeout))

        return _P()

    def start_recv_into(self, bucket: Any, slot: int, out: torch.Tensor) -> Pending[torch.Tensor] | None:
        inner = self.inner.start_recv_into(bucket, slot, out)
        if inner is None:
            return None
        outer = self

        class _P(Pending[torch.Tensor]):
            def wait(self, timeout: float | None = None) -> torch.Tensor:
                return outer._maybe_corrupt(inner.wait(timeout))

        return _P()

    def refetch(self, bucket: Any) -> torch.Tensor:
        return self._maybe_corrupt(self.inner.refetch(bucket))

    def release_recv(self, bucket: Any, slot: int) -> None:
        self.inner.release_recv(bucket, slot)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


def _hooks(scn: GdrScenario, transport: Any, digest: Digest | None = None) -> SyncHooks | None:
    check = ChecksumHooks(policy=RetryPolicy(retries=2), refetch=getattr(transport, "refetch", None)) \
        if scn.verify else None
    return DigestHooks(inner=check, digest=digest) if scn.digest else check


def _store(port: int, timeout: float) -> TCPStore:
    return TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout))


def _source(scn: GdrScenario, rank: int, port: int, out: Any) -> None:
    res: dict[str, Any] = {"role": "src", "rank": rank, "ok": False, "replicas": {}}
    try:
        store = _store(port, scn.timeout * 4)
        listener = LinkListener(HOST, 0, TOKEN)
        store.set(f"link/src{rank}", str(listener.port))
        plans = [build_plan(scn.sources, rep.needs, scn.bucket_bytes) for rep in scn.replicas]
        inbox: dict[int, queue.Queue[tuple[int, Mailbox]]] = {i: queue.Queue() for i in range(len(scn.replicas))}
        expected = sum(len(p.dsts_of(rank)) for p in plans)

        def accept() -> None:
            for _ in range(expected):
                mb = Mailbox(listener.accept(timeout=scn.timeout * 4))
                h, _ = mb.get("hello", timeout=scn.timeout)
                inbox[int(h["replica"])].put((int(h["dst"]), mb))

        threading.Thread(target=accept, daemon=True).start()
        errors: list[str] = []

        def serve(i: int) -> None:
            rep, plan = scn.replicas[i], plans[i]
            stats: list[dict[str, Any]] = []
            res["replicas"][i] = stats
            try:
                peers: dict[int, Mailbox] = {}
                for _ in plan.dsts_of(rank):
                    d, mb = inbox[i].get(timeout=scn.timeout * 4)
                    peers[d] = mb
                transport = GdrTransport(num_slots=scn.num_slots, delta=scn.delta)
                sender = WeightSender(plan, rank, transport, peers, timeout=scn.timeout, hooks=_hooks(scn, None))
                mine = {s.name: s for s in plan.sources[rank]} if rank < plan.num_src else {}
                staged: dict[str, torch.Tensor] | None = None
                if scn.arena:
                    layout = plan.arena("src", rank)
                    buf = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8)
                    staged = {e.name: entry_view(buf, e) for e in layout.entries}
                for v in rep.versions:
                    if i in scn.hold and scn.hold[i][0] == v:
                        _, other, ov = scn.hold[i]
                        store.wait([f"committed/{other}/{ov}"], timedelta(seconds=scn.timeout * 4))
                    tensors = {n: slice_of(full_tensor(n, s.dtype, s.global_shape, v, scn.change), s.box)
                               for n, s in mine.items()}
                    if staged is not None:  # the trainer publishes into its staging arena
                        for n, t in tensors.items():
                            staged[n].copy_(t)
                        tensors = staged
                    if not plan.dsts_of(rank):
                        continue
                    st = sender.send_version(v, tensors)
                    stats.append({**st.to_dict(), "transport": transport.describe()})
                    res.setdefault("direct_buckets", 0)
                    res["direct_buckets"] += st.direct_buckets
                transport.close()
            except BaseException as exc:
                errors.append(f"replica {i}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")

        threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(len(scn.replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            res["error"] = "; ".join(errors)
        else:
            res["ok"] = True
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["trace"] = traceback.format_exc()
    out.put(res)


def _destination(scn: GdrScenario, replica: int, rank: int, port: int, out: Any) -> None:
    res: dict[str, Any] = {"role": f"dst{replica}", "rank": rank, "ok": False, "committed": [], "checked": 0,
                           "mismatches": [], "failed": [], "stats": []}
    try:
        rep = scn.replicas[replica]
        store = _store(port, scn.timeout * 4)
        if rep.join_after is not None:
            other, ov = rep.join_after
            store.wait([f"committed/{other}/{ov}"], timedelta(seconds=scn.timeout * 4))
            res["joined_at"] = time.time()
        plan = build_plan(scn.sources, rep.needs, scn.bucket_bytes)
        peers: dict[int, Mailbox] = {}
        for s in plan.srcs_of(rank):
            sport = int(store.get(f"link/src{s}"))
            mb = Mailbox(connect(HOST, sport, TOKEN, timeout=scn.timeout))
            mb.send("hello", replica=replica, dst=rank)
            peers[s] = mb
        gdrs = {s: GdrTransport(num_slots=scn.num_slots, delta=scn.delta)
                for s in (plan.srcs_of(rank) if scn.routed else [0])}
        gdr: Transport = RoutingTransport(dict(gdrs)) if scn.routed else gdrs[0]
        transport: Transport = gdr
        corrupt = rep.corrupt.get(rank)
        if corrupt is not None:
            transport = CorruptingTransport(gdr, corrupt[1])
        digests: dict[int, Digest] = {}
        receiver = WeightReceiver(plan, rank, transport, peers, timeout=scn.timeout, hooks=_hooks(scn, transport))
        needs = {s.name: s for s in plan.needs[rank]}
        engine: dict[str, torch.Tensor] = {}  # the committed weights (engine stand-in)
        into: dict[str, torch.Tensor] | None = None
        if scn.arena:  # the agent's destination arena, loaded into the engine after each version
            layout = plan.arena("dst", rank)
            dbuf = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8)
            into = {e.name: entry_view(dbuf, e) for e in layout.entries}
        for v in rep.versions:
            if isinstance(transport, CorruptingTransport):
                transport.armed = corrupt is not None and corrupt[0] == v
            staged: dict[str, torch.Tensor] = {}

            def on_bucket(items: list[tuple[str, torch.Tensor]], staged: dict[str, torch.Tensor] = staged) -> None:
                for n, t in items:
                    if n in staged:
                        res["mismatches"].append(f"{n} handed twice")
                    staged[n] = t.clone()

            if scn.digest:
                digests[v] = Digest()
                receiver.hooks = _hooks(scn, transport, digests[v])
            try:
                st = receiver.receive_version(on_bucket, expected_version=v, into=into)
            except Exception as exc:
                res["failed"].append({"version": v, "error": f"{type(exc).__name__}: {exc}"})
                break  # links are poisoned after an abort; the agent would reconnect
            engine.update(staged)
            res["committed"].append(v)
            if v in digests:
                res.setdefault("digests", {})[v] = {"hex": digests[v].hex(), "leaves": digests[v].leaves}
            moved = [g.describe() for g in gdrs.values()]
            res["stats"].append({**st.to_dict(), "transport": {**moved[0], "refetches": sum(
                int(d["refetches"]) for d in moved)}})
            for n, s in needs.items():
                if not s.box.numel:
                    continue
                want = slice_of(full_tensor(n, s.dtype, s.global_shape, v, scn.change), s.box)
                if n not in engine or not same_bits(engine[n], want):
                    res["mismatches"].append(f"v{v}: {n} differs")
                res["checked"] += 1
            store.add(f"count/{replica}/{v}", 1)
            if int(store.add(f"count/{replica}/{v}", 0)) == len(rep.needs):
                store.set(f"committed/{replica}/{v}", "1")
        # what the engine serves at the end, for the "nothing committed" check
        last = res["committed"][-1] if res["committed"] else None
        res["serving"] = last
        if last is not None:
            res["serving_exact"] = all(
                same_bits(engine[n], slice_of(full_tensor(n, s.dtype, s.global_shape, last, scn.change), s.box))
                for n, s in needs.items() if s.box.numel
            )
        if isinstance(transport, CorruptingTransport):
            res["corrupted"] = transport.corrupted
        res["ok"] = True
        for g in gdrs.values():
            g.close()
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["trace"] = traceback.format_exc()
    out.put(res)


def _dump_path(key: tuple[str, int], pid: int) -> str:
    return f"/tmp/gdr-harness-{pid}-{key[0]}-{key[1]}.txt"


def _child(target: Any, key: tuple[str, int], *args: Any) -> None:
    """Run a process body with a stack dump on SIGUSR1 (the parent asks for it before killing a
    process that never reported, so a hang shows where it hangs)."""
    with open(_dump_path(key, os.getpid()), "w") as f:
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
        target(*args)


def run_gdr(scn: GdrScenario, deadline: float = 300.0) -> dict[tuple[str, int], dict[str, Any]]:
    """Run every source rank and every replica rank in its own process; return their reports."""
    # forkserver: children fork from a clean single-threaded server, never from the test process,
    # whose threads (TCPStore servers, mailboxes of earlier tests) could hold locks across a fork
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gdr_harness"])
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=deadline))
    out = ctx.Queue()
    procs: list[tuple[tuple[str, int], Any]] = []
    for r in range(len(scn.sources)):
        procs.append((("src", r), ctx.Process(target=_child, args=(_source, ("src", r), scn, r, store.port, out),
                                              daemon=True)))
    for i, rep in enumerate(scn.replicas):
        for r in range(len(rep.needs)):
            key = (f"dst{i}", r)
            procs.append((key, ctx.Process(target=_child, args=(_destination, key, scn, i, r, store.port, out),
                                           daemon=True)))
    for _, p in procs:
        p.start()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    end = time.monotonic() + deadline
    try:
        while len(results) < len(procs) and time.monotonic() < end:
            try:
                r = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for _, p in procs):
                    with contextlib.suppress(queue.Empty):
                        while True:
                            r = out.get(timeout=0.5)
                            results[(r["role"], r["rank"])] = r
                    break
                continue
            results[(r["role"], r["rank"])] = r
    finally:
        stacks: dict[tuple[str, int], str] = {}
        for key, p in procs:
            p.join(timeout=5)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(0.5)
                with contextlib.suppress(OSError), open(_dump_path(key, p.pid)) as f:
                    stacks[key] = f.read()
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
            with contextlib.suppress(OSError):
                os.unlink(_dump_path(key, p.pid or 0))
    for key, p in procs:
        results.setdefault(key, {"role": key[0], "rank": key[1], "ok": False,
                                 "error": f"no report; stacks:\n{stacks.get(key, '(none)')}"})
        results[key]["exitcode"] = p.exitcode
    return results


def assert_ok(results: dict[tuple[str, int], dict[str, Any]]) -> None:
    for key, r in sorted(results.items()):
        assert r["ok"], f"{key}: {r.get('error')}\n{r.get('trace', '')}"
        assert r.get("mismatches", []) == [], f"{key}: {r['mismatches'][:5]}"
        assert not r.get("failed"), f"{key}: {r['failed']}"
