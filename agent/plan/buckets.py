"""Flattened buckets: many tensors packed into one contiguous byte buffer plus an index.

Why: one IPC handle or one collective then moves a whole bucket (slime measured 81% of the time in
per-tensor IPC handle open/close before flattening). The index (name, dtype, shape, offset) travels as
plain data; the bytes travel through a transport. Unpacking returns views, never copies.

Entries are aligned (default 256 bytes) so every view is suitably aligned for any dtype and for CUDA
vectorized copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_ALIGNMENT = 256

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


class BucketError(ValueError):
    """A bucket index or buffer does not fit what was asked (size, dtype, alignment)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("bfloat16"), stable across torch versions."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise BucketError(f"dtype {dtype} is not supported on the wire; supported: {sorted(_DTYPES)}")
    return name


def to_dtype(name: str) -> torch.dtype:
    """Inverse of dtype_name; raises BucketError naming the supported dtypes."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise BucketError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None


_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in _DTYPES.items()}


def itemsize(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given by wire name or torch dtype."""
    if isinstance(dtype, str):
        try:
            return _ITEMSIZE[dtype]
        except KeyError:
            to_dtype(dtype)  # raises a clear BucketError
            raise
    return dtype.itemsize


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


SMALL_ALIGNMENT = 16


def entry_offset(cursor: int, nbytes: int, alignment: int) -> int:
    """Where an entry of `nbytes` starts at or after `cursor`: `alignment`-aligned, except that entries
    smaller than `alignment` only get 16-byte alignment (enough for every dtype), so thousands of
    tiny tensors do not waste 256 bytes each."""
    return align_up(cursor, alignment if nbytes >= alignment else min(alignment, SMALL_ALIGNMENT))


@dataclass(frozen=True)
class BucketEntry:
    """One tensor's place in a bucket: `nbytes` bytes at byte `offset`, to be viewed as dtype/shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BucketEntry:
        return cls(str(d["name"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]), int(d["offset"]))


@dataclass(frozen=True)
class BucketLayout:
    """The index of a flattened bucket: entries in order and the total byte size of the buffer."""

    entries: tuple[BucketEntry, ...]
    nbytes: int
    alignment: int = DEFAULT_ALIGNMENT

    @classmethod
    def build(
        cls, items: Iterable[tuple[str, str | torch.dtype, Sequence[int]]], alignment: int = DEFAULT_ALIGNMENT
    ) -> BucketLayout:
        """Lay out (name, dtype, shape) items back to back, each entry starting at an aligned offset."""
        entries: list[BucketEntry] = []
        cursor = 0
        for name, dtype, shape in items:
            dname = dtype if isinstance(dtype, str) else dtype_name(dtype)
            dims = tuple(int(s) for s in shape)
            nbytes = math.prod(dims) * itemsize(dname)
            entry = BucketEntry(name, dname, dims, entry_offset(cursor, nbytes, alignment))
            entries.append(entry)
            cursor = entry.offset + entry.nbytes
        return cls(tuple(entries), cursor, alignment)

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries], "nbytes": self.nbytes, "alignment": self.alignment}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BucketLayout:
        layout = cls(
            tuple(BucketEntry.from_dict(e) for e in d["entries"]), int(d["nbytes"]), int(d.get("alignment", 1))
        )
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise BucketError if entries overlap, are misaligned or run past `nbytes` (untrusted index)."""
        end = 0
        for e in self.entries:
            to_dtype(e.dtype)
            if any(s < 0 for s in e.shape):
                raise BucketError(f"entry {e.name!r} has a negative dimension {e.shape}")
            if e.offset < end:
                raise BucketError(f"entry {e.name!r} at offset {e.offset} overlaps the previous entry (ends {end})")
            if e.offset % itemsize(e.dtype):
                raise BucketError(f"entry {e.name!r} offset {e.offset} is not aligned to its dtype {e.dtype}")
            end = e.offset + e.nbytes
        if end > self.nbytes:
            raise BucketError(f"bucket index needs {end} bytes but declares nbytes={self.nbytes}")


def allocate(nbytes: int, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 bucket buffer of `nbytes` on `device` (pinned host memory when asked and CUDA exists)."""
    pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def entry_view(buffer: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    """The entry's bytes in `buffer` as a tensor of its dtype and shape: a view, no copy."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise BucketError(f"bucket buffer must be a 1-d uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    end = entry.offset + entry.nbytes
    if end > buffer.numel():
        raise BucketError(f"entry {entry.name!r} ends at byte {end} but the buffer has {buffer.numel()} bytes")
    raw = buffer[entry.offset : end]
    dt = to_dtype(entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dt, device=buffer.device)
    return raw.view(dt).view(entry.shape)


def entry_views(buffer: torch.Tensor, entries: Sequence[BucketEntry]) -> list[torch.Tensor]:
    """entry_view of every entry, sliced from one typed view of `buffer` per dtype: a bucket of thousands of
    small tensors made three tensor ops per entry (about 5 us each) where two slices of a typed view do."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise BucketError(f"bucket buffer must be a 1-d uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    size = buffer.numel()
    typed: dict[str, torch.Tensor | None] = {}
    out: list[torch.Tensor] = []
    for e in entries:
        flat = typed.get(e.dtype, buffer)
        if flat is buffer:
            isz = itemsize(e.dtype)
            flat = typed[e.dtype] = buffer[: size // isz * isz].view(to_dtype(e.dtype)) \
                if buffer.storage_offset() % isz == 0 else None
        n = math.prod(e.shape)
        if flat is None or e.offset % flat.element_size() or not n:
            out.append(entry_view(buffer, e))  # an unaligned entry or buffer (its checks name the problem)
            continue
        start = e.offset // flat.element_size()
        if start + n > flat.numel():
            raise BucketError(f"entry {e.name!r} ends at byte {e.offset + n * flat.element_size()} but the buffer "
                              f"has {size} bytes")
        out.append(flat[start : start + n].view(e.shape))
    return out


def pack(buffer: torch.Tensor, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `tensors` (one per entry, any strides, same device or not) into `buffer` at their offsets."""
    if len(tensors) != len(layout.entries):
        raise BucketError(f"pack got {len(tensors)} tensors for {len(layout.entries)} entries")
    for entry, t in zip(layout.entries, tensors, strict=True):
        if tuple(t.shape) != entry.shape or dtype_name(t.dtype) != entry.dtype:
            raise BucketError(
                f"tensor for entry {entry.name!r} is {dtype_name(t.dtype)}{list(t.shape)}, "
                f"the index says {entry.dtype}{list(entry.shape)}"
            )
        if entry.nbytes:
            entry_view(buffer, entry).copy_(t)


def unpack(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for every entry. Views alias `buffer`: copy them before the buffer is reused."""
    return list(zip((e.name for e in layout.entries), entry_views(buffer, layout.entries), strict=True))


def flatten(
    named: Iterable[tuple[str, torch.Tensor]], alignment: int = DEFAULT_ALIGNMENT, device: torch.device | str | None = None
) -> tuple[torch.Tensor, BucketLayout]:
    """Pack named tensors into a fresh buffer (convenience for clients; the agent reuses buffers)."""
    items = list(named)
    layout = BucketLayout.build(((n, t.dtype, t.shape) for n, t in items), alignment)
    dev = device if device is not None else (items[0][1].device if items else "cpu")
    buffer = allocate(layout.nbytes, dev)
    pack(buffer, layout, [t for _, t in items])
    return buffer, layout
