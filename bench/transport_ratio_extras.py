"""Bench plugins (loaded by bench/transport_ratio.py): `--transport gdr`, `--verify`, `--delta-fraction F`.

    python bench/transport_ratio.py --transport gdr --size-mb 1024 [--prefetch K] [--verify]
    python bench/transport_ratio.py --transport gdr --size-mb 256 --delta-fraction 0.05
    python bench/transport_ratio.py --transport ipc --size-mb 256 --verify

gdr: the agent path (plan, WeightSender -> GdrTransport -> WeightReceiver, loading every tensor) and a raw
NIXL READ of the same bytes per (source, destinations) stream, same processes, same NIXL/UCX setup, no
plan, packing or control messages. JSON adds agent_gbps, raw_gbps, ratio (raw seconds / agent seconds),
bit_exact, and the transport's counters.

--verify: turns on verify: Checksum for the agent path of any transport and adds the checksum throughput
of this machine (`verify_gbps`, xxh3_64 over a 256 MiB host buffer).

--delta-fraction F (gdr): every timed version changes F of the trainer's 16-bit words at random places
(an optimizer step); the transport sends deltas where they pay. JSON adds `wire_fraction` (bytes read /
bytes of the full buckets, timed versions only) and checks bit-exactness through per-bucket checksums
plus, where the trainer and inference layouts are identical, a checksum of every tensor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import transport_ratio as bench
from transport_ratio import BenchConfig, MiB, register_bench, register_option

from weightsync.agent.plan import Box, TransferPlan, build_plan
from weightsync.agent.transfer import verify
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.agent.transports.gdr import GdrTransport
from weightsync.agent.transports.nixl_endpoint import Backoff, NixlEndpoint, desc_of, mem_of
from weightsync.agent.wire.link import Mailbox

_CHECKSUM_BENCH_BYTES = 256 * MiB


def _mutate(flat: torch.Tensor, fraction: float, seed: int) -> None:
    """Change `fraction` of the 16-bit words of `flat` (random places, random new bits)."""
    words = flat[: flat.numel() // 2 * 2].view(torch.int16)
    k = int(words.numel() * fraction)
    if k <= 0:
        return
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, words.numel(), (k,), generator=g)
    words[idx] = words[idx] ^ torch.randint(1, 1 << 14, (k,), generator=g, dtype=torch.int16)


def _transport(cfg: BenchConfig) -> GdrTransport:
    frac = cfg.extra.get("delta_fraction")
    delta = DeltaConfig(max_changed_fraction=float(cfg.extra.get("delta_max", 0.25))) if frac else None
    return GdrTransport(num_slots=int(cfg.extra.get("prefetch", 2)), delta=delta)


def _run(cfg: BenchConfig, role: str, rank: int, port: int) -> dict[str, Any]:
    from weightsync.agent.transports.nccl import make_store

    store = make_store(bench.HOST, port, is_master=False, timeout=cfg.timeout)
    world = cfg.num_src + cfg.num_dst
    metas = bench.model_metas(cfg.size_mb)
    sources, needs = bench.layouts(cfg, metas)
    plan = build_plan(sources, needs, cfg.bucket_mb * MiB)
    pattern = bench._pattern()
    mine = sources[rank] if role == "src" else needs[rank]
    # the trainer's staging and the inference destination both in the plan's arena layout (zero-copy)
    flat, _owner, views = bench._arena(plan.arena(role, rank), cfg.device)
    if role == "src":
        for s in mine:
            full = bench.synth_full(pattern, s.name, s.dtype, s.global_shape)
            views[s.name].copy_(full[s.box.slices_within(Box.full(s.global_shape))])
            del full
    else:
        flat.zero_()
    peers = bench._links(cfg, plan, role, rank, store)
    transport = _transport(cfg)
    frac = float(cfg.extra.get("delta_fraction") or 0.0)
    checked = bool(cfg.extra.get("verify")) or frac > 0
    hooks = verify.ChecksumHooks(refetch=transport.refetch if role == "dst" else None) if checked else None
    times: list[tuple[float, float]] = []
    stats: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    versions = cfg.warmup + cfg.iters
    if role == "src":
        sender = WeightSender(plan, rank, transport, peers, device=cfg.device, timeout=cfg.timeout, hooks=hooks)
        for v in range(versions):
            if frac and v > 0:
                _mutate(flat, frac, 1000 * rank + v)
            bench._barrier(store, f"agent{v}", world)
            t0 = time.time()
            st = sender.send_version(v, views)
            times.append((t0, time.time()))
            stats.append(st.to_dict())
            counters.append(dict(transport.stats.to_dict()))
    else:
        receiver = WeightReceiver(plan, rank, transport, peers, device=cfg.device, timeout=cfg.timeout, hooks=hooks)

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in items:
                views[name].copy_(t)

        for v in range(versions):
            if not frac:
                flat.zero_()
            bench._barrier(store, f"agent{v}", world)
            t0 = time.time()
            if cfg.load == "into":
                st = receiver.receive_version(None, expected_version=v, into=views)
            else:
                st = receiver.receive_version(load, expected_version=v)
            times.append((t0, time.time()))
            stats.append(st.to_dict())
            counters.append(dict(transport.stats.to_dict()))
    result: dict[str, Any] = {"agent_times": times[cfg.warmup :], "agent_stats": stats[-1],
                              "describe": transport.describe()}
    base = counters[cfg.warmup - 1] if cfg.warmup else {"full_bytes": 0, "wire_bytes": 0}
    result["timed_full_bytes"] = counters[-1]["full_bytes"] - base["full_bytes"]
    result["timed_wire_bytes"] = counters[-1]["wire_bytes"] - base["wire_bytes"]
    result.update(_check(cfg, role, rank, store, mine, views, pattern, frac))
    transport.close()
    bench._barrier(store, "raw-setup", world)
    result["raw_times"] = _raw_read(cfg, plan, role, rank, store, flat, peers, world)
    return result


def _check(cfg: BenchConfig, role: str, rank: int, store: Any, mine: list[Any], views: dict[str, torch.Tensor],
           pattern: torch.Tensor, frac: float) -> dict[str, Any]:
    """Bit-exactness: against the synthetic tensors, or (delta runs, whose trainer tensors drift) against
    the trainer's own per-tensor checksums where the boxes coincide."""
    def key(s: Any) -> str:
        return f"ck/{s.name}/{s.box.offset}/{s.box.shape}"

    def digest(t: torch.Tensor) -> str:
        return verify.checksum(t.contiguous().reshape(-1).view(torch.uint8).cpu())

    if role == "src":
        if frac:
            for s in mine:
                store.set(key(s), digest(views[s.name]))
        bench._barrier(store, "checked", cfg.num_src + cfg.num_dst)
        return {}
    bench._barrier(store, "checked", cfg.num_src + cfg.num_dst)
    bad, compared = [], 0
    for s in mine:
        if frac:
            if not store.check([key(s)]):
                continue
            ok = store.get(key(s)).decode() == digest(views[s.name])
        else:
            want = bench.synth_full(pattern, s.name, s.dtype, s.global_shape)[s.box.slices_within(
                Box.full(s.global_shape))]
            ok = torch.equal(views[s.name].contiguous().view(-1).view(torch.uint8).cpu(),
                             want.contiguous().view(-1).view(torch.uint8))
        compared += 1
        if not ok:
            bad.append(s.name)
    return {"bit_exact": not bad, "mismatched": bad[:5], "compared": compared}


