"""Expert-parallel inference layout of MoE experts (HF names `...mlp.experts.<e>.{gate,up,down}_proj.weight`).

An engine replica of TP size `tp` with expert parallelism `ep` (SGLang `--ep-size`, which divides the TP
size; vLLM's expert parallelism is the case ep == tp) puts the experts in `ep` contiguous ranges, one per
group of tp / ep consecutive ranks, and splits each expert of a group over its tp / ep ranks like a
dense MLP (gate / up by rows, down by columns). ep == 1 splits every expert over all ranks; ep == tp
gives each rank whole experts. A rank needs nothing of the experts outside its range, so the plan
sends each expert only to the ranks that serve it. Attention and dense tensors follow layout/heads.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from weightsync.agent.layout.heads import head_shard
from weightsync.agent.layout.rules import LayoutError, Rule, TensorMeta, split_box, untie
from weightsync.agent.layout.spec import Attention
from weightsync.agent.plan import Box, TensorShard

EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_range(num_experts: int, tp_size: int, ep_size: int, tp_rank: int) -> range:
    """The experts inference rank `tp_rank` serves."""
    if ep_size < 1 or tp_size % ep_size:
        raise LayoutError(f"inference EP {ep_size} does not divide TP {tp_size} (the EP groups are made of TP ranks)")
    if num_experts % ep_size:
        raise LayoutError(f"{num_experts} experts do not divide over inference EP {ep_size}")
    per = num_experts // ep_size
    group = tp_rank // (tp_size // ep_size)
    return range(group * per, (group + 1) * per)


def expert_shard(meta: TensorMeta, tp_size: int, tp_rank: int, ep_size: int, num_experts: int) -> TensorShard | None:
    """The box of an expert tensor a rank needs, None when the expert is served elsewhere."""
    m = EXPERT.search(meta.name)
    if m is None:
        raise LayoutError(f"{meta.name!r} is not an expert tensor")
    e = int(m.group(2))
    if e >= num_experts:
        raise LayoutError(f"{meta.name!r}: expert {e} of a model with {num_experts} experts")
    if e not in expert_range(num_experts, tp_size, ep_size, tp_rank):
        return None
    moe_tp = tp_size // ep_size
    dim = 1 if m.group(3) == "down_proj" else 0
    box = Box.full(meta.shape)
    if moe_tp > 1:
        try:
            box = split_box(box, dim, moe_tp, tp_rank % moe_tp, even=True)
        except LayoutError as exc:
            raise LayoutError(f"{meta.name!r} {list(meta.shape)} over expert TP {moe_tp}: {exc}") from None
    return TensorShard(meta.name, meta.dtype, meta.shape, box)


def moe_layout(metas: Iterable[TensorMeta], tp_size: int, tp_rank: int, attention: Attention, *, ep_size: int = 1,
               num_experts: int = 0, overrides: Mapping[str, Rule] | None = None,
               tie_word_embeddings: bool = False) -> list[TensorShard]:
    """What inference rank `tp_rank` needs: its experts (expert_shard), the rest head-wise (layout/heads.py)."""
    out = []
    for meta in untie(metas, tie_word_embeddings):
        if num_experts and EXPERT.search(meta.name):
            s = expert_shard(meta, tp_size, tp_rank, ep_size, num_experts)
            if s is not None:
                out.append(s)
        else:
            out.append(head_shard(meta, tp_size, tp_rank, attention, overrides))
    return out
