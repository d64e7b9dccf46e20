"""Reshard plan at scale: the first version of a layout (plan built) and every later one (plan reused).

    .venv/bin/python bench/plan_scale.py --tensors 70000 --ranks 256 --json

The model (`--model uniform`): `--tensors` 2-d bf16 row-parallel weights (hidden/4 .. hidden rows, at
least one per rank; hidden columns), FSDP Shard(0) over `--ranks` trainer ranks (`--ranks-per-pod` per
pod), to `--inference-tp` ranks that each need a column shard of every tensor (the default TP rules).
`--model llama` mixes column-parallel, row-parallel and replicated (norm) tensors instead.

It runs what the agents do (agent/transfer/fetch.py, agent/transfer/serve.py, agent/wire/protocol.py). The trainer side lays
out its ranks (a ShardTable) and encodes each pod's metadata (`layout_s`, `meta_s`, all pods one after
the other). The inference agent, per version: decodes every pod's metadata, joins it into the sources,
lays out its needs (the default TP rules), makes the plan inputs (payload and key) and asks the plan
cache, then looks up what its rank 0 receives and what trainer rank 0 sends (making those ranks' shard
objects). `agent_first_s` is its first version (the plan is built: `build_s`); `first_s` adds the
trainer side's layout and metadata; `next_s` is the median of `--versions` later versions (same
layout: everything found by lookups, the plan reused). `serve_first_s` is the trainer agent's first
version: decode the inputs and build the plan. One JSON object, with sizes, the plan's memory
(`plan_mb`) and peak RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

from weightsync.agent.plan import PlanInputs, ShardTable, TransferPlan
from weightsync.agent.plan.cache import PlanCache
from weightsync.agent.wire import protocol as P


def model(kind: str, tensors: int, ranks: int, hidden: int) -> tuple[list[str], list[tuple[int, ...]]]:
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    for i in range(tensors):
        if kind == "uniform":
            names.append(f"model.layers.{i}.mlp.down_proj.weight")
            shapes.append((max(ranks, (hidden // 4) * (1 + i % 4)), hidden))
        else:  # a transformer layer every 4 tensors: q (column), o (row), up (column), norm (replicated)
            layer, j = divmod(i, 4)
            name, shape = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                           ("mlp.up_proj.weight", (4 * hidden, hidden)), ("input_layernorm.weight", (hidden,))][j]
            names.append(f"model.layers.{layer}.{name}")
            shapes.append(shape)
    return names, shapes


def trainer_table(names: list[str], shapes: list[tuple[int, ...]], ranks: int) -> ShardTable:
    """FSDP Shard(0) of every tensor over all ranks (torch.chunk sizes; empty chunks left out), as the
    trainer agents' staging would describe it, computed as arrays."""
    order = sorted(range(len(names)), key=names.__getitem__)
    names, shapes = [names[i] for i in order], [shapes[i] for i in order]
    T, D = len(names), max(len(s) for s in shapes)
    gs = np.ones((D, T), dtype=np.int32)
    for i, s in enumerate(shapes):
        gs[: len(s), i] = s
    rows = gs[0]
    per = -(-rows // ranks)
    start = np.minimum(np.arange(ranks, dtype=np.int32)[:, None] * per, rows)
    offset = np.zeros((D, ranks, T), dtype=np.int32)
    offset[0] = start
    shape = np.empty((D, ranks, T), dtype=np.int32)
    shape[:] = gs[:, None, :]
    shape[0] = np.minimum(per, rows - start)
    present = shape[0] > 0
    return ShardTable.from_dense(names, ["bfloat16"] * T, shapes, offset, shape, None if present.all() else present,
                                 dims_first=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/plan_scale.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=8, help="trainer (FSDP) ranks")
    p.add_argument("--ranks-per-pod", type=int, default=8)
    p.add_argument("--inference-tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--model", choices=("uniform", "llama"), default="uniform")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--versions", type=int, default=5, help="later versions timed with the plan reused")
    p.add_argument("--no-serve", action="store_true", help="skip the trainer agent's side")
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    args = p.parse_args(argv)
    tp, R = args.inference_tp, args.ranks
    bucket_bytes = args.bucket_mb << 20

    # --- trainer side: layout, per-pod metadata --------------------------------------------------------
    t0 = time.perf_counter()
    names, shapes = model(args.model, args.tensors, R, args.hidden)
    table = trainer_table(names, shapes, R)
    layout_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pods = [list(range(a, min(R, a + args.ranks_per_pod))) for a in range(0, R, args.ranks_per_pod)]
    payloads = [P.encode_meta_table(ranks, ShardTable.stack([(table, r) for r in ranks]), {}) for ranks in pods]
    meta_s = time.perf_counter() - t0
    del table

    # --- inference side, per version -------------------------------------------------------------------
    cache = PlanCache()
    looked: dict[str, Any] = {}

    def one_version() -> tuple[float, TransferPlan, PlanInputs]:
        t = time.perf_counter()
        src_meta: dict[int, Any] = {}
        for payload in payloads:
            ranks, _aliases = P.decode_meta(payload)
            src_meta.update(ranks)
        sources = P.sources_table(src_meta, R)
        needs = P.needs_table(sources, tp, tp, None, lambda: P.tp_needs_table(sources, tp))
        inputs = P.plan_inputs(sources, needs, bucket_bytes)
        plan = cache.get_or_build(inputs, inputs.build)
        # what WeightReceiver(plan, 0) and WeightSender(plan, 0) look up
        looked.update(srcs=len(plan.srcs_of(0)), recv_buckets=len(plan.buckets_to(0)),
                      slot=plan.max_bucket_nbytes(dst=0), needs0=len(plan.needs[0]), dsts=len(plan.dsts_of(0)),
                      send_buckets=len(plan.buckets_from(0)), sources0=len(plan.sources[0]))
        return time.perf_counter() - t, plan, inputs

    first_s, first, inputs = one_version()
    nexts = [one_version() for _ in range(args.versions)]
    assert all(pl is first for _, pl, _ in nexts), "a later version with the same layout must reuse the plan"
    pieces = first.num_pieces
    result: dict[str, Any] = {
        "model": args.model, "tensors": args.tensors, "ranks": R, "inference_tp": tp,
        "shards": first.sources.table.num_rows + first.needs.table.num_rows,
        "pieces": pieces, "buckets": len(first.buckets),
        "first_s": round(layout_s + meta_s + first_s, 4), "agent_first_s": round(first_s, 4),
        "next_s": round(statistics.median(s for s, _, _ in nexts), 4) if nexts else None,
        "build_s": round(cache.build_seconds, 4), "layout_s": round(layout_s, 4), "meta_s": round(meta_s, 4),
        "inputs_bytes": len(inputs.payload), "meta_bytes": sum(len(x) for x in payloads),
        "plan_mb": round(first.nbytes / 2**20),
        "cache_hits": cache.hits, "cache_misses": cache.misses,
        "delivered_bytes": first.delivered_bytes(), "looked_up": looked,
    }

    # --- trainer side of the first version: decode the inputs, build the plan --------------------------
    if not args.no_serve:
        payload, key, hash_ = inputs.payload, inputs.key, first.hash
        del first, nexts, inputs
        P._SOURCES.clear(), P._NEEDS.clear(), P._INPUTS.clear(), P._METAS.clear()
        cache = PlanCache()
        gc.collect()
        t = time.perf_counter()
        plan = cache.get_or_build_key(key, lambda: PlanInputs.decode(payload).build())
        plan.dsts_of(0), plan.sources[0]
        result["serve_first_s"] = round(time.perf_counter() - t, 4)
        assert plan.hash == hash_, "both sides must compute the same plan"
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