def _raw_read(cfg: BenchConfig, plan: TransferPlan, role: str, rank: int, store: Any, flat: torch.Tensor,
              peers: dict[int, Mailbox], world: int) -> list[tuple[float, float]]:
    """Raw NIXL: each destination READs the bytes of its streams from the source's registered buffer,
    in bucket-sized descriptors of one request per stream, all posted at once."""
    streams = [st for st in bench._streams(plan) if (st[0] == rank if role == "src" else rank in st[1])]
    total = sum(n for _, _, n in streams)
    buf = flat if flat.numel() >= total else torch.empty(max(total, 1), dtype=torch.uint8, device=cfg.device)
    nx = NixlEndpoint()
    reg = nx.register([buf])
    chunk = cfg.bucket_mb * MiB
    times: list[tuple[float, float]] = []
    try:
        if role == "src":
            md = nx.metadata()
            for d, mb in peers.items():
                mb.send("raw.hello", md, agent=nx.name, desc=list(desc_of(buf)), mem=mem_of(buf)[0], dst=d)
        else:
            remotes: dict[int, tuple[str, tuple[int, int, int], str]] = {}
            for s, mb in peers.items():
                h, payload = mb.get("raw.hello", timeout=cfg.timeout)
                name = nx.load_remote(str(h["agent"]), bytes(payload))
                a, n, dev = h["desc"]
                remotes[s] = (name, (int(a), int(n), int(dev)), str(h["mem"]))
        for i in range(cfg.warmup + cfg.iters):
            bench._barrier(store, f"raw{i}", world)
            t0 = time.time()
            if role == "src":
                for mb in peers.values():
                    mb.get("raw.done", timeout=cfg.timeout, match={"i": i})
            else:
                _read_streams(nx, remotes, streams, buf, chunk, cfg.timeout)
                for mb in peers.values():
                    mb.send("raw.done", i=i)
            times.append((t0, time.time()))
    finally:
        nx.deregister(reg)
        nx.close()
    return times[cfg.warmup :]


