"""Layout rules: TP defaults for HF names, overrides, FSDP Shard(0) chunks, tied embeddings, DTensor."""

from __future__ import annotations

import queue

import pytest
import torch
from wsagent_helpers import dtensor_worker, forkserver_context

from weightsync.agent.layout.rules import (
    LayoutError,
    TensorMeta,
    inference_layout,
    rule_for,
    shard_dim,
    shard_from_dtensor,
    split_box,
    tensor_metas,
    trainer_layout,
)
from weightsync.agent.plan import Box


@pytest.mark.parametrize(
    ("name", "ndim", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 2, 0),
        ("model.layers.0.self_attn.k_proj.bias", 1, 0),
        ("model.layers.3.self_attn.v_proj.weight", 2, 0),
        ("model.layers.0.mlp.gate_proj.weight", 2, 0),
        ("model.layers.0.mlp.up_proj.weight", 2, 0),
        ("model.layers.0.self_attn.o_proj.weight", 2, 1),
        ("model.layers.0.self_attn.o_proj.bias", 1, None),  # row-parallel bias: replicated
        ("model.layers.0.mlp.down_proj.weight", 2, 1),
        ("model.embed_tokens.weight", 2, 0),
        ("lm_head.weight", 2, 0),
        ("model.layers.0.input_layernorm.weight", 1, None),
        ("model.norm.weight", 1, None),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", 1, None),
    ],
)
def test_default_rules(name: str, ndim: int, dim: int | None) -> None:
    assert shard_dim(name, ndim) == dim


def test_overrides_win_and_accept_dims() -> None:
    over = {r"k_proj\.weight$": "replicated", r"experts\.\d+\.w$": 1}
    assert rule_for("model.layers.0.self_attn.k_proj.weight", over) == "replicated"
    assert shard_dim("model.layers.0.self_attn.k_proj.weight", 2, over) is None
    assert shard_dim("model.layers.0.mlp.experts.7.w", 3, over) == 1
    assert shard_dim("x.w", 2, {r"^x": -1}) == 1
    with pytest.raises(LayoutError, match="out of range"):
        shard_dim("x.w", 2, {r"^x": 5})
    with pytest.raises(LayoutError, match="unknown layout rule"):
        shard_dim("x.w", 2, {r"^x": "diagonal"})  # type: ignore[dict-item]


def test_inference_tp_boxes() -> None:
    metas = [TensorMeta("a.q_proj.weight", "bfloat16", (8, 4)), TensorMeta("a.o_proj.weight", "bfloat16", (4, 8)),
             TensorMeta("a.norm.weight", "float32", (4,))]
    r1 = {s.name: s.box for s in inference_layout(metas, 4, 1)}
    assert r1["a.q_proj.weight"] == Box((2, 0), (2, 4))
    assert r1["a.o_proj.weight"] == Box((0, 2), (4, 2))
    assert r1["a.norm.weight"] == Box((0,), (4,))
    with pytest.raises(LayoutError, match="does not divide by 3"):
        inference_layout(metas, 3, 0)


def test_fsdp_chunks_follow_torch_chunk() -> None:
    full = Box((0, 0), (10, 3))
    got = [split_box(full, 0, 4, r, even=False) for r in range(4)]
    want = [c.shape for c in torch.empty(10, 3).chunk(4, dim=0)]
    assert [b.shape for b in got] == want
    assert [b.offset[0] for b in got] == [0, 3, 6, 9]
    # 2 rows over 4 ranks: the last two ranks hold nothing and are left out of the layout
    metas = [TensorMeta("w", "float32", (2, 3))]
    assert [len(trainer_layout(metas, fsdp_size=4, fsdp_rank=r)) for r in range(4)] == [1, 1, 0, 0]


def test_trainer_tp_then_fsdp() -> None:
    metas = [TensorMeta("m.q_proj.weight", "float32", (16, 4))]
    s = trainer_layout(metas, tp_size=2, tp_rank=1, fsdp_size=2, fsdp_rank=1)[0]
    assert s.box == Box((12, 0), (4, 4))  # TP rank 1 holds rows 8..16, its FSDP rank 1 holds 12..16


def test_tied_embeddings_drop_lm_head() -> None:
    named = [("model.embed_tokens.weight", torch.zeros(8, 4)), ("lm_head.weight", torch.zeros(8, 4)),
             ("model.norm.weight", torch.zeros(4))]
    metas = tensor_metas(named)
    assert [s.name for s in inference_layout(metas, 2, 0, tie_word_embeddings=True)] == [
        "model.embed_tokens.weight", "model.norm.weight"]
    assert [s.name for s in trainer_layout(metas, tie_word_embeddings=True)] == [
        "model.embed_tokens.weight", "model.norm.weight"]
    assert len(inference_layout(metas, 2, 0)) == 3


def test_shard_from_dtensor_is_truthful() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = forkserver_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=dtensor_worker, args=(r, port, out), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(4):
            r = out.get(timeout=90)
            got[r[0]] = r[1:]
    except queue.Empty:
        pytest.fail(f"DTensor workers did not report: {got}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got[0] == ((0, 0), (3, 3), (10, 3), True)
    assert got[3] == ((9, 0), (1, 3), (10, 3), True)
    assert all(v[3] for v in got.values())
    # plain tensors come back whole
    shard, _ = shard_from_dtensor("x", torch.zeros(2, 2))
    assert shard.box == Box((0, 0), (2, 2))
