"""Trainer and Custom engine processes for the ring staging tests (test_ring_staging.py).

    python ring_apps.py trainer --run DIR [--hold-timeout S]   # publishes version v when DIR/go-v appears
    python ring_apps.py engine --run DIR [--slow V]            # loads version V slowly

The model: TENSORS fp32 tensors of ROWS x COLS (1 MiB each); version v of tensor i is `base(i) + v`, so the
engine checks every tensor it committed bit for bit without talking to the trainer."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

TENSORS, ROWS, COLS = 8, 256, 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (i + 1)
            + version for i in range(TENSORS)}


def _append(path: Path, row: dict[str, object]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def trainer(run: Path, hold_timeout: float) -> None:
    from weightsync.agent.client import TrainerSession

    w = weights(0)
    with TrainerSession(rank=0, hold_timeout=hold_timeout) as s:
        v = 1
        while True:
            while not (run / f"go-{v}").exists():
                time.sleep(0.01)
            for t in w.values():
                t.add_(1)  # training: version v is base + v
            t0 = time.time()
            res = s.publish(w, v)
            _append(run / "published.jsonl", {"version": v, "served": res.served, "streamed": res.streamed,
                                              "seconds": time.time() - t0})
            v += 1


def engine(run: Path, slow: int) -> None:
    from weightsync.agent.client import InferenceSession

    params: dict[str, torch.Tensor] = {}

    def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if version == slow:
            (run / f"loading-{version}").touch()
            time.sleep(0.4)  # a slow engine: the load spans seconds, so a test can kill the receiver mid-stream
        for n, t in tensors:
            params[n] = t.clone()

    def on_commit(version: int) -> None:
        want = weights(version)
        exact = set(params) == set(want) and all(torch.equal(params[n], want[n]) for n in want)
        _append(run / "commits.jsonl", {"version": version, "bit_exact": exact})

    def on_abort(version: int, reason: str) -> None:
        _append(run / "aborts.jsonl", {"version": version, "reason": reason})

    InferenceSession(on_bucket, on_commit, on_abort=on_abort, rank=0).start()
    threading.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("trainer", "engine"))
    p.add_argument("--run", required=True)
    p.add_argument("--hold-timeout", type=float, default=60.0)
    p.add_argument("--slow", type=int, default=-1)
    a = p.parse_args()
    if a.what == "trainer":
        trainer(Path(a.run), a.hold_timeout)
    else:
        engine(Path(a.run), a.slow)


if __name__ == "__main__":
    main()
