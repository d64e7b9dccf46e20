"""Agent pipeline benchmark: publish -> stage -> transfer -> engine load -> commit, through real processes.

    .venv/bin/python bench/agent_pipeline.py --mode {nccl,ipc,gdr} --size-mb N \
        [--fsdp A [--dp R] --inference-tp B] [--bucket-mb M] [--versions V] \
        [--staging {version,ring} [--depth D] [--snapshot {auto,copy,none}]] [--device {cpu,cuda}] [--no-raw] \
        [--replicas N [--fan-out {direct,relay}]] [--trainer-egress-gbps G] [--tensors N] --json

What runs is what a pod runs: `--fsdp A` x `--dp R` trainer processes (TrainerSession, each publishing its FSDP
Shard(0) chunk of a Llama-shaped bf16 model), their agent, an inference agent and `--inference-tp B`
Custom engine processes (InferenceSession, each loading its TP shard), every agent and app its own
process on its own loopback "pod" address (separated pods: NCCL over gloo, or GDR over NIXL/UCX), or one
colocated pod (IPC over POSIX shared memory, A == B). No Kubernetes: the agents follow the trainer's
announcements. The trainers publish version v+1 only after every engine rank committed v, so every version
is measured alone. `--replicas N` runs N such inference pods (one replica each); `--fan-out relay` sets
spec.transfer.fanOut Relay on every agent (agent/transfer/relay.py): the replicas fetching a version are chained and the
trainer sends it once. `--trainer-egress-gbps G` caps what leaves the trainer pod's address at G Gbit/s (an htb
class on the loopback device, for the agents and the raw reference alike; needs root and `tc`), as a trainer
node's NIC caps it: on loopback nothing else is the bottleneck that fan-out removes.

`--device cuda` puts the trainers' weights, the engines' parameters and the agents' transport buffers
(WEIGHTSYNC_AGENT_DEVICE) on GPUs: the trainer pod on GPU 0, the inference pod on GPU 1 where there is one
(ProcessGroupNCCL needs a GPU per rank: `--mode nccl --device cuda` needs two), else GPU 0 too (IPC: one
colocated pod; GDR: NIXL between two processes on one GPU).

Then, in the same run and between the same pods, the raw transport with the same bytes in the same bucket
sizes: gloo send/recv (nccl; ProcessGroupNCCL with --device cuda), NIXL READ (gdr, of GPU memory with
--device cuda), and for ipc a writer process copying into a shared-memory file and a reader process copying it
out (the two copies any hand-off through shared memory needs; with --device cuda a CUDA IPC buffer).

`--tensors N` spreads the same bytes over N tensors shaped like an MoE model (moe_metas: experts of equal size plus
two large dense tensors), and runs the same bench again at 256 tensors in the same invocation: the difference is
what each tensor costs (`per_tensor_overhead_us`). Without it, the Llama-shaped model has about 251 tensors per GiB.
A `--tensors` run takes 10 versions unless --versions says otherwise (else 6): versions 2 and 3 stage into new
segments whose pages the trainer's copy faults in, and with 6 versions the median of versions 2-6 was the slowest
steady version, not a typical one, in each of the two runs the slope compares.

JSON fields (steady state: version 1 excluded, it forms groups, faults pages in and learns the layout):
  end_to_end_s       p50 of first publish call -> last engine rank committed
  trainer_blocked_s  p50 of the longest TrainerSession.publish (how long training is held)
  publish_skew_s     p50 of the first -> last trainer rank's publish call (the ranks leave their step together,
                     as FSDP ranks do; what is left is process scheduling on shared cores)
  raw_s, ratio       the raw transport's p50 seconds and raw / end_to_end (1.0: the product adds nothing)
  copies_per_byte    bytes copied in memory besides the wire and the engine's own load, per model byte and
                     version, counted by the agents (weightsync_agent_copied_bytes_total, all stages)
  peak_staging_bytes the agents' staging memory high-water mark (weightsync_agent_staging_peak_bytes), summed;
                     `peak_staging_bytes_by_pod` per agent (it includes the first version, staged before the
                     trainer knows the plan); `staging_bytes_at_end_by_pod`: what each agent holds after the
                     last version (weightsync_agent_staging_bytes), the steady state
  staging, depth     whole-version staging (the default) or the ring of DEPTH bucket slots (agent/staging/ring.py)
  snapshot_bytes     ring: memory the trainers hold as snapshots of the last version (device memory on GPUs;
                     0 when the trainer is held instead: CPU tensors with --snapshot auto or none)
  bit_exact          every engine rank's tensors equal the trainer's last version, byte for byte
  replicas, fan_out  inference replicas, and how they are fed (direct: the trainer sends to each; relay: a chain)
  trainer_egress_gbps  the cap on the trainer pod's egress (null: none)
  tensors            the model's tensors (--tensors N, else the Llama shapes')
  engine_calls       p50 of the calls the agents made into the engine ranks per version (on_bucket + on_pieces,
                     every rank and replica), against `buckets`: the buckets the inference agents received per
                     version (weightsync_agent_received_buckets_total)
  per_tensor_overhead_us  with --tensors: the slope of end_to_end_s over the tensor count at fixed bytes, from this
                     run and one at 256 tensors (`base`: its figures; `ratio_at_base`: its ratio), each scaled to
                     this run's bytes; `trainer_blocked_per_tensor_us`: the same for trainer_blocked_s;
                     `same_raw`: both runs' ratios against one raw reference, the median of both runs' raw samples
                     (`raw_samples_s`; the raw transport moves the same bytes in the same buckets in both, so
                     its run-to-run scatter is noise, not a difference between them), and their difference
                     `ratio_gap`
  trainer_sent_per_byte  bytes the trainer agent sent per model byte and version (what leaves the trainer pod:
                     N with direct fan-out to N replicas, 1 with relay); `relayed_per_byte`: bytes the inference
                     agents forwarded per model byte and version (N - 1 with relay)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
for _p in (BENCH_DIR, REPO / "tests" / "agent_process"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MiB = 1 << 20
RAW_ITERS = 3


# -- the model ------------------------------------------------------------------------------------------
def model(size_mb: int, tensors: int | None = None) -> list[Any]:
    """The Llama-shaped model of `size_mb` MiB (about 251 tensors per GiB), or, with `tensors`, an MoE-shaped one of
    about the same bytes in exactly that many tensors (moe_metas)."""
    from transport_ratio import model_metas

    return model_metas(size_mb) if tensors is None else moe_metas(size_mb, tensors)


MOE_HIDDEN = 256       # the experts' hidden size (a multiple of 8: every TP rule divides)
MOE_EXPERTS = 128      # experts per layer, as Qwen3-30B-A3B
MOE_DENSE_SHARE = 8    # 1/8 of the bytes in the dense tensors (embed_tokens, lm_head), the rest in experts


def moe_metas(size_mb: int, tensors: int) -> list[Any]:
    """`tensors` bf16 tensors of about `size_mb` MiB shaped like an MoE model: two large dense ones (embed_tokens and
    lm_head, 1/16 of the bytes each), one norm, and experts of equal size (gate/up: intermediate x hidden,
    down: hidden x intermediate; MOE_EXPERTS per layer), so that the bytes stay put as the tensor count moves and
    only the per-tensor cost changes. Every TP rule divides by 8."""
    from weightsync.agent.layout.rules import TensorMeta

    if tensors < 6:
        raise SystemExit("--tensors: at least 6 (the dense tensors and one expert)")
    h = MOE_HIDDEN
    total = size_mb * MiB // 2  # elements
    n_exp = tensors - 3
    inter = max(8, total * (MOE_DENSE_SHARE - 1) // MOE_DENSE_SHARE // n_exp // h // 8 * 8)
    vocab = max(8, (total - n_exp * inter * h - h) // 2 // h // 8 * 8)  # the dense ones take what rounding left
    m = [TensorMeta("model.embed_tokens.weight", "bfloat16", (vocab, h)),
         TensorMeta("model.norm.weight", "bfloat16", (h,))]
    for k in range(n_exp):
        layer, rest = divmod(k, 3 * MOE_EXPERTS)
        e, j = divmod(rest, 3)
        proj = ("gate_proj", "up_proj", "down_proj")[j]
        shape = (h, inter) if proj == "down_proj" else (inter, h)
        m.append(TensorMeta(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", "bfloat16", shape))
    m.append(TensorMeta("lm_head.weight", "bfloat16", (vocab, h)))
    return m


_PATTERN: list[torch.Tensor] = []


def full_tensor(meta: Any) -> torch.Tensor:
    """The trainer's full tensor before version 1 (a cheap deterministic byte pattern, made once per process: at
    16,384 tensors, making it per tensor took minutes)."""
    from transport_ratio import _pattern, synth_full

    if not _PATTERN:
        _PATTERN.append(_pattern())
    return synth_full(_PATTERN[0], meta.name, meta.dtype, meta.shape)


def advance(t: torch.Tensor, versions: int = 1) -> None:
    """What one training step does to a tensor here: every 16-bit word + 1 (exact, wraps)."""
    t.view(torch.int16).add_(versions)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _committed(run: Path, version: int, ranks: int, replica: int | None = None) -> bool:
    """Whether `ranks` engine ranks committed `version` (of one replica, or counted over all of them)."""
    done = {(d.get("replica", 0), d["rank"]) for d in _read_jsonl(run / "commits.jsonl")
            if d["version"] == version and (replica is None or d.get("replica", 0) == replica)}
    return len(done) >= ranks


# -- app processes -------------------------------------------------------------------------------------
def run_trainer(run: Path, rank: int, fsdp: int, size_mb: int, versions: int, snapshot: str = "auto",
                dp: int = 1, device: str = "cpu", tensors: int | None = None) -> None:
    """Trainer rank `rank` of `fsdp` x `dp` (HSDP: `dp` replicas of an FSDP group of `fsdp`): its shard is FSDP
    chunk rank % fsdp, which the ranks of the other replicas hold too."""
    from weightsync.agent.client import PlacedShard, TrainerSession
    from weightsync.agent.layout.rules import trainer_layout
    from weightsync.agent.plan import Box

    metas = model(size_mb, tensors)
    by_name = {m.name: m for m in metas}  # a search per shard was 16,384^2 comparisons, seconds before version 1
    weights: dict[str, Any] = {}
    for s in trainer_layout(metas, fsdp_size=fsdp, fsdp_rank=rank % fsdp):
        meta = by_name[s.name]
        local = full_tensor(meta)[s.box.slices_within(Box.full(s.global_shape))].clone().to(device)
        weights[s.name] = PlacedShard(local, s.global_shape, s.box.offset)
    prof = None
    if os.environ.get("BENCH_PROFILE"):  # a developer's look at where publish spends its time (cProfile)
        import cProfile

        prof = cProfile.Profile()
    with TrainerSession(rank=rank, ring_snapshot=snapshot) as session, \
            (run / f"trainer-{rank}.jsonl").open("a") as fh:
        for v in range(1, versions + 1):
            while not (run / f"go-{v}").exists():
                time.sleep(0.002)
            for w in weights.values():
                advance(w.tensor)
            # FSDP ranks leave an optimizer step together (it ends with a collective): publish together too, so
            # that end_to_end_s measures the transfer, not how far apart two processes finished their step
            # on shared cores (publish_skew_s shows what is left)
            (run / f"stepped-{v}-{rank}").touch()
            while not all((run / f"stepped-{v}-{r}").exists() for r in range(fsdp * dp)):
                time.sleep(0.0005)
            t0 = time.time()
            if device != "cpu":
                torch.cuda.synchronize(device)  # the step's kernels are done before the clock starts
            if prof is not None and v > 1:
                prof.enable()
            res = session.publish(weights, v)
            if prof is not None and v > 1:
                prof.disable()
                prof.dump_stats(os.environ["BENCH_PROFILE"] + f"/trainer-{rank}.prof")
            fh.write(json.dumps({"rank": rank, "version": v, "t_start": t0, "t_published": time.time(),
                                 "streamed": res.streamed, "served": res.served}) + "\n")
            fh.flush()
        threading.Event().wait()  # ring staging with a snapshot: the session streams the last version


def run_engine(run: Path, rank: int, tp: int, size_mb: int, versions: int, device: str = "cpu",
               replica: int = 0, tensors: int | None = None) -> None:
    from weightsync.agent.client import InferenceSession
    from weightsync.agent.layout.rules import inference_layout
    from weightsync.agent.plan import Box
    from weightsync.agent.staging.copies import copy_all

    metas = model(size_mb, tensors)
    by_name = {m.name: m for m in metas}
    needs = inference_layout(metas, tp, rank)
    params = {s.name: torch.empty(s.box.shape, dtype=getattr(torch, s.dtype), device=device) for s in needs}
    calls: dict[int, int] = {}  # version -> calls the agent made into this engine rank (on_bucket + on_pieces)

    def loaded() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)  # the engine's load is done before the agent reuses the buffer

    def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        calls[version] = calls.get(version, 0) + 1
        # the engine's own load, a bucket at a time (one foreach call on CPU, as an engine loads a flat bucket;
        # one copy each on CUDA, see agent/staging/copies.py)
        copy_all([params[n] for n, _ in tensors], [t for _, t in tensors])
        loaded()

    def on_pieces(version: int, pieces: list[tuple[str, tuple[slice, ...], torch.Tensor]]) -> None:
        calls[version] = calls.get(version, 0) + 1
        # the engine's own load, of tensors that arrive in pieces: each piece into its place, one foreach call
        copy_all([params[n][index] for n, index, _ in pieces], [t for _, _, t in pieces])
        loaded()

    def check() -> None:
        """The last version, bit for bit, once every engine rank committed it (a check while another rank is
        still loading would take its cores and slow the version being measured)."""
        while not _committed(run, versions, tp, replica):
            time.sleep(0.01)
        bad = []
        for s in needs:
            want = full_tensor(by_name[s.name])[s.box.slices_within(
                Box.full(s.global_shape))].clone()
            advance(want, versions)
            if not torch.equal(want.view(torch.int16), params[s.name].cpu().view(torch.int16)):
                bad.append(s.name)
        tmp = run / f"exact-{replica}-{rank}.json.tmp"
        tmp.write_text(json.dumps({"bit_exact": not bad, "mismatched": bad[:5], "tensors": len(needs)}))
        tmp.replace(run / f"exact-{replica}-{rank}.json")  # the parent never reads half a file

    def on_commit(version: int) -> None:
        with (run / "commits.jsonl").open("a") as fh:
            fh.write(json.dumps({"replica": replica, "rank": rank, "version": version, "t": time.time(),
                                 "engine_calls": calls.get(version, 0)}) + "\n")
        if version == versions:  # the engine is committed: nothing changes `params` any more
            threading.Thread(target=check, daemon=True).start()

    InferenceSession(on_bucket, on_commit, rank=rank, on_pieces=on_pieces).start()
    threading.Event().wait()


# -- a trainer NIC ---------------------------------------------------------------------------------------
class EgressCap:
    """Packets from `ip` on the loopback device leave at most at `gbps` (htb; everything else unlimited)."""

    def __init__(self, ip: str, gbps: float | None) -> None:
        self.ip, self.gbps = ip, gbps

    def _tc(self, *args: str, check: bool = True) -> None:
        import subprocess

        res = subprocess.run(["tc", *args], capture_output=True, text=True)
        if check and res.returncode != 0:
            raise SystemExit(f"--trainer-egress-gbps: `tc {' '.join(args)}` failed: {res.stderr.strip()} "
                             "(needs root and the sch_htb / cls_u32 kernel modules)")

    def __enter__(self) -> EgressCap:
        if self.gbps:
            self._tc("qdisc", "del", "dev", "lo", "root", check=False)
            self._tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "99")
            self._tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:99", "htb", "rate", "400gbit")
            rate = f"{int(self.gbps * 1000)}mbit"
            self._tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate)
            self._tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                     "ip", "src", f"{self.ip}/32", "flowid", "1:10")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.gbps:
            self._tc("qdisc", "del", "dev", "lo", "root", check=False)


# -- raw transports --------------------------------------------------------------------------------------
def _store(addr: str, rank: int) -> Any:
    import torch.distributed as dist

    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), 2, rank == 0, timeout=datetime.timedelta(seconds=120))


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    return [(o, min(step, total - o)) for o in range(0, total, step)]


def _barrier(store: Any, name: str) -> None:
    if store.add(name, 1) == 2:
        store.set(f"{name}/go", "1")
    store.wait([f"{name}/go"])


def run_raw(kind: str, rank: int, ip: str, store_addr: str, nbytes: int, bucket: int, iters: int, out: Path,
            device: str = "cpu") -> None:
    """Rank 0 (trainer pod) -> rank 1 (inference pod): `nbytes` in `bucket`-sized pieces, `iters` timed
    rounds after one warm-up; rank 1 writes the seconds of each round. `device`: where the buffers live."""
    store = _store(store_addr, rank)
    if device != "cpu":
        torch.cuda.set_device(device)
        raw = {"nccl": _raw_nccl, "gdr": _raw_nixl, "ipc": _raw_cuda_ipc}[kind]
    else:
        raw = {"nccl": _raw_gloo, "gdr": _raw_nixl, "ipc": _raw_shm}[kind]
    times = raw(store, rank, ip, nbytes, bucket, iters, out, device)
    if rank == 1:
        out.write_text(json.dumps(times))
        store.set("bye", "1")
    else:
        store.wait(["bye"])  # rank 0 hosts the store: it leaves last


def _raw_gloo(store: Any, rank: int, ip: str, nbytes: int, bucket: int, iters: int, out: Path,
              device: str = "cpu") -> list[float]:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    opts._timeout = datetime.timedelta(seconds=120)
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    bufs = [torch.ones(n, dtype=torch.uint8) for _, n in _chunks(nbytes, bucket)]
    times = []
    for _ in range(iters + 1):
        pg.barrier().wait()
        t0 = time.perf_counter()
        for b in bufs:
            (pg.send([b], 1, 0) if rank == 0 else pg.recv([b], 0, 0)).wait()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _raw_nccl(store: Any, rank: int, ip: str, nbytes: int, bucket: int, iters: int, out: Path,
              device: str = "cpu") -> list[float]:
    """ProcessGroupNCCL send/recv between the two pods' GPUs, from and into GPU memory."""
    import torch.distributed as dist

    pg: Any = dist.ProcessGroupNCCL(store, rank, 2)  # type: ignore[call-arg]  # options default
    bufs = [torch.ones(n, dtype=torch.uint8, device=device) for _, n in _chunks(nbytes, bucket)]
    times = []
    for _ in range(iters + 1):
        pg.barrier().wait()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for b in bufs:
            (pg.send([b], 1, 0) if rank == 0 else pg.recv([b], 0, 0)).wait()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _handoff(store: Any, rank: int, shm: torch.Tensor, mine: torch.Tensor, bucket: int, iters: int,
             sync: Callable[[], None] | None = None) -> list[float]:
    """The double-buffered hand-off both ipc references time: the writer (rank 0) copies each bucket of
    `mine` into slot k % 2 of `shm`, the reader copies it out of its own mapping; `sync` (CUDA) runs after
    each copy, before the other side is told."""
    times = []
    for i in range(iters + 1):
        _barrier(store, f"it{i}")
        t0 = time.perf_counter()
        for k, (o, n) in enumerate(_chunks(mine.numel(), bucket)):
            slot = shm[(k % 2) * bucket:(k % 2) * bucket + n]
            if rank == 0:
                if k >= 2:
                    store.wait([f"r{i}/{k - 2}"])
                slot.copy_(mine[o:o + n])
            else:
                store.wait([f"w{i}/{k}"])
                mine[o:o + n].copy_(slot)
            if sync is not None:
                sync()
            store.set(f"{'w' if rank == 0 else 'r'}{i}/{k}", "1")
        times.append(time.perf_counter() - t0)
    _barrier(store, "handoff-done")  # the writer's buffer outlives the reader's mapping
    return times[1:]


