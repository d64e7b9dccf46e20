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
from weightsync.agent.layout import LayoutError, TensorMeta
from weightsync.agent.layout_heads import head_layout, kv_head_of
from weightsync.agent.layout_presets import LLAMA_GQA, MEGATRON_LLAMA
from weightsync.agent.layout_spec import Attention, Fuse, Naming, Rename, map_shard
from weightsync.agent.plan import Box

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
    """Build the layouts and plan; refused -> {"refused": msg}; else move every planned piece from the
    sources' staged boxes to the destinations' and compare with the reference."""
    try:
        lay = B.build_layouts(cfg)
    except B.Refused as exc:
        return {"refused": str(exc)}
    m = lay.preset.model
    hf = B.hf_full(m)
    staged: list[dict[str, torch.Tensor]] = []
    for r in range(cfg.num_src):
        c = B.coord(cfg, r)
        layers = B.stage_layers(m.layers, cfg.trainer_pp, c.stage)
        full = (B.megatron_full(m, hf, layers, cfg.trainer_tp, first=c.stage == 0, last=c.stage == cfg.trainer_pp - 1,
                                ep=cfg.trainer_ep, ep_rank=c.ep)
                if lay.preset.naming.local_layers else hf)
        local = {s.name: full[s.name][s.box.slices_within(Box.full(s.global_shape))] for s in lay.native[r]}
        mine = {}
        for p in lay.parts[r]:
            dst = torch.empty(p.shard.box.shape, dtype=torch.bfloat16)
            p.view.copy_into(dst, local[p.trainer_name])
            mine[p.shard.name] = dst
        staged.append(mine)
    got = [{s.name: torch.zeros(s.box.shape, dtype=torch.bfloat16) for s in need} for need in lay.needs]
    need_box = [{s.name: s.box for s in need} for need in lay.needs]
    src_box = [{p.shard.name: p.shard.box for p in ps} for ps in lay.parts]
    for b in lay.plan.buckets:
        for e in b.entries:
            pc = e.piece
            assert src_box[pc.src][pc.name] == pc.src_box
            piece = staged[pc.src][pc.name][pc.box.slices_within(pc.src_box)]
            for d in pc.dsts:
                got[d][pc.name][pc.box.slices_within(need_box[d][pc.name])] = piece
    bad = [(d, s.name) for d, need in enumerate(lay.needs) for s in need
           if not torch.equal(got[d][s.name].view(torch.int16),
                              B.expected_slice(m, s.name, hf[s.name], cfg.inference_tp, d, cfg.inference_ep)
                              .contiguous().view(torch.int16))]
    return {"bit_exact": not bad, "bad": bad[:3]}


REASONS = ("do not divide", "does not divide", "not divide", "cut a", "not a multiple", "not implemented", "no experts", "exceeds")


@pytest.mark.parametrize("preset", ["llama-gqa", "megatron-fused", "fsdp2-tp-strided"])
def test_every_combination_is_bit_exact_or_refused_by_reason(preset: str) -> None:
    seen = {"ok": 0, "refused": 0}
    for tp, fsdp, pp, itp in itertools.product((1, 2, 8, 16), (1, 2, 3), (1, 2, 3), (1, 2, 8, 16, 32, 64, 12)):
        cfg = B.LayoutsConfig(transport="nccl", size_mb=0, trainer_tp=tp, inference_tp=itp, preset=preset,
                              trainer_fsdp=fsdp, trainer_pp=pp, bucket_kb=64)
        res = _execute(cfg)
        if "refused" in res:
            assert any(r in res["refused"] for r in REASONS), (tp, fsdp, pp, itp, res)
            seen["refused"] += 1
        else:
            assert res["bit_exact"], (tp, fsdp, pp, itp, res)
            seen["ok"] += 1
    assert seen["ok"] >= 20 and seen["refused"] >= 20, seen


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
])
def test_real_processes_and_transports_are_bit_exact(args: tuple[str, ...]) -> None:
    rc, res = _cli(*args)
    assert rc == 0, res
    assert res["bit_exact"] is True and res["refused"] is None
    assert res["verified_tensors"] > 0
    if "megatron-fused" in args:
        assert res["fused_parts"] > 0 and res["trainer_tensors"] < res["engine_tensors"]
    if "fsdp2-tp-strided" in args:
        assert res["strided_dtensors"] > 0
    if "16" in args:
        assert res["broadcast_buckets"] > 0  # KV heads replicated on TP 16 > 8 KV heads: one send, two ranks


def test_cli_refusal_names_the_reason() -> None:
    rc, res = _cli("--preset", "megatron-fused", "--trainer-tp", "16")
    assert rc == 3 and res["bit_exact"] is None
    assert "cut a qkv group" in res["refused"]


def test_engine_weights_publishes_megatron_tensors_in_hf_names() -> None:
    """What a Megatron trainer rank passes to TrainerSession.publish: its local tensors (TP rank 1 of 2,
    pipeline stage 1 of 2) as client TensorShards of HF tensors, each holding exactly its box."""
    from weightsync.agent.client import TensorShard as ClientShard
    from weightsync.agent.client import local_shards
    from weightsync.agent.layout_spec import engine_weights

    m = LLAMA_GQA
    hf = B.hf_full(m)
    layers = range(2, 4)
    full = B.megatron_full(m, hf, layers, 2, first=False, last=True)
    weights = {}
    for n, t in full.items():  # Megatron TP: column-parallel and vocab rows, row-parallel columns, norms whole
        if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "output_layer.weight")):
            weights[n] = ClientShard(t.chunk(2)[1], tuple(t.shape), (t.shape[0] // 2, 0))
        elif n.endswith(("linear_proj.weight", "linear_fc2.weight")):
            weights[n] = ClientShard(t.chunk(2, dim=1)[1], tuple(t.shape), (0, t.shape[1] // 2))
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


def test_expert_ranges_follow_engine_ep_groups() -> None:
    from weightsync.agent.layout_experts import expert_range, expert_shard

    assert [expert_range(128, 4, 2, r) for r in range(4)] == [range(0, 64)] * 2 + [range(64, 128)] * 2
    meta = TensorMeta("model.layers.0.mlp.experts.70.down_proj.weight", "bfloat16", (64, 32))
    assert expert_shard(meta, 4, 0, 2, 128) is None  # served by the other EP group
    s = expert_shard(meta, 4, 3, 2, 128)
    assert s is not None and s.box == Box((0, 16), (64, 16))  # down_proj split by columns over expert TP 2
    with pytest.raises(LayoutError, match="does not divide TP"):
        expert_range(128, 4, 3, 0)
