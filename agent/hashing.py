"""One piece's digest leaf, in a module light enough for an engine process to import.

The leaf is defined in agent/transfer/digest.py's docstring (xxh3_128 of the piece's bytes, seeded by its key; the
on-device weighted sum for CUDA buckets). The vLLM plugin (agent/engines/vllm_plugin.py) recomputes leaves
inside the engine's workers with this same code, which imports only torch and xxhash.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MASK = (1 << 128) - 1
XXH3_128 = "xxh3_128"
WSUM = "wsum64"


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
        from weightsync.agent.transfer.verify import wsum_total

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
    """A WSUM leaf from the piece's on-device weighted sum (verify.wsum_total, read back)."""
    inner = total & 0xFFFFFFFFFFFFFFFF
    return int(_xxhash().xxh3_128_intdigest(f"{key}|{inner:016x}|{nbytes}".encode()))


def fmt(value: int) -> str:
    return f"{value & MASK:032x}"