def _raw_cuda_ipc(store: Any, rank: int, ip: str, nbytes: int, bucket: int, iters: int, out: Path,
                  device: str = "cpu") -> list[float]:
    """`_raw_shm` on the GPU: the hand-off through a CUDA IPC buffer of two slots, its handle opened by the
    reader's own process; each side synchronises before it signals."""
    from weightsync.agent.transports.ipc import _cuda_handle, _open_cuda

    if rank == 0:
        shm = torch.empty(2 * bucket, dtype=torch.uint8, device=device)
        store.set("handle", json.dumps(_cuda_handle(shm)))
    else:
        shm = _open_cuda(json.loads(store.get("handle")), 2 * bucket, torch.device(device))
    mine = torch.ones(nbytes, dtype=torch.uint8, device=device)
    return _handoff(store, rank, shm, mine, bucket, iters, sync=lambda: torch.cuda.synchronize(device))


def _raw_shm(store: Any, rank: int, ip: str, nbytes: int, bucket: int, iters: int, out: Path,
             device: str = "cpu") -> list[float]:
    """Writer copies each bucket into a shared-memory file, the reader (own mapping, own process) copies
    it out: two slots, like a double-buffered hand-off."""
    path = Path("/dev/shm") / f"{out.parent.name}-raw-shm"  # memory-backed, like the pod's staging volume
    if rank == 0:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 2 * bucket)
        os.close(fd)
    _barrier(store, "shm-made")
    shm = torch.from_file(str(path), shared=True, size=2 * bucket, dtype=torch.uint8)
    times = _handoff(store, rank, shm, torch.ones(nbytes, dtype=torch.uint8), bucket, iters)
    if rank == 0:
        path.unlink()
    return times


