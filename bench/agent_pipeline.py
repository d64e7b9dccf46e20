"""Agent pipeline benchmark: publish -> stage -> transfer -> engine load -> commit, through real processes.

    .venv/bin/python bench/agent_pipeline.py --mode nccl --size-mb 64 --versions 5 > bench/results/agent-pipeline-nccl.json
    .venv/bin/python bench/agent_pipeline.py --mode ipc  --size-mb 64 --versions 5 > bench/results/agent-pipeline-ipc.json

What runs: a trainer app (TrainerSession), its agent, an inference agent and a Custom engine app
(InferenceSession), each its own process on its own loopback IP (separated, NCCL over gloo), or one
colocated agent between the two apps (IPC over POSIX shared memory). No Kubernetes (the agents follow the
trainer's announcements). The trainer publishes version v+1 only after the engine committed v, so every
version is measured alone.

Per version: `publish_s` (TrainerSession.publish: the copy into staging + the agent's ack, i.e. how long
training is held), `commit_latency_s` (publish returned -> engine commit callback), `end_to_end_s`
(publish called -> commit), and the effective rate size / end_to_end. The last version's bytes are checked
bit for bit (sha256 of every tensor on both sides). NCCL mode then measures, in the same run and between
the same two pod addresses, the raw transport the product uses (a gloo group, the same bytes in the same
bucket sizes, real processes): `raw_s_p50` and `ratio` = raw / product (1.0: no overhead over the wire).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "agent_process"))


def _tensors(size_mb: int, count: int) -> dict[str, torch.Tensor]:
    per = max(1, (size_mb << 20) // 4 // count)
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def _commits(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out[int(d["version"])] = float(d["t"])
    return out


def run_trainer(size_mb: int, count: int, versions: int, log: Path, commits: Path) -> None:
    from weightsync.agent.client import TrainerSession, checksums

    weights = _tensors(size_mb, count)
    with TrainerSession() as s, log.open("a") as fh:
        for v in range(1, versions + 1):
            for t in weights.values():
                t.add_(1.0)
            t0 = time.time()
            s.publish(weights, v)
            t1 = time.time()
            sums = checksums(weights.items()) if v == versions else None
            fh.write(json.dumps({"version": v, "t_start": t0, "t_published": t1, "checksums": sums}) + "\n")
            fh.flush()
            deadline = time.time() + 300
            while v not in _commits(commits) and time.time() < deadline:
                time.sleep(0.005)
    threading.Event().wait()


def run_engine(size_mb: int, count: int, versions: int, out: Path) -> None:
    from weightsync.agent.client import InferenceSession, checksums

    params = {n: torch.empty_like(t) for n, t in _tensors(size_mb, count).items()}

    def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in tensors:
            params[n].copy_(t)

    def on_commit(version: int) -> None:
        t = time.time()
        if version == versions:  # written before the commit line the parent waits for
            (out.parent / f"engine-sums-{version}.json").write_text(json.dumps(checksums(params.items())))
        with out.open("a") as fh:
            fh.write(json.dumps({"version": version, "t": t}) + "\n")

    InferenceSession(on_bucket, on_commit).start()
    threading.Event().wait()


def run_raw(rank: int, ip: str, store_host: str, store_port: int, size_mb: int, bucket_mb: int, iters: int,
            out: Path) -> None:
    """The raw transport the NCCL-mode product path uses: a gloo group between the two pods' addresses,
    rank 0 sending the same bytes in the same bucket sizes to rank 1; rank 1 writes each iteration's time."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(store_host, store_port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    opts._timeout = datetime.timedelta(seconds=120)
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    total, step = size_mb << 20, bucket_mb << 20
    bufs = [torch.ones(min(step, total - o), dtype=torch.uint8) for o in range(0, total, step)]
    times = []
    for _ in range(iters + 1):  # the first one warms the connections up
        pg.barrier().wait()
        t0 = time.perf_counter()
        for b in bufs:
            (pg.send([b], 1, 0) if rank == 0 else pg.recv([b], 0, 0)).wait()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.write_text(json.dumps(times[1:]))
    pg.barrier().wait()


def raw_reference(c: Any, t: Any, i: Any, size_mb: int, bucket_mb: int, iters: int) -> list[float]:
    """Seconds per iteration of the raw gloo transfer between the same two pod addresses (real processes)."""
    from weightsync.e2e.procs import free_port

    me, out, port = str(Path(__file__).resolve()), c.root / "raw.json", free_port(t.ip)
    procs = [c.spawn(pod, f"raw{rank}", [sys.executable, me, "raw", "--rank", str(rank), "--ip", pod.ip,
                                         "--store", f"{t.ip}:{port}", "--size-mb", str(size_mb),
                                         "--bucket-mb", str(bucket_mb), "--iters", str(iters), "--out", str(out)])
             for rank, pod in ((0, t), (1, i))]
    for proc in procs:
        proc.wait(300)
    return [float(x) for x in json.loads(out.read_text())]


