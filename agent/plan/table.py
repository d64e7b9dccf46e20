"""The columnar shard table (`ShardTable`): how one side's boxes are held as numpy arrays, and which columns
it is sent as between agents without an object per shard (the encoding itself: plan/encoding.py)."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any, overload

import numpy as np

from weightsync.agent.plan.buckets import to_dtype
from weightsync.agent.plan.encoding import (
    decode_names,
    encode_names,
    get_rows,
    pack_arrays,
    put_column,
    put_rows,
    read_column,
    unpack_arrays,
)
from weightsync.agent.plan.types import Box, PlanError, TensorShard, _box, _rows, _shard, _streamed


class RankShards(Sequence[TensorShard]):
    """Rank `rank` of a ShardTable as a sequence of TensorShard (made on first use). What decode_meta
    hands out: code that wants objects gets them, code that knows tables (ShardTable.stack) reads the
    arrays without making any."""

    __slots__ = ("rank", "table")

    def __init__(self, table: ShardTable, rank: int) -> None:
        self.table = table
        self.rank = rank

    def __len__(self) -> int:
        return int(self.table.indptr[self.rank + 1] - self.table.indptr[self.rank])

    @overload
    def __getitem__(self, i: int) -> TensorShard: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[TensorShard]: ...

    def __getitem__(self, i: int | slice) -> TensorShard | Sequence[TensorShard]:
        return self.table.shards(self.rank)[i]

    def __iter__(self) -> Iterator[TensorShard]:
        return iter(self.table.shards(self.rank))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.table.shards(self.rank) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.table.shards(self.rank))

    def __repr__(self) -> str:
        return f"<{len(self)} shards of {self.table.kind} rank {self.rank}>"


# --- columnar shards ------------------------------------------------------------------------------------


def _as_i64(a: Any, ndim: int) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=np.int64)
    if out.ndim != ndim:
        raise PlanError(f"expected a {ndim}-d array, got shape {out.shape}")
    return out


_I32_MAX = (1 << 31) - 1


def coord_dtype(max_dim: int) -> type[np.signedinteger[Any]]:
    """int32 box coordinates when every dim fits (half the memory and bandwidth), else int64."""
    return np.int32 if max_dim <= _I32_MAX else np.int64


class ShardTable:
    """Every rank's shards of one side (sources or needs), as arrays.

    Why: 70,000 tensors on 256 ranks are 18M shards; as objects they take minutes and gigabytes, as
    arrays a plan over them takes seconds. Tensors are sorted by name and a tensor's id is its position;
    rank r's rows are `indptr[r]:indptr[r + 1]`, sorted by tensor id, at most one per tensor. Boxes are
    columns: `off[k]` / `shp[k]` hold dim k of every row (dim-major, so per-dim arithmetic is contiguous),
    in int32 unless a global dim needs int64; dims are padded to `ndim_max` with offset 0 and size 1.
    Treat it as immutable: derived data (encoding, digest, dense view, shard objects) is memoized.
    """

    def __init__(self, names: Sequence[str], dtypes: Sequence[str], gshape: Any, ndim: Any, indptr: Any,
                 tensor: Any, offset: Any, shape: Any, *, kind: str = "source", check: bool = True,
                 dims_first: bool = False) -> None:
        """`offset` / `shape` are [rows, dims] (or [dims, rows] with dims_first)."""
        self.names: tuple[str, ...] = tuple(names)
        self.dtypes: tuple[str, ...] = tuple(dtypes)
        self.gshape = _as_i64(gshape, 2)
        self.ndim = _as_i64(ndim, 1)
        self.indptr = _as_i64(indptr, 1)
        self.tensor = np.ascontiguousarray(tensor, dtype=np.int32)
        self.cdt = coord_dtype(int(self.gshape.max()) if self.gshape.size else 0)
        off, shp = np.asarray(offset), np.asarray(shape)
        if off.ndim != 2 or shp.ndim != 2:
            raise PlanError(f"{kind} table: boxes must be 2-d arrays, got {off.shape} / {shp.shape}")
        if not dims_first:
            off, shp = off.T, shp.T
        narrow = self.cdt == np.int32 and off.dtype.itemsize > 4
        if check and narrow and off.size and (max(off.max(), shp.max()) > _I32_MAX or min(off.min(), shp.min()) < 0):
            raise PlanError(f"{kind} table: box coordinates must lie in 0..{int(self.gshape.max())}")
        self.off = np.ascontiguousarray(off, dtype=self.cdt)
        self.shp = np.ascontiguousarray(shp, dtype=self.cdt)
        self.kind = kind
        self._shards: dict[int, tuple[TensorShard, ...]] = {}
        self._sections: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None
        if check:
            self._check()

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_lists(cls, ranks: Sequence[Sequence[TensorShard]], kind: str = "source") -> ShardTable:
        """From per-rank lists of TensorShard; raises the PlanError the rules call for (a tensor twice on
        one rank, two ranks disagreeing on a tensor's dtype or global shape)."""
        meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for r, shards in enumerate(ranks):
            seen: set[str] = set()
            for s in shards:
                if s.name in seen:
                    raise PlanError(f"{kind} rank {r} lists tensor {s.name!r} twice; one box per tensor and rank")
                seen.add(s.name)
                m = meta.get(s.name)
                if m is None:
                    meta[s.name] = (s.dtype, s.global_shape, r)
                elif (m[0], m[1]) != (s.dtype, s.global_shape):
                    raise PlanError(
                        f"tensor {s.name!r}: {kind} rank {m[2]} says {m[0]}{list(m[1])} but {kind} rank {r} says "
                        f"{s.dtype}{list(s.global_shape)}; trainer and inference must describe the same model"
                    )
        names = sorted(meta)
        idx = {n: i for i, n in enumerate(names)}
        D = max([1, *(len(m[1]) for m in meta.values())])
        gshape = np.ones((len(names), D), dtype=np.int64)
        ndim = np.zeros(len(names), dtype=np.int64)
        for i, n in enumerate(names):
            gs = meta[n][1]
            ndim[i] = len(gs)
            gshape[i, : len(gs)] = gs
        indptr = [0]
        tensor: list[int] = []
        offs: list[tuple[int, ...]] = []
        shps: list[tuple[int, ...]] = []
        for shards in ranks:
            for s in sorted(shards, key=lambda s: idx[s.name]):
                pad = D - s.box.ndim
                tensor.append(idx[s.name])
                offs.append(s.box.offset + (0,) * pad)
                shps.append(s.box.shape + (1,) * pad)
            indptr.append(len(tensor))
        return cls(names, [meta[n][0] for n in names], gshape, ndim, indptr, tensor,
                   np.array(offs, dtype=np.int64).reshape(-1, D), np.array(shps, dtype=np.int64).reshape(-1, D),
                   kind=kind, check=False)

    @classmethod
    @_streamed
    def from_dense(cls, names: Sequence[str], dtypes: Sequence[str], global_shapes: Sequence[Sequence[int]],
                   offset: np.ndarray, shape: np.ndarray, present: np.ndarray | None = None, *,
                   kind: str = "source", dims_first: bool = False) -> ShardTable:
        """From [ranks, tensors, dims] offset/shape arrays ([dims, ranks, tensors] with dims_first; dims
        padded with offset 0, shape 1) and an optional [ranks, tensors] mask of the shards that exist:
        what a vectorized layout produces. Tensors need not be sorted by name."""
        if not dims_first:
            offset, shape = np.moveaxis(offset, 2, 0), np.moveaxis(shape, 2, 0)
        T = len(names)
        D = offset.shape[0] if offset.ndim == 3 else 0
        R = offset.shape[1] if offset.ndim == 3 else 0
        if offset.shape != (D, R, T) or shape.shape != (D, R, T) or D < 1:
            raise PlanError(f"offset/shape must be [ranks, {T} tensors, dims >= 1], got {offset.shape} / {shape.shape}")
        order = sorted(range(T), key=names.__getitem__)
        if order != list(range(T)):
            names = [names[i] for i in order]
            dtypes = [dtypes[i] for i in order]
            global_shapes = [global_shapes[i] for i in order]
            offset, shape = offset[:, :, order], shape[:, :, order]
            present = None if present is None else present[:, order]
        gshape = np.ones((T, D), dtype=np.int64)
        ndim = np.zeros(T, dtype=np.int64)
        for i, gs in enumerate(global_shapes):
            if len(gs) > D:
                raise PlanError(f"tensor {names[i]!r} has {len(gs)} dims but the arrays only {D}")
            ndim[i] = len(gs)
            gshape[i, : len(gs)] = gs
        tensor: np.ndarray
        if present is None:
            indptr = np.arange(R + 1, dtype=np.int64) * T
            tensor = np.tile(np.arange(T, dtype=np.int32), R)
            off, shp = offset.reshape(D, R * T), shape.reshape(D, R * T)
        else:
            r_idx, t_idx = np.nonzero(present)
            indptr = np.concatenate([[0], np.cumsum(np.bincount(r_idx, minlength=R))])
            tensor = t_idx
            off, shp = offset[:, r_idx, t_idx], shape[:, r_idx, t_idx]
        return cls(names, dtypes, gshape, ndim, indptr, tensor, off, shp, kind=kind, dims_first=True)

    @classmethod
    @_streamed
    def split_even(cls, tensors: ShardTable, dims: np.ndarray, parts: int, kind: str = "destination") -> ShardTable:
        """`parts` ranks, rank r holding part r of every tensor of `tensors` (names, dtypes, global
        shapes) split evenly along dims[t] (-1: the whole tensor): a tensor-parallel layout. The caller
        checks divisibility."""
        T, D = len(tensors.names), tensors.ndim_max
        g = tensors.gshape.T.astype(tensors.cdt)  # [dims, tensors]
        off = np.zeros((D, parts, T), dtype=tensors.cdt)
        shp = np.broadcast_to(g[:, None, :], (D, parts, T)).copy()
        for k in range(D):
            sel = dims == k
            if sel.any():
                size = g[k, sel] // parts
                off[k][:, sel] = np.arange(parts, dtype=tensors.cdt)[:, None] * size[None, :]
                shp[k][:, sel] = size[None, :]
        return cls(tensors.names, tensors.dtypes, tensors.gshape, tensors.ndim, np.arange(parts + 1) * T,
                   np.tile(np.arange(T, dtype=np.int32), parts), off.reshape(D, parts * T), shp.reshape(D, parts * T),
                   kind=kind, check=False, dims_first=True)

    @classmethod
    @_streamed
    def stack(cls, rows: Sequence[tuple[ShardTable, int] | None], kind: str = "source") -> ShardTable:
        """A table whose rank r is rank `rows[r][1]` of table `rows[r][0]` (None: holds nothing). Used to
        join the per-pod metadata of every trainer pod into the sources of a plan; tensors no rank holds
        are left out, and the tables must agree on the dtype and global shape of every tensor."""
        tables: list[ShardTable] = []
        for item in rows:
            if item is not None and all(item[0] is not t for t in tables):
                tables.append(item[0])
        if not tables:
            return cls([], [], np.ones((0, 1)), [], np.zeros(len(rows) + 1), [], np.zeros((0, 1)),
                       np.zeros((0, 1)), kind=kind, check=False)
        first = tables[0]
        D = max(t.ndim_max for t in tables)
        wide = [t.padded(D) for t in tables]
        names: Sequence[str]
        maps: list[np.ndarray | None]
        if all(t.names == first.names and t.dtypes == first.dtypes and np.array_equal(w.gshape, wide[0].gshape)
               and np.array_equal(t.ndim, first.ndim) for t, w in zip(tables, wide, strict=True)):
            # one tensor table (every trainer pod publishes the same model): nothing to merge or check
            names, maps = first.names, [None] * len(tables)
            dtypes: list[str | None] = list(first.dtypes)
            gshape, ndim = wide[0].gshape, first.ndim
        else:
            names = sorted(set().union(*(t.names for t in tables)))
            idx = {n: i for i, n in enumerate(names)}
            maps = [np.array([idx[n] for n in t.names], dtype=np.int32) for t in tables]
            dtypes, gshape, ndim = cls._merge_tensors(tables, wide, maps, len(names), D, kind)
        T = len(names)
        pos = {id(t): i for i, t in enumerate(tables)}
        cdt = np.int64 if any(w.cdt == np.int64 for w in wide) else np.int32
        indptr = [0]
        tens: list[np.ndarray] = []
        offs: list[np.ndarray] = []
        shps: list[np.ndarray] = []
        for item in rows:
            if item is not None:
                i = pos[id(item[0])]
                sl = wide[i].rank_rows(item[1])
                m = maps[i]
                tt = wide[i].tensor[sl]
                tens.append(tt if m is None else m[tt])
                offs.append(wide[i].off[:, sl])
                shps.append(wide[i].shp[:, sl])
                indptr.append(indptr[-1] + len(tt))
            else:
                indptr.append(indptr[-1])
        tensor = np.concatenate(tens) if tens else np.zeros(0, np.int32)
        off = np.concatenate(offs, axis=1, dtype=cdt) if offs else np.zeros((D, 0), cdt)
        shp = np.concatenate(shps, axis=1, dtype=cdt) if shps else np.zeros((D, 0), cdt)
        held = np.zeros(T, dtype=bool)
        held[tensor] = True
        if not held.all():  # drop tensors no selected rank holds (e.g. pods an IPC group cannot read)
            keep = np.flatnonzero(held)
            remap = (np.cumsum(held) - 1).astype(np.int32)
            names = [names[i] for i in keep.tolist()]
            dtypes = [dtypes[i] for i in keep.tolist()]
            gshape, ndim, tensor = gshape[keep], ndim[keep], remap[tensor]
        return cls(names, [str(d) for d in dtypes], gshape, ndim, indptr, tensor, off, shp, kind=kind, check=False,
                   dims_first=True)

    @staticmethod
    def _merge_tensors(tables: list[ShardTable], wide: list[ShardTable], maps: list[np.ndarray | None], T: int,
                       D: int, kind: str) -> tuple[list[str | None], np.ndarray, np.ndarray]:
        """dtype, global shape and ndim of every tensor of a union of tables; PlanError on disagreement."""
        dtypes: list[str | None] = [None] * T
        gshape = np.ones((T, D), dtype=np.int64)
        ndim = np.full(T, -1, dtype=np.int64)
        for t, w, m in zip(tables, wide, maps, strict=True):
            ids = np.arange(T) if m is None else m
            fresh = ndim[ids] < 0
            gshape[ids[fresh]] = w.gshape[fresh]
            ndim[ids[fresh]] = t.ndim[fresh]
            for j in np.flatnonzero(fresh).tolist():
                dtypes[int(ids[j])] = t.dtypes[j]
            clash = (~fresh) & ((ndim[ids] != t.ndim) | (gshape[ids] != w.gshape).any(axis=1)
                                | np.array([dtypes[int(i)] != dt for i, dt in zip(ids.tolist(), t.dtypes, strict=True)]))
            if clash.any():
                name = t.names[int(np.flatnonzero(clash)[0])]
                other = next(o for o in tables if o is not t and name in o.index)
                a, b = other._one(name), t._one(name)
                raise PlanError(f"tensor {name!r}: one {kind} rank says {a.dtype}{list(a.global_shape)} but another "
                                f"says {b.dtype}{list(b.global_shape)}; trainer and inference must describe the same model")
        return dtypes, gshape, ndim

    def _check(self, rows_sorted: bool = False) -> None:
        """Raise PlanError unless the table keeps its invariants (rows_sorted: the row order is known to
        be right, as when it was decoded from a presence bitmap)."""
        T = len(self.names)
        D = self.gshape.shape[1]
        N = len(self.tensor)
        kind = self.kind
        if D < 1 or self.gshape.shape[0] != T or len(self.dtypes) != T or self.ndim.shape != (T,):
            raise PlanError(f"{kind} table: {T} names, {len(self.dtypes)} dtypes, global shapes {self.gshape.shape}, "
                            f"ndims {self.ndim.shape} do not match")
        for a, b in itertools.pairwise(self.names):
            if not a < b:
                raise PlanError(f"{kind} table: tensor names must be sorted and unique ({a!r} before {b!r})")
        for dt in set(self.dtypes):
            to_dtype(dt)
        if (self.ndim < 0).any() or (self.ndim > D).any():
            raise PlanError(f"{kind} table: a tensor has more dims than the table's {D}")
        pad = np.arange(D)[None, :] >= self.ndim[:, None]
        if (self.gshape < 0).any() or (self.gshape[pad] != 1).any():
            raise PlanError(f"{kind} table: global shapes must be non-negative (padding dims 1)")
        ip = self.indptr
        if len(ip) < 1 or ip[0] != 0 or ip[-1] != N or (np.diff(ip) < 0).any():
            raise PlanError(f"{kind} table: row pointers do not cover its {N} rows")
        if self.off.shape != (D, N) or self.shp.shape != (D, N):
            raise PlanError(f"{kind} table: {N} rows but boxes of shape {self.off.shape} / {self.shp.shape}")
        if not N:
            return
        if self.tensor.min() < 0 or self.tensor.max() >= T:
            raise PlanError(f"{kind} table: a row names tensor id outside 0..{T - 1}")
        ok = np.ones(N - 1, dtype=bool) if rows_sorted else np.diff(self.tensor) > 0
        starts = ip[1:-1]
        ok[starts[(starts > 0) & (starts < N)] - 1] = True
        if not ok.all():
            i = int(np.argmin(ok)) + 1
            r = self.rank_of(i)
            name = self.names[int(self.tensor[i])]
            if self.tensor[i] == self.tensor[i - 1]:
                raise PlanError(f"{kind} rank {r} lists tensor {name!r} twice; one box per tensor and rank")
            raise PlanError(f"{kind} table: the rows of rank {r} are not sorted by tensor name (at {name!r})")
        bad = np.zeros(N, dtype=bool)
        for k in range(D):
            o, s = self.off[k], self.shp[k]
            col = self.gshape[:, k]
            if (col == col[0]).all() and not pad[:, k].any():  # same size in every tensor: no per-row gather
                bad |= (o < 0) | (s < 0) | (o > col[0]) | (s > int(col[0]) - o)
                continue
            g = col.astype(self.cdt)[self.tensor]
            bad |= (o < 0) | (s < 0) | (o > g) | (s > g - o)
            padk = pad[:, k]
            if padk.any():
                bad |= padk[self.tensor] & ((o != 0) | (s != 1))
        if bad.any():
            i = int(np.argmax(bad))
            t = int(self.tensor[i])
            n = int(self.ndim[t])
            raise PlanError(
                f"tensor {self.names[t]!r}: box offset={tuple(self.off[:n, i].tolist())} "
                f"shape={tuple(self.shp[:n, i].tolist())} is outside its global shape {self.global_shape(t)} "
                f"({kind} rank {self.rank_of(i)})"
            )

    # -- access -----------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.indptr) - 1

    def __len__(self) -> int:
        return self.num_ranks

    @property
    def num_rows(self) -> int:
        return len(self.tensor)

    @property
    def ndim_max(self) -> int:
        return int(self.gshape.shape[1])

    @property
    def offset(self) -> np.ndarray:
        """[rows, dims] view of the offsets."""
        return self.off.T

    @property
    def shape(self) -> np.ndarray:
        """[rows, dims] view of the local shapes."""
        return self.shp.T

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def rank_of(self, row: int) -> int:
        return int(np.searchsorted(self.indptr, row, side="right")) - 1

    def rank_rows(self, r: int) -> slice:
        return slice(int(self.indptr[r]), int(self.indptr[r + 1]))

    def global_shape(self, t: int) -> tuple[int, ...]:
        return self._gshapes[t]

    @cached_property
    def _gshapes(self) -> list[tuple[int, ...]]:
        D = self.ndim_max
        full = _rows(self.gshape.T, slice(None))
        return [g if n == D else g[:n] for g, n in zip(full, self.ndim.tolist(), strict=True)]

    def shards(self, r: int) -> tuple[TensorShard, ...]:
        """Rank r's shards as objects, sorted by name (made once)."""
        got = self._shards.get(r)
        if got is None:
            sl = self.rank_rows(r)
            names, dtypes, gshapes, nd, D = self.names, self.dtypes, self._gshapes, self.ndim.tolist(), self.ndim_max
            out = []
            for t, o, s in zip(self.tensor[sl].tolist(), _rows(self.off, sl), _rows(self.shp, sl), strict=True):
                n = nd[t]
                out.append(_shard(names[t], dtypes[t], gshapes[t], _box(o, s) if n == D else _box(o[:n], s[:n])))
            got = self._shards[r] = tuple(out)
        return got

    def _one(self, name: str) -> TensorShard:
        t = self.index[name]
        return _shard(name, self.dtypes[t], self._gshapes[t], Box.full(self._gshapes[t]))

    @cached_property
    def full_shards(self) -> dict[str, TensorShard]:
        """One whole-tensor shard per tensor (name, dtype, global shape): what layouts start from."""
        return {n: _shard(n, dt, gs, _box((0,) * len(gs), gs))
                for n, dt, gs in zip(self.names, self.dtypes, self._gshapes, strict=True)}

    @cached_property
    @_streamed
    def dense(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, shape) as [dims, ranks, tensors] arrays (absent shards: all zeros) and the [ranks,
        tensors] mask of present shards. No copy when every rank holds every tensor."""
        R, T, D = self.num_ranks, len(self.names), self.ndim_max
        if self.num_rows == R * T and (T == 0 or bool((self.tensor.reshape(R, T) == np.arange(T)).all())):
            return self.off.reshape(D, R, T), self.shp.reshape(D, R, T), np.ones((R, T), dtype=bool)
        off = np.zeros((D, R, T), dtype=self.cdt)
        shp = np.zeros((D, R, T), dtype=self.cdt)
        present = np.zeros((R, T), dtype=bool)
        r_of = np.repeat(np.arange(R), np.diff(self.indptr))
        for k in range(D):
            off[k][r_of, self.tensor] = self.off[k]
            shp[k][r_of, self.tensor] = self.shp[k]
        present[r_of, self.tensor] = True
        return off, shp, present

    def padded(self, dims: int) -> ShardTable:
        """The same table with boxes padded to `dims` dims (itself when it has that many already)."""
        have = self.ndim_max
        if have == dims:
            return self
        if have > dims:
            raise PlanError(f"cannot pad a {have}-dim table to {dims} dims")
        extra = dims - have
        g = np.concatenate([self.gshape, np.ones((len(self.names), extra), dtype=np.int64)], axis=1)
        off = np.concatenate([self.off, np.zeros((extra, self.num_rows), dtype=self.cdt)])
        shp = np.concatenate([self.shp, np.ones((extra, self.num_rows), dtype=self.cdt)])
        return ShardTable(self.names, self.dtypes, g, self.ndim, self.indptr, self.tensor, off, shp, kind=self.kind,
                          check=False, dims_first=True)

    # -- encoding ---------------------------------------------------------------------------------------
    @_streamed
    def sections(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The table as (meta, arrays) for pack_arrays: names, dtypes, global shapes, which tensors each
        rank holds (a bitmap or id list, whichever is smaller) and each box column in the narrowest
        integer type (shapes as the distance to the global shape, mostly constant 0). Memoized."""
        if self._sections is not None:
            return self._sections
        T, D, R, N = len(self.names), self.ndim_max, self.num_ranks, self.num_rows
        name_len, name_utf8 = encode_names(self.names)
        kinds = sorted(set(self.dtypes))
        code = {d: i for i, d in enumerate(kinds)}
        arrays: dict[str, np.ndarray] = {
            "name_len": name_len,
            "name_utf8": name_utf8,
            "dtype": np.array([code[d] for d in self.dtypes], dtype=np.uint8),
            "ndim": self.ndim.astype(np.uint8),
            "gshape": self.gshape,
        }
        meta: dict[str, Any] = {"tensors": T, "dims": D, "ranks": R, "rows": N, "dtypes": kinds}
        put_rows(arrays, meta, self.indptr, self.tensor, T)
        meta["offset"] = [put_column(arrays, f"offset{k}", self.off[k]) for k in range(D)]
        short = []
        for k in range(D):
            col = self.gshape[:, k]
            if not N or (col == col[0]).all():  # the same size in every tensor: no per-row gather
                short.append(put_column(arrays, f"short{k}", self.shp[k], flip=int(col[0]) if T else 0))
            else:
                short.append(put_column(arrays, f"short{k}", col.astype(self.cdt)[self.tensor] - self.shp[k]))
        meta["short"] = short
        self._sections = (meta, arrays)
        return self._sections

    @classmethod
    @_streamed
    def from_sections(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], kind: str = "source") -> ShardTable:
        """Inverse of sections(); validates everything (the bytes came from a peer). Raises ValueError."""
        try:
            T, D, R, N = (int(meta[k]) for k in ("tensors", "dims", "ranks", "rows"))
            kinds = [str(d) for d in meta["dtypes"]]
            if min(T, D, R, N) < 0 or D < 1:
                raise ValueError("negative sizes")
            names = decode_names(arrays["name_len"], arrays["name_utf8"], T)
            code = arrays["dtype"]
            if code.shape != (T,) or (T and int(code.max()) >= len(kinds)):
                raise ValueError("bad dtype codes")
            dtypes = [kinds[c] for c in code.tolist()]
            ndim = arrays["ndim"].astype(np.int64)
            gshape = arrays["gshape"]
            if gshape.shape != (T, D) or ndim.shape != (T,) or gshape.dtype != np.int64:
                raise ValueError("bad global shapes")
            indptr, tensor = get_rows(meta, arrays, R, T, N)
            if N and (tensor.min() < 0 or tensor.max() >= T):
                raise ValueError("tensor id out of range")
            specs_o, specs_s = meta["offset"], meta["short"]
            if len(specs_o) != D or len(specs_s) != D:
                raise ValueError("column specs do not match dims")
            if (gshape < 0).any():
                raise ValueError("negative global shape")
            cdt = coord_dtype(int(gshape.max()) if T else 0)
            off = np.empty((D, N), dtype=cdt)
            shp = np.empty((D, N), dtype=cdt)
            for k in range(D):
                col = gshape[:, k]
                flip = (int(col[0]) if T else 0) if not N or (col == col[0]).all() else col.astype(cdt)[tensor]
                read_column(arrays, f"offset{k}", specs_o[k], off[k])
                read_column(arrays, f"short{k}", specs_s[k], shp[k], flip)
        except (KeyError, TypeError, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"bad shard table: {exc!r}") from None
        table = cls(names, dtypes, gshape, ndim, indptr, tensor, off, shp, kind=kind, check=False, dims_first=True)
        table._check(rows_sorted=meta["rows_as"] == "bitmap")
        table._sections = (dict(meta), dict(arrays))  # the digest is over the bytes both sides hold
        return table

    def encode(self) -> bytes:
        meta, arrays = self.sections()
        return pack_arrays({"table": meta}, arrays)

    @classmethod
    def decode(cls, buf: bytes | memoryview, kind: str = "source") -> ShardTable:
        meta, arrays = unpack_arrays(buf)
        if not isinstance(meta.get("table"), dict):
            raise ValueError("not a shard table")
        return cls.from_sections(meta["table"], arrays, kind)

    @cached_property
    def tensors_digest(self) -> str:
        """SHA-256 of the tensor table alone (names, dtypes, global shapes): what a layout depends on."""
        h = hashlib.sha256(json.dumps([self.names, self.dtypes]).encode())
        h.update(np.ascontiguousarray(self.ndim, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.gshape, dtype="<i8").tobytes())
        return h.hexdigest()

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the table's encoding: equal tables (in the same encoding) have equal digests."""
        meta, arrays = self.sections()
        h = hashlib.sha256(json.dumps(meta, separators=(",", ":"), sort_keys=True).encode())
        for name, a in arrays.items():
            le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
            h.update(f"|{name}|{le.dtype.str}|{list(le.shape)}|".encode())
            h.update(le.data.cast("B") if le.nbytes else b"")
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"ShardTable({self.kind}: {self.num_ranks} ranks, {len(self.names)} tensors, {self.num_rows} shards)"
