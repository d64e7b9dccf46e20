"""Should the sender's digest pass be folded into the trainer's copy into staging? Times both on this machine.

    python bench/digest_fold.py [--mib 1024] [--runs 5] --json

The trainer's `publish()` copies its tensors into the staging file (memory-backed, as the pod's staging volume
is); that copy is what holds training. The trainer agent then hashes each piece (xxh3-128, `agent/transfer/digest.py`)
as it sends the bucket, pipelined with the wire. Folding the hash into the copy (each 1 MiB chunk hashed right
after it is copied, while it is in cache) saves a read of every byte from memory, but the trainer would pay
for it. One process, one thread (as torchrun starts a rank among several), median of RUNS, each variant in turn:

  copy                    dst.copy_(src), what publish() does now
  copy_chunked_1MiB       the same copy in 1 MiB chunks (the folded variant's copy alone)
  copy_with_hash_folded   each 1 MiB chunk copied, then hashed from the destination
  hash_pass_after         the agent's pass now: xxh3 over the staged bytes, 64 MiB at a time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import xxhash

CHUNK = 1 << 20
BUCKET = 64 << 20


def measure(nbytes: int, runs: int) -> dict[str, object]:
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=shm, prefix="digest-fold-") as f:
        dst = torch.from_file(f.name, shared=True, size=nbytes, dtype=torch.uint8)
        dst.fill_(0)  # pages faulted in once, as a reused staging segment's are

        def copy() -> None:
            dst.copy_(src)

        def copy_chunked() -> None:
            for o in range(0, nbytes, CHUNK):
                dst[o:o + CHUNK].copy_(src[o:o + CHUNK])

        def copy_with_hash_folded() -> None:
            h = xxhash.xxh3_128(seed=1)
            for o in range(0, nbytes, CHUNK):
                d = dst[o:o + CHUNK]
                d.copy_(src[o:o + CHUNK])
                h.update(d.numpy().data)

        def hash_pass_after() -> None:
            h = xxhash.xxh3_128(seed=1)
            for o in range(0, nbytes, BUCKET):
                h.update(dst[o:o + BUCKET].numpy().data)

        variants: dict[str, Callable[[], None]] = {
            "copy": copy, "copy_chunked_1MiB": copy_chunked, "copy_with_hash_folded": copy_with_hash_folded,
            "hash_pass_after": hash_pass_after}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(runs):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    return {
        "benchmark": "digest_fold", "bytes": nbytes, "runs": runs, "median_s": med,
        "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        # what folding would add to the time publish() holds the trainer, and what it would save in total
        "trainer_held_added_s": round(med["copy_with_hash_folded"] - med["copy"], 4),
        "cpu_saved_s": round(med["copy"] + med["hash_pass_after"] - med["copy_with_hash_folded"], 4),
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/digest_fold.py", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="bytes copied, in MiB (default 1024)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.mib << 20, a.runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
