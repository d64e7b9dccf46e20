"""Reshard plan at scale: the first version of a layout (plan built) and every later one (plan reused).

    .venv/bin/python bench/plan_scale.py --tensors 70000 --ranks 256 --json

The model: `--tensors` 2-d bf16 tensors (hidden x hidden/4 .. hidden), FSDP Shard(0) over `--ranks`
trainer ranks (every tensor split by rows over all ranks, the FSDP2 layout), to `--inference-tp` ranks
that each need a column shard of every tensor (TP). Per version, an agent encodes the plan inputs (what
the destination sends each source) and asks the agent's plan cache (agent/plan_cache.py) for the plan:
`first_s` is the first version (build), `next_s` the median of the next `--versions` (inputs encoded and
hashed, plan reused), `build_s` the plan build alone. One JSON object with the sizes and the plan's
bucket count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from weightsync.agent import protocol as P
from weightsync.agent.plan import TensorShard, TransferPlan, build_plan
from weightsync.agent.plan_cache import PlanCache


def layout(tensors: int, ranks: int, inference_tp: int, hidden: int) -> tuple[list[list[TensorShard]], list[list[TensorShard]]]:
    sources: list[list[TensorShard]] = [[] for _ in range(ranks)]
    needs: list[list[TensorShard]] = [[] for _ in range(inference_tp)]
    for i in range(tensors):
        rows = max(ranks, (hidden // 4) * (1 + i % 4))
        cols = hidden
        shape = (rows, cols)
        per = -(-rows // ranks)
        for r in range(ranks):
            start = min(r * per, rows)
            n = min(per, rows - start)
            if n > 0:
                sources[r].append(TensorShard.of(f"t{i}", "bfloat16", shape, (start, 0), (n, cols)))
        cper = cols // inference_tp
        for d in range(inference_tp):
            needs[d].append(TensorShard.of(f"t{i}", "bfloat16", shape, (0, d * cper), (rows, cper)))
    return sources, needs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/plan_scale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=8, help="trainer (FSDP) ranks")
    p.add_argument("--inference-tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--versions", type=int, default=5, help="later versions timed with the plan reused")
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    sources, needs = layout(args.tensors, args.ranks, args.inference_tp, args.hidden)
    layout_s = time.perf_counter() - t0
    bucket_bytes = args.bucket_mb << 20
    cache = PlanCache()

    def one_version() -> tuple[float, TransferPlan]:
        t = time.perf_counter()
        inputs = P.encode_plan_inputs(sources, needs, bucket_bytes)
        plan = cache.get_or_build(inputs, lambda: build_plan(sources, needs, bucket_bytes))
        return time.perf_counter() - t, plan

    first_s, first = one_version()
    nexts = [one_version() for _ in range(args.versions)]
    assert all(p is first for _, p in nexts), "a later version with the same layout must reuse the plan"
    t0 = time.perf_counter()
    inputs_bytes = len(P.encode_plan_inputs(sources, needs, bucket_bytes))
    encode_s = time.perf_counter() - t0
    result = {
        "tensors": args.tensors, "ranks": args.ranks, "inference_tp": args.inference_tp,
        "shards": sum(len(s) for s in sources) + sum(len(n) for n in needs),
        "buckets": len(first.buckets),
        "first_s": round(first_s, 4), "next_s": round(statistics.median(s for s, _ in nexts), 4),
        "build_s": round(cache.build_seconds, 4), "encode_inputs_s": round(encode_s, 4),
        "inputs_bytes": inputs_bytes, "layout_s": round(layout_s, 4),
        "cache_hits": cache.hits, "cache_misses": cache.misses,  # versions + 1 calls: 1 build, the rest hits
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
