"""What a trainer rank holds: its local shards, each with its place in the global tensor.

`local_shards` turns what an app passes to `TrainerSession.publish` (an nn.Module, a state_dict, or (name,
value) pairs of plain tensors, DTensors, FSDP1 ShardedTensors or `PlacedShard`s) into `LocalShard`s (local
bytes plus global shape and offset) and the tied aliases, refusing by name what has no single box. The
checksums are sha256 over a tensor's bytes, what both ends compare to call a transfer bit-exact. Nothing
here talks to the agent: the layouts (layout/spec.py's `engine_weights`) build on it, and the client
(agent/client.py) stages what it returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.agent.layout.dtensor import dtensor_local_box


@dataclass(frozen=True)
class PlacedShard:
    """A local tensor with its global placement, for shards a trainer holds as plain tensors (Megatron TP,
    hand-split slices): publish reads the box from here, as it reads a DTensor's from its placements."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


Weights = torch.nn.Module | Mapping[str, Any] | Iterable[tuple[str, Any]]


@dataclass(frozen=True)
class LocalShard:
    """What a rank publishes for one tensor: its local bytes and where they sit in the global tensor."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def _dtensor_shard(name: str, t: Any) -> LocalShard:
    """The local tensor and its box; a placement with no box (a _StridedShard whose rows are not
    contiguous, Partial, unknown types) is refused by name (layout.dtensor.PlacementError)."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor is published

    assert isinstance(t, DTensor)
    offset, _shape = dtensor_local_box(name, t)
    return LocalShard(name, t.to_local().detach(), tuple(t.shape), offset)


def _is_sharded_tensor(t: Any) -> bool:
    cls: type = type(t)
    known = _SHARDED_TYPES.get(cls)
    if known is None:  # per type, not per tensor: walking the MRO cost about 1 us for each of an MoE publish's
        known = _SHARDED_TYPES[cls] = any(c.__name__ == "ShardedTensor" and
                                          c.__module__.startswith("torch.distributed._shard") for c in cls.__mro__)
    return known


_SHARDED_TYPES: dict[type, bool] = {}


