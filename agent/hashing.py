"""The content hashes every side computes: a piece's digest leaf and the on-device weighted sum under the
`wsum64` leaf and checksum, in a module light enough for an engine process to import (torch and xxhash only).

The leaf is defined in agent/transfer/digest.py's docstring (xxh3_128 of the piece's bytes, seeded by its key; the
on-device weighted sum for CUDA buckets). The vLLM plugin (agent/engines/vllm_plugin.py) recomputes leaves
inside the engine's workers with this same code, which imports only torch and xxhash.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

MASK = (1 << 128) - 1
XXH3_128 = "xxh3_128"
WSUM = "wsum64"
WSUM_BLOCK = 1 << 12  # int64 words per block of the weighted sum
#: the leaves of a bucket: (piece key, leaf) in the bucket's order
Leaves = list[tuple[str, int]]


@dataclass(frozen=True)
class HashedLeaves:
    """A bucket's leaves with the hex strings its metadata carries, formatted once where they were hashed.

    Why: an MoE bucket has hundreds of pieces, and formatting a leaf costs about 1 us, as much as hashing a small
    piece's bytes. The trainer agent sends the same staged bytes to every replica (SentLeaves) and, over IPC, its
    own receiver compares what it hashed (HashedHere) against the metadata: both reuse `hexes` instead of
    formatting every leaf again for every transfer and every compare."""

    leaves: Leaves
    hexes: list[str]

    @classmethod
    def of(cls, leaves: Leaves) -> HashedLeaves:
        return cls(leaves, [fmt(v) for _, v in leaves])


def piece_key(name: str, dtype: str, global_shape: Iterable[int], offset: Iterable[int], shape: Iterable[int]) -> str:
    """The piece's identity: the same region of the same tensor has the same key whichever rank sends it."""
    return f"{name}|{dtype}|{','.join(map(str, global_shape))}|{','.join(map(str, offset))}|{','.join(map(str, shape))}"


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - xxhash is a declared dependency of the agent extra
        raise RuntimeError("the content digest needs the 'xxhash' package: pip install 'weightsync[agent]'") from exc
    return xxhash


def leaf(key: str, data: torch.Tensor, algorithm: str = XXH3_128) -> int:
    """The 128-bit leaf of one piece (`data`: its bytes, 1-d uint8)."""
    if algorithm == WSUM:
        return _wsum_leaf(key, int(wsum_total(data).item()), data.numel())
    if algorithm != XXH3_128:
        raise ValueError(f"unknown digest algorithm {algorithm!r}; supported: {XXH3_128}, {WSUM}")
    xx = _xxhash()
    seed = xx.xxh3_64_intdigest(key.encode())
    host = data if data.device.type == "cpu" else data.cpu()
    if host.numel() == 0:
        return int(xx.xxh3_128_intdigest(b"", seed=seed))
    if not host.is_contiguous():
        host = host.contiguous()
    return int(xx.xxh3_128_intdigest(host.numpy().data, seed=seed))


def _wsum_leaf(key: str, total: int, nbytes: int) -> int:
    """A WSUM leaf from the piece's on-device weighted sum (wsum_total, read back)."""
    inner = total & 0xFFFFFFFFFFFFFFFF
    return int(_xxhash().xxh3_128_intdigest(f"{key}|{inner:016x}|{nbytes}".encode()))


def fmt(value: int) -> str:
    return f"{value & MASK:032x}"


def wsum_total(data: torch.Tensor) -> torch.Tensor:
    """The sum of `_wsum` as a 0-d int64 tensor on the data's device, not yet read back: a caller with many
    pieces (a bucket's digest leaves) stacks them and reads them all at once, one device sync instead of one
    per piece."""
    n = data.numel()
    whole = n // 8 * 8
    words = data[:whole].view(torch.int64)
    nblocks = -(-words.numel() // WSUM_BLOCK) if words.numel() else 0
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if nblocks:
        full = words.numel() // WSUM_BLOCK * WSUM_BLOCK
        sums = []
        if full:
            sums.append(words[:full].view(-1, WSUM_BLOCK).sum(dim=1))
        if full < words.numel():
            sums.append(words[full:].sum().reshape(1))
        per_block = torch.cat(sums)
        weights = torch.arange(1, 2 * per_block.numel(), 2, dtype=torch.int64, device=data.device)
        total = (per_block * weights).sum()
    tail = data[whole:].to(torch.int64)
    if tail.numel():
        total = total + (tail * torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=data.device)).sum()
    return total
