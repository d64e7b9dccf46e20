"""A Custom engine's model layout, sent with its hello: what each of its TP ranks needs, by heads and experts.

Without it the agent splits a Custom engine's tensors by the default row rules (agent/layout/rules.py), which
cut attention heads when TP exceeds the KV heads. An engine that passes `layout=` to InferenceSession
gets head-wise TP with KV heads replicated (layout/heads.py), expert parallelism (layout/experts.py)
and, for block-FP8 weights the trainer published with their `weight_scale_inv`, the scale boxes that go
with each rank's weight box (layout/fp8.py). Every rank of the engine sends the same layout; the agent refuses
a rank whose layout differs, and a layout that cannot lay out the model fails the load with the reason
(never a silent row split).

    InferenceSession(on_bucket, on_commit, layout={"num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                                                   "num_experts": 128, "expert_parallel": 4})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from weightsync.agent.layout.experts import moe_layout
from weightsync.agent.layout.fp8 import BLOCK, scale_shard
from weightsync.agent.layout.rules import LayoutError, Rule, TensorMeta
from weightsync.agent.layout.spec import Attention
from weightsync.agent.plan import TensorShard

_RULES = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class EngineLayout:
    """Head counts, experts, expert parallelism and extra TP rules (regex -> rule) of a Custom engine."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0
    expert_parallel: int = 1
    tp_rules: tuple[tuple[str, Rule], ...] = ()
    fp8_block: int = BLOCK

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineLayout:
        """Raises LayoutError naming the bad or unknown field."""
        known = {"num_heads", "num_kv_heads", "head_dim", "num_experts", "expert_parallel", "tp_rules", "fp8_block"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LayoutError(f"unknown layout fields {unknown}; known: {sorted(known)}")
        ints = {}
        for k in ("num_heads", "num_kv_heads", "head_dim", "num_experts", "expert_parallel", "fp8_block"):
            if k in d:
                v = d[k]
                if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "num_experts" else 1):
                    raise LayoutError(f"layout field {k} must be a positive integer, got {v!r}")
                ints[k] = v
        for k in ("num_heads", "num_kv_heads", "head_dim"):
            if k not in ints:
                raise LayoutError(f"layout field {k} is required")
        rules = d.get("tp_rules") or {}
        if not isinstance(rules, Mapping) or not all(
                isinstance(k, str) and (v is None or v in _RULES or (isinstance(v, int) and not isinstance(v, bool)))
                for k, v in rules.items()):
            raise LayoutError(f"layout tp_rules must map regexes to one of {_RULES}, a dim or null, got {rules!r}")
        out = cls(tp_rules=tuple(sorted(rules.items())), **ints)
        Attention(out.num_heads, out.num_kv_heads, out.head_dim)  # the head counts must group
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tp_rules"] = dict(self.tp_rules)
        return d

    def needs(self, names: dict[str, TensorShard], world: int, tp: int) -> list[list[TensorShard]]:
        """Every TP rank's boxes of the published tensors `names` (the fetcher's layout_fn)."""
        if world != tp:
            raise LayoutError(f"a layout for {world} ranks with tensor parallelism {tp}: only pure TP (world == TP)")
        scales = {n for n in names if n.endswith(".weight_scale_inv")}
        metas = [TensorMeta(n, s.dtype, s.global_shape) for n, s in sorted(names.items()) if n not in scales]
        attention = Attention(self.num_heads, self.num_kv_heads, self.head_dim)
        out = []
        for r in range(tp):
            mine = moe_layout(metas, tp, r, attention, ep_size=self.expert_parallel, num_experts=self.num_experts,
                              overrides=dict(self.tp_rules))
            for s in list(mine):
                if s.name + "_scale_inv" in scales:
                    sc = scale_shard(s, self.fp8_block, who="engine ")
                    published = names[sc.name].global_shape
                    if published != sc.global_shape:
                        raise LayoutError(f"{sc.name} {list(published)} is not the {self.fp8_block}x{self.fp8_block} "
                                          f"block grid of {s.name} {list(s.global_shape)}")
                    mine.append(sc)
            out.append(mine)
        return out