def _raw_nixl(store: Any, rank: int, ip: str, nbytes: int, bucket: int, iters: int, out: Path,
              device: str = "cpu") -> list[float]:
    """The reader READs the writer's registered buffer (host or GPU memory) in bucket-sized descriptors, one
    request."""
    from transport_ratio_extras import _read_streams

    from weightsync.agent.transports.nixl_endpoint import NixlEndpoint, configure_ucx, desc_of, mem_of

    configure_ucx()
    buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    nx = NixlEndpoint()
    reg = nx.register([buf])
    times = []
    try:
        if rank == 0:
            store.set("md", nx.metadata())
            store.set("desc", json.dumps({"agent": nx.name, "desc": list(desc_of(buf)), "mem": mem_of(buf)[0]}))
        else:
            d = json.loads(store.get("desc"))
            name = nx.load_remote(str(d["agent"]), bytes(store.get("md")))
            a, n, dev = d["desc"]
            remotes = {0: (name, (int(a), int(n), int(dev)), str(d["mem"]))}
        for i in range(iters + 1):
            _barrier(store, f"it{i}")
            t0 = time.perf_counter()
            if rank == 1:
                _read_streams(nx, remotes, [(0, (1,), nbytes)], buf, bucket, 120.0)
                if device != "cpu":
                    torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            _barrier(store, f"done{i}")
    finally:
        nx.deregister(reg)
        nx.close()
    return times[1:]