def _sharded_tensor_shard(name: str, t: Any) -> LocalShard | None:
    """An FSDP1 ShardedTensor (SHARDED_STATE_DICT): this rank's one local shard with its global box, or None
    when this rank holds no shard of it (torch.chunk leaves the last ranks empty for a short dim 0)."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec  # as above

    spec = t.sharding_spec()
    if not isinstance(spec, ChunkShardingSpec | EnumerableShardingSpec):
        raise ValueError(f"{name}: a ShardedTensor with sharding spec {type(spec).__name__} is not supported "
                         "(ChunkShardingSpec and EnumerableShardingSpec are); publish its local shard as a "
                         "PlacedShard(tensor, global_shape, global_offset)")
    shards = t.local_shards()
    if not shards:
        return None
    if len(shards) > 1:
        raise ValueError(f"{name}: this rank holds {len(shards)} local shards of the ShardedTensor; one per rank is "
                         "supported (publish each as its own PlacedShard under its own name, or reshard)")
    shard = shards[0]
    local_t = shard.tensor.detach()
    global_shape = tuple(int(d) for d in t.metadata().size)
    offset = tuple(int(o) for o in shard.metadata.shard_offsets)
    sizes = tuple(int(d) for d in shard.metadata.shard_sizes)
    if sizes != tuple(local_t.shape):
        raise ValueError(f"{name}: local shard shape {tuple(local_t.shape)} does not match its metadata {sizes}")
    if len(offset) != len(global_shape) or len(sizes) != len(global_shape):
        raise ValueError(f"{name}: shard offsets {offset} do not match the global shape {global_shape}")
    for d, (g, o, n) in enumerate(zip(global_shape, offset, sizes, strict=True)):
        if o < 0 or o + n > g:
            raise ValueError(f"{name}: dim {d} shard [{o}, {o + n}) lies outside global size {g}")
    return LocalShard(name, local_t, global_shape, offset)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """`t` out of autograd: a detached alias when it takes part in it, else itself (a detach per tensor cost
    microseconds each, tens of thousands of times per MoE publish, to change nothing)."""
    return t.detach() if t.requires_grad or t.grad_fn is not None else t


def _is_parameter(value: Any) -> bool:
    """isinstance(value, nn.Parameter) without its Python-level instance check for the common plain tensor."""
    if type(value) is torch.Tensor and not getattr(value, "_is_param", False):
        return False
    return isinstance(value, torch.nn.Parameter)


def _shard_of(name: str, value: Any) -> LocalShard | None:
    if isinstance(value, PlacedShard):
        t = _detached(value.tensor)
        shape = t.shape
        if len(value.global_shape) != len(shape) or len(value.global_offset) != len(shape):
            raise ValueError(f"{name}: global shape/offset rank does not match the tensor's {t.dim()} dims")
        if any(o < 0 or o + n > g for g, o, n in zip(value.global_shape, value.global_offset, shape, strict=True)):
            d, g, o, n = next((d, g, o, n) for d, (g, o, n) in enumerate(zip(value.global_shape, value.global_offset,
                                                                             shape, strict=True)) if o < 0 or o + n > g)
            raise ValueError(f"{name}: dim {d} shard [{o}, {o + n}) lies outside global size {g}")
        return LocalShard(name, t, tuple(value.global_shape), tuple(value.global_offset))
    if type(value).__name__ == "DTensor":
        return _dtensor_shard(name, value)
    if _is_sharded_tensor(value):
        return _sharded_tensor_shard(name, value)
    if isinstance(value, torch.Tensor):
        t = _detached(value)
        return LocalShard(name, t, tuple(t.shape), (0,) * t.dim())
    raise TypeError(f"{name}: expected a tensor, DTensor, ShardedTensor or PlacedShard, got {type(value).__name__}")


def _alias_start(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """Where a plain tensor's bytes start, or None for one that has no bytes here (DTensor, ShardedTensor, empty).
    Tensors that start elsewhere are never the same bytes, so only a tensor that starts where an earlier one
    started pays for the full comparison (`_alias_key`): tied weights are a handful in a model."""
    if type(t).__name__ == "DTensor" or _is_sharded_tensor(t) or t.numel() == 0:
        return None
    return (t.device, t.data_ptr())


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    # the first byte's address stands for (storage, offset): two views that start at the same address with the
    # same shape, strides and dtype are the same bytes (and it costs no storage object per tensor)
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def local_shards(weights: Weights) -> tuple[list[LocalShard], dict[str, str]]:
    """Normalise what the app passes to publish into local shards, plus tied aliases {dropped: kept}.

    Tied weights (e.g. lm_head.weight sharing embed_tokens.weight) are published once under the first name;
    the alias map tells receivers the other name refers to the same bytes.
    """
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = weights.state_dict(keep_vars=True).items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    shards: list[LocalShard] = []
    aliases: dict[str, str] = {}
    starts: dict[tuple[torch.device, int], tuple[str, torch.Tensor]] = {}  # where bytes start -> the first there
    more: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor]]] = {}  # the others there (not aliases)
    names: set[str] = set()
    for name, value in items:
        if name in names:
            raise ValueError(f"tensor name {name!r} appears twice in one publish")
        names.add(name)
        raw = value.data if not isinstance(value, PlacedShard) and _is_parameter(value) else value
        start = _alias_start(raw) if isinstance(raw, torch.Tensor) else None
        if start is not None:
            first = starts.get(start)
            if first is None:
                starts[start] = (name, raw)
            else:
                key = _alias_key(raw)
                kept = next((n for n, t in (first, *more.get(start, ())) if _alias_key(t) == key), None)
                if kept is not None:
                    aliases[name] = kept
                    continue
                more.setdefault(start, []).append((name, raw))
        shard = _shard_of(name, raw)
        if shard is not None:  # None: a ShardedTensor of which this rank holds no shard
            shards.append(shard)
    return shards, aliases


class LocalShardsMemo:
    """local_shards of a trainer's publishes, remembered while the app publishes the very same objects.

    Why: a trainer publishes the same tensors every step (a state_dict of the same tensors, or the same
    PlacedShards), and normalising tens of thousands of them again (checks, boxes, tied weights) cost a few
    microseconds each per version while the trainer waited. Reused only when every (name, value) pair is the
    same as last time, by identity, in the same order, and every value's bytes still start where they did (tied
    weights are found by address) with the same shape; and only when each shard is the app's own tensor object (a plain tensor or a
    PlacedShard's), so that it reads whatever the app's tensor holds now. Parameters (`.data` is a new alias
    each time, and FSDP swaps it), DTensors and ShardedTensors are normalised every time."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Any]] | None = None
        self._tensors: list[torch.Tensor] = []
        self._starts: list[int] = []
        self._shapes: list[torch.Size] = []
        self._result: tuple[list[LocalShard], dict[str, str]] | None = None

    def __call__(self, weights: Weights) -> tuple[list[LocalShard], dict[str, str]]:
        if not isinstance(weights, Mapping):
            self._items = self._result = None
            return local_shards(weights)
        items = list(weights.items())
        if self._result is not None and self._items is not None and len(items) == len(self._items) and \
                all(a[1] is b[1] and a[0] == b[0] for a, b in zip(items, self._items, strict=True)) and \
                [t.data_ptr() for t in self._tensors] == self._starts and \
                [t.shape for t in self._tensors] == self._shapes:
            return self._result
        shards, aliases = local_shards(items)
        tensors = [v.tensor if isinstance(v, PlacedShard) else v for _, v in items]
        own = len(shards) + len(aliases) == len(items) and all(
            type(t) is torch.Tensor and not getattr(t, "_is_param", False) for t in tensors) and all(
            s.tensor is t for s, t in zip(shards, (t for (n, _), t in zip(items, tensors, strict=True)
                                                   if n not in aliases), strict=True))
        self._items, self._result = (items, (shards, aliases)) if own else (None, None)
        self._tensors = tensors if own else []
        self._starts = [t.data_ptr() for t in tensors] if own else []
        self._shapes = [t.shape for t in tensors] if own else []
        return self._result or (shards, aliases)


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order: the same digest on both sides means bit-exact."""
    c = t.detach().contiguous().cpu()
    if c.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(c.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """tensor_checksum of each (name, tensor): what a trainer and an engine compare after a load."""
    return {name: tensor_checksum(t) for name, t in named}

