"""The stall a user feels: a real vLLM server paused, loaded by weightsync, resumed, against vLLM's own load.

    .venv/bin/python bench/engine_stall.py --engine vllm --size-mb N [--bucket-mb M] [--versions V] --json

What runs: vLLM's own OpenAI server (the CPU build in the engine venv, e2e/engines/vllm_server.py) serving the
tiny Llama scaled to about N MiB of bf16 weights (`size_config`: head_dim 64, 8 layers, hidden and
intermediate grown), with the weightsync weight-transfer backend (agent/engines/vllm_plugin.py). The agent's
side is the real VLLMAdapter (backend auto -> "weightsync", announced by the server) driven the way the agent
drives every engine, `base.load_version(adapter, v, buckets, pause_generation=True)`, with the version's
tensors in buckets of `--bucket-mb` (the agent's bucketSizeMB, default 512): what an inference agent does when
it commits a version it holds (agent/atomic.py). `driver: "adapter"`: the adapter runs in this process, not in
an agent process fed by a trainer agent (bench/agent_pipeline.py measures that part; here the stall starts at
the pause, and what is measured is what happens between pause and resume).

A user's request streams tokens the whole time (greedy, `stream: true`, requests back to back). Per version:

  pause_to_resume_s   the longest gap between two events of that stream (request sent, token received) that
                      overlaps the adapter's session: generation paused -> generation resumed, as the user
                      feels it (it includes one ordinary decode step and the recompute of the preempted request
                      after the adapter's prefix-cache reset)
  session_s           the adapter's side: POST /pause sent -> POST /resume answered
  floor_s             vLLM's own load of the same tensors, already in its process, in the same run: a worker
                      extension (`--worker-extension-cls`, called through vLLM's dev route /collective_rpc) runs
                      the worker's start_weight_update (the backend's initialize_layerwise_reload), the
                      backend's model.load_weights of every bucket the worker received for this version (kept
                      from the agent's load), and the worker's finish_weight_update (finalize_layerwise_reload),
                      timed inside the worker: vLLM's reload overhead included, no transfer, no HTTP
  ratio               floor_s / pause_to_resume_s (1.0: weightsync adds nothing to vLLM's own load)
  bit_exact           one more version through the same path (unmeasured): every parameter vLLM holds equals the
                      sent tensors, by sha256 as vLLM's compute_tensor_digests hashes them (q/k/v and gate/up
                      fused as vLLM's Llama holds them): /weight_checker for the parameters it still holds, and
                      for the linear layers (whose parameter vLLM's CPU GEMM dispatch repacks into oneDNN and
                      empties: /weight_checker hashes 0 bytes there) the hash of the weight as vLLM hands it to
                      that prepack, taken by the extension inside the worker
  profile             where the time goes, agent side (pack copy, digest leaves, broadcast, status all-reduce,
                      HTTP per route) and engine side (receive buffer, broadcast, digest leaves, load_weights,
                      status, start/finish), summed per version; engine side from timers the extension wraps
                      around the plugin's functions in the worker (measurement only, nothing else changes)

  raw                 after the server stopped, the same bytes in the same buckets over gloo between this venv's
                      torch and the engine venv's (one thread each): into a receive buffer kept across buckets,
                      and into a fresh one per bucket as the plugin receives

Version 1 is the warm-up (forms the group, faults pages in); figures are medians over versions 2..V.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
LAYERS = 8
VOCAB = 2048
EXT_MODULE = "ws_engine_stall_ext"  # this file, linked under this name on the server's PYTHONPATH
EXT_CLS = f"{EXT_MODULE}.FloorExtension"


# -- the engine side: a vLLM worker extension ---------------------------------------------------------------
class FloorExtension:
    """Mixed into vLLM's worker class (`--worker-extension-cls`); its methods are called with POST
    /collective_rpc {"method": ...}. Imports only torch and weightsync (the engine venv has both)."""

    def wsbench_arm(self) -> dict[str, Any]:
        """Wrap the weightsync backend's steps with timers and keep what each session loads."""
        eng = self.weight_transfer_engine  # type: ignore[attr-defined]
        if getattr(eng, "_wsbench", None) is not None:
            return {"armed": True}
        from weightsync.agent.engines import vllm_wire

        st: dict[str, Any] = {"capture": [], "capturing": True, "sessions": []}
        eng._wsbench = st

        def cur() -> dict[str, float]:
            if not st["sessions"]:
                st["sessions"].append(defaultdict(float))
            return st["sessions"][-1]

        def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    cur()[key] += time.perf_counter() - t0
            return run

        for name in ("broadcast", "tensor_leaves", "status_allreduce"):
            setattr(vllm_wire, name, timed(f"engine_{name}_s", getattr(vllm_wire, name)))
        load, start, finish, update = eng._load, eng.start_weight_update, eng.finish_weight_update, eng.update_weights

        def _load(tensors: list[tuple[str, torch.Tensor]]) -> None:
            timed("engine_load_weights_s", load)(tensors)
            if st["capturing"]:
                st["capture"].append(tensors)  # views of the received buffer: what vLLM got, kept for the floor

        def _start() -> None:
            st["sessions"].append(defaultdict(float))
            if st["capturing"]:
                st["capture"] = []
            timed("engine_start_s", start)()

        def _update(info: dict[str, Any]) -> None:
            cur()["engine_buckets"] += 1
            timed("engine_update_weights_s", update)(info)

        eng._load, eng.start_weight_update = _load, _start
        eng.finish_weight_update, eng.update_weights = timed("engine_finish_s", finish), _update
        return {"armed": True}

    def wsbench_digest_next(self) -> dict[str, Any]:
        """For the next session only: the sha256 of every linear layer's weight as vLLM hands it to its CPU
        GEMM prepack (`dispatch_cpu_unquantized_gemm`, which then empties the parameter: /weight_checker sees
        0 bytes there). Costs a hash per byte: only for the unmeasured check version."""
        import hashlib

        from vllm.model_executor.layers import utils as layer_utils

        st = self.weight_transfer_engine._wsbench  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        names = {id(m): n for n, m in model.named_modules()}
        st["digests"] = {}
        if not hasattr(layer_utils, "_wsbench_orig"):
            layer_utils._wsbench_orig = layer_utils.dispatch_cpu_unquantized_gemm

            def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
                digests = st.get("digests")
                w = getattr(layer, "weight", None)
                if digests is not None and w is not None and not w.is_meta and w.numel():
                    digests[names.get(id(layer), "?") + ".weight"] = hashlib.sha256(
                        w.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                return layer_utils._wsbench_orig(layer, remove_weight)
            layer_utils.dispatch_cpu_unquantized_gemm = dispatch
        return {"armed": True}

    def wsbench_digests(self) -> dict[str, str]:
        st = self.weight_transfer_engine._wsbench  # type: ignore[attr-defined]
        out, st["digests"] = st.get("digests") or {}, None
        return out

    def wsbench_sessions(self) -> list[dict[str, float]]:
        """Every session's timers since the last call (then forgotten)."""
        st = self.weight_transfer_engine._wsbench  # type: ignore[attr-defined]
        out, st["sessions"] = [dict(s) for s in st["sessions"]], []
        return out

    def wsbench_floor(self) -> dict[str, Any]:
        """vLLM's own session over the tensors of the last version, already in this process."""
        eng = self.weight_transfer_engine  # type: ignore[attr-defined]
        st = eng._wsbench
        held = st["capture"]
        st["capturing"] = False
        try:
            t0 = time.perf_counter()
            self.start_weight_update()  # type: ignore[attr-defined]  # the worker's own, as /start_weight_update
            t1 = time.perf_counter()
            for tensors in held:
                eng._load(tensors)  # the backend's model.load_weights (MTP completeness check off)
            t2 = time.perf_counter()
            self.finish_weight_update()  # type: ignore[attr-defined]  # finalize_layerwise_reload
            t3 = time.perf_counter()
        finally:
            st["capturing"] = True
        st["sessions"].pop()  # the floor's own timers are not a version's
        return {"floor_s": t3 - t0, "start_s": t1 - t0, "load_weights_s": t2 - t1, "finish_s": t3 - t2,
                "buckets": len(held), "tensors": sum(len(b) for b in held),
                "bytes": sum(t.numel() * t.element_size() for b in held for _, t in b)}


# -- the model ---------------------------------------------------------------------------------------------
def size_config(size_mb: int) -> dict[str, Any]:
    """tiny_llama.CONFIG scaled to about `size_mb` MiB of bf16 weights: head_dim 64, GQA 2:1, LAYERS layers,
    intermediate ~8/3 hidden (a multiple of 64), vocab VOCAB; hidden a multiple of 128."""
    from weightsync.agent.demo import tiny_llama

    best: dict[str, Any] | None = None
    for h in range(128, 16384, 128):
        c = dict(tiny_llama.CONFIG)
        c.update(hidden_size=h, intermediate_size=-(-(8 * h // 3) // 64) * 64, num_hidden_layers=LAYERS,
                 num_attention_heads=h // 64, num_key_value_heads=h // 128, head_dim=64, vocab_size=VOCAB)
        n = model_bytes(c)
        if best is None or abs(n - size_mb * MiB) < abs(model_bytes(best) - size_mb * MiB):
            best = c
        if n > size_mb * MiB:
            break
    assert best is not None
    return best


def model_bytes(config: dict[str, Any]) -> int:
    from weightsync.agent.demo import tiny_llama

    return sum(2 * int(torch.Size(s).numel()) for s in tiny_llama.param_shapes(config).values())


def make_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from weightsync.agent.demo import tiny_llama

    return {k: v.to(torch.bfloat16).contiguous() for k, v in tiny_llama.init_weights(0, config).items()}


def advance(weights: dict[str, torch.Tensor]) -> None:
    """What one training step does here: every bf16 word + 1 (exact; a value moves by one ulp)."""
    for t in weights.values():
        t.view(torch.int16).add_(1)


def buckets_of(weights: dict[str, torch.Tensor], bucket_mb: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Whole tensors in order, a bucket closed before the tensor that would take it past bucket_mb."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_mb * MiB:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def as_received(buckets: list[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Each bucket as the inference agent hands it to the engine adapter: views of one receive slot, where
    the trainer-to-agent wire landed it (not timed here: that hop is the job's transport, measured by
    bench/agent_pipeline.py). The adapter then sends the slot's bytes as they lie, with no pack."""
    from weightsync.agent.engines import vllm_wire

    out = []
    for b in buckets:
        buf, info = vllm_wire.pack(b, None, torch.device("cpu"))
        out.append(vllm_wire.views(buf[: info.nbytes], info))
    return out


def vllm_checksums(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, str]:
    """What vLLM's /weight_checker reports for these weights (compute_tensor_digests: sha256 of each
    parameter's bytes) under vLLM's Llama parameter names: qkv_proj and gate_up_proj fused in that order."""
    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

    out: dict[str, str] = {}
    prefix = "dp0:pp0:pcp0:tp0:"
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        out[prefix + name] = sha(weights[name])
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out[prefix + p + "self_attn.qkv_proj.weight"] = sha(torch.cat(
            [weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        out[prefix + p + "mlp.gate_up_proj.weight"] = sha(torch.cat(
            [weights[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]))
        for x in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight"):
            out[prefix + p + x] = sha(weights[p + x])
    return out


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def compare(want: dict[str, str], prepack: dict[str, str], checker: dict[str, str]) -> dict[str, Any]:
    """The sent tensors' digests against vLLM's: /weight_checker's for the parameters vLLM still holds,
    the pre-prepack hash for the linear layers whose parameter vLLM's CPU GEMM dispatch emptied."""
    prefix = "dp0:pp0:pcp0:tp0:"
    got: dict[str, str] = {}
    sources = {"weight_checker": 0, "before_gemm_prepack": 0}
    for key in want:
        name = key[len(prefix):]
        if checker.get(key) not in (None, EMPTY_SHA256):
            got[key] = checker[key]
            sources["weight_checker"] += 1
        elif name in prepack:
            got[key] = prepack[name]
            sources["before_gemm_prepack"] += 1
    mismatches = sorted(k for k in want if got.get(k) != want[k])
    extra = sorted(k for k in checker if k not in want)
    return {"match": not mismatches, "mismatches": mismatches, "compared": len(got), "by_source": sources,
            "engine_params_not_compared": extra}


# -- the user ----------------------------------------------------------------------------------------------
class Stream(threading.Thread):
    """A user's greedy requests, streamed and back to back: `events` are the times a request was sent and
    each token arrived."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True, name="user-stream")
        self.url, self.max_tokens = url, max_tokens
        self.events: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        import requests

        while not self.stop.is_set():
            self.events.append(time.monotonic())
            try:
                with requests.post(f"{self.url}/v1/completions", stream=True, timeout=600, json={
                        "model": "tiny-llama", "prompt": [1, 17, 42, 99, 7], "max_tokens": self.max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith(b"data: ") and line != b"data: [DONE]":
                            self.events.append(time.monotonic())
                        if self.stop.is_set():
                            break
            except Exception as exc:  # reported in the result
                self.error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.5)

    def gap(self, t0: float, t1: float) -> float | None:
        """The longest gap between consecutive events that overlaps [t0, t1]."""
        ev = list(self.events)
        gaps = [b - a for a, b in itertools.pairwise(ev) if b > t0 and a < t1]
        return max(gaps) if gaps else None

    def ordinary(self, windows: list[tuple[float, float]]) -> float | None:
        """The median gap between events outside every window (a decode step)."""
        ev = list(self.events)
        gaps = [b - a for a, b in itertools.pairwise(ev) if all(b <= t0 or a >= t1 for t0, t1 in windows)]
        return statistics.median(gaps) if gaps else None


# -- the agent side: timers around the adapter -------------------------------------------------------------
class AgentTimers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.calls: list[tuple[str, float, float]] = []

    def install(self, adapter: Any) -> None:
        from weightsync.agent.engines import vllm_wire

        pack_leaves = vllm_wire.tensor_leaves

        def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.t[key] += time.perf_counter() - t0
            return run

        vllm_wire.pack = timed("agent_pack_total_s", vllm_wire.pack)  # copy + leaves (leaves also on their own)
        vllm_wire.tensor_leaves = timed("agent_leaves_s", pack_leaves)
        vllm_wire.broadcast = timed("agent_broadcast_s", vllm_wire.broadcast)
        vllm_wire.status_allreduce = timed("agent_status_allreduce_s", vllm_wire.status_allreduce)
        request = adapter.client.request

        def req(method: str, path: str, *a: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            try:
                return request(method, path, *a, **kw)
            finally:
                t1 = time.monotonic()
                self.calls.append((path, t0, t1))
                self.t[f"http {path}"] += t1 - t0
        adapter.client.request = req

    def take(self) -> dict[str, float]:
        out, self.t = dict(self.t), defaultdict(float)
        if "agent_pack_total_s" in out:
            out["agent_pack_copy_s"] = out["agent_pack_total_s"] - out.get("agent_leaves_s", 0.0)
        return out


# -- the raw reference: the same bytes over gloo between the two torch builds ---------------------------------
def run_raw(rank: int, port: int, nbytes: int, bucket: int, iters: int) -> None:
    """Rank 0 (this venv, as the agent) broadcasts `nbytes` in `bucket`-sized pieces to rank 1 (the engine venv,
    as vLLM's worker), one thread each as the engine serves; rank 1 prints the seconds of each round, into a
    receive buffer kept across buckets ("reuse") and into a fresh one per bucket ("fresh", as the plugin's
    WorkerReceiver allocates)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=300)
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    sizes = [min(bucket, nbytes - o) for o in range(0, nbytes, bucket)]
    src = torch.ones(max(sizes), dtype=torch.uint8)
    keep = torch.empty(max(sizes), dtype=torch.uint8)
    bo = dist.BroadcastOptions()
    bo.rootRank = 0
    out: dict[str, list[float]] = {"reuse": [], "fresh": []}
    for mode in ("reuse", "fresh"):
        for _ in range(iters + 1):
            pg.barrier().wait()
            t0 = time.perf_counter()
            for n in sizes:
                buf = src[:n] if rank == 0 else (keep[:n] if mode == "reuse" else torch.empty(n, dtype=torch.uint8))
                pg.broadcast([buf], bo).wait()
                del buf
            out[mode].append(time.perf_counter() - t0)
        out[mode] = out[mode][1:]
    pg.barrier().wait()
    if rank == 1:
        print(json.dumps(out))


def raw_reference(nbytes: int, bucket_mb: int, iters: int = 3) -> dict[str, Any]:
    from weightsync.e2e.engine_venv import engine_python
    from weightsync.e2e.procs import free_port

    port = free_port("127.0.0.1")
    args = ["raw", "--port", str(port), "--nbytes", str(nbytes), "--bucket", str(bucket_mb * MiB),
            "--iters", str(iters)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    me = str(Path(__file__).resolve())
    p0 = subprocess.Popen([sys.executable, me, *args, "--rank", "0"], env=env)
    p1 = subprocess.run([str(engine_python()), me, *args, "--rank", "1"], env=env, capture_output=True, text=True,
                        timeout=900)
    p0.wait(60)
    if p1.returncode != 0:
        return {"error": p1.stderr[-500:]}
    times = json.loads(p1.stdout.strip().splitlines()[-1])
    return {f"raw_broadcast_{k}_s": round(statistics.median(v), 4) for k, v in times.items()}


# -- the run -----------------------------------------------------------------------------------------------
def start_server(config: dict[str, Any], run_dir: Path, host: str, port: int) -> subprocess.Popen[bytes]:
    from weightsync.agent.demo import tiny_llama
    from weightsync.e2e.engines import vllm_server

    model_dir = tiny_llama.write_model_dir(run_dir / "model", config)
    ext = run_dir / "ext"
    ext.mkdir()
    (ext / f"{EXT_MODULE}.py").symlink_to(Path(__file__).resolve())
    env = vllm_server.server_env()
    env["PYTHONPATH"] = str(ext)  # only the extension's module: the repo root's operator/ must not shadow
    cmd = [*vllm_server.server_command(model_dir, host, port), "--worker-extension-cls", EXT_CLS]
    log = (run_dir / "vllm.log").open("wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rpc(url: str, method: str, timeout: float = 600.0) -> Any:
    import requests

    r = requests.post(f"{url}/collective_rpc", json={"method": method}, timeout=timeout)
    r.raise_for_status()
    return r.json()["results"][0]


def run(size_mb: int, bucket_mb: int, versions: int, agent_threads: int | None = None,
        handed: str = "slot") -> dict[str, Any]:
    from weightsync.agent.engines.base import load_version
    from weightsync.agent.engines.vllm import VLLMAdapter
    from weightsync.e2e.engines import vllm_server
    from weightsync.e2e.procs import free_port

    if agent_threads:
        torch.set_num_threads(agent_threads)
    config = size_config(size_mb)
    nbytes = model_bytes(config)
    run_dir = Path(tempfile.mkdtemp(prefix="ws-engine-stall-"))
    host = "127.0.0.1"
    port = free_port(host)
    url = f"http://{host}:{port}"
    t_start = time.monotonic()
    proc = start_server(config, run_dir, host, port)
    stream: Stream | None = None
    try:
        vllm_server.wait_ready(url, timeout=600, proc=proc)
        ready_s = time.monotonic() - t_start
        weights = make_weights(config)
        adapter = VLLMAdapter(url)
        release = adapter.check_engine_version()
        rpc(url, "wsbench_arm")
        timers = AgentTimers()
        timers.install(adapter)
        rows: list[dict[str, Any]] = []
        windows: list[tuple[float, float]] = []
        stream = Stream(url, max_tokens=128 - 5 - 1)
        for v in range(1, versions + 1):
            advance(weights)
            buckets = buckets_of(weights, bucket_mb)
            if handed == "slot":
                buckets = as_received(buckets)
            if v == 2:
                stream.start()
                time.sleep(3.0)  # a few ordinary decode steps before the first measured pause
            timers.take()
            timers.calls.clear()
            t0 = time.perf_counter()
            loaded = load_version(adapter, v, buckets, pause_generation=True)
            wall = time.perf_counter() - t0
            agent = timers.take()
            calls = list(timers.calls)
            p0 = min(c[1] for c in calls if c[0] == "/pause")
            p1 = max(c[2] for c in calls if c[0] == "/resume")
            windows.append((p0, p1))
            engine = rpc(url, "wsbench_sessions")
            time.sleep(1.0)  # the user's stream resumes, the engine decodes again
            floor = rpc(url, "wsbench_floor")
            time.sleep(1.0)
            rows.append({"version": v, "tensors": loaded, "buckets": len(buckets), "load_version_s": wall,
                         "session_s": p1 - p0, "p0": p0, "p1": p1, "floor": floor,
                         "agent": agent, "engine": engine[0] if engine else {}})
        stream.stop.set()
        time.sleep(0.5)
        for r in rows:
            r["pause_to_resume_s"] = stream.gap(r.pop("p0"), r.pop("p1")) if r["version"] > 1 else None
        # the check: one more version through the same path, unmeasured, hashed inside vLLM as it loads
        advance(weights)
        rpc(url, "wsbench_digest_next")
        load_version(adapter, versions + 1, buckets_of(weights, bucket_mb), pause_generation=True)
        check = compare(vllm_checksums(weights, config), rpc(url, "wsbench_digests"),
                        adapter.check_weights()["checksums"])
        served = adapter.served_version()
        adapter.close()
        ordinary = stream.ordinary(windows)
        return result(locals())
    finally:
        if stream is not None:
            stream.stop.set()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_all(size_mb: int, bucket_mb: int, versions: int, agent_threads: int | None, with_raw: bool,
            handed: str = "slot") -> dict[str, Any]:
    out = run(size_mb, bucket_mb, versions, agent_threads, handed)
    out["buckets_handed_as"] = handed
    if with_raw:  # after the server stopped: the wire alone, same bytes, same buckets, same two torch builds
        out["raw"] = raw_reference(out["bytes"], bucket_mb)
    return out


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def result(ns: dict[str, Any]) -> dict[str, Any]:
    rows, config, check = ns["rows"], ns["config"], ns["check"]
    steady = rows[1:]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    stall = med([r["pause_to_resume_s"] for r in steady if r["pause_to_resume_s"] is not None])
    floor = med([r["floor"]["floor_s"] for r in steady])
    session = med([r["session_s"] for r in steady])

    def prof(side: str) -> dict[str, float]:
        keys = sorted({k for r in steady for k in r[side]})
        return {k: round(statistics.median(r[side].get(k, 0.0) for r in steady), 4) for k in keys}

    per_version = [{
        "version": r["version"], "pause_to_resume_s": _r(r["pause_to_resume_s"]), "session_s": _r(r["session_s"]),
        "floor_s": _r(r["floor"]["floor_s"]),
        "ratio": _r(r["floor"]["floor_s"] / r["pause_to_resume_s"], 3) if r["pause_to_resume_s"] else None,
        "floor_parts": {k: _r(v) if isinstance(v, float) else v for k, v in r["floor"].items() if k != "floor_s"},
        "buckets": r["buckets"]} for r in rows]
    return {
        "benchmark": "engine_stall", "engine": "vllm", "engine_release": ns["release"], "driver": "adapter",
        "backend": ns["adapter"].backend, "size_mb": ns["size_mb"], "bytes": ns["nbytes"],
        "tensors": len(ns["weights"]), "bucket_mb": ns["bucket_mb"], "versions": ns["versions"],
        "model": {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")},
        "pause_to_resume_s": _r(stall), "session_s": _r(session), "floor_s": _r(floor),
        "ratio": _r(floor / stall, 3) if stall and floor else None,
        "ratio_session": _r(floor / session, 3) if session and floor else None,
        "decode_step_s": _r(ns["ordinary"]),
        "bit_exact": bool(check["match"]),
        "bit_exact_check": {k: (v[:5] if isinstance(v, list) else v) for k, v in check.items()},
        "served_version": ns["served"],
        "profile_agent_s": prof("agent"), "profile_engine_s": prof("engine"),
        "per_version": per_version,
        "stream_error": ns["stream"].error,
        "server_ready_s": _r(ns["ready_s"], 1),
        "agent_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "torch": torch.__version__,
        "note": ("CPU: vLLM's CPU build in the engine venv (OMP_NUM_THREADS=1, 1 GiB KV), the adapter in this "
                 "process over gloo; version 1 excluded; floor = vLLM's own start/load_weights/finish in its "
                 "worker over the tensors it received"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/engine_stall.py", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm",), default="vllm")
    p.add_argument("--size-mb", type=int, default=64, help="model size in MiB (bf16)")
    p.add_argument("--bucket-mb", type=int, default=512, help="the agent's bucketSizeMB (default: the agent's)")
    p.add_argument("--versions", type=int, default=4, help="versions loaded; version 1 is the warm-up")
    p.add_argument("--agent-threads", type=int, default=None,
                   help="torch intra-op threads of the adapter's process (default: torch's, as the agent runs)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw gloo reference (`raw`)")
    p.add_argument("--handed", choices=("slot", "tensors"), default="slot",
                   help="buckets as the inference agent hands them (views of its receive slot: no pack) or as "
                   "separate tensors (the adapter packs them)")
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    if (argv if argv is not None else sys.argv[1:])[:1] == ["raw"]:
        rp = argparse.ArgumentParser()
        for flag in ("--rank", "--port", "--nbytes", "--bucket", "--iters"):
            rp.add_argument(flag, type=int, required=True)
        r = rp.parse_args((argv if argv is not None else sys.argv[1:])[1:])
        run_raw(r.rank, r.port, r.nbytes, r.bucket, r.iters)
        return 0
    a = p.parse_args(argv)
    if a.versions < 2:
        p.error("--versions must be at least 2 (version 1 is the warm-up)")
    print(json.dumps(run_all(a.size_mb, a.bucket_mb, a.versions, a.agent_threads, not a.no_raw, a.handed), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