# -- the run -----------------------------------------------------------------------------------------------
_METRIC = re.compile(r'^(weightsync_agent_[a-z_]+?)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every weightsync_agent_* sample at `url`/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[f"{m.group(1)}{{{m.group(2) or ''}}}"] = float(m.group(3))
    return out


def settled(urls: list[str], timeout: float = 10.0) -> list[dict[str, float]]:
    """Scrapes of every agent once their copy counters stopped moving: an agent counts a version's copies
    after the engine committed it, so a scrape right at the commit can miss the last version's counts."""
    last = [scrape(u) for u in urls]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        time.sleep(0.3)
        now = [scrape(u) for u in urls]
        if copied_bytes(now) == copied_bytes(last):
            return now
        last = now
    return last


def copied_bytes(samples: list[dict[str, float]]) -> dict[str, float]:
    return summed(samples, "weightsync_agent_copied_bytes_total", "stage")


def summed(samples: list[dict[str, float]], metric: str, *labels: str) -> dict[str, float]:
    """A counter summed over every agent's scrape, by the values of `labels` (joined by '/')."""
    out: dict[str, float] = {}
    for s in samples:
        for key, v in s.items():
            if key.startswith(metric + "{"):
                k = "/".join(key.split(f'{label}="', 1)[1].split('"', 1)[0] for label in labels)
                out[k] = out.get(k, 0.0) + v
    return out


def run(mode: str, size_mb: int, fsdp: int, tp: int, bucket_mb: int, versions: int, staging: str = "version",
        depth: int = 2, snapshot: str = "auto", with_raw: bool = True, dp: int = 1,
        device: str = "cpu", threads_per_rank: int | None = None, replicas: int = 1,
        fan_out: str = "direct", trainer_egress_gbps: float | None = None,
        tensors: int | None = None) -> dict[str, Any]:
    from podprocs import Cluster, wait_for

    from weightsync.crds import contract
    from weightsync.e2e.procs import free_port

    if mode == "ipc" and dp != 1:
        raise SystemExit("--dp: the separated modes only (nccl, gdr)")
    if mode == "ipc" and replicas != 1:
        raise SystemExit("--replicas: the separated modes only (nccl, gdr)")
    if fan_out == "relay" and mode == "ipc":
        raise SystemExit("--fan-out relay: --mode nccl or gdr (spec.transfer.fanOut Relay is between pods)")
    if mode == "ipc" and fsdp != tp:
        raise SystemExit("--mode ipc runs one colocated pod whose trainer and engine ranks are the same GPUs: "
                         f"--fsdp ({fsdp}) must equal --inference-tp ({tp})")
    trainer_dev, inference_dev = pod_devices(mode, device)
    metas = model(size_mb, tensors)
    model_bytes = sum(int(torch.Size(m.shape).numel()) * 2 for m in metas)
    run_dir = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    me = str(Path(__file__).resolve())
    if mode == "ipc":
        c = Cluster(run_dir, mode="IPC", placement="Colocated", bucket_mb=bucket_mb)
        t = i = c.add_pod("bench-colocated-0", contract.ROLE_COLOCATED, ranks=list(range(fsdp)))
        pods = [t]
    else:
        c = Cluster(run_dir, mode=mode.upper(), bucket_mb=bucket_mb)
        t = c.add_pod("bench-trainer-0", contract.ROLE_TRAINER, ranks=list(range(fsdp * dp)))
        infs = [c.add_pod(f"bench-inference-{k}-0", contract.ROLE_INFERENCE, ranks=list(range(tp)), replica=k)
                for k in range(replicas)]
        i = infs[0]
        pods = [t, *infs]
        if fan_out == "relay":
            c.extra_env[contract.ENV_FAN_OUT] = "Relay"
    c.write_topology()
    common = ["--run", str(run_dir), "--size-mb", str(size_mb), "--versions", str(versions),
              *(["--tensors", str(tensors)] if tensors else [])]
    scrapes: list[list[dict[str, float]]] = []
    cap = EgressCap(t.ip, trainer_egress_gbps).__enter__()
    try:
        for p in pods:
            c.start_agent(p, WEIGHTSYNC_LOG_LEVEL=os.environ.get("WEIGHTSYNC_LOG_LEVEL", "WARNING"),
                          WEIGHTSYNC_STAGING=staging, WEIGHTSYNC_STAGING_DEPTH=str(depth),
                          **{contract.ENV_AGENT_DEVICE: trainer_dev if p is t else inference_dev})
        threads = {"engine": rank_threads("engine", tp, threads_per_rank),
                   "trainer": rank_threads("trainer", fsdp * dp, threads_per_rank)}
        for k, ipod in enumerate(pods[1:] or pods):
            for r in range(tp):
                c.spawn(ipod, f"engine{r}", [sys.executable, me, "engine", "--rank", str(r), "--tp", str(tp), *common,
                                             "--device", inference_dev, "--replica", str(k)], **threads["engine"])
        for r in range(fsdp * dp):
            c.spawn(t, f"trainer{r}", [sys.executable, me, "trainer", "--rank", str(r), "--fsdp", str(fsdp),
                                       "--dp", str(dp),
                                       "--snapshot", snapshot, *common, "--device", trainer_dev], **threads["trainer"])
        budget = 120 + size_mb / 5
        for v in range(1, versions + 1):
            (run_dir / f"go-{v}").touch()
            wait_for(lambda v=v: _committed(run_dir, v, tp * replicas), budget,
                     f"version {v} committed by {tp} engine ranks of {replicas} replica(s)", c)
            if v == 1:  # steady-state counters start after the first version
                scrapes.append(settled([p.metrics_url for p in pods]))
        scrapes.append(settled([p.metrics_url for p in pods]))
        exact_files = [run_dir / f"exact-{k}-{r}.json" for k in range(replicas) for r in range(tp)]
        wait_for(lambda: all(f.exists() for f in exact_files), budget, "every engine rank's bit-exact check", c)
        exact = [json.loads(f.read_text()) for f in exact_files]
        for p in pods:  # the agents are done: the raw transport alone between the same pods
            c.kill(p, "agent")
        if not with_raw:
            return _result(locals(), [])
        raw_out = run_dir / "raw.json"
        port = free_port(t.ip)
        procs = [c.spawn(pod, f"raw{k}", [sys.executable, me, "raw", "--kind", mode, "--rank", str(k), "--ip", pod.ip,
                                          "--store", f"{t.ip}:{port}", "--nbytes", str(model_bytes),
                                          "--bucket", str(bucket_mb * MiB), "--iters", str(RAW_ITERS),
                                          "--out", str(raw_out), "--device", dev])
                 for k, pod, dev in ((0, t, trainer_dev), (1, i, inference_dev))]
        for proc in procs:
            if proc.wait(600) != 0:
                raise RuntimeError(f"raw {mode} reference failed; see {run_dir}")
        raw = [float(x) for x in json.loads(raw_out.read_text())]
    finally:
        c.stop_all()
        cap.__exit__()
    return _result(locals(), raw)


def rank_threads(role: str, ranks: int, threads_per_rank: int | None) -> dict[str, str]:
    """The environment one of a pod's `ranks` trainer or engine processes runs with, as the real ones do:
    torchrun sets OMP_NUM_THREADS=1 for each of several trainer ranks when the variable is unset (a rank
    alone keeps torch's default, one thread per core); engines serve with one intra-op thread (vLLM's
    `set_torch_threads_for_runtime`: idle OpenMP workers spin and steal the serving loop's cycles; SGLang's
    GPU model runner calls `torch.set_num_threads(1)`). Without it, ranks each run one OpenMP thread per
    core and their copies spin against each other and against the wire (the trainer's copy into staging
    took 2 s instead of 0.06 s here). `threads_per_rank`: N > 0 forces N on both; 0 leaves every process
    torch's default, as the bench did before."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    if threads_per_rank is None:
        return {"OMP_NUM_THREADS": "1"} if role == "engine" or ranks > 1 else {}
    return {"OMP_NUM_THREADS": str(threads_per_rank)} if threads_per_rank > 0 else {}


def pod_devices(mode: str, device: str) -> tuple[str, str]:
    """(trainer pod's device, inference pod's device): GPU 0 and GPU 1 where there is one, else both GPU 0."""
    if device == "cpu":
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    gpus = torch.cuda.device_count()
    if mode == "nccl" and gpus < 2:
        raise SystemExit("--mode nccl --device cuda needs two GPUs: ProcessGroupNCCL refuses two ranks on one GPU")
    return "cuda:0", "cuda:0" if mode == "ipc" or gpus < 2 else "cuda:1"


def _device_note(device: str) -> str:
    if device == "cpu":
        return "CPU tensors and buffers; steady-state figures exclude version 1"
    return (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
            "steady-state figures exclude version 1")


def _result(ns: dict[str, Any], raw: list[float]) -> dict[str, Any]:
    run_dir, versions, fsdp, tp, model_bytes, metas = (ns[k] for k in ("run_dir", "versions", "fsdp", "tp",
                                                                        "model_bytes", "metas"))
    mode, size_mb, bucket_mb, scrapes, exact, pods = (ns[k] for k in ("mode", "size_mb", "bucket_mb", "scrapes",
                                                                     "exact", "pods"))
    pubs = [d for r in range(fsdp * ns["dp"]) for d in _read_jsonl(run_dir / f"trainer-{r}.jsonl")]
    commits = _read_jsonl(run_dir / "commits.jsonl")
    rows = []
    for v in range(1, versions + 1):
        pv = [d for d in pubs if d["version"] == v]
        start = min(d["t_start"] for d in pv)
        rows.append({"version": v, "trainer_blocked_s": max(d["t_published"] - d["t_start"] for d in pv),
                     "end_to_end_s": max(d["t"] for d in commits if d["version"] == v) - start,
                     "publish_skew_s": max(d["t_start"] for d in pv) - start})
    steady = rows[1:] or rows
    e2e = statistics.median(r["end_to_end_s"] for r in steady)
    raw_s = statistics.median(raw) if raw else float("nan")
    before, after = copied_bytes(scrapes[0]), copied_bytes(scrapes[-1])
    steady_versions = max(1, versions - 1)
    stages = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / (model_bytes * steady_versions) for k in after}
    dig = [summed(sc, "weightsync_agent_digest_bytes_total", "side", "source") for sc in (scrapes[0], scrapes[-1])]
    digest = {k: (dig[1].get(k, 0.0) - dig[0].get(k, 0.0)) / (model_bytes * steady_versions) for k in dig[1]}
    moved = [summed(sc, "weightsync_agent_transfer_bytes_total", "direction") for sc in (scrapes[0], scrapes[-1])]
    per_byte = {k: (moved[1].get(k, 0.0) - moved[0].get(k, 0.0)) / (model_bytes * steady_versions) for k in moved[1]}
    buckets = [summed(sc, "weightsync_agent_received_buckets_total").get("", 0.0) for sc in (scrapes[0], scrapes[-1])]
    calls = [sum(d.get("engine_calls", 0) for d in commits if d["version"] == r["version"]) for r in steady]
    peak = sum(s.get("weightsync_agent_staging_peak_bytes{}", 0.0) for s in scrapes[-1])
    by_pod = {p.name: int(s.get("weightsync_agent_staging_peak_bytes{}", 0.0)) for p, s in zip(pods, scrapes[-1],
                                                                                              strict=True)}
    snapshot_bytes = max((s.get("weightsync_agent_trainer_snapshot_bytes{}", 0.0) for sc in scrapes for s in sc),
                         default=0.0)
    return {
        "benchmark": "agent_pipeline", "mode": mode, "size_mb": size_mb, "bytes": model_bytes, "tensors": len(metas),
        "fsdp": fsdp, "dp": ns["dp"], "inference_tp": tp, "bucket_mb": bucket_mb, "versions": versions,
        "bit_exact": all(e["bit_exact"] for e in exact),
        "end_to_end_s": round(e2e, 4), "end_to_end_s_max": round(max(r["end_to_end_s"] for r in steady), 4),
        "trainer_blocked_s": round(statistics.median(r["trainer_blocked_s"] for r in steady), 4),
        "publish_skew_s": round(statistics.median(r["publish_skew_s"] for r in steady), 4),
        "raw_s": round(raw_s, 4) if raw else None, "ratio": round(raw_s / e2e, 3) if raw else None,
        "raw_samples_s": [round(x, 4) for x in raw],
        "effective_gbps": round(model_bytes / e2e / 1e9, 3),
        "raw_gbps": round(model_bytes / raw_s / 1e9, 3) if raw else None,
        "copies_per_byte": round(sum(stages.values()), 3),
        # calls the agents made into the engine ranks per version (on_bucket + on_pieces, every rank and replica: p50)
        # against the buckets they received per version (every inference agent)
        "engine_calls": statistics.median(calls) if calls else None,
        "buckets": round((buckets[1] - buckets[0]) / steady_versions, 2),
        "copies_per_byte_by_stage": {k: round(v, 3) for k, v in sorted(stages.items())},
        # the content digest's reads of each byte (side/source: hashed = read, reused = leaves taken as computed)
        "digest_reads_per_byte": round(sum(v for k, v in digest.items() if k.endswith("/hashed")), 3),
        "digest_bytes_per_byte_by_source": {k: round(v, 3) for k, v in sorted(digest.items())},
        "peak_staging_bytes": int(peak), "peak_staging_bytes_by_pod": by_pod,
        "staging_bytes_at_end_by_pod": {p.name: int(s.get("weightsync_agent_staging_bytes{}", 0.0))
                                        for p, s in zip(pods, scrapes[-1], strict=True)},
        "staging": ns["staging"], "depth": ns["depth"] if ns["staging"] == "ring" else None,
        "snapshot": ns["snapshot"] if ns["staging"] == "ring" else None, "snapshot_bytes": int(snapshot_bytes),
        "trainer_held_for": sorted({str(d.get("streamed") or "copy into staging") for d in pubs}),
        # each rank process's intra-op threads (null: torch's default, one per core; rank_threads)
        "omp_num_threads": {role: int(env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or 0) or None
                            for role, env in ns["threads"].items()},
        "replicas": ns["replicas"], "fan_out": ns["fan_out"], "trainer_egress_gbps": ns["trainer_egress_gbps"],
        "trainer_sent_per_byte": round(per_byte.get("sent", 0.0), 3),
        "relayed_per_byte": round(per_byte.get("relayed", 0.0), 3),
        "first_version_end_to_end_s": round(rows[0]["end_to_end_s"], 4),
        "device": ns["device"], "trainer_device": ns["trainer_dev"], "inference_device": ns["inference_dev"],
        "raw_kind": ({"nccl": "gloo send/recv", "gdr": "NIXL READ",
                      "ipc": "shared-memory hand-off: writer copy in + reader copy out"} if ns["device"] == "cpu" else
                     {"nccl": "ProcessGroupNCCL send/recv", "gdr": "NIXL READ of GPU memory",
                      "ipc": "CUDA IPC hand-off: writer copy in + reader copy out"})[mode],
        "per_version": rows,
        "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
        "note": _device_note(ns["device"]),
    }


BASE_TENSORS = 256


def with_per_tensor_overhead(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """`res` (a run at N tensors) with the slope of end_to_end_s over the tensor count at fixed bytes, against `base`
    (the same run at BASE_TENSORS tensors): microseconds each tensor adds to a version. The two models differ in bytes
    by a rounding of shapes only; each time is scaled to `res`'s bytes first."""
    scaled = base["end_to_end_s"] * res["bytes"] / base["bytes"]
    extra = res["tensors"] - base["tensors"]
    keys = ("tensors", "bytes", "end_to_end_s", "trainer_blocked_s", "raw_s", "ratio", "bit_exact", "copies_per_byte",
            "engine_calls", "buckets", "load_avg_1m")
    return {**res, "per_tensor_overhead_us": round((res["end_to_end_s"] - scaled) / extra * 1e6, 2) if extra else None,
            "trainer_blocked_per_tensor_us": round((res["trainer_blocked_s"] - base["trainer_blocked_s"]
                                                    * res["bytes"] / base["bytes"]) / extra * 1e6, 2) if extra else None,
            "ratio_at_base": base["ratio"],
            "same_raw": same_raw(res, base),
            "base": {k: base.get(k) for k in keys}}


def same_raw(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """Both runs' ratios against one raw reference: the median of the raw samples of both (None without them)."""
    samples = [*res.get("raw_samples_s", []), *base.get("raw_samples_s", [])]
    if not samples:
        return None
    raw_s = statistics.median(samples)
    ratio, at_base = raw_s / res["end_to_end_s"], raw_s / base["end_to_end_s"]
    return {"raw_s": round(raw_s, 4), "ratio": round(ratio, 3), "ratio_at_base": round(at_base, 3),
            "ratio_gap": round(at_base - ratio, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/agent_pipeline.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    rp = sub.add_parser("raw")
    for flag, kind in (("--kind", str), ("--rank", int), ("--ip", str), ("--store", str), ("--nbytes", int),
                       ("--bucket", int), ("--iters", int), ("--out", str)):
        rp.add_argument(flag, type=kind, required=True)
    rp.add_argument("--device", default="cpu")
    for name in ("trainer", "engine"):
        sp = sub.add_parser(name)
        for flag in ("--rank", "--size-mb", "--versions", "--fsdp" if name == "trainer" else "--tp"):
            sp.add_argument(flag, type=int, required=True)
        if name == "engine":
            sp.add_argument("--replica", type=int, default=0)
        sp.add_argument("--tensors", type=int, default=None)
        sp.add_argument("--run", required=True)
        sp.add_argument("--device", default="cpu")
        if name == "trainer":
            sp.add_argument("--snapshot", default="auto")
            sp.add_argument("--dp", type=int, default=1)
    p.add_argument("--mode", choices=("nccl", "ipc", "gdr"), default="nccl")
    p.add_argument("--size-mb", type=int, default=64, help="model size in MiB")
    p.add_argument("--fsdp", type=int, default=1, help="trainer ranks (FSDP Shard(0))")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the FSDP group (HSDP): every shard is "
                   "held by DP trainer ranks, and the plan sends each from one of them")
    p.add_argument("--inference-tp", type=int, default=1, help="engine ranks of the one replica (TP)")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--versions", type=int, default=None,
                   help="versions published (default 6; 10 with --tensors: see above)")
    p.add_argument("--staging", choices=("version", "ring"), default="version",
                   help="the trainer agent's staging: whole versions (default) or a ring of bucket slots")
    p.add_argument("--depth", type=int, default=2, help="ring slots per transfer (--staging ring)")
    p.add_argument("--snapshot", choices=("auto", "copy", "none"), default="auto",
                   help="ring: what the trainer keeps (TrainerSession(ring_snapshot=...))")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where weights, engine parameters and agent buffers live (cuda: GPU 0, and GPU 1 if any)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw transport reference (raw_s, ratio: null)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="OMP_NUM_THREADS of each trainer and engine process; default: as the real ones run (trainers "
                   "as torchrun starts them: 1 when a pod runs several ranks, else torch's default; engines 1, as "
                   "vLLM and SGLang serve); 0: torch's default everywhere (one thread per core)")
    p.add_argument("--replicas", type=int, default=1, help="inference replicas, one pod each (nccl, gdr)")
    p.add_argument("--fan-out", choices=("direct", "relay"), default="direct",
                   help="how the replicas are fed: the trainer sends to each (direct) or to a chain (relay; nccl, gdr)")
    p.add_argument("--trainer-egress-gbps", type=float, default=None,
                   help="cap the trainer pod's egress at G Gbit/s, as its NIC would (tc htb on loopback; root)")
    p.add_argument("--tensors", type=int, default=None,
                   help=f"spread --size-mb over N tensors shaped like an MoE model (moe_metas), and run again at "
                   f"{BASE_TENSORS} tensors, same bytes, for per_tensor_overhead_us; default: the Llama-shaped model "
                   "(about 251 tensors per GiB)")
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    a = p.parse_args(argv)
    if a.cmd == "trainer":
        run_trainer(Path(a.run), a.rank, a.fsdp, a.size_mb, a.versions, a.snapshot, a.dp, a.device, a.tensors)
    elif a.cmd == "engine":
        run_engine(Path(a.run), a.rank, a.tp, a.size_mb, a.versions, a.device, a.replica, a.tensors)
    elif a.cmd == "raw":
        run_raw(a.kind, a.rank, a.ip, a.store, a.nbytes, a.bucket, a.iters, Path(a.out), a.device)
    else:
        if a.versions is None:
            a.versions = 10 if a.tensors is not None else 6
        if a.versions < 2:
            p.error("--versions must be at least 2 (version 1 is the warm-up)")
        # a `timeout` or a Ctrl-C stops the pods' processes too (run()'s finally), not only this one
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        args = (a.mode, a.size_mb, a.fsdp, a.inference_tp, a.bucket_mb, a.versions, a.staging, a.depth, a.snapshot,
                not a.no_raw, a.dp, a.device, a.threads_per_rank, a.replicas, a.fan_out, a.trainer_egress_gbps)
        res = run(*args, tensors=a.tensors)
        if a.tensors is not None:
            res = with_per_tensor_overhead(res, run(*args, tensors=BASE_TENSORS))
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