def _read_streams(nx: NixlEndpoint, remotes: dict[int, tuple[str, tuple[int, int, int], str]],
                  streams: list[tuple[int, tuple[int, ...], int]], buf: torch.Tensor, chunk: int,
                  timeout: float) -> None:
    ag = nx.agent
    mem, dev = mem_of(buf)
    handles = []
    off = 0
    for src, _dsts, n in streams:
        name, (raddr, _rlen, rdev), rmem = remotes[src]
        local, remote = [], []
        for c in range(0, n, chunk):
            k = min(chunk, n - c)
            local.append((int(buf.data_ptr()) + off + c, k, dev))
            remote.append((raddr + c, k, rdev))
        off += n
        h = ag.initialize_xfer("READ", ag.get_xfer_descs(local, mem), ag.get_xfer_descs(remote, rmem), name)
        state = ag.transfer(h)
        if state == "ERR":
            raise RuntimeError(f"raw NIXL READ from {name} failed to start")
        handles.append(h)
    deadline = time.monotonic() + timeout
    pending = list(handles)
    pause = Backoff()  # the same polling policy as the transport
    while pending:
        pause()
        if time.monotonic() > deadline:
            raise RuntimeError("raw NIXL READ timed out")
        left = []
        for h in pending:
            st = ag.check_xfer_state(h)
            if st == "ERR":
                raise RuntimeError("raw NIXL READ failed")
            if st == "PROC":
                left.append(h)
        pending = left
    for h in handles:
        ag.release_xfer_handle(h)


