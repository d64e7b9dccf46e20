"""Real model layouts (bench/layouts.py presets): every flag combination is bit-exact or refused by reason.

The matrix runs the product layouts and planner in-process and executes the plan piece by piece (no
transport), against the bench's independent reference (HF tensors, Megatron tensors built by
concatenation, the engines' head rules written out again). A few combinations per preset go through
real processes and transports via the bench's CLI."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from weightsync.agent.layout.heads import head_layout, kv_head_of
from weightsync.agent.layout.presets import LLAMA_GQA, MEGATRON_LLAMA
from weightsync.agent.layout.rules import LayoutError, TensorMeta
from weightsync.agent.layout.spec import Attention, Fuse, Naming, Rename, map_shard
from weightsync.agent.plan import Box
from weightsync.agent.plan.buckets import to_dtype

BENCH = Path(__file__).resolve().parents[2] / "bench" / "layouts.py"


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_layouts", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_layouts"] = mod
    spec.loader.exec_module(mod)
    return mod


B = _bench()


def _execute(cfg: Any) -> dict[str, Any]:
    """Build the layouts and plan; refused -> {"refused": msg}; else stage every trainer rank as the bench
    does, move every planned piece from the sources' staged boxes to the destinations', and check each
    destination against the reference (bench.verify)."""
    try:
        lay = B.build_layouts(cfg)
    except B.Refused as exc:
        return {"refused": str(exc)}
    staged: list[dict[str, torch.Tensor]] = []
    for r in range(cfg.num_src):
        local, _ = B.native_locals(cfg, lay, r, real_dtensors=False)
        views = {s.name: torch.empty(s.box.shape, dtype=to_dtype(s.dtype)) for s in lay.sources[r]}
        B.stage(lay, r, local, views)
        staged.append(views)
    got = [{s.name: torch.zeros(s.box.shape, dtype=to_dtype(s.dtype)) for s in need} for need in lay.needs]
    need_box = [{s.name: s.box for s in need} for need in lay.needs]
    src_box = [{s.name: s.box for s in src} for src in lay.sources]
    for b in lay.plan.buckets:
        for e in b.entries:
            pc = e.piece
            assert src_box[pc.src][pc.name] == pc.src_box
            piece = staged[pc.src][pc.name][pc.box.slices_within(pc.src_box)]
            for d in pc.dsts:
                got[d][pc.name][pc.box.slices_within(need_box[d][pc.name])] = piece
    res = [B.verify(cfg, lay, d, got[d]) for d in range(cfg.num_dst)]
    return {"bit_exact": all(r["bit_exact"] for r in res), "bad": [n for r in res for n in r["mismatched"]][:3],
            "max_rel_err": max(r["max_rel_err"] for r in res)}


REASONS = ("do not divide", "does not divide", "not divide", "cut a", "not a multiple", "not implemented", "no experts", "exceeds")


@pytest.mark.parametrize("preset", ["llama-gqa", "megatron-fused", "fsdp2-tp-strided"])
def test_every_combination_is_bit_exact_or_refused_by_reason(preset: str) -> None:
    seen = {"ok": 0, "refused": 0}
    for tp, fsdp, pp, itp in itertools.product((1, 2, 16), (1, 2, 3), (1, 2, 3), (1, 2, 16, 64, 12)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset=preset,
                              trainer_fsdp=fsdp, trainer_pp=pp, bucket_kb=64)
        res = _execute(cfg)
        if "refused" in res:
            assert any(r in res["refused"] for r in REASONS), (tp, fsdp, pp, itp, res)
            seen["refused"] += 1
        else:
            assert res["bit_exact"], (tp, fsdp, pp, itp, res)
            seen["ok"] += 1
    assert seen["ok"] >= 10 and seen["refused"] >= 20, seen


@pytest.mark.parametrize("naming", ["hf", "megatron"])
def test_qwen2_qkv_bias_is_split_and_fused_like_the_weights(naming: str, monkeypatch: Any) -> None:
    """Qwen2-style q / k / v biases: fused per KV group in Megatron's linear_qkv.bias, split by heads (KV heads
    replicated past their count) on the engine."""
    import dataclasses

    from weightsync.agent.layout.presets import NAMINGS, PRESETS, Preset

    qwen2 = dataclasses.replace(LLAMA_GQA, qkv_bias=True, tie_word_embeddings=True)
    monkeypatch.setitem(PRESETS, "qwen2", Preset("qwen2", qwen2, NAMINGS[naming]))
    for tp, pp, itp in itertools.product((1, 8), (1, 2), (4, 16)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset="qwen2",
                              trainer_pp=pp, bucket_kb=64)
        res = _execute(cfg)
        assert res.get("bit_exact"), (tp, pp, itp, res)
        lay = B.build_layouts(cfg)
        assert any(s.name.endswith("k_proj.bias") for s in lay.needs[0])


@pytest.mark.parametrize("naming", ["hf", "megatron"])
def test_tied_embeddings_are_sent_once_and_never_needed_as_lm_head(naming: str, monkeypatch: Any) -> None:
    """Llama-3.2-style tied embeddings: the engine needs no lm_head; a Megatron last stage's copy of the
    embedding (output_layer.weight) is left unsent."""
    import dataclasses

    from weightsync.agent.layout.presets import NAMINGS, PRESETS, Preset

    tied = dataclasses.replace(LLAMA_GQA, tie_word_embeddings=True)
    monkeypatch.setitem(PRESETS, "tied", Preset("tied", tied, NAMINGS[naming]))
    for tp, pp, itp in itertools.product((1, 2), (1, 2), (1, 4, 16)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset="tied",
                              trainer_pp=pp, bucket_kb=64)
        res = _execute(cfg)
        assert res.get("bit_exact"), (tp, pp, itp, res)
        lay = B.build_layouts(cfg)
        assert not any(s.name == "lm_head.weight" for need in lay.needs for s in need)
        sent = {e.piece.name for b in lay.plan.buckets for e in b.entries}
        assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent


def test_qwen_moe_every_expert_parallel_combination_is_bit_exact_or_refused() -> None:
    """Trainer EP != engine EP / TP: 128 experts, local expert numbers per trainer EP rank, fused expert fc1."""
    seen = {"ok": 0, "refused": 0}
    for tp, ep, pp, itp, iep in itertools.product((1, 2), (1, 3, 4), (1, 2), (2, 8), (1, 2, 3, 8)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset="qwen-moe",
                              trainer_ep=ep, trainer_pp=pp, inference_ep=iep, bucket_kb=256)
        res = _execute(cfg)
        if "refused" in res:
            assert any(r in res["refused"] for r in REASONS), (tp, ep, pp, itp, iep, res)
            seen["refused"] += 1
        else:
            assert res["bit_exact"], (tp, ep, pp, itp, iep, res)
            seen["ok"] += 1
    assert seen["ok"] >= 20 and seen["refused"] >= 10, seen


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    a = LLAMA_GQA.attention
    assert [kv_head_of(16, r, a.num_kv_heads) for r in (0, 1, 2, 15)] == [range(0, 1), range(0, 1), range(1, 2),
                                                                          range(7, 8)]
    metas = [TensorMeta("model.layers.0.self_attn.k_proj.weight", "bfloat16", (32, 128))]
    boxes = [head_layout(metas, 32, r, a)[0].box for r in range(32)]
    assert boxes[0] == boxes[3] == Box((0, 0), (4, 128)) and boxes[4] == Box((4, 0), (4, 128))
    with pytest.raises(LayoutError, match="not a multiple"):
        head_layout(metas, 12, 0, a)


def test_fused_qkv_maps_to_one_box_per_component() -> None:
    a = Attention(num_heads=4, num_kv_heads=2, head_dim=2)  # group: 2 q heads (4 rows), k (2), v (2)
    parts = map_shard(MEGATRON_LLAMA, "decoder.layers.1.self_attention.linear_qkv.weight", "bfloat16", (16, 3),
                      (8, 0), (8, 3), attention=a, tp_size=2, layer_offset=4)
    assert [(p.shard.name, p.shard.box.offset, p.shard.box.shape) for p in parts] == [
        ("model.layers.5.self_attn.q_proj.weight", (4, 0), (4, 3)),
        ("model.layers.5.self_attn.k_proj.weight", (2, 0), (2, 3)),
        ("model.layers.5.self_attn.v_proj.weight", (2, 0), (2, 3))]
    local = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(parts[1].view.of(local), local[4:6])


def test_rename_and_unmatched_names() -> None:
    n = Naming("x", rules=(Rename(r"a\.(?P<layer>\d+)\.w", "b.{layer}.w"),), local_layers=True)
    (p,) = map_shard(n, "a.2.w", "float32", (4,), (0,), (4,), layer_offset=10)
    assert p.shard.name == "b.12.w"
    (q,) = map_shard(n, "other", "float32", (4,), (0,), (4,))
    assert q.shard.name == "other"
    bad = Naming("y", rules=(Fuse("f", ("a", "b"), "gate_up"),))
    with pytest.raises(LayoutError, match="along a dim other than 0"):
        map_shard(bad, "f", "float32", (4, 4), (0, 2), (4, 2), tp_size=1)


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([sys.executable, str(BENCH), *args, "--iters", "1", "--json"], capture_output=True,
                         text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    return out.returncode, json.loads(lines[0])


@pytest.mark.parametrize("args", [
    ("--preset", "llama-gqa", "--trainer-tp", "2", "--trainer-fsdp", "2", "--inference-tp", "16"),
    ("--preset", "megatron-fused", "--trainer-tp", "2", "--trainer-pp", "2", "--inference-tp", "16",
     "--transport", "ipc"),
    ("--preset", "fsdp2-tp-strided", "--trainer-tp", "2", "--trainer-fsdp", "2", "--inference-tp", "4"),
    ("--preset", "qwen-moe", "--trainer-tp", "2", "--trainer-ep", "2", "--inference-tp", "4", "--inference-ep", "2"),
    ("--preset", "deepseek-fp8", "--fp8", "--trainer-tp", "2", "--trainer-ep", "2", "--inference-tp", "4",
     "--inference-ep", "4"),
])
def test_real_processes_and_transports_are_bit_exact(args: tuple[str, ...]) -> None:
    rc, res = _cli(*args)
    assert rc == 0, res
    assert res["bit_exact"] is True and res["refused"] is None
    assert res["verified_tensors"] > 0
    # the raw transport ran under the same plan, and the CPU of every rank process was counted
    assert res["raw_seconds"] > 0 and res["ratio"] == pytest.approx(res["raw_seconds"] / res["seconds"])
    assert res["cpu_seconds"] > 0 and res["raw_cpu_seconds"] > 0 and res["processes"] >= 2
    if "megatron-fused" in args:
        assert res["fused_parts"] > 0 and res["trainer_tensors"] < res["engine_tensors"]
    if "fsdp2-tp-strided" in args:
        assert res["strided_dtensors"] > 0
    if "--fp8" in args:
        assert 0 < res["max_rel_err"] <= 0.07 and res["fp8_tensors"] > 0
    if "16" in args:
        assert res["broadcast_buckets"] > 0  # KV heads replicated on TP 16 > 8 KV heads: one send, two ranks


def test_cli_refusal_names_the_reason() -> None:
    rc, res = _cli("--preset", "megatron-fused", "--trainer-tp", "16")
    assert rc == 3 and res["bit_exact"] is None
    assert "cut a qkv group" in res["refused"]


def test_engine_weights_publishes_megatron_tensors_in_hf_names() -> None:
    """What a Megatron trainer rank passes to TrainerSession.publish: its local tensors (TP rank 1 of 2,
    pipeline stage 1 of 2) as PlacedShards of HF tensors, each holding exactly its box."""
    from weightsync.agent.layout.shards import PlacedShard, local_shards
    from weightsync.agent.layout.spec import engine_weights

    m = LLAMA_GQA
    hf = B.hf_full(m)
    layers = range(2, 4)
    full = B.megatron_full(m, hf, layers, 2, first=False, last=True)
    weights = {}
    for n, t in full.items():  # Megatron TP: column-parallel and vocab rows, row-parallel columns, norms whole
        if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "output_layer.weight")):
            weights[n] = PlacedShard(t.chunk(2)[1], tuple(t.shape), (t.shape[0] // 2, 0))
        elif n.endswith(("linear_proj.weight", "linear_fc2.weight")):
            weights[n] = PlacedShard(t.chunk(2, dim=1)[1], tuple(t.shape), (0, t.shape[1] // 2))
        else:
            weights[n] = t
    out = engine_weights(weights, MEGATRON_LLAMA, attention=m.attention, tp_size=2, layer_offset=2)
    shards, _ = local_shards(out)
    assert {s.name for s in shards} == {n for n in hf if any(f"layers.{i}." in n for i in layers)} | {
        "model.norm.weight", "lm_head.weight"}
    for s in shards:
        box = Box(s.global_offset, tuple(s.tensor.shape))
        assert torch.equal(s.tensor.view(torch.int16), hf[s.name][box.slices_within(Box.full(s.global_shape))]
                           .view(torch.int16)), s.name


@pytest.mark.parametrize("naming", ["megatron-deepseek", "hf"])
def test_deepseek_fp8_every_combination_is_bit_exact_within_the_block_bound_or_refused(naming: str,
                                                                                       monkeypatch: Any) -> None:
    """bf16 -> e4m3 with 128x128 weight_scale_inv, quantized on each trainer rank's own boxes: the fp8 bytes
    and scales equal the block-by-block reference quantization of the full tensor, and each block's
    dequantization error is at most 0.07 of its largest element. Trainer in Megatron names (the preset) or
    HF names (an FSDP trainer with expert parallelism)."""
    from weightsync.agent.layout.presets import DEEPSEEK_V3, NAMINGS, PRESETS, Preset

    monkeypatch.setitem(PRESETS, "ds", Preset("ds", DEEPSEEK_V3, NAMINGS[naming]))
    seen = {"ok": 0, "refused": 0}
    for tp, fsdp, ep, itp, iep in itertools.product((1, 2), (1, 2), (1, 4), (1, 4, 8), (1, 4)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset="ds",
                              trainer_fsdp=fsdp, trainer_ep=ep, inference_ep=iep, fp8=True, bucket_kb=1024)
        res = _execute(cfg)
        if "refused" in res:
            assert any(r in res["refused"] for r in (*REASONS, "block boundaries")), (tp, fsdp, ep, itp, iep, res)
            seen["refused"] += 1
        else:
            assert res["bit_exact"], (tp, fsdp, ep, itp, iep, res)
            assert 0 < res["max_rel_err"] <= 0.07, res
            seen["ok"] += 1
    assert seen["ok"] >= 4 and seen["refused"] >= 5, seen


def test_block_fp8_roundtrip_and_scale_boxes() -> None:
    from weightsync.agent.layout.fp8 import block_rel_err, dequantize_blocks, quantize_blocks, scale_shard
    from weightsync.agent.plan import TensorShard

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 260, generator=g) * torch.logspace(-4, 1, 300)[:, None]).to(torch.bfloat16).float()
    q, s = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    assert block_rel_err(w, q, s) <= 0.0625
    assert (dequantize_blocks(q, s) - w).abs().max() > 0  # lossy, so the check above can fail
    box = TensorShard.of("m.layers.0.mlp.down_proj.weight", "bfloat16", (300, 260), (128, 0), (172, 260))
    sc = scale_shard(box)
    assert (sc.name, sc.global_shape, sc.box) == ("m.layers.0.mlp.down_proj.weight_scale_inv", (3, 3),
                                                  Box((1, 0), (2, 3)))
    with pytest.raises(LayoutError, match="block boundaries"):
        scale_shard(TensorShard.of("x.weight", "bfloat16", (256, 256), (64, 0), (64, 256)))


def test_expert_ranges_follow_engine_ep_groups() -> None:
    from weightsync.agent.layout.experts import expert_range, expert_shard

    assert [expert_range(128, 4, 2, r) for r in range(4)] == [range(0, 64)] * 2 + [range(64, 128)] * 2
    meta = TensorMeta("model.layers.0.mlp.experts.70.down_proj.weight", "bfloat16", (64, 32))
    assert expert_shard(meta, 4, 0, 2, 128) is None  # served by the other EP group
    s = expert_shard(meta, 4, 3, 2, 128)
    assert s is not None and s.box == Box((0, 16), (64, 16))  # down_proj split by columns over expert TP 2
    with pytest.raises(LayoutError, match="does not divide TP"):
        expert_range(128, 4, 3, 0)


def test_engine_weights_quantizes_where_the_bytes_are() -> None:
    """A DeepSeek trainer rank (TP rank 1 of 2) publishing block-FP8: fp8 weights and weight_scale_inv boxes
    equal to the reference quantization of the full tensors; unquantized tensors stay bf16 views."""
    from weightsync.agent.layout.fp8 import DEEPSEEK_QUANTIZED
    from weightsync.agent.layout.presets import DEEPSEEK_V3, HF
    from weightsync.agent.layout.shards import PlacedShard, local_shards
    from weightsync.agent.layout.spec import engine_weights

    hf = B.hf_full(DEEPSEEK_V3, finite=True)
    names = ["model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight"]
    weights = {names[0]: PlacedShard(hf[names[0]].chunk(2)[1], tuple(hf[names[0]].shape), (512, 0)),
               names[1]: PlacedShard(hf[names[1]].chunk(2, dim=1)[1], tuple(hf[names[1]].shape), (0, 256)),
               names[2]: hf[names[2]]}
    out = engine_weights(weights, HF, fp8=DEEPSEEK_QUANTIZED)
    assert sorted(out) == sorted([*names, names[0] + "_scale_inv", names[1] + "_scale_inv"])
    got = {s.name: s for s in local_shards(out)[0]}
    q0, s0 = B.ref_quantize(hf[names[0]])
    assert got[names[0]].tensor.dtype == torch.float8_e4m3fn
    assert torch.equal(got[names[0]].tensor.view(torch.uint8), q0[512:].view(torch.uint8))
    assert got[names[0] + "_scale_inv"].global_offset == (4, 0) and torch.equal(got[names[0] + "_scale_inv"].tensor,
                                                                                s0[4:])
    q1, s1 = B.ref_quantize(hf[names[1]])
    assert torch.equal(got[names[1]].tensor.view(torch.uint8), q1[:, 256:].view(torch.uint8))
    assert torch.equal(got[names[1] + "_scale_inv"].tensor, s1[:, 2:])
    assert got[names[2]].tensor.dtype == torch.bfloat16
    with pytest.raises(LayoutError, match="block boundaries"):
        engine_weights({names[1]: PlacedShard(hf[names[1]][:, :64], tuple(hf[names[1]].shape), (0, 0))}, HF,
                       fp8=DEEPSEEK_QUANTIZED)
