"""`verify: Checksum`: a per-bucket checksum computed by the sender, checked by the receiver before the
bucket's tensors are handed on, with a retry-then-fail policy.

Why per bucket (not per tensor): the bucket is the unit a transport moves and the unit a transport can
fetch again, so a mismatch is retried exactly where it happened; a version whose bucket still mismatches
after the retries fails as a whole and is never committed (the sync layer aborts it).

Algorithms (the sender names the one it used; the receiver computes the same one):
* ``xxh3_64`` (PyPI ``xxhash``): host memory, ~10 GB/s per core; the default for CPU buckets.
* ``wsum64``: a position-weighted 64-bit sum computed with torch on the bucket's own device, so a GPU
  bucket is checked without a device-to-host copy. Weaker than xxh3 (linear), but detects flipped,
  zeroed and swapped words across blocks, which is what a bad DMA or a stale buffer produces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.hashing import wsum_total
from weightsync.agent.plan import BucketPlan
from weightsync.agent.transfer.sync import SyncHooks

log = logging.getLogger(__name__)

XXH3 = "xxh3_64"
WSUM = "wsum64"
ALGORITHMS = (XXH3, WSUM)


class ChecksumMismatch(RuntimeError):
    """A bucket's bytes still differ from the sender's checksum after every allowed retry."""


def _xxh3(data: torch.Tensor) -> str:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - xxhash is a declared dependency of the agent extra
        raise RuntimeError("verify: Checksum needs the 'xxhash' package: pip install 'weightsync[agent]'") from exc
    host = data if data.device.type == "cpu" else data.cpu()
    if not host.is_contiguous():
        host = host.contiguous()
    if host.numel() == 0:
        return f"{xxhash.xxh3_64_intdigest(b''):016x}"
    return f"{xxhash.xxh3_64_intdigest(host.numpy().data):016x}"


def _wsum(data: torch.Tensor) -> str:
    """sum_b (2b+1) * sum(words of block b) mod 2^64, plus the tail bytes and the length."""
    return f"{int(wsum_total(data).item()) & 0xFFFFFFFFFFFFFFFF:016x}:{data.numel()}"


def default_algorithm(data: torch.Tensor) -> str:
    """xxh3 for host buffers, the on-device weighted sum for accelerator buffers."""
    return XXH3 if data.device.type == "cpu" else WSUM


def checksum(data: torch.Tensor, algorithm: str | None = None) -> str:
    """The checksum of a 1-d uint8 tensor as a hex string (raw bytes: NaN payloads and -0.0 count)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"checksum expects a 1-d uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    algo = algorithm or default_algorithm(data)
    if algo == XXH3:
        return _xxh3(data)
    if algo == WSUM:
        return _wsum(data)
    raise ValueError(f"unknown checksum algorithm {algo!r}; supported: {', '.join(ALGORITHMS)}")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a mismatching bucket is fetched again before the version fails."""

    retries: int = 2

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


def check_with_retries(
    data: torch.Tensor,
    expected: str,
    algorithm: str,
    refetch: Callable[[], torch.Tensor] | None,
    policy: RetryPolicy,
    *,
    what: str = "bucket",
) -> int:
    """Check `data` against `expected`; on a mismatch call `refetch()` (which fetches the bytes again and
    returns them) up to `policy.retries` times. Returns the number of retries used; raises
    ChecksumMismatch when the bytes never matched (or there is no way to fetch them again).

    Pure apart from the callables: the policy is testable without any transport.
    """
    got = checksum(data, algorithm)
    tries = 0
    while got != expected:
        if refetch is None or tries >= policy.retries:
            how = "no way to fetch it again" if refetch is None else f"{tries} retries"
            raise ChecksumMismatch(
                f"{what}: checksum {algorithm} is {got}, the sender computed {expected} ({how}); the bytes were "
                "corrupted in transit or the sender's buffer changed while it was read"
            )
        tries += 1
        log.warning("verify.retry what=%s attempt=%s got=%s expected=%s", what, tries, got, expected)
        data = refetch()
        got = checksum(data, algorithm)
    return tries


@dataclass
class VerifyStats:
    """Counters for logs, /metrics and the bench."""

    buckets: int = 0
    bytes: int = 0
    retries: int = 0
    failures: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ChecksumHooks(SyncHooks):
    """SyncHooks for `verify: Checksum`.

    Sender: `on_send_bucket` returns {"checksum", "algorithm"} for the packed bucket (it travels as the
    `sync.bucket` frame). Receiver: `on_recv_bucket` checks the arrived bytes before any tensor is handed
    on; on a mismatch it asks `refetch(bucket)` for the bytes again (a transport that can re-read a
    bucket, e.g. GDR's one-sided READ, passes its `refetch`), then raises ChecksumMismatch, which fails
    the version (the receiver never commits it).
    """

    algorithm: str | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    refetch: Callable[[BucketPlan], torch.Tensor] | None = None
    stats: VerifyStats = field(default_factory=VerifyStats)

    def on_send_bucket(self, version: int, bucket: BucketPlan, data: torch.Tensor) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        algo = self.algorithm or default_algorithm(data)
        digest = checksum(data, algo)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.buckets += 1
        self.stats.bytes += data.numel()
        return {"checksum": digest, "algorithm": algo}

    def on_recv_bucket(
        self, version: int, bucket: BucketPlan, data: torch.Tensor, meta: Mapping[str, Any] | None
    ) -> None:
        what = f"bucket {bucket.index} of version {version} from source rank {bucket.src}"
        if not meta or "checksum" not in meta:
            self.stats.failures += 1
            raise ChecksumMismatch(f"{what}: the sender sent no checksum; both sides must run verify: Checksum")
        refetch = None
        if self.refetch is not None:
            fetch = self.refetch

            def refetch() -> torch.Tensor:
                return fetch(bucket)

        t0 = time.perf_counter()
        try:
            self.stats.retries += check_with_retries(
                data, str(meta["checksum"]), str(meta.get("algorithm", XXH3)), refetch, self.policy, what=what
            )
        except ChecksumMismatch:
            self.stats.failures += 1
            raise
        finally:
            self.stats.seconds += time.perf_counter() - t0
        self.stats.buckets += 1
        self.stats.bytes += data.numel()


def throughput(nbytes: int = 256 << 20, algorithm: str = XXH3, repeats: int = 3) -> dict[str, Any]:
    """Checksum throughput on a random host buffer (best of `repeats`), for the bench."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        checksum(data, algorithm)
        best = min(best, time.perf_counter() - t0)
    return {"algorithm": algorithm, "bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9}


def checksum_hooks(transport: object | None = None, *, retries: int = 2, algorithm: str | None = None) -> ChecksumHooks:
    """ChecksumHooks wired to a transport: retries use its `refetch(bucket)` when it has one (GDR can
    read a bucket again; push transports cannot, so a mismatch there fails the version at once)."""
    return ChecksumHooks(algorithm=algorithm, policy=RetryPolicy(retries), refetch=getattr(transport, "refetch", None))
