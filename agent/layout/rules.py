"""Layouts: which box of each tensor a rank holds (trainer) or needs (inference), by parallelism.

Inference tensor parallelism follows the Megatron/vLLM convention on HF parameter names:
* column-parallel (output features split, dim 0 of weight and bias): q/k/v_proj, gate/up_proj;
* row-parallel (input features split, dim 1 of the weight; the bias is replicated): o_proj, down_proj;
* vocab-parallel (dim 0): embed_tokens, lm_head;
* replicated: everything else (norms, biases of row-parallel layers, scalars).
Models that differ (fused qkv, GQA with fewer KV heads than TP ranks, MoE experts) pass `overrides`:
a mapping of regular expressions (searched in the name, first match wins, checked before the
defaults) to a rule name or an explicit shard dim (int) or None (replicated).

Trainer layouts: TP as above, then FSDP Shard(0) of the local TP box with torch.chunk semantics
(ceil-sized chunks, trailing ranks may get less or nothing), or the truthful box of a DTensor's local
tensor (seed 000: global shape + global offset of the local shard, never the local shape alone).

Tied embeddings: when `tie_word_embeddings`, lm_head.weight is the same tensor as embed_tokens.weight;
it is dropped from both sides so it is neither sent twice nor expected by engines that collapse it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from weightsync.agent.layout.dtensor import dtensor_local_box
from weightsync.agent.plan import Box, TensorShard
from weightsync.agent.plan.buckets import dtype_name

RuleName = Literal["column", "row", "vocab", "replicated"]
Rule = RuleName | int | None


class LayoutError(ValueError):
    """A tensor cannot be laid out as asked (indivisible dim, unknown rule); the message says how to fix."""


DEFAULT_RULES: tuple[tuple[str, RuleName], ...] = (
    (r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_in|embed_out)\.weight$", "vocab"),
    (r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$", "column"),
    (r"(^|\.)(o_proj|down_proj|w2)\.(weight|bias)$", "row"),
)
TIED_HEAD = re.compile(r"(^|\.)lm_head\.weight$")


@dataclass(frozen=True)
class TensorMeta:
    """A tensor of the model: name, wire dtype and global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        shape = tuple(t.shape)
        return cls(name, dtype_name(t.dtype), shape)


def tensor_metas(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Metadata of full (unsharded) named tensors, e.g. a model's state_dict items."""
    return [TensorMeta.of(n, t) for n, t in named]


def untie(metas: Iterable[TensorMeta], tie_word_embeddings: bool) -> list[TensorMeta]:
    """Drop lm_head.weight when the embeddings are tied."""
    return [m for m in metas if not (tie_word_embeddings and TIED_HEAD.search(m.name))]


def rule_for(name: str, overrides: Mapping[str, Rule] | None = None) -> Rule:
    """The TP rule of a tensor name: overrides first, then the defaults, else replicated."""
    for pattern, rule in (overrides or {}).items():
        if re.search(pattern, name):
            return rule
    for pattern, default in DEFAULT_RULES:
        if re.search(pattern, name):
            return default
    return "replicated"


def shard_dim(name: str, ndim: int, overrides: Mapping[str, Rule] | None = None) -> int | None:
    """The dim a tensor is split along under TP, or None when every rank holds all of it."""
    rule = rule_for(name, overrides)
    if rule is None or rule == "replicated" or ndim == 0:
        return None
    if isinstance(rule, int) and not isinstance(rule, bool):
        if not -ndim <= rule < ndim:
            raise LayoutError(f"override shard dim {rule} is out of range for {name!r} with {ndim} dims")
        return rule % ndim
    if rule in ("column", "vocab"):
        return 0
    if rule == "row":
        return 1 if ndim >= 2 else None  # a row-parallel bias is replicated (added after the all-reduce)
    raise LayoutError(f"unknown layout rule {rule!r} for {name!r}; use column, row, vocab, replicated or a dim")


def split_box(box: Box, dim: int, parts: int, index: int, *, even: bool) -> Box:
    """Part `index` of `parts` of `box` along `dim`. even=True (TP) requires divisibility; even=False
    uses torch.chunk sizes (FSDP Shard(0)): ceil-sized chunks, the tail may be short or empty."""
    if not 0 <= index < parts:
        raise LayoutError(f"rank {index} is outside a group of {parts}")
    n = box.shape[dim]
    if even:
        if n % parts:
            raise LayoutError(
                f"dim {dim} of size {n} does not divide by {parts} ranks; pass an override (e.g. replicated)"
            )
        size = n // parts
        start = index * size
    else:
        chunk = -(-n // parts) if n else 0
        start = min(index * chunk, n)
        size = max(0, min(chunk, n - start))
    off = list(box.offset)
    shape = list(box.shape)
    off[dim] += start
    shape[dim] = size
    return Box(tuple(off), tuple(shape))


def tp_shard(meta: TensorMeta, tp_size: int, tp_rank: int, overrides: Mapping[str, Rule] | None = None) -> TensorShard:
    """The box of `meta` a TP rank holds."""
    box = Box.full(meta.shape)
    dim = shard_dim(meta.name, len(meta.shape), overrides)
    if dim is not None and tp_size > 1:
        try:
            box = split_box(box, dim, tp_size, tp_rank, even=True)
        except LayoutError as exc:
            raise LayoutError(f"{meta.name!r} {list(meta.shape)} under TP {tp_size}: {exc}") from None
    return TensorShard(meta.name, meta.dtype, meta.shape, box)


def inference_layout(
    metas: Iterable[TensorMeta],
    tp_size: int,
    tp_rank: int,
    *,
    overrides: Mapping[str, Rule] | None = None,
    tie_word_embeddings: bool = False,
) -> list[TensorShard]:
    """What inference TP rank `tp_rank` of `tp_size` needs."""
    return [tp_shard(m, tp_size, tp_rank, overrides) for m in untie(metas, tie_word_embeddings)]


def trainer_layout(
    metas: Iterable[TensorMeta],
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    fsdp_size: int = 1,
    fsdp_rank: int = 0,
    overrides: Mapping[str, Rule] | None = None,
    tie_word_embeddings: bool = False,
) -> list[TensorShard]:
    """What a trainer rank holds: its TP box, then FSDP Shard(0) of it (empty chunks are left out)."""
    out = []
    for m in untie(metas, tie_word_embeddings):
        s = tp_shard(m, tp_size, tp_rank, overrides)
        if fsdp_size > 1 and s.box.ndim:
            s = TensorShard(m.name, m.dtype, m.shape, split_box(s.box, 0, fsdp_size, fsdp_rank, even=False))
        if s.box.numel:
            out.append(s)
    return out


def shard_from_local(
    name: str, local: torch.Tensor, global_shape: Sequence[int], offset: Sequence[int]
) -> TensorShard:
    """The truthful shard of a local tensor that starts at `offset` of a tensor of `global_shape`."""
    return TensorShard.of(name, local.dtype, global_shape, offset, tuple(local.shape))


def shard_from_dtensor(name: str, t: Any) -> tuple[TensorShard, torch.Tensor]:
    """(shard, local tensor) of a DTensor (e.g. FSDP2 Shard(0)): global shape and the global offset
    of this rank's local chunk (any Shard / _StridedShard / Replicate placement whose rows are contiguous;
    others raise layout.dtensor.PlacementError). Plain tensors come back whole."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor is published

    if not isinstance(t, DTensor):
        return TensorShard.full(name, t.dtype, tuple(t.shape)), t
    offset, _shape = dtensor_local_box(name, t)
    local = t.to_local()
    return shard_from_local(name, local, tuple(t.shape), offset), local
