"""The binary encoding of shard tables (and of plan inputs, and the per-pod metadata): a self-describing blob
of a JSON header and little-endian arrays (`pack_arrays` / `unpack_arrays`), integer columns stored as
offsets from their minimum in the narrowest unsigned type, tensor-name tables, and which tensors each rank
holds (a bitmap or an id list). Every decoder checks sizes before it makes an array: the bytes come from a
peer. ShardTable.sections / from_sections (plan/table.py) say which columns a table is."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_BLOB = struct.Struct("<4sB3xI")  # magic, version, JSON header length; then the header, then 8-aligned arrays
_BLOB_MAGIC = b"WSPB"
_BLOB_VERSION = 1
_WIRE_DTYPES = {"|u1", "<u2", "<u4", "<u8", "<i4", "<i8", "|b1"}


def pack_arrays(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """A self-describing binary blob: a JSON header (`meta` and where each array lies), then the arrays'
    little-endian bytes. Deterministic: the same meta and arrays give the same bytes."""
    sections: list[list[Any]] = []
    chunks: list[bytes | memoryview] = []
    pos = 0
    for name, a in arrays.items():
        le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        pad = -pos % 8
        if pad:
            chunks.append(b"\0" * pad)
            pos += pad
        sections.append([name, le.dtype.str, list(le.shape), pos, le.nbytes])
        chunks.append(le.data.cast("B") if le.nbytes else b"")
        pos += le.nbytes
    head = json.dumps({"meta": meta, "sections": sections}, separators=(",", ":"), sort_keys=True).encode()
    prefix = _BLOB.pack(_BLOB_MAGIC, _BLOB_VERSION, len(head)) + head
    return b"".join([prefix, b"\0" * (-len(prefix) % 8), *chunks])


def unpack_arrays(buf: bytes | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of pack_arrays; the arrays are read-only views of `buf`. Raises ValueError on anything
    malformed (sizes are checked before any array is made)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _BLOB.size:
        raise ValueError("too short for a weightsync blob")
    magic, version, hlen = _BLOB.unpack_from(mv)
    if magic != _BLOB_MAGIC or version != _BLOB_VERSION:
        raise ValueError(f"not a weightsync blob (magic {bytes(magic)!r}, version {version})")
    end = _BLOB.size + hlen
    if end > len(mv):
        raise ValueError("blob header runs past the end")
    doc = json.loads(bytes(mv[_BLOB.size:end]))
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("sections"), list):
        raise ValueError("blob header lacks meta/sections")
    base = end + (-end % 8)
    arrays: dict[str, np.ndarray] = {}
    for sec in doc["sections"]:
        if not (isinstance(sec, list) and len(sec) == 5 and isinstance(sec[0], str) and sec[1] in _WIRE_DTYPES
                and isinstance(sec[2], list) and all(isinstance(x, int) and x >= 0 for x in sec[2])
                and isinstance(sec[3], int) and isinstance(sec[4], int) and sec[3] >= 0):
            raise ValueError(f"bad blob section {sec!r}"[:200])
        name, dt, shape, off, nbytes = sec
        dtype = np.dtype(dt)
        count = math.prod(shape)
        if count * dtype.itemsize != nbytes or base + off + nbytes > len(mv):
            raise ValueError(f"blob section {name!r} does not fit the blob")
        arrays[name] = np.frombuffer(mv, dtype=dtype, count=count, offset=base + off).reshape(shape)
    return doc["meta"], arrays


def uint_width(span: int) -> int:
    """Bytes per value needed for 0..span (0: the column is constant)."""
    if span == 0:
        return 0
    return next(w for w in (1, 2, 4, 8) if span < 1 << (8 * w))


def put_column(arrays: dict[str, np.ndarray], name: str, col: np.ndarray, flip: int | None = None) -> list[int]:
    """Store an integer column (or `flip - col`) as value - min in the narrowest unsigned type, in one
    pass; returns [min, width] (width 0: every value is min and nothing is stored)."""
    if not len(col):
        return [0, 0]
    cmin, cmax = int(col.min()), int(col.max())
    lo, hi = (cmin, cmax) if flip is None else (flip - cmax, flip - cmin)
    w = uint_width(hi - lo)
    if w:
        out = np.empty(len(col), dtype=f"<u{w}")
        if flip is None:
            np.subtract(col, lo, out=out, casting="unsafe")
        else:
            np.subtract(cmax, col, out=out, casting="unsafe")  # flip - col - lo
        arrays[name] = out
    return [lo, w]


def _spec(spec: Any, name: str) -> tuple[int, int]:
    if not (isinstance(spec, list) and len(spec) == 2 and all(isinstance(x, int) for x in spec)
            and spec[1] in (0, 1, 2, 4, 8) and abs(spec[0]) < 1 << 62):
        raise ValueError(f"bad column spec for {name}")
    return spec[0], spec[1]


def get_column(arrays: Mapping[str, np.ndarray], name: str, spec: Any, n: int) -> np.ndarray:
    lo, w = _spec(spec, name)
    if w == 0:
        return np.full(n, lo, dtype=np.int64)
    a = arrays.get(name)
    if a is None or a.shape != (n,) or a.dtype.itemsize != w:
        raise ValueError(f"column {name} is missing or has the wrong size")
    return a.astype(np.int64) + lo


def read_column(arrays: Mapping[str, np.ndarray], name: str, spec: Any, out: np.ndarray,
                 flip: int | np.ndarray | None = None) -> None:
    """Inverse of put_column, written into `out` (int32 or int64) without int64 temporaries."""
    lo, w = _spec(spec, name)
    limit = np.iinfo(out.dtype).max
    if w == 0:
        if flip is None:
            out.fill(lo)
        elif isinstance(flip, int):
            out.fill(flip - lo)
        else:
            np.subtract(flip, lo, out=out)
        return
    a = arrays.get(name)
    if a is None or a.shape != out.shape or a.dtype.itemsize != w:
        raise ValueError(f"column {name} is missing or has the wrong size")
    if not 0 <= lo <= limit or lo + (int(a.max()) if w >= out.dtype.itemsize else (1 << 8 * w) - 1) > limit:
        raise ValueError(f"column {name} does not fit {out.dtype}")
    out[...] = a
    out += lo
    if flip is not None:
        np.subtract(flip, out, out=out)


_NAMES: dict[bytes, tuple[str, ...]] = {}  # name tables seen: every pod's metadata carries the same one


_ENCODED: dict[int, tuple[tuple[str, ...], np.ndarray, np.ndarray]] = {}  # id(names) -> (names, lengths, utf-8)


def encode_names(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    got = _ENCODED.get(id(names))
    if got is not None and got[0] is names:
        return got[1], got[2]
    enc = [n.encode() for n in names]
    lens, blob = np.array([len(e) for e in enc], dtype="<u4"), np.frombuffer(b"".join(enc), dtype=np.uint8)
    if len(_ENCODED) >= 16:
        _ENCODED.pop(next(iter(_ENCODED)))
    _ENCODED[id(names)] = (names, lens, blob)  # holding `names` keeps its id from being reused
    return lens, blob


def decode_names(lens_a: np.ndarray, blob_a: np.ndarray, T: int) -> tuple[str, ...]:
    import xxhash

    h = xxhash.xxh3_128(lens_a.tobytes())
    h.update(blob_a.tobytes())
    key = h.digest()
    got = _NAMES.get(key)
    if got is not None and len(got) == T:
        return got
    lens, blob = lens_a.astype(np.int64), blob_a.tobytes()
    if lens.shape != (T,) or int(lens.sum()) != len(blob):
        raise ValueError("tensor names do not add up")
    ends = np.cumsum(lens).tolist()
    names = tuple(blob[a:b].decode() for a, b in zip([0, *ends][: len(ends)], ends, strict=True))
    if len(_NAMES) >= 16:
        _NAMES.pop(next(iter(_NAMES)))
    _NAMES[key] = names
    return names


def put_rows(arrays: dict[str, np.ndarray], meta: dict[str, Any], indptr: np.ndarray, tensor: np.ndarray,
             T: int) -> None:
    """Which of T tensors each rank holds (rank r's rows are tensor[indptr[r]:indptr[r + 1]], ascending) into
    `arrays` and `meta["rows_as"]`: a presence bitmap or the id list, whichever is smaller."""
    R, N = len(indptr) - 1, len(tensor)
    bitmap_bytes, list_bytes = (R * T + 7) // 8, 8 * (R + 1) + N * max(1, uint_width(max(T - 1, 0)))
    if bitmap_bytes <= list_bytes and N == R * T:  # every rank holds every tensor
        bits = np.full(bitmap_bytes, 255, dtype=np.uint8)
        if N % 8:
            bits[-1] = (0xFF00 >> (N % 8)) & 0xFF
        arrays["present"] = bits
        meta["rows_as"] = "bitmap"
    elif bitmap_bytes <= list_bytes:
        present = np.zeros((R, T), dtype=bool)
        present[np.repeat(np.arange(R), np.diff(indptr)), tensor] = True
        arrays["present"] = np.packbits(present.reshape(-1))
        meta["rows_as"] = "bitmap"
    else:
        arrays["indptr"] = indptr
        meta["rows_as"] = "list"
        meta["tensor"] = put_column(arrays, "tensor", tensor.astype(np.int64))


def get_rows(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], R: int, T: int, N: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of put_rows for R ranks, T tensors and N rows: (indptr, tensor). Raises ValueError on an
    encoding that does not add up (KeyError / TypeError on a missing or malformed entry)."""
    if meta["rows_as"] == "bitmap":
        bits = arrays["present"]
        if bits.shape != ((R * T + 7) // 8,):
            raise ValueError("bad presence bitmap")
        if N == R * T:  # every rank holds every tensor
            full_bytes_ok = not (bits[: N // 8] != 255).any()
            tail_ok = N % 8 == 0 or bits[-1] == (0xFF00 >> (N % 8)) & 0xFF
            if not (full_bytes_ok and tail_ok):
                raise ValueError("presence bitmap and row count disagree")
            return np.arange(R + 1, dtype=np.int64) * T, np.tile(np.arange(T, dtype=np.int32), R)
        r_idx, t_idx = np.nonzero(np.unpackbits(bits, count=R * T).reshape(R, T))
        if len(t_idx) != N:
            raise ValueError("presence bitmap and row count disagree")
        return np.concatenate([[0], np.cumsum(np.bincount(r_idx, minlength=R))]), t_idx.astype(np.int32)
    if meta["rows_as"] == "list":
        indptr = arrays["indptr"]
        if indptr.shape != (R + 1,):
            raise ValueError("bad row pointers")
        return indptr, get_column(arrays, "tensor", meta["tensor"], N)
    raise ValueError(f"unknown row encoding {meta['rows_as']!r}")
