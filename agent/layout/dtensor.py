"""Where a DTensor's local tensor sits in its global tensor, for every placement, or a refusal by name.

The plan needs one box (global offset + shape) per tensor and rank. torch's
`compute_local_shape_and_global_offset` returns the *first* global index of each sharded dim, which is
the box only when the rank's indices along that dim form one contiguous range. `_StridedShard`
(FSDP2 over TP, or any right-to-left sharding) can give a rank indices such as rows {0, 1, 4, 5}: the
first offset then describes the wrong box and the bytes land in the wrong rows, silently. So this
module computes every global index a rank holds along every dim, from the placements' data semantics
(torch.chunk sizes; `_StridedShard(sf)` chunks into `sf` pieces first, then each piece into the mesh
dim's size, and concatenates the rank's chunk of every piece), and accepts the box only when each
index list is contiguous and ascending. FSDP2 + TP with even dims (placements
`(_StridedShard(0, sf=tp), Shard(0))`) is contiguous and works; anything else is refused with the
placement, the rank's mesh coordinate and the indices it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class PlacementError(ValueError):
    """A DTensor placement cannot be published as one box per rank; the message names the placement."""


def _chunk(idx: np.ndarray, parts: int, index: int) -> np.ndarray:
    """torch.chunk semantics: ceil-sized chunks, trailing chunks short or empty."""
    n = len(idx)
    size = -(-n // parts) if n else 0
    start = min(index * size, n)
    return idx[start:min(start + size, n)]


def _kind(p: Any) -> str:
    """'strided', 'shard', 'replicate', 'partial' or '' (unknown) for a torch placement object."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch: no strided placement to worry about
        _StridedShard = None  # type: ignore[misc,assignment]
    if _StridedShard is not None and isinstance(p, _StridedShard):  # checked first: older torch subclassed Shard
        return "strided"
    if isinstance(p, Shard) and type(p).__name__ == "Shard":
        return "shard"
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial):
        return "partial"
    return ""


def global_indices(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> list[np.ndarray]:
    """Per dim, the global indices (in local order) the rank at `coordinate` holds. Raises PlacementError
    for Partial and for placement types whose data layout is unknown here."""
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise PlacementError(f"{len(placements)} placements for a mesh of shape {tuple(mesh_shape)} "
                             f"and coordinate {tuple(coordinate)}")
    idx = [np.arange(int(n), dtype=np.int64) for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        kind = _kind(p)
        k, c = int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        if kind == "replicate":
            continue
        if kind == "partial":
            raise PlacementError(f"placement {p} on mesh dim {mesh_dim} is Partial: the rank holds a summand, not "
                                 "bytes of the tensor; reduce it first (t.redistribute(placements=[Replicate()...]))")
        if kind not in ("shard", "strided"):
            raise PlacementError(f"placement {p!r} ({type(p).__name__}) on mesh dim {mesh_dim} is not supported "
                                 "(Shard, _StridedShard, Replicate are); publish its local tensor as a PlacedShard")
        d = int(p.dim) % len(idx) if idx else 0
        if not idx:
            raise PlacementError(f"placement {p} shards a 0-dim tensor")
        if kind == "shard":
            idx[d] = _chunk(idx[d], k, c)
        else:
            sf = int(p.split_factor)
            idx[d] = np.concatenate([_chunk(_chunk(idx[d], sf, j), k, c) for j in range(sf)])
    return idx


def dtensor_box(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any],
    *, name: str = "tensor",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of the rank at `coordinate`, or PlacementError naming the placement
    when its indices along some dim are not one contiguous ascending range (no box describes them)."""
    offset: list[int] = []
    shape: list[int] = []
    for d, ix in enumerate(global_indices(global_shape, mesh_shape, coordinate, placements)):
        n = len(ix)
        if n == 0:  # an empty chunk: a zero-size box at the end of the dim, as torch reports it
            offset.append(int(global_shape[d]))
            shape.append(0)
            continue
        start = int(ix[0])
        if not np.array_equal(ix, np.arange(start, start + n)):
            shown = ", ".join(str(int(i)) for i in ix[:8]) + (", ..." if n > 8 else "")
            raise PlacementError(
                f"{name}: placements {tuple(placements)} on mesh {tuple(mesh_shape)} give the rank at coordinate "
                f"{tuple(coordinate)} indices [{shown}] of dim {d}, not one contiguous range, so no box describes "
                "its local tensor (publishing the first offset would put bytes in the wrong rows). Redistribute it "
                "to Shard/Replicate placements before publishing, or publish per-range PlacedShards")
        offset.append(start)
        shape.append(n)
    return tuple(offset), tuple(shape)


def dtensor_local_box(name: str, t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of a DTensor on this rank; checked against its local tensor."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlacementError(f"{name}: this rank is not part of the DTensor's device mesh")
    offset, shape = dtensor_box(tuple(t.shape), tuple(mesh.shape), coord, t.placements, name=name)
    local_shape = tuple(t.to_local().shape)
    if shape != local_shape:
        raise PlacementError(f"{name}: local shard shape {local_shape} does not match its placements "
                             f"{tuple(t.placements)}, which give {shape}")
    return offset, shape
