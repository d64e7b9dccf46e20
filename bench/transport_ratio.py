"""Benchmark: N MB through the agent path and through the raw transport under it, in the same run.

    python bench/transport_ratio.py --transport {ipc,nccl} --size-mb N \
        [--trainer-tp A --inference-tp B] [--fsdp K] [--bucket-mb M] [--json]

Every trainer and inference rank is a separate process (forkserver). The agent path is the real one:
plan, WeightSender -> Transport -> WeightReceiver over authenticated links. Each trainer rank's
tensors sit in one staging buffer laid out by `plan.arena` (what the trainer agent's staging holds;
shared memory for IPC), and each inference rank receives into its destination tensors (`into=`, laid
out the same way), or with `--load callback` gets views and copies them like an engine would.

The raw path moves the same bytes per (source, destinations) stream with no plan, no packing and no
control traffic: torch.distributed send/recv (one destination) or broadcast (several) for nccl, gloo
on CPU; for IPC one memcpy from the trainer's pre-mapped shared staging into the destination (the
physical floor: the agent also needs exactly one copy there); on CUDA a device-to-device copy. Agent
and raw rounds alternate (after warm-up rounds that form groups and fault pages in) and each is timed
from a common barrier to the last rank's end; medians are reported. The agent's result is verified
bit for bit against the trainer's tensors. One JSON object is printed.

Extensible: other modules register transports (`register_bench`) and options (`register_option`); every
module in PLUGINS (next to this file) is imported at start so it can do so (gdr, --verify, delta).
Benchmark code lives in bench/, out of the product package; run it as a script (`make bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout
from weightsync.agent.plan import Box, TensorShard, TransferPlan, build_plan
from weightsync.agent.plan.buckets import BucketLayout, entry_view, itemsize, to_dtype
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import SyncHooks
from weightsync.agent.transports.base import Transport
from weightsync.agent.wire.link import LinkListener, Mailbox, connect

# Plugins sit next to this file (on sys.path unless PYTHONSAFEPATH is set).
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
PLUGINS = ("transport_ratio_extras",)

MiB = 1 << 20
HOST = "127.0.0.1"
TOKEN = "weightsync-bench-token"
_PERIOD = 1048573  # prime: the synthetic byte pattern never lines up with a row or tensor boundary


@dataclass
class BenchConfig:
    """Everything a worker process needs (picklable)."""

    transport: str
    size_mb: int
    trainer_tp: int = 1
    inference_tp: int = 1
    fsdp: int = 1
    bucket_mb: int = 512
    warmup: int = 1
    iters: int = 5
    device: str = "cpu"
    load: str = "into"
    staging: str = "arena"
    timeout: float = 600.0
    hooks_factory: Callable[[], SyncHooks] | None = None
    transport_factory: Callable[[BenchConfig, Any], Transport] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_src(self) -> int:
        return self.trainer_tp * self.fsdp

    @property
    def num_dst(self) -> int:
        return self.inference_tp


# -- registry -------------------------------------------------------------------------------------------
BenchFn = Callable[[BenchConfig], dict[str, Any]]
#: transport name -> function running the whole benchmark for it and returning the JSON fields.
BENCHES: dict[str, BenchFn] = {}
#: (add arguments to the parser, apply parsed args to the config) pairs from plugins.
OPTIONS: list[tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, BenchConfig], None]]] = []


def register_bench(name: str, fn: BenchFn) -> None:
    """Make `--transport name` run `fn(config)`."""
    BENCHES[name] = fn


def register_option(
    add: Callable[[argparse.ArgumentParser], None], apply: Callable[[argparse.Namespace, BenchConfig], None]
) -> None:
    """Add command-line options (`add(parser)`) and fold them into the config (`apply(args, config)`)."""
    OPTIONS.append((add, apply))


def load_plugins() -> None:
    """Import every PLUGINS module so it can register transports and options."""
    for name in PLUGINS:
        importlib.import_module(name)


# -- the synthetic model ----------------------------------------------------------------------------
def model_metas(size_mb: int, hidden: int = 1024, vocab: int = 8192) -> list[TensorMeta]:
    """A Llama-shaped bf16 model of about `size_mb` MiB (every dim divides by 8 for TP)."""
    while hidden > 64 and 32 * hidden * hidden + 4 * vocab * hidden > size_mb * MiB:
        hidden //= 2
        vocab //= 2
    layer_bytes = 32 * hidden * hidden
    layers = max(1, round((size_mb * MiB - 4 * vocab * hidden) / layer_bytes))
    m = [TensorMeta("model.embed_tokens.weight", "bfloat16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        m += [TensorMeta(f"{p}.input_layernorm.weight", "bfloat16", (hidden,))]
        m += [TensorMeta(f"{p}.self_attn.{n}_proj.weight", "bfloat16", (hidden, hidden)) for n in "qkvo"]
        m += [TensorMeta(f"{p}.mlp.{n}_proj.weight", "bfloat16", (4 * hidden, hidden)) for n in ("gate", "up")]
        m += [TensorMeta(f"{p}.mlp.down_proj.weight", "bfloat16", (hidden, 4 * hidden))]
    m += [TensorMeta("model.norm.weight", "bfloat16", (hidden,)), TensorMeta("lm_head.weight", "bfloat16",
                                                                              (vocab, hidden))]
    return m


def layouts(cfg: BenchConfig, metas: list[TensorMeta]) -> tuple[list[list[TensorShard]], list[list[TensorShard]]]:
    k = cfg.fsdp
    sources = [trainer_layout(metas, tp_size=cfg.trainer_tp, tp_rank=r // k, fsdp_size=k, fsdp_rank=r % k)
               for r in range(cfg.num_src)]
    needs = [inference_layout(metas, cfg.inference_tp, r) for r in range(cfg.num_dst)]
    return sources, needs


def _pattern() -> torch.Tensor:
    g = torch.Generator().manual_seed(20260521)
    return torch.randint(0, 256, (_PERIOD,), dtype=torch.uint8, generator=g)


def synth_full(pattern: torch.Tensor, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The trainer's full tensor: a prime-period random byte pattern at a per-name phase."""
    nbytes = math.prod(shape) * itemsize(dtype)
    phase = zlib.crc32(name.encode()) % _PERIOD
    reps = (phase + nbytes) // _PERIOD + 1
    raw = pattern.repeat(reps)[phase : phase + nbytes].clone()  # clone: an aligned start for the dtype view
    return raw.view(to_dtype(dtype)).reshape(shape)


