"""Delta sync: send only the words of a bucket that changed since the previous version.

Why in bucket byte space: the delta is computed on exactly the bytes the receiver assembles (the packed
wire bucket), so it is correct under any reshard plan; seed 002 found the corruption that follows from
computing a delta in one layout and applying it in another. Comparison is on raw integer words, so NaN
payloads, -0.0 and denormals are carried bit-exactly (a float comparison would call NaN != NaN "changed"
and -0.0 == 0.0 "unchanged").

Wire format of an encoded delta (one uint8 buffer):

    header  32 bytes  "WSD1", unit (1/2/4/8 bytes per word), total words, changed words, overflow gaps
    gaps    n bytes   distance to the previous changed word, 255 = "look in the overflow list"
    pad to 8
    overflow m x int64  the gaps >= 255, in order
    pad to unit
    values  n x unit  the new words

At 5% of bf16 elements changed this is ~7.5% of the full bucket (1 gap byte + 2 value bytes per change).

State (`DeltaBase`): the sender keeps the previous bucket bytes it sent and labels them with a random
base id; the receiver keeps the bytes it reconstructed and the id they carry. A delta names the base it
was computed against, so a receiver whose base differs (it missed or failed a version) takes the full
bucket instead: deltas heal themselves, and a full transfer and a delta transfer give identical bytes.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from weightsync.agent.plan.buckets import itemsize

MAGIC = b"WSD1"
_HEADER = struct.Struct("<4sB3xQQQ")  # magic, unit, pad, total words, changed words, overflow gaps
HEADER_BYTES = 32
assert _HEADER.size <= HEADER_BYTES
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """An encoded delta is malformed or does not fit the base it is applied to."""


@dataclass(frozen=True)
class DeltaConfig:
    """When to send a delta: the changed fraction of a bucket's words must be at most
    `max_changed_fraction` and the encoding must be smaller than the full bucket."""

    max_changed_fraction: float = 0.25
    unit: int | None = None  # bytes per compared word; None: the largest of 4/2/1 dividing the bucket

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_changed_fraction <= 1.0:
            raise ValueError(f"max_changed_fraction must be in [0, 1], got {self.max_changed_fraction}")
        if self.unit is not None and self.unit not in _UNIT_DTYPES:
            raise ValueError(f"unit must be one of {sorted(_UNIT_DTYPES)}, got {self.unit}")


def pick_unit(nbytes: int, preferred: int | None = None) -> int:
    """The word size used to compare a bucket of `nbytes`: 2 bytes suits bf16/fp16 weights (a changed
    bf16 element costs one word), falling back to 1 byte for odd sizes."""
    if preferred is not None and nbytes % preferred == 0:
        return preferred
    return 2 if nbytes % 2 == 0 else 1


def unit_for_dtypes(dtypes: Iterable[str]) -> int:
    """The word size for a bucket holding these dtypes: the gcd of their sizes (bf16 -> 2, fp32 -> 4,
    mixed bf16 + fp32 -> 2, anything with int8 -> 1), so one changed element is about one changed word."""
    g = 0
    for d in dtypes:
        g = math.gcd(g, itemsize(d))
    return g if g in _UNIT_DTYPES else 1


def max_encoded_bytes(nbytes: int) -> int:
    """An upper bound on the size of a useful encoding (never more than the full bucket plus header)."""
    return nbytes + HEADER_BYTES + 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Encoded:
    """The result of `encode`: `nbytes` bytes written to the output buffer, or None when a full bucket is
    the better choice (`changed_fraction` says why)."""

    nbytes: int | None
    changed_words: int
    total_words: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_words / self.total_words if self.total_words else 0.0


def changed_words(prev: torch.Tensor, cur: torch.Tensor, unit: int) -> torch.Tensor:
    """Indices (int64) of the `unit`-byte words that differ between two uint8 buffers, bit for bit."""
    dt = _UNIT_DTYPES[unit]
    return (prev.view(dt) != cur.view(dt)).nonzero().squeeze(1)


def encode(
    prev: torch.Tensor,
    cur: torch.Tensor,
    out: torch.Tensor,
    config: DeltaConfig | None = None,
    *,
    unit: int | None = None,
) -> Encoded:
    """Encode `cur` relative to `prev` (1-d uint8, same length, same device) into `out` (1-d uint8 of at
    least `max_encoded_bytes(len)` bytes). Returns Encoded(nbytes=None) when the full bucket should be
    sent instead (too many changes, or the delta would not be smaller)."""
    cfg = config or DeltaConfig()
    if prev.shape != cur.shape or prev.dtype != torch.uint8 or cur.dtype != torch.uint8 or cur.dim() != 1:
        raise DeltaError(f"encode needs two 1-d uint8 buffers of one length, got {tuple(prev.shape)} and "
                         f"{tuple(cur.shape)}")
    nbytes = cur.numel()
    unit = pick_unit(nbytes, cfg.unit or unit)
    total = nbytes // unit
    idx = changed_words(prev, cur, unit)
    n = idx.numel()
    if total == 0 or n > cfg.max_changed_fraction * total:
        return Encoded(None, n, total)
    gaps = torch.empty_like(idx)
    if n:
        gaps[0] = idx[0]
        torch.sub(idx[1:], idx[:-1], out=gaps[1:])
    big = gaps >= 255
    overflow = gaps[big]
    m = overflow.numel()
    gaps_off = HEADER_BYTES
    over_off = _align(gaps_off + n, 8)
    vals_off = _align(over_off + 8 * m, max(unit, 1))
    size = vals_off + n * unit
    if size >= nbytes:
        return Encoded(None, n, total)
    if out.numel() < size:
        raise DeltaError(f"delta output buffer has {out.numel()} bytes, the encoding needs {size}")
    header = _HEADER.pack(MAGIC, unit, total, n, m).ljust(HEADER_BYTES, b"\0")
    out[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    if n:
        out[gaps_off : gaps_off + n].copy_(gaps.clamp(max=255).to(torch.uint8))
        if m:
            out[over_off : over_off + 8 * m].view(torch.int64).copy_(overflow)
        dt = _UNIT_DTYPES[unit]
        out[vals_off:size].view(dt).copy_(cur.view(dt)[idx])
    return Encoded(size, n, total)


def apply(base: torch.Tensor, encoded: torch.Tensor) -> int:
    """Apply an encoded delta to `base` in place (1-d uint8); afterwards `base` holds the sender's new
    bytes exactly. Returns the number of changed words. Raises DeltaError on a malformed encoding."""
    if encoded.numel() < HEADER_BYTES:
        raise DeltaError(f"encoded delta of {encoded.numel()} bytes is shorter than its header")
    magic, unit, total, n, m = _HEADER.unpack(bytes(encoded[: _HEADER.size].cpu().numpy()))
    if magic != MAGIC or unit not in _UNIT_DTYPES:
        raise DeltaError(f"not a delta encoding (magic {magic!r}, unit {unit})")
    if total * unit != base.numel():
        raise DeltaError(f"delta is for {total * unit} bytes, the base has {base.numel()}")
    if n > total or m > n:
        raise DeltaError(f"delta header is inconsistent: {n} changes, {m} overflow gaps, {total} words")
    gaps_off = HEADER_BYTES
    over_off = _align(gaps_off + n, 8)
    vals_off = _align(over_off + 8 * m, unit)
    size = vals_off + n * unit
    if encoded.numel() < size:
        raise DeltaError(f"delta of {encoded.numel()} bytes is truncated; its header says {size}")
    if n == 0:
        return 0
    enc = encoded if encoded.device == base.device else encoded[:size].to(base.device)
    gaps = enc[gaps_off : gaps_off + n].to(torch.int64)
    big = gaps == 255
    if int(big.sum()) != m:
        raise DeltaError(f"delta has {int(big.sum())} escaped gaps but declares {m}")
    if m:
        gaps[big] = enc[over_off : over_off + 8 * m].view(torch.int64)
    idx = torch.cumsum(gaps, 0)
    if int(idx[-1]) >= total or (n > 1 and bool((gaps[1:] <= 0).any())):
        raise DeltaError("delta indices run past the bucket or are not increasing")
    dt = _UNIT_DTYPES[unit]
    base.view(dt)[idx] = enc[vals_off:size].view(dt)
    return n


def new_base_id() -> int:
    """A random 63-bit label for one version of one bucket's bytes."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclass
class DeltaBase:
    """The previous bytes of each bucket (by plan bucket index) and the id that labels them."""

    bytes_by_index: dict[int, torch.Tensor] = field(default_factory=dict)
    ids: dict[int, int | None] = field(default_factory=dict)

    def buffer(self, index: int, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The stored bytes of bucket `index` (allocated on first use; contents meaningful only when
        `ids[index]` is set)."""
        buf = self.bytes_by_index.get(index)
        if buf is None or buf.numel() != nbytes or buf.device != torch.device(device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.bytes_by_index[index] = buf
            self.ids[index] = None
        return buf

    def id_of(self, index: int) -> int | None:
        return self.ids.get(index)

    def invalidate(self, index: int | None = None) -> None:
        if index is None:
            self.ids.clear()
        else:
            self.ids[index] = None

    def total_bytes(self) -> int:
        return sum(b.numel() for b in self.bytes_by_index.values())


def wire_fraction(encoded_nbytes: int | None, full_nbytes: int) -> float:
    """Bytes on the wire relative to the full bucket (1.0 when the full bucket was sent)."""
    if full_nbytes == 0:
        return 0.0
    return (encoded_nbytes if encoded_nbytes is not None else full_nbytes) / full_nbytes