def run_gdr(cfg: BenchConfig) -> dict[str, Any]:
    """Run the GDR agent and raw NIXL phases with one process per rank; return the JSON fields."""
    metas = bench.model_metas(cfg.size_mb)
    sources, needs = bench.layouts(cfg, metas)
    plan = build_plan(sources, needs, cfg.bucket_mb * MiB)
    results = bench.run_workers(cfg, _run, ["weightsync.agent.transports.gdr"])
    delivered = plan.delivered_bytes()
    agent_s = [bench._span(results, "agent_times", i) for i in range(cfg.iters)]
    raw_s = [bench._span(results, "raw_times", i) for i in range(cfg.iters)]
    agent, raw = statistics.median(agent_s), statistics.median(raw_s)
    dsts = [r for r in results if r["role"] == "dst"]
    full = sum(r["timed_full_bytes"] for r in dsts)
    wire = sum(r["timed_wire_bytes"] for r in dsts)
    out_json: dict[str, Any] = {
        "transport": "gdr",
        "device": cfg.device,
        "size_mb": cfg.size_mb,
        "bytes_delivered": delivered,
        "trainer_tp": cfg.trainer_tp,
        "inference_tp": cfg.inference_tp,
        "fsdp": cfg.fsdp,
        "bucket_mb": cfg.bucket_mb,
        "buckets": len(plan.buckets),
        "prefetch": int(cfg.extra.get("prefetch", 2)),
        "load": cfg.load,
        "direct_buckets_sender": sum(r["agent_stats"].get("direct_buckets", 0) for r in results if r["role"] == "src"),
        "direct_buckets_receiver": sum(r["agent_stats"].get("direct_buckets", 0) for r in dsts),
        "iters": cfg.iters,
        "agent_seconds": agent,
        "raw_seconds": raw,
        "agent_seconds_all": agent_s,
        "raw_seconds_all": raw_s,
        "agent_gbps": delivered / agent / 1e9,
        "raw_gbps": delivered / raw / 1e9,
        "ratio": raw / agent,
        "bit_exact": all(r.get("bit_exact", True) for r in results),
        "compared": sum(r.get("compared", 0) for r in dsts),
        "mismatched": [n for r in results for n in r.get("mismatched", [])][:5],
        "ucx_tls": os.environ.get("UCX_TLS") or dsts[0]["describe"].get("ucx_tls"),
        "verify": bool(cfg.extra.get("verify")),
        "delta_fraction": cfg.extra.get("delta_fraction"),
        "receiver": dsts[0]["describe"],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    if cfg.extra.get("delta_fraction"):
        out_json["wire_fraction"] = wire / full if full else 0.0
        out_json["wire_bytes"] = wire
        out_json["full_bytes"] = full
    return out_json


register_bench("gdr", run_gdr)


def _add(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gdr / verify / delta (bench/transport_ratio_extras.py)")
    g.add_argument("--verify", action="store_true", help="verify: Checksum on the agent path; adds verify_gbps")
    g.add_argument("--delta-fraction", type=float, default=None,
                   help="gdr: change this fraction of the trainer's words per version; adds wire_fraction")
    g.add_argument("--prefetch", type=int, default=2, help="gdr: buckets read ahead (K)")


def _with_verify_gbps(fn: Any) -> Any:
    def run(cfg: BenchConfig) -> dict[str, Any]:
        result = fn(cfg)
        tp = verify.throughput(_CHECKSUM_BENCH_BYTES, verify.XXH3)
        result.update(verify=True, verify_algorithm=tp["algorithm"], verify_gbps=tp["gbps"])
        return result

    return run


def _apply(args: argparse.Namespace, cfg: BenchConfig) -> None:
    cfg.extra["prefetch"] = args.prefetch
    if args.delta_fraction is not None:
        if cfg.transport != "gdr":
            raise SystemExit("--delta-fraction needs --transport gdr (deltas ride the GDR transport)")
        if not 0 < args.delta_fraction < 1:
            raise SystemExit("--delta-fraction must be between 0 and 1")
        cfg.extra["delta_fraction"] = args.delta_fraction
    if args.verify:
        cfg.extra["verify"] = True
        if cfg.transport != "gdr":
            cfg.hooks_factory = verify.ChecksumHooks
        name = cfg.transport
        if name in bench.BENCHES:
            bench.BENCHES[name] = _with_verify_gbps(bench.BENCHES[name])


register_option(_add, _apply)