def _arena(layout: BucketLayout, device: str, shm_path: str | None = None) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:
    """One buffer holding a rank's tensors in the plan's arena layout (like the agent's staging
    segment): in shared memory when `shm_path` is given. Returns (buffer, owner handle, views)."""
    owner: Any = None
    if shm_path is not None:
        from weightsync.agent.transports.ipc import _ShmSegment

        owner = _ShmSegment(shm_path, max(layout.nbytes, 1), create=True)
        flat = owner.tensor
    else:
        flat = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=device)
    views = {e.name: entry_view(flat, e) for e in layout.entries}
    return flat, owner, views


# -- worker processes ---------------------------------------------------------------------------------
def _barrier(store: Any, name: str, world: int) -> None:
    if store.add(name, 1) == world:
        store.set(f"{name}/go", "1")
    store.wait([f"{name}/go"])


def _sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _links(cfg: BenchConfig, plan: TransferPlan, role: str, rank: int, store: Any) -> dict[int, Mailbox]:
    peers: dict[int, Mailbox] = {}
    if role == "src":
        listener = LinkListener(HOST, 0, TOKEN)
        store.set(f"link/src{rank}", str(listener.port))
        for _ in plan.dsts_of(rank):
            mb = Mailbox(listener.accept(timeout=cfg.timeout))
            h, _ = mb.get("hello", timeout=cfg.timeout)
            peers[int(h["dst"])] = mb
    else:
        for s in plan.srcs_of(rank):
            mb = Mailbox(connect(HOST, int(store.get(f"link/src{s}")), TOKEN, timeout=cfg.timeout))
            mb.send("hello", dst=rank)
            peers[s] = mb
    return peers


def _make_transport(cfg: BenchConfig, store: Any) -> Transport:
    if cfg.transport_factory is not None:
        return cfg.transport_factory(cfg, store)
    if cfg.transport == "ipc":
        from weightsync.agent.transports.ipc import IpcTransport

        return IpcTransport(prefix="weightsync-bench", close_each_bucket=bool(cfg.extra.get("ipc_close_each_bucket")))
    from weightsync.agent.transports.nccl import NcclTransport

    return NcclTransport(store, host=HOST, timeout=cfg.timeout)


