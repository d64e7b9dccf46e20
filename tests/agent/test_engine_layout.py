"""A Custom engine's layout (InferenceSession(layout=...)): validated by field, head-wise needs with KV
heads replicated, scale boxes beside block-FP8 weights."""

from __future__ import annotations

import pytest

from weightsync.agent.layout.engine import EngineLayout
from weightsync.agent.layout.rules import LayoutError
from weightsync.agent.plan import Box, TensorShard


def test_layout_fields_are_checked_by_name() -> None:
    with pytest.raises(LayoutError, match="unknown layout fields"):
        EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 2, "head_dim": 4, "heads": 8})
    with pytest.raises(LayoutError, match="head_dim is required"):
        EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 2})
    with pytest.raises(LayoutError, match="positive integer"):
        EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 2, "head_dim": True})
    with pytest.raises(LayoutError, match="do not group"):
        EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 3, "head_dim": 4})
    lay = EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 2, "head_dim": 4, "tp_rules": {"x$": "row"}})
    assert EngineLayout.from_dict(lay.to_dict()) == lay


def test_needs_replicate_kv_heads_and_carry_scale_boxes() -> None:
    lay = EngineLayout.from_dict({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128})
    names = {s.name: s for s in [
        TensorShard.full("model.layers.0.self_attn.k_proj.weight", "float8_e4m3fn", (256, 1024)),
        TensorShard.full("model.layers.0.self_attn.k_proj.weight_scale_inv", "float32", (2, 8)),
        TensorShard.full("model.norm.weight", "bfloat16", (1024,))]}
    needs = lay.needs(names, 4, 4)
    k = [next(s for s in n if s.name.endswith("k_proj.weight")).box for n in needs]
    assert k[0] == k[1] == Box((0, 0), (128, 1024)) and k[2] == k[3] == Box((128, 0), (128, 1024))
    sc = [next(s for s in n if s.name.endswith("_scale_inv")).box for n in needs]
    assert sc[1] == Box((0, 0), (1, 8)) and sc[2] == Box((1, 0), (1, 8))
    with pytest.raises(LayoutError, match="only pure TP"):
        lay.needs(names, 4, 2)
    with pytest.raises(LayoutError, match="not a multiple"):
        lay.needs(names, 3, 3)


def test_agent_keeps_one_layout_per_replica_while_ranks_are_connected() -> None:
    """EngineState.take_layout on a stand-in for the agent's state: a rank that differs from the connected ones is
    refused with both layouts; an engine whose ranks all left may come back with another, or with none."""
    from types import SimpleNamespace

    from weightsync.agent.inference.engine import EngineState

    a = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 4}
    b = {**a, "num_kv_heads": 4}
    connected: list[int] = []
    agent = SimpleNamespace(layout=None, layout_fn=None, registry=SimpleNamespace(ranks=lambda: list(connected)))
    assert EngineState.take_layout(agent, a, 0) == "" and agent.layout is not None
    fn = agent.layout_fn
    connected.append(0)
    assert EngineState.take_layout(agent, a, 1) == "" and agent.layout_fn is fn  # same layout: same needs object
    assert "connected ranks [0]" in EngineState.take_layout(agent, b, 1)
    assert "sends no layout" in EngineState.take_layout(agent, None, 1)
    assert "bad layout" in EngineState.take_layout(agent, {"num_heads": 8}, 1)
    connected.clear()
    assert EngineState.take_layout(agent, b, 0) == "" and agent.layout.num_kv_heads == 4
    assert EngineState.take_layout(agent, None, 0) == "" and agent.layout is None
