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


@dataclass
class _Run:
    """Entries of one dtype and shape at equal spacing, in entry order though not necessarily adjacent (an MoE
    layer's gate, up and down projections interleave: each is a run): viewed with one as_strided over all of
    them and an unbind, or one as_strided for a run of one. In elements of the dtype."""

    dtype: str
    start: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    indices: list[int]  # which entries, in order
    spacing: int = 0
    end: int = 0  # one past the last element of the last entry


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _progressions(items: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(entry index, start) pairs in order, cut into maximal arithmetic progressions of their starts."""
    out: list[list[tuple[int, int]]] = []
    for item in items:
        cur = out[-1] if out else None
        if cur is not None and ((len(cur) == 1 and item[1] > cur[0][1]) or
                                (len(cur) > 1 and item[1] - cur[-1][1] == cur[1][1] - cur[0][1])):
            cur.append(item)
        else:
            out.append([item])
    return out


#: entries of one dtype and shape are read as up to this many interleaved progressions (an MoE layer's gate
#: and up projections, of one shape, alternate with down's)
_MAX_INTERLEAVE = 4


def _runs(entries: Sequence[BucketEntry]) -> list[_Run] | None:
    """The entries as runs, or None when some entry is empty or not aligned to its dtype (entry_view then
    names the problem, entry by entry). The entries of each dtype and shape are cut into the fewest arithmetic
    progressions of their starts, read every p-th entry for p up to _MAX_INTERLEAVE."""
    by_kind: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = {}
    for k, e in enumerate(entries):
        isz = itemsize(e.dtype)
        if not math.prod(e.shape) or e.offset % isz:
            return None
        by_kind.setdefault((e.dtype, e.shape), []).append((k, e.offset // isz))
    runs: list[_Run] = []
    for (dtype, shape), items in by_kind.items():
        best = min(([prog for i in range(p) for prog in _progressions(items[i::p])]
                    for p in range(1, _MAX_INTERLEAVE + 1)), key=len)
        n, strides = math.prod(shape), _contiguous_strides(shape)
        for prog in best:
            spacing = prog[1][1] - prog[0][1] if len(prog) > 1 else n
            runs.append(_Run(dtype, prog[0][1], shape, strides, [k for k, _ in prog], spacing, prog[-1][1] + n))
    return runs


#: entries -> their runs, by the identity of the entries' sequence (a plan's bucket layouts live as long as the
#: plan; a version receives the same ones again); bounded
_RUNS: dict[int, tuple[Sequence[BucketEntry], list[_Run] | None]] = {}
_RUNS_MAX = 4096


def _runs_of(entries: Sequence[BucketEntry]) -> list[_Run] | None:
    hit = _RUNS.get(id(entries))
    if hit is not None and hit[0] is entries:
        return hit[1]
    runs = _runs(entries)
    if len(_RUNS) >= _RUNS_MAX:
        _RUNS.clear()
    _RUNS[id(entries)] = (entries, runs)
    return runs


def entry_views(buffer: torch.Tensor, entries: Sequence[BucketEntry]) -> list[torch.Tensor]:
    """entry_view of every entry, made by runs of equal, equally spaced entries (`_Run`) from one typed view of
    `buffer` per dtype: a bucket of thousands of small tensors made two tensor ops per entry (slice and view,
    about 3 us each); an MoE bucket's experts now take one as_strided and an unbind per run (under 1 us per
    entry), a lone entry one as_strided. The runs are worked out once per layout."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise BucketError(f"bucket buffer must be a 1-d uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    runs = _runs_of(entries)
    size = buffer.numel()
    if runs is None or any(buffer.storage_offset() % itemsize(r.dtype) for r in runs):
        return [entry_view(buffer, e) for e in entries]  # an empty or unaligned entry, or an unaligned buffer
    typed: dict[str, torch.Tensor] = {}
    out: list[torch.Tensor] = [buffer] * len(entries)
    for r in runs:
        flat = typed.get(r.dtype)
        if flat is None:
            isz = itemsize(r.dtype)
            flat = typed[r.dtype] = buffer[: size // isz * isz].view(to_dtype(r.dtype))
        if r.end > flat.numel():
            bad = next(e for e in entries if e.offset + e.nbytes > size)
            raise BucketError(f"entry {bad.name!r} ends at byte {bad.offset + bad.nbytes} but the buffer has "
                              f"{size} bytes")
        at = flat.storage_offset() + r.start
        if len(r.indices) == 1:
            out[r.indices[0]] = flat.as_strided(r.shape, r.strides, at)
            continue
        for k, v in zip(r.indices, flat.as_strided((len(r.indices), *r.shape), (r.spacing, *r.strides), at).unbind(0),
                        strict=True):
            out[k] = v
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