def _report(run: Callable[..., dict[str, Any]], cfg: Any, role: str, rank: int, port: int, out: Any) -> None:
    """A worker process: `run(cfg, role, rank, store_port)`'s result, or its error and trace, to the parent."""
    if os.environ.get("WEIGHTSYNC_BENCH_DEBUG"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["WEIGHTSYNC_BENCH_DEBUG"]), exit=True)
    res: dict[str, Any] = {"role": role, "rank": rank}
    try:
        res.update(run(cfg, role, rank, port))
    except BaseException as exc:  # reported to the parent, which fails the run with it
        import traceback

        res["error"] = f"{type(exc).__name__}: {exc}"
        res["trace"] = traceback.format_exc()
    out.put(res)


def _run_worker(cfg: BenchConfig, role: str, rank: int, port: int) -> dict[str, Any]:
    from weightsync.agent.transports.nccl import make_store

    # One intra-op thread: copies are memory-bound, and OpenMP barriers on a busy 2-core machine cost
    # far more than they gain. (Agent processes should do the same.)
    torch.set_num_threads(1)
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(0)
    store = make_store(HOST, port, is_master=False, timeout=cfg.timeout)
    world = cfg.num_src + cfg.num_dst
    metas = model_metas(cfg.size_mb)
    sources, needs = layouts(cfg, metas)
    plan = build_plan(sources, needs, cfg.bucket_mb * MiB)
    pattern = _pattern()
    mine = sources[rank] if role == "src" else needs[rank]
    shm_path = None
    if role == "src" and cfg.transport == "ipc" and not cfg.device.startswith("cuda"):
        # named like the transport's own segments so a crashed run's leftovers are cleaned up next time
        shm_path = f"/dev/shm/weightsync-bench-{os.getpid()}-{os.urandom(4).hex()}-s9"
    flat, owner, views = _arena(plan.arena(role, rank), cfg.device, shm_path)
    if cfg.staging == "separate":  # every tensor its own allocation: the sender packs, the receiver copies
        views = {s.name: torch.empty(s.box.shape, dtype=to_dtype(s.dtype), device=cfg.device) for s in mine}
    if role == "src":
        for s in mine:
            full = synth_full(pattern, s.name, s.dtype, s.global_shape)
            views[s.name].copy_(full[s.box.slices_within(Box.full(s.global_shape))])
            del full
    else:
        flat.zero_()
    peers = _links(cfg, plan, role, rank, store)
    transport = _make_transport(cfg, store)
    if owner is not None and hasattr(transport, "register_shared"):
        transport.register_shared(owner.path, flat)  # the staged tensors are shareable: no pack
    hooks = cfg.hooks_factory() if cfg.hooks_factory else None
    # The raw path is set up once, then agent and raw rounds alternate, so load drift on a shared
    # machine hits both alike.
    _barrier(store, "raw-setup", world)
    raw_step, raw_close = _raw(cfg, plan, role, rank, store, flat, peers, world, owner)
    times: list[tuple[float, float]] = []
    raw_times: list[tuple[float, float]] = []
    stats: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    last = cfg.warmup + cfg.iters - 1
    if role == "src":
        sender = WeightSender(plan, rank, transport, peers, device=cfg.device, timeout=cfg.timeout, hooks=hooks)
    else:
        receiver = WeightReceiver(plan, rank, transport, peers, device=cfg.device, timeout=cfg.timeout, hooks=hooks)

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            views[name].copy_(t)

    for v in range(cfg.warmup + cfg.iters):
        if role == "dst":
            for t in views.values():
                t.zero_()
        _barrier(store, f"agent{v}", world)
        t0 = time.time()
        if role == "src":
            st = sender.send_version(v, views)
        elif cfg.load == "into":
            st = receiver.receive_version(None, expected_version=v, into=views)
        else:
            st = receiver.receive_version(load, expected_version=v)
        _sync_device(cfg.device)
        times.append((t0, time.time()))
        stats.append(st.to_dict())
        if role == "dst" and v == last:
            result.update(_verify(pattern, mine, views))
        raw_times.append(raw_step(v))
    result.update({"agent_times": times[cfg.warmup :], "agent_stats": stats[-1],
                   "raw_times": raw_times[cfg.warmup :]})
    raw_close()
    transport.close()
    if owner is not None:
        del views, flat
        owner.close()
        owner.unlink()
    return result


