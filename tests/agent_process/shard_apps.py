"""Test apps for sharded layouts, run as processes next to real agents.

    python shard_apps.py trainer --rank R --fsdp F --versions N    # publishes its FSDP Shard(0) chunks
    python shard_apps.py engine --ranks 0,1 --out DIR               # one InferenceSession per TP rank

The model is a deterministic function of the version (`model(version)`), so the test knows every byte the
engine must end up with: the inference TP box of each tensor (agent/layout/rules.py rules) of model(version).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

NAMES = {
    "model.embed_tokens.weight": ((16, 6), torch.bfloat16),                    # vocab-parallel (dim 0)
    "model.layers.0.self_attn.q_proj.weight": ((8, 6), torch.float32),      # column-parallel (dim 0)
    "model.layers.0.self_attn.o_proj.weight": ((6, 8), torch.float32),      # row-parallel (dim 1)
    "model.layers.0.mlp.down_proj.weight": ((6, 4), torch.int8),            # row-parallel, int8
    "model.norm.weight": ((6,), torch.float32),                             # replicated
    "model.big.weight": ((1200, 500), torch.float32),  # replicated; each FSDP half (1.2 MB) spans 1 MB buckets
}


def model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for name, (shape, dtype) in NAMES.items():
        if dtype == torch.int8:
            out[name] = torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def fsdp_chunk(t: torch.Tensor, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk-style Shard(0) bounds (uneven last chunk, possibly empty)."""
    per = -(-t.shape[0] // world)
    start = min(rank * per, t.shape[0])
    return start, min(start + per, t.shape[0])


def run_trainer(rank: int, fsdp: int, versions: int, interval: float) -> None:
    from weightsync.agent.client import PlacedShard, TrainerSession

    with TrainerSession(rank=rank) as s:
        for v in range(1, versions + 1):
            shards = {}
            for name, t in model(v).items():
                a, b = fsdp_chunk(t, fsdp, rank)
                if b > a:
                    shards[name] = PlacedShard(t[a:b].clone(), tuple(t.shape), (a,) + (0,) * (t.dim() - 1))
            s.publish(shards, v)
            print(f"published version={v} rank={rank}", flush=True)
            time.sleep(interval)
    while True:
        time.sleep(3600)


def run_engine(ranks: list[int], out: Path) -> None:
    from weightsync.agent.client import InferenceSession

    out.mkdir(parents=True, exist_ok=True)

    def session(rank: int) -> InferenceSession:
        got: dict[str, torch.Tensor] = {}

        def on_begin(version: int) -> None:
            got.clear()

        def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
            for n, t in tensors:
                got[n] = t.clone()

        def on_commit(version: int) -> None:
            final = out / f"v{version}-rank{rank}.pt"
            partial = final.with_suffix(".pt.partial")
            torch.save(dict(got), partial)
            partial.replace(final)  # atomic: the test polls for the file and must never read half of it
            print(f"committed version={version} rank={rank}", flush=True)

        return InferenceSession(on_bucket, on_commit, on_begin=on_begin, rank=rank).start()

    sessions = [session(r) for r in ranks]
    print(f"engine ranks={ranks} sessions={len(sessions)}", flush=True)
    threading.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trainer")
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--fsdp", type=int, required=True)
    t.add_argument("--versions", type=int, default=3)
    t.add_argument("--interval", type=float, default=1.0)
    e = sub.add_parser("engine")
    e.add_argument("--ranks", required=True)
    e.add_argument("--out", required=True)
    a = p.parse_args()
    if a.what == "trainer":
        run_trainer(a.rank, a.fsdp, a.versions, a.interval)
    else:
        run_engine([int(r) for r in a.ranks.split(",")], Path(a.out))


if __name__ == "__main__":
    main()
