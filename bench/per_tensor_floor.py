"""The per-tensor floor of a version on this machine: the work every tensor needs once per version, each stage
timed alone in one process, at 256 tensors and at N (same bytes, the MoE shapes of agent_pipeline.py).

Why: issue 33 asks the product path (bench/agent_pipeline.py) to keep its ratio against the raw transport within
0.1 of the 256-tensor run at 16,384 tensors. That allows the 16,384-tensor version only so much more time than
the 256-tensor one (`--against`: raw_s / (ratio_at_base - 0.1) - base end_to_end_s, from a pipeline JSON). This
script measures what no implementation can skip, with the product's own functions and the plan's real buckets:

- publish: the trainer's copy of every tensor into its staging views (staging.copies.copy_all, views kept);
- leaves: the digest's xxh3 leaf of every piece (transfer.digest.bucket_leaves, seeds memoized as per plan);
- hex: the leaves' hex form the bucket metadata carries (hashing.HashedLeaves.of);
- load: the engine's copy of every tensor from its bucket into its own parameter (copy_all, views kept, as
  staging.places.BucketViews keeps them).

It is not a benchmark of the product (that is agent_pipeline.py, with real agent processes against the raw
transport): it is the lower bound of the product's extra time at N tensors: `floor_extra_s` with the stages one
after another, `overlapped_floor_s` (their extra CPU spread over every core) if they overlapped perfectly, as the
product's processes at best do. When that is above the allowance, the ratio criterion cannot be met on this machine
by any change to the agent.

    python bench/per_tensor_floor.py --size-mb 1024 --tensors 16384 --json \\
        [--against bench/results/session41/ipc-16384-head-1.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_pipeline import BASE_TENSORS, full_tensor, model

from weightsync.agent.hashing import XXH3_128, HashedLeaves
from weightsync.agent.plan import Box, TensorShard, build_plan
from weightsync.agent.plan.buckets import entry_views
from weightsync.agent.staging.copies import copy_all, split_for_threads
from weightsync.agent.transfer.digest import bucket_leaves

MiB = 1 << 20


Stage = Callable[[], object]


def _timed(fn: Stage) -> tuple[float, float]:
    """(wall, CPU) seconds of one call; CPU counts every thread of the process (copy_all's too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def stages(size_mb: int, tensors: int, bucket_mb: int) -> dict[str, Stage]:
    """Each stage of one version for `tensors` tensors of `size_mb` MiB in all, ready to time (memory allocated,
    views and splits made, every stage run once: first touches and memos are paid, as by a first version)."""
    metas = model(size_mb, tensors)
    shards = [TensorShard.full(m.name, m.dtype, m.shape) for m in metas]
    plan = build_plan([shards], [shards], bucket_mb * MiB)
    sources = {m.name: full_tensor(m) for m in metas}
    staged = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]
    views = [entry_views(buf, b.layout.entries) for buf, b in zip(staged, plan.buckets, strict=True)]
    params = {m.name: torch.empty_like(sources[m.name]) for m in metas}

    def region(t: torch.Tensor, e: Any) -> torch.Tensor:  # a piece: the whole tensor, or a box of a large one
        return t[e.piece.box.slices_within(Box.full(e.piece.global_shape))]

    publish_dst = [v for vs in views for v in vs]
    publish_src = [region(sources[e.piece.name], e) for b in plan.buckets for e in b.entries]
    load_dst = [[region(params[e.piece.name], e) for e in b.entries] for b in plan.buckets]

    publish_chunks = split_for_threads([t.nbytes for t in publish_src], torch.get_num_threads())
    load_chunks = [split_for_threads([t.nbytes for t in vs], torch.get_num_threads()) for vs in views]

    def publish() -> None:  # the trainer's staging keeps its views and their split (client.py, staging/places.py)
        with torch.no_grad():
            copy_all(publish_dst, publish_src, publish_chunks)

    def leaves() -> list[Any]:
        return [bucket_leaves(b, buf, XXH3_128) for b, buf in zip(plan.buckets, staged, strict=True)]

    publish()
    hashed = leaves()

    def hexes() -> list[HashedLeaves]:
        return [HashedLeaves.of(lv) for lv in hashed]

    def load() -> None:
        with torch.no_grad():
            for dst, vs, chunks in zip(load_dst, views, load_chunks, strict=True):
                copy_all(dst, vs, chunks)  # one call per bucket, as an engine loads bucket by bucket

    hexes()
    load()
    assert all(torch.equal(params[n].view(torch.int16), sources[n].view(torch.int16)) for n in params)  # bytes moved
    return {"publish": publish, "leaves": leaves, "hex": hexes, "load": load}


