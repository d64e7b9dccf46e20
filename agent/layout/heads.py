"""Head-wise inference TP: what each engine rank needs of the attention tensors, KV replication included.

Engines split attention by heads, not rows: q_proj (and its bias) by query heads, o_proj's input
columns by query heads, k_proj / v_proj by KV heads. When TP exceeds the KV heads (GQA, e.g. 8 KV heads
on TP 16) each KV head is replicated on TP / num_kv_heads consecutive ranks, as vLLM and SGLang do: those
ranks need the same box, which the plan sends once to all of them (a broadcast piece). Head counts that
do not divide are refused with the numbers (the engines refuse them too). Everything else follows
layout/rules.py (column / row / vocab / replicated, overrides, tied embeddings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from weightsync.agent.layout.rules import LayoutError, Rule, TensorMeta, tp_shard, untie
from weightsync.agent.layout.spec import Attention
from weightsync.agent.plan import Box, TensorShard

Q_PROJ = re.compile(r"(^|\.)q_proj\.(weight|bias)$")
KV_PROJ = re.compile(r"(^|\.)(k_proj|v_proj)\.(weight|bias)$")
O_PROJ = re.compile(r"(^|\.)o_proj\.weight$")


def kv_head_of(tp_size: int, tp_rank: int, num_kv_heads: int) -> range:
    """The KV heads a TP rank needs: its share when TP divides them, else the one it replicates."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads do not divide by TP {tp_size}")
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_kv_heads:
        raise LayoutError(f"TP {tp_size} exceeds the {num_kv_heads} KV heads and is not a multiple of them, "
                          "so the KV heads cannot be replicated evenly")
    h = tp_rank // (tp_size // num_kv_heads)
    return range(h, h + 1)


def head_shard(meta: TensorMeta, tp_size: int, tp_rank: int, attention: Attention,
               overrides: Mapping[str, Rule] | None = None) -> TensorShard:
    """The box of `meta` an inference TP rank needs, head-wise for attention tensors."""
    a = attention
    name, shape = meta.name, meta.shape
    is_q, is_kv, is_o = bool(Q_PROJ.search(name)), bool(KV_PROJ.search(name)), bool(O_PROJ.search(name))
    if not (is_q or is_kv or is_o) or tp_size == 1:
        return tp_shard(meta, tp_size, tp_rank, overrides)
    if (is_q or is_o) and a.num_heads % tp_size:
        raise LayoutError(f"{name}: {a.num_heads} query heads do not divide by TP {tp_size}")
    dim = 1 if is_o else 0
    heads = a.num_kv_heads if is_kv else a.num_heads
    if shape[dim] != heads * a.head_dim:
        raise LayoutError(f"{name} {list(shape)}: dim {dim} is not {heads} heads x {a.head_dim}")
    if is_kv:
        hs = kv_head_of(tp_size, tp_rank, a.num_kv_heads)
    else:
        per = a.num_heads // tp_size
        hs = range(tp_rank * per, (tp_rank + 1) * per)
    off = [0] * len(shape)
    size = list(shape)
    off[dim], size[dim] = hs.start * a.head_dim, len(hs) * a.head_dim
    return TensorShard(name, meta.dtype, shape, Box(tuple(off), tuple(size)))


def head_layout(metas: Iterable[TensorMeta], tp_size: int, tp_rank: int, attention: Attention, *,
                overrides: Mapping[str, Rule] | None = None, tie_word_embeddings: bool = False) -> list[TensorShard]:
    """What inference TP rank `tp_rank` of `tp_size` needs, attention split by heads."""
    return [head_shard(m, tp_size, tp_rank, attention, overrides) for m in untie(metas, tie_word_embeddings)]