def _verify(pattern: torch.Tensor, mine: list[TensorShard], views: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every received tensor, bit for bit, against the trainer's full tensor sliced to this rank."""
    bad = []
    for s in mine:
        want = synth_full(pattern, s.name, s.dtype, s.global_shape)[s.box.slices_within(Box.full(s.global_shape))]
        got = views[s.name]
        if not torch.equal(got.contiguous().view(-1).view(torch.uint8).cpu(), want.contiguous().view(-1).view(torch.uint8)):
            bad.append(s.name)
    return {"bit_exact": not bad, "mismatched": bad[:5], "verified_tensors": len(mine)}


RawStep = Callable[[int], tuple[float, float]]


def _streams(plan: TransferPlan) -> list[tuple[int, tuple[int, ...], int]]:
    """(src, dsts, bytes) per stream of the plan, in first-bucket order."""
    sizes: dict[tuple[int, tuple[int, ...]], int] = {}
    for b in plan.buckets:
        sizes[(b.src, b.dsts)] = sizes.get((b.src, b.dsts), 0) + b.nbytes
    return [(s, d, n) for (s, d), n in sizes.items()]


def _raw(cfg: BenchConfig, plan: TransferPlan, role: str, rank: int, store: Any, flat: torch.Tensor,
         peers: dict[int, Mailbox], world: int, staging: Any = None) -> tuple[RawStep, Callable[[], None]]:
    """Set up the raw path; returns (one timed round for version v, cleanup)."""
    streams = [st for st in _streams(plan) if (st[0] == rank if role == "src" else rank in st[1])]
    total = sum(n for _, _, n in streams)
    buf = flat if flat.numel() >= total else torch.empty(total, dtype=torch.uint8, device=cfg.device)
    if cfg.transport == "ipc" or (cfg.transport_factory is not None and cfg.extra.get("raw") == "ipc"):
        return _raw_ipc(cfg, role, rank, store, buf, streams, peers, world, staging)
    return _raw_dist(cfg, role, rank, store, buf, streams, world)


def _raw_dist(cfg: BenchConfig, role: str, rank: int, store: Any, buf: torch.Tensor,
              streams: list[tuple[int, tuple[int, ...], int]], world: int) -> tuple[RawStep, Callable[[], None]]:
    """torch.distributed send/recv (one destination) or broadcast (several) of each stream's bytes."""
    import datetime

    import torch.distributed as dist

    groups = []
    for s, dsts, n in streams:  # plan order everywhere: deadlock-free group creation
        prefix = dist.PrefixStore(f"raw/src{s}-dst{'.'.join(map(str, dsts))}/", store)
        me = 0 if role == "src" else 1 + dsts.index(rank)
        if cfg.device.startswith("cuda"):
            pg: Any = dist.ProcessGroupNCCL(prefix, me, 1 + len(dsts), dist.ProcessGroupNCCL.Options())
        else:
            gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            gopts._timeout = datetime.timedelta(seconds=cfg.timeout)
            pg = dist.ProcessGroupGloo(prefix, me, 1 + len(dsts), gopts)
        groups.append((dsts, n, pg, me))

    def step(v: int) -> tuple[float, float]:
        _barrier(store, f"raw{v}", world)
        t0 = time.time()
        works, off = [], 0
        for dsts, n, pg, me in groups:
            view = buf[off : off + n]
            off += n
            if len(dsts) > 1:
                bo = dist.BroadcastOptions()
                bo.rootRank = 0
                works.append(pg.broadcast([view], bo))
            elif me == 0:
                works.append(pg.send([view], 1, 0))
            else:
                works.append(pg.recv([view], 0, 0))
        for w in works:
            w.wait()
        _sync_device(cfg.device)
        return t0, time.time()

    return step, lambda: None


def _raw_ipc(cfg: BenchConfig, role: str, rank: int, store: Any, buf: torch.Tensor,
             streams: list[tuple[int, tuple[int, ...], int]], peers: dict[int, Mailbox],
             world: int, staging: Any) -> tuple[RawStep, Callable[[], None]]:
    """The bar for IPC: one memcpy of the same bytes from the trainer's (shared, pre-mapped) staging
    memory into the destination buffer, no protocol. On CUDA: a device-to-device copy."""
    if cfg.device.startswith("cuda"):
        other = torch.empty_like(buf)

        def cuda_step(v: int) -> tuple[float, float]:
            _barrier(store, f"raw{v}", world)
            torch.cuda.synchronize()
            t0 = time.time()
            if role == "dst":
                other.copy_(buf)
            torch.cuda.synchronize()
            return t0, time.time()

        return cuda_step, lambda: None
    from weightsync.agent.transports.ipc import _ShmSegment

    maps: dict[int, _ShmSegment] = {}
    if role == "src":
        for d in sorted({d for _, dsts, _ in streams for d in dsts}):
            peers[d].send("raw.stage", path=staging.path, size=staging.nbytes)
    else:
        for s in sorted({s for s, _, _ in streams}):
            h, _ = peers[s].get("raw.stage", timeout=cfg.timeout)
            maps[s] = _ShmSegment(h["path"], int(h["size"]), create=False)

    def step(v: int) -> tuple[float, float]:
        _barrier(store, f"raw{v}", world)
        t0 = time.time()
        if role == "dst":
            off = 0
            for s, _dsts, n in streams:
                src_mem = maps[s].tensor
                assert src_mem is not None
                n = min(n, src_mem.numel())
                buf[off : off + n].copy_(src_mem[:n])
                off += n
        return t0, time.time()

    def close() -> None:
        for m in maps.values():
            m.close()

    return step, close


# -- the parent -------------------------------------------------------------------------------------
def _span(results: list[dict[str, Any]], key: str, i: int) -> float:
    return max(r[key][i][1] for r in results) - min(r[key][i][0] for r in results)


def run_workers(cfg: Any, run: Callable[..., dict[str, Any]], preload: list[str]) -> list[dict[str, Any]]:
    """One forkserver process per source and destination rank running `run(cfg, role, rank, store_port)`;
    their reports (its result, or its error and trace). The first error stops the wait (the others would wait for its rank until their
    timeout); any error or a missing report raises with every worker's message and trace."""
    from weightsync.agent.transports.nccl import make_store

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "weightsync.agent.transfer.send", "weightsync.agent.transfer.receive",
                                  "weightsync.agent.layout.rules", *preload])
    store = make_store(HOST, 0, is_master=True, timeout=cfg.timeout)
    out = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(run, cfg, "src", r, store.port, out), daemon=True)
             for r in range(cfg.num_src)]
    procs += [ctx.Process(target=_report, args=(run, cfg, "dst", r, store.port, out), daemon=True)
              for r in range(cfg.num_dst)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + cfg.timeout
    try:
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1.0))
                if "error" in results[-1]:
                    break
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    break
    finally:
        failed = any("error" in r for r in results)
        for p in procs:
            p.join(timeout=0.1 if failed else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = [f"{r['role']}{r['rank']}: {r['error']}\n{r.get('trace', '')}" for r in results if "error" in r]
    if errors or len(results) < len(procs):
        raise RuntimeError("benchmark worker failed: " + ("\n".join(errors) or "a worker died without a report"))
    return results


def run_processes(cfg: BenchConfig) -> dict[str, Any]:
    """Run the agent and raw phases with one process per rank; return the JSON fields."""
    metas = model_metas(cfg.size_mb)
    sources, needs = layouts(cfg, metas)
    plan = build_plan(sources, needs, cfg.bucket_mb * MiB)
    results = run_workers(cfg, _run_worker, ["weightsync.agent.transports.ipc", "weightsync.agent.transports.nccl"])
    delivered = plan.delivered_bytes()
    agent_s = [_span(results, "agent_times", i) for i in range(cfg.iters)]
    raw_s = [_span(results, "raw_times", i) for i in range(cfg.iters)]
    agent = statistics.median(agent_s)
    raw = statistics.median(raw_s)
    # rounds alternate agent, raw: the ratio of each adjacent pair cancels most load drift
    paired = statistics.median(r / a for a, r in zip(agent_s, raw_s, strict=True))
    dst_stats = [r["agent_stats"] for r in results if r["role"] == "dst"]
    src_stats = [r["agent_stats"] for r in results if r["role"] == "src"]
    return {
        "transport": cfg.transport,
        "device": cfg.device,
        "size_mb": cfg.size_mb,
        "model_bytes": sum(math.prod(m.shape) * itemsize(m.dtype) for m in metas),
        "bytes_delivered": delivered,
        "trainer_tp": cfg.trainer_tp,
        "inference_tp": cfg.inference_tp,
        "fsdp": cfg.fsdp,
        "bucket_mb": cfg.bucket_mb,
        "buckets": len(plan.buckets),
        "tensors": len(metas),
        "plan_hash": plan.hash,
        "iters": cfg.iters,
        "agent_seconds": agent,
        "raw_seconds": raw,
        "agent_seconds_all": agent_s,
        "raw_seconds_all": raw_s,
        "agent_gbps": delivered / agent / 1e9,
        "raw_gbps": delivered / raw / 1e9,
        "ratio": paired,
        "ratio_of_medians": raw / agent,
        "bit_exact": all(r.get("bit_exact", True) for r in results),
        "mismatched": [n for r in results for n in r.get("mismatched", [])][:5],
        "sender_pack_seconds": max((s["pack_seconds"] for s in src_stats), default=0.0),
        "sender_wait_seconds": max((s["wait_seconds"] for s in src_stats), default=0.0),
        "receiver_wait_seconds": max((s["wait_seconds"] for s in dst_stats), default=0.0),
        "receiver_load_seconds": max((s["load_seconds"] for s in dst_stats), default=0.0),
        "load": cfg.load,
        "staging": cfg.staging,
        "ipc_close_each_bucket": bool(cfg.extra.get("ipc_close_each_bucket")),
        "sender_direct_buckets": sum(s.get("direct_buckets", 0) for s in src_stats),
        "receiver_direct_buckets": sum(s.get("direct_buckets", 0) for s in dst_stats),
        "handshake_seconds": max((s["handshake_seconds"] for s in dst_stats + src_stats), default=0.0),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


register_bench("ipc", run_processes)
register_bench("nccl", run_processes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/transport_ratio.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", required=True, help=f"one of: {', '.join(sorted(BENCHES))}")
    p.add_argument("--size-mb", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--trainer-tp", type=int, default=1)
    p.add_argument("--inference-tp", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=1, help="FSDP Shard(0) ranks per trainer TP rank")
    p.add_argument("--bucket-mb", type=int, default=512, help="bucketSizeMB (default 512, the WeightSyncJob default)")
    p.add_argument("--warmup", type=int, default=1, help="untimed versions first (groups, page faults)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed rounds (agent and raw alternate); medians are reported, ratio is the median of "
                        "the per-round raw/agent ratios")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--load", choices=("into", "callback"), default="into",
                   help="receiver writes into the destination tensors (into) or hands views to a callback "
                        "that copies them (callback)")
    p.add_argument("--staging", choices=("arena", "separate"), default="arena",
                   help="trainer tensors and destination tensors in one buffer laid out by the plan (arena: "
                        "zero-copy where possible) or each in its own allocation (separate: pack + copy)")
    p.add_argument("--ipc-close-each-bucket", action="store_true",
                   help="IPC readers unmap every handle before releasing its bucket (strict mode)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    for add, _ in OPTIONS:
        add(p)
    return p


def main(argv: list[str] | None = None) -> int:
    load_plugins()
    args = build_parser().parse_args(argv)
    if args.transport not in BENCHES:
        print(f"unknown transport {args.transport!r}; available: {', '.join(sorted(BENCHES))}", file=sys.stderr)
        return 2
    cfg = BenchConfig(args.transport, args.size_mb, args.trainer_tp, args.inference_tp, args.fsdp, args.bucket_mb,
                      args.warmup, args.iters, args.device, args.load, args.staging, args.timeout)
    cfg.extra["ipc_close_each_bucket"] = args.ipc_close_each_bucket
    for _, apply in OPTIONS:
        apply(args, cfg)
    result = BENCHES[args.transport](cfg)
    if not args.json:
        print(f"{cfg.transport}: agent {result['agent_gbps']:.2f} GB/s, raw {result['raw_gbps']:.2f} GB/s, "
              f"ratio {result['ratio']:.3f}, bit_exact={result['bit_exact']}", file=sys.stderr)
    print(json.dumps(result))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0 if result.get("bit_exact") else 1


if __name__ == "__main__":
    # Run the imported module's main so worker functions pickle as transport_ratio._run_worker (importable in the
    # forkserver's children: they get this process's sys.path), not as __main__._run_worker.
    from transport_ratio import main as _main

    sys.exit(_main())
