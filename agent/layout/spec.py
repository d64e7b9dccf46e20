"""A trainer's tensor names and fusions, mapped to the engine's (Hugging Face) names as boxes.

The plan only knows engine names and boxes. A trainer that names or fuses its tensors differently
(Megatron `linear_qkv` = per KV group [q heads, k, v]; `linear_fc1` = per TP shard [gate, up]; local
layer numbers on each pipeline stage) describes that once with a `Naming`. Each of its local shards
then maps to one box per engine tensor (`SourcePart`) plus a `View` that says where that box's rows
sit in the local tensor: `local.view(groups, period, *rest)[:, start:start + rows]`. The view is read
once, by the copy into staging the publish makes anyway, so de-interleaving costs no extra copy and
the planner stays the vectorized one (it sees ordinary boxes, cached per layout).

What cannot be a box is refused with the reason: a fused tensor split along another dim, or a chunk
(e.g. FSDP Shard(0) of a fused tensor) whose rows cut a group, which would scatter an engine tensor's
rows over several boxes of one rank. Head-wise needs of the inference side live in layout/heads.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from weightsync.agent.layout.fp8 import quantize_blocks, scale_shard
from weightsync.agent.layout.rules import LayoutError, Rule
from weightsync.agent.layout.shards import PlacedShard, local_shards
from weightsync.agent.plan import TensorShard
from weightsync.agent.plan.buckets import dtype_name


@dataclass(frozen=True)
class Attention:
    """Head counts of a model's attention (GQA when num_kv_heads < num_heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_heads, self.num_kv_heads, self.head_dim) < 1 or self.num_heads % self.num_kv_heads:
            raise LayoutError(f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads")


@dataclass(frozen=True)
class Rename:
    """One trainer tensor is one engine tensor. `trainer` is a regex matched against the whole name; a
    `(?P<layer>\\d+)` group is renumbered by the stage's layer offset when the naming's layers are local,
    an `(?P<expert>\\d+)` group by the expert-parallel rank's first expert when its experts are local."""

    trainer: str
    engine: str


@dataclass(frozen=True)
class Fuse:
    """One trainer tensor stacks several engine tensors along dim 0, interleaved in groups:
    kind "qkv": one group per KV head, rows [q heads of the group, k, v] x head_dim (Megatron linear_qkv);
    kind "gate_up": one group per trainer TP shard, rows [gate, up] (Megatron linear_fc1); with
    per_tp=False one group for the whole tensor (an expert's linear_fc1 with expert TP 1)."""

    trainer: str
    engines: tuple[str, ...]
    kind: Literal["qkv", "gate_up"]
    per_tp: bool = True


@dataclass(frozen=True)
class Naming:
    """How a trainer names its tensors, and its TP rules on those names (for layout.trainer_layout)."""

    name: str
    rules: tuple[Rename | Fuse, ...] = ()
    tp_rules: Mapping[str, Rule] = field(default_factory=dict)
    local_layers: bool = False  # layer numbers restart on each pipeline stage (Megatron)
    local_experts: bool = False  # expert numbers restart on each expert-parallel rank (Megatron)


HF = Naming("hf")


@dataclass(frozen=True)
class View:
    """Where an engine box sits in a rank's local trainer tensor: rows [start, start+rows) of each of
    `groups` consecutive groups of `period` rows (dim 0). groups == 1 and rows == period is the whole."""

    groups: int
    period: int
    start: int
    rows: int

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """The engine box out of `local`, shaped like the box: a view for a whole tensor or one group; for
        several groups a copy (their rows are not evenly spaced, so no single strided view has the box's
        shape). `copy_into` reads the groups strided straight into their destination instead."""
        if local.dim() == 0 or (self.groups == 1 and self.rows == self.period):
            return local
        rest = tuple(local.shape[1:])
        part = local.view(self.groups, self.period, *rest)[:, self.start:self.start + self.rows]
        return part.reshape(self.groups * self.rows, *rest)

    def copy_into(self, dst: torch.Tensor, local: torch.Tensor) -> None:
        """Copy the box out of `local` into `dst` (shaped like the box): the one copy, reading strided."""
        if local.dim() == 0 or (self.groups == 1 and self.rows == self.period):
            dst.copy_(local)
            return
        rest = tuple(local.shape[1:])
        src = local.view(self.groups, self.period, *rest)[:, self.start:self.start + self.rows]
        dst.view(self.groups, self.rows, *rest).copy_(src)


@dataclass(frozen=True)
class SourcePart:
    """One engine box a trainer rank holds, and where it sits in that rank's local trainer tensor."""

    trainer_name: str
    shard: TensorShard
    view: View


def _match(naming: Naming, name: str) -> tuple[Rename | Fuse | None, re.Match[str] | None]:
    for rule in naming.rules:
        m = re.fullmatch(rule.trainer, name)
        if m:
            return rule, m
    return None, None


def _expand(template: str, m: re.Match[str], naming: Naming, layer_offset: int, expert_offset: int) -> str:
    groups = m.groupdict()
    out = m.expand(template)
    if groups.get("layer") is not None:
        out = out.replace("{layer}", str(int(groups["layer"]) + (layer_offset if naming.local_layers else 0)))
    if groups.get("expert") is not None:
        out = out.replace("{expert}", str(int(groups["expert"]) + (expert_offset if naming.local_experts else 0)))
    return out


def fused_rows(rule: Fuse, global_rows: int, attention: Attention | None, tp_size: int,
               name: str) -> tuple[int, tuple[int, ...]]:
    """(groups in the whole tensor, rows per group of each component) of a fused tensor."""
    if rule.kind == "qkv":
        if attention is None:
            raise LayoutError(f"{name}: a fused qkv tensor needs the model's head counts (Attention)")
        a = attention
        rows: tuple[int, ...] = ((a.num_heads // a.num_kv_heads) * a.head_dim, a.head_dim, a.head_dim)
        groups = a.num_kv_heads
    else:
        groups = tp_size if rule.per_tp else 1
        if global_rows % (2 * groups):
            raise LayoutError(f"{name}: {global_rows} rows do not hold [gate, up] for each of {groups} TP shards")
        rows = (global_rows // (2 * groups),) * 2
    if len(rows) != len(rule.engines):
        raise LayoutError(f"{name}: {rule.kind} fuses {len(rows)} tensors, the rule names {len(rule.engines)}")
    if groups * sum(rows) != global_rows:
        raise LayoutError(f"{name}: {global_rows} rows, but {groups} groups of {list(rows)} rows "
                          f"({rule.kind}) make {groups * sum(rows)}")
    return groups, rows


def map_shard(naming: Naming, name: str, dtype: str, global_shape: Sequence[int], offset: Sequence[int],
              shape: Sequence[int], *, attention: Attention | None = None, tp_size: int = 1,
              layer_offset: int = 0, expert_offset: int = 0) -> list[SourcePart]:
    """The engine boxes a trainer rank's local shard of `name` holds (several for a fused tensor)."""
    gshape, off, shp = tuple(map(int, global_shape)), tuple(map(int, offset)), tuple(map(int, shape))
    rule, m = _match(naming, name)
    whole = View(1, shp[0] if shp else 1, 0, shp[0] if shp else 1)
    if rule is None or m is None:
        return [SourcePart(name, TensorShard.of(name, dtype, gshape, off, shp), whole)]
    if isinstance(rule, Rename):
        target = _expand(rule.engine, m, naming, layer_offset, expert_offset)
        return [SourcePart(name, TensorShard.of(target, dtype, gshape, off, shp), whole)]
    if not gshape:
        raise LayoutError(f"{name}: a 0-dim tensor cannot be fused")
    groups, rows = fused_rows(rule, gshape[0], attention, tp_size, name)
    period = sum(rows)
    if off[1:] != (0,) * (len(gshape) - 1) or shp[1:] != gshape[1:]:
        raise LayoutError(f"{name}: this rank's shard {list(shp)} at {list(off)} splits the fused {rule.kind} "
                          "tensor along a dim other than 0; its components would not be boxes")
    if shp[0] == 0:
        return []
    if off[0] % period or shp[0] % period:
        raise LayoutError(
            f"{name}: rows [{off[0]}, {off[0] + shp[0]}) of this rank cut a {rule.kind} group of {period} rows "
            f"(components {list(rows)}): each engine tensor's rows would be scattered over several boxes. Shard a "
            f"fused tensor only along whole groups (TP dividing its {groups} groups, no FSDP chunks inside them)")
    g0, g = off[0] // period, shp[0] // period
    parts = []
    start = 0
    for template, r in zip(rule.engines, rows, strict=True):
        target = _expand(template, m, naming, layer_offset, expert_offset)
        parts.append(SourcePart(name, TensorShard.of(target, dtype, (groups * r, *gshape[1:]),
                                                     (g0 * r, *off[1:]), (g * r, *shp[1:])),
                                View(g, period, start, r)))
        start += r
    return parts


def map_shards(naming: Naming, shards: Sequence[TensorShard], *, attention: Attention | None = None,
               tp_size: int = 1, layer_offset: int = 0, expert_offset: int = 0) -> list[SourcePart]:
    """map_shard over a rank's trainer shards; an engine tensor mapped twice is an error."""
    out: list[SourcePart] = []
    seen: dict[str, str] = {}
    for s in shards:
        for p in map_shard(naming, s.name, s.dtype, s.global_shape, s.box.offset, s.box.shape,
                           attention=attention, tp_size=tp_size, layer_offset=layer_offset,
                           expert_offset=expert_offset):
            if p.shard.name in seen:
                raise LayoutError(f"engine tensor {p.shard.name!r} comes from both {seen[p.shard.name]!r} and {s.name!r}")
            seen[p.shard.name] = s.name
            out.append(p)
    return out


def engine_weights(weights: Mapping[str, Any], naming: Naming, *, attention: Attention | None = None,
                   tp_size: int = 1, layer_offset: int = 0, expert_offset: int = 0,
                   fp8: str | None = None) -> dict[str, Any]:
    """What a trainer passes to `TrainerSession.publish` to publish in engine names: its local tensors
    (plain, DTensor, PlacedShard) mapped to `PlacedShard`s of engine tensors whose
    tensors are views of the local ones (publish copies each once into staging). With `fp8` (a regex of
    engine names, e.g. fp8.DEEPSEEK_QUANTIZED) the matching weights are block-quantized here, on the
    tensor's device, and published as float8_e4m3fn plus their `weight_scale_inv` boxes."""
    quantized = re.compile(fp8) if fp8 else None
    shards, _aliases = local_shards(weights)
    out: dict[str, Any] = {}

    def put(name: str, value: Any, source: str) -> None:
        if name in out:
            raise LayoutError(f"engine tensor {name!r} is published twice (last from {source!r})")
        out[name] = value

    for s in shards:
        for p in map_shard(naming, s.name, dtype_name(s.tensor.dtype), s.global_shape, s.global_offset,
                           tuple(s.tensor.shape), attention=attention, tp_size=tp_size, layer_offset=layer_offset,
                           expert_offset=expert_offset):
            if quantized is not None and quantized.search(p.shard.name) and p.shard.box.numel:
                sc = scale_shard(p.shard, who="trainer ")
                q, scale = quantize_blocks(p.view.of(s.tensor))
                put(p.shard.name, PlacedShard(q, p.shard.global_shape, p.shard.box.offset), s.name)
                put(sc.name, PlacedShard(scale, sc.global_shape, sc.box.offset), s.name)
            else:
                put(p.shard.name, PlacedShard(p.view.of(s.tensor), p.shard.global_shape, p.shard.box.offset), s.name)
    return out


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The layers of pipeline stage `stage` (even split; an uneven one is refused with the numbers)."""
    if num_layers % pp_size:
        raise LayoutError(f"{num_layers} layers do not divide into {pp_size} pipeline stages")
    per = num_layers // pp_size
    return range(stage * per, (stage + 1) * per)