def run(mode: str, size_mb: int, count: int, versions: int, bucket_mb: int) -> dict[str, Any]:
    from podprocs import Cluster, wait_for
    from weightsync.crds import contract

    root = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    me = str(Path(__file__).resolve())
    if mode == "ipc":
        c = Cluster(root, mode="IPC", placement="Colocated", bucket_mb=bucket_mb)
        t = i = c.add_pod("bench-colocated-0", contract.ROLE_COLOCATED)
        pods = [t]
    else:
        c = Cluster(root, mode="NCCL", bucket_mb=bucket_mb)
        t = c.add_pod("bench-trainer-0", contract.ROLE_TRAINER)
        i = c.add_pod("bench-inference-0-0", contract.ROLE_INFERENCE)
        pods = [t, i]
    c.write_topology()
    commits, tlog = root / "commits.jsonl", root / "trainer.jsonl"
    try:
        for p in pods:
            c.start_agent(p, WEIGHTSYNC_LOG_LEVEL=os.environ.get("WEIGHTSYNC_LOG_LEVEL", "WARNING"))
        c.spawn(i, "engine", [sys.executable, me, "engine", "--size-mb", str(size_mb), "--count", str(count),
                              "--versions", str(versions), "--out", str(commits)])
        c.spawn(t, "trainer", [sys.executable, me, "trainer", "--size-mb", str(size_mb), "--count", str(count),
                               "--versions", str(versions), "--log", str(tlog), "--commits", str(commits)])
        wait_for(lambda: versions in _commits(commits), 120 + versions * size_mb / 10, "the last commit", c)
        pubs = {int(d["version"]): d for d in map(json.loads, tlog.read_text().splitlines())}
        done = _commits(commits)
        engine_sums = json.loads((root / f"engine-sums-{versions}.json").read_text())
        bit_exact = engine_sums == pubs[versions]["checksums"]
        if mode == "nccl":
            for p in pods:  # the agents are done: measure the raw transport alone on the same addresses
                c.kill(p, "agent")
            raw = raw_reference(c, t, i, size_mb, bucket_mb, max(versions - 1, 1))
    finally:
        c.stop_all()
    nbytes = sum(t.numel() * 4 for t in _tensors(size_mb, count).values())
    rows = []
    for v in range(1, versions + 1):
        p = pubs[v]
        rows.append({"version": v, "publish_s": p["t_published"] - p["t_start"],
                     "commit_latency_s": done[v] - p["t_published"], "end_to_end_s": done[v] - p["t_start"]})
    steady = rows[1:] or rows  # version 1 includes group creation and first-touch of shared memory
    e2e = [r["end_to_end_s"] for r in steady]
    return {
        "benchmark": "agent_pipeline", "mode": mode, "size_mb": size_mb, "tensors": count, "bytes": nbytes,
        "bucket_mb": bucket_mb, "versions": versions, "bit_exact": bit_exact,
        "publish_s_p50": statistics.median(r["publish_s"] for r in steady),
        "commit_latency_s_p50": statistics.median(r["commit_latency_s"] for r in steady),
        "end_to_end_s_p50": statistics.median(e2e), "end_to_end_s_max": max(e2e),
        "effective_gbps_p50": nbytes / statistics.median(e2e) / 1e9,
        "first_version_end_to_end_s": rows[0]["end_to_end_s"],
        **({"raw_s_p50": statistics.median(raw), "raw_gbps_p50": nbytes / statistics.median(raw) / 1e9,
            "ratio": statistics.median(raw) / statistics.median(e2e)} if mode == "nccl" else {}),
        "per_version": rows,
        "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
        "note": "CPU only, shared machine (see load_avg_1m); steady-state figures exclude version 1",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    rp = sub.add_parser("raw")
    for flag, kind in (("--rank", int), ("--ip", str), ("--store", str), ("--size-mb", int), ("--bucket-mb", int),
                       ("--iters", int), ("--out", str)):
        rp.add_argument(flag, type=kind, required=True)
    for name in ("trainer", "engine"):
        sp = sub.add_parser(name)
        sp.add_argument("--size-mb", type=int, required=True)
        sp.add_argument("--count", type=int, required=True)
        sp.add_argument("--versions", type=int, required=True)
        if name == "trainer":
            sp.add_argument("--log", required=True)
            sp.add_argument("--commits", required=True)
        else:
            sp.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("nccl", "ipc"), default="nccl")
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--count", type=int, default=64, help="number of tensors")
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=16)
    a = p.parse_args()
    if a.cmd == "trainer":
        run_trainer(a.size_mb, a.count, a.versions, Path(a.log), Path(a.commits))
    elif a.cmd == "raw":
        host, port = a.store.rsplit(":", 1)
        run_raw(a.rank, a.ip, host, int(port), a.size_mb, a.bucket_mb, a.iters, Path(a.out))
    elif a.cmd == "engine":
        run_engine(a.size_mb, a.count, a.versions, Path(a.out))
    else:
        print(json.dumps(run(a.mode, a.size_mb, a.count, a.versions, a.bucket_mb), indent=1))


if __name__ == "__main__":
    main()