def paired(base: dict[str, Stage], at_n: dict[str, Stage], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each stage timed `rounds` times at the base count and at N, alternated call by call: the machine's drift
    (other load, frequency, memory) falls on both sides of each pair instead of on one invocation."""
    out: dict[str, dict[str, list[float]]] = {k: {"base_s": [], "n_s": [], "base_cpu_s": [], "n_cpu_s": []}
                                              for k in base}
    for _ in range(rounds):
        for k in base:
            (bw, bc), (nw, nc) = _timed(base[k]), _timed(at_n[k])
            out[k]["base_s"].append(bw)
            out[k]["n_s"].append(nw)
            out[k]["base_cpu_s"].append(bc)
            out[k]["n_cpu_s"].append(nc)
    return out


def _gaps(a: list[float], b: list[float]) -> list[float]:
    """The paired differences b - a."""
    return [y - x for x, y in zip(a, b, strict=True)]


def allowance(pipeline_json: Path) -> dict[str, float]:
    """What issue 33's ratio criterion allows the N-tensor version over the 256-tensor one in that pipeline run:
    against the run's one raw reference for both (`same_raw`, the median of both runs' raw samples) when it has
    one, else against its own raw and ratio_at_base."""
    d = json.loads(pipeline_json.read_text())
    same = d.get("same_raw") or {}
    raw, base = same.get("raw_s", d["raw_s"]), d["base"]
    ratio_at_base = same.get("ratio_at_base", d["ratio_at_base"])
    need_ratio = ratio_at_base - 0.1
    allowed_e2e = raw / need_ratio
    return {"raw_s": raw, "ratio_at_base": ratio_at_base, "base_end_to_end_s": base["end_to_end_s"],
            "end_to_end_s": d["end_to_end_s"], "allowed_end_to_end_s": round(allowed_e2e, 4),
            "allowed_extra_s": round(allowed_e2e - base["end_to_end_s"], 4),
            "measured_extra_s": round(d["end_to_end_s"] - base["end_to_end_s"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16384)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15, help="timed pairs per stage (base, N), alternated")
    ap.add_argument("--against", type=Path, help="an agent_pipeline.py --json result at the same --tensors")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    times = paired(stages(a.size_mb, BASE_TENSORS, a.bucket_mb), stages(a.size_mb, a.tensors, a.bucket_mb), a.rounds)
    base = {k: statistics.median(v["base_s"]) for k, v in times.items()}
    at_n = {k: statistics.median(v["n_s"]) for k, v in times.items()}
    gaps = {k: _gaps(v["base_s"], v["n_s"]) for k, v in times.items()}
    extra = {k: statistics.median(g) for k, g in gaps.items()}
    cpu_extra = {k: statistics.median(_gaps(v["base_cpu_s"], v["n_cpu_s"])) for k, v in times.items()}
    spread = {k: [round(min(g), 4), round(max(g), 4)] for k, g in gaps.items()}
    cpus = os.cpu_count() or 1
    res: dict[str, Any] = {
        "benchmark": "per_tensor_floor", "size_mb": a.size_mb, "tensors": a.tensors, "base_tensors": BASE_TENSORS,
        "bucket_mb": a.bucket_mb, "rounds": a.rounds, "torch_threads": torch.get_num_threads(), "cpus": cpus,
        "seconds_at_base": {k: round(v, 4) for k, v in base.items()},
        "seconds": {k: round(v, 4) for k, v in at_n.items()},
        # the median of the paired differences, and their smallest and largest
        "extra_s": {k: round(v, 4) for k, v in extra.items()},
        "extra_s_range": spread,
        "extra_us_per_tensor": {k: round(v / (a.tensors - BASE_TENSORS) * 1e6, 2) for k, v in extra.items()},
        "floor_extra_s": round(sum(extra.values()), 4),
        "floor_us_per_tensor": round(sum(extra.values()) / (a.tensors - BASE_TENSORS) * 1e6, 2),
        # the stages run in different processes and threads in the product: even overlapped perfectly on every
        # core, the extra time is at least their extra CPU spread over the cores
        "cpu_extra_s": {k: round(v, 4) for k, v in cpu_extra.items()},
        "overlapped_floor_s": round(sum(cpu_extra.values()) / cpus, 4),
    }
    if a.against is not None:
        res["criterion"] = allowance(a.against)
        allowed = max(res["criterion"]["allowed_extra_s"], 1e-9)
        res["floor_over_allowance"] = round(res["floor_extra_s"] / allowed, 2)
        res["overlapped_floor_over_allowance"] = round(res["overlapped_floor_s"] / allowed, 2)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k in extra:
            print(f"{k:8s} {base[k]:.4f} s at {BASE_TENSORS}, {at_n[k]:.4f} s at {a.tensors}: "
                  f"{res['extra_us_per_tensor'][k]} us per tensor")
        print(f"floor: {res['floor_extra_s']} s more at {a.tensors} tensors ({res['floor_us_per_tensor']} us each); "
              f"overlapped on {cpus} cores: {res['overlapped_floor_s']} s")
        if "criterion" in res:
            print(f"the ratio criterion allows {res['criterion']['allowed_extra_s']} s more; measured "
                  f"{res['criterion']['measured_extra_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
