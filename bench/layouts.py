"""Benchmark: real model layouts resharded through the agent's plan and transports, checked bit for bit.

    python bench/layouts.py --preset NAME [--trainer-tp A --trainer-fsdp B --trainer-pp C --trainer-ep D
        --inference-tp E --inference-ep F] [--fp8] [--transport nccl|ipc] [--bucket-kb K] [--iters N] --json

Presets (agent/layout/presets.py) are scaled-down fixtures with real models' shape rules: `llama-gqa`
(32 query heads, 8 KV heads, HF names on both sides), `megatron-fused` (Megatron names, fused
linear_qkv per KV group and linear_fc1 = [gate, up] per TP shard, local layer numbers per pipeline
stage on the trainer; HF names on the engine), `fsdp2-tp-strided` (every trainer rank runs FSDP2
`fully_shard` over `parallelize_module` TP in a real gloo group and publishes its DTensors, whose
column-parallel weights are `_StridedShard`).

Every trainer and inference rank is its own process (bench.transport_ratio.run_workers). A trainer rank
maps its local trainer tensors to engine boxes (agent/layout/spec.py: renames, fused components as
strided views) and copies them once into its plan arena; the agent's WeightSender / transport /
WeightReceiver move them; each inference rank needs its head-wise boxes (agent/layout/heads.py: KV heads
replicated when TP exceeds them). The check is independent of that code: the full HF tensors are random,
the Megatron tensors are built from them by concatenation following Megatron's layout, and each
inference rank's expected slices follow the engines' head rules written out again here.

A combination the layouts cannot express is refused before any process starts: one JSON object with
`refused` (the reason) and `bit_exact: null`, exit status 3. Timing fields are medians over --iters:
`seconds` (one version through WeightSender / WeightReceiver, the slowest rank), `raw_seconds` (the same
streams through the raw transport, one op per (source, destinations) stream with no plan and no control
message, bench/transport_ratio.py, in rounds alternating with the agent's), `ratio` (raw / agent) and
`cpu_seconds` / `raw_cpu_seconds` (the CPU time of every rank process over one version, their threads
included: with more rank processes than cores, this is what the wall time follows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.agent.layout.dtensor import PlacementError
from weightsync.agent.layout.experts import moe_layout
from weightsync.agent.layout.fp8 import block_rel_err, fp8_shards, quantize_blocks, scale_name
from weightsync.agent.layout.presets import (
    PRESETS,
    DeepSeekShape,
    ModelShape,
    Preset,
    deepseek_megatron_metas,
    hf_metas,
    hf_stage_metas,
    megatron_metas,
)
from weightsync.agent.layout.rules import LayoutError, TensorMeta, trainer_layout
from weightsync.agent.layout.spec import SourcePart, map_shards, stage_layers
from weightsync.agent.plan import Box, PlanError, TensorShard, TransferPlan, build_plan
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from transport_ratio import BenchConfig, _arena, _barrier, _links, _make_transport, _raw, run_workers  # noqa: E402

HOST = "127.0.0.1"


class Refused(Exception):
    """The layouts cannot express this combination; the message says why."""


@dataclass
class LayoutsConfig(BenchConfig):
    """Flags of one run (picklable for the worker processes)."""

    preset: str = "llama-gqa"
    trainer_fsdp: int = 1
    trainer_pp: int = 1
    trainer_ep: int = 1
    inference_ep: int = 1
    fp8: bool = False
    bucket_kb: int = 256
    dtensor_port: int = 0

    @property
    def num_src(self) -> int:
        return self.trainer_tp * self.trainer_fsdp * self.trainer_pp * self.trainer_ep

    @property
    def num_dst(self) -> int:
        return self.inference_tp


@dataclass(frozen=True)
class Coord:
    """A trainer rank's place: pipeline stage, TP rank, expert-parallel rank, FSDP rank
    (rank = ((stage * tp + tp_rank) * ep + ep_rank) * fsdp + fsdp_rank; dense tensors are replicated over EP)."""

    stage: int
    tp: int
    fsdp: int
    ep: int = 0


def coord(cfg: LayoutsConfig, rank: int) -> Coord:
    f, e, t = cfg.trainer_fsdp, cfg.trainer_ep, cfg.trainer_tp
    return Coord(rank // (f * e * t), (rank // (f * e)) % t, rank % f, (rank // f) % e)


# -- the layouts, through the product code ------------------------------------------------------------
@dataclass
class Layouts:
    preset: Preset
    native: list[list[TensorShard]]  # per trainer rank, in the trainer's names
    parts: list[list[SourcePart]]  # per trainer rank, engine boxes and where they sit in the native tensors
    sources: list[list[TensorShard]]  # per trainer rank, as they travel (fp8 weights + scales with --fp8)
    needs: list[list[TensorShard]]
    plan: TransferPlan


def stage_metas(cfg: LayoutsConfig, preset: Preset, c: Coord) -> tuple[list[TensorMeta], range]:
    m = preset.model
    layers = stage_layers(m.layers, cfg.trainer_pp, c.stage)
    first, last = c.stage == 0, c.stage == cfg.trainer_pp - 1
    if preset.naming.local_layers:
        if isinstance(m, DeepSeekShape):
            return deepseek_megatron_metas(m, layers, first=first, last=last, ep_size=cfg.trainer_ep), layers
        return megatron_metas(m, layers, first=first, last=last, ep_size=cfg.trainer_ep), layers
    per = m.experts // cfg.trainer_ep
    experts = range(c.ep * per, (c.ep + 1) * per) if m.experts else None
    return hf_stage_metas(hf_metas(m), layers, first=first, last=last, experts=experts), layers


def build_layouts(cfg: LayoutsConfig) -> Layouts:
    """Both sides' layouts and the plan, or Refused with the reason."""
    preset = PRESETS.get(cfg.preset)
    if preset is None:
        raise Refused(f"unknown preset {cfg.preset!r} (known: {', '.join(sorted(PRESETS))})")
    if min(cfg.trainer_tp, cfg.trainer_fsdp, cfg.trainer_pp, cfg.trainer_ep, cfg.inference_tp, cfg.inference_ep) < 1:
        raise Refused("parallel sizes must be >= 1")
    m = preset.model
    if not m.experts and (cfg.trainer_ep > 1 or cfg.inference_ep > 1):
        raise Refused(f"preset {cfg.preset} is a dense model with no experts: --trainer-ep / --inference-ep need an "
                      "MoE preset (qwen-moe)")
    if m.experts and m.experts % cfg.trainer_ep:
        raise Refused(f"{m.experts} experts do not divide over trainer EP {cfg.trainer_ep}")
    model_rules: dict[str, Any] = dict(getattr(m, "tp_overrides", {}))
    overrides = {**preset.naming.tp_rules, **model_rules}
    try:
        native: list[list[TensorShard]] = []
        parts: list[list[SourcePart]] = []
        for r in range(cfg.num_src):
            c = coord(cfg, r)
            metas, layers = stage_metas(cfg, preset, c)
            shards = trainer_layout(metas, tp_size=cfg.trainer_tp, tp_rank=c.tp, fsdp_size=cfg.trainer_fsdp,
                                    fsdp_rank=c.fsdp, overrides=overrides,
                                    tie_word_embeddings=m.tie_word_embeddings)
            native.append(shards)
            parts.append(map_shards(preset.naming, shards, attention=m.attention, tp_size=cfg.trainer_tp,
                                    layer_offset=layers.start, expert_offset=c.ep * (m.experts // cfg.trainer_ep)))
        needs = [moe_layout(hf_metas(m), cfg.inference_tp, d, m.attention, ep_size=cfg.inference_ep,
                            num_experts=m.experts, overrides=model_rules,
                            tie_word_embeddings=m.tie_word_embeddings)
                 for d in range(cfg.num_dst)]
        sources = [[p.shard for p in ps] for ps in parts]
        if cfg.fp8:  # the trainer quantizes its own boxes; the engines need fp8 boxes plus their block scales
            sources = [fp8_shards(s, who="trainer ") for s in sources]
            needs = [fp8_shards(n, who="engine ") for n in needs]
        plan = build_plan(sources, needs, cfg.bucket_kb * 1024)
    except (LayoutError, PlanError, PlacementError) as exc:
        raise Refused(str(exc)) from None
    return Layouts(preset, native, parts, sources, needs, plan)


# -- the independent reference --------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def hf_full(m: ModelShape | DeepSeekShape, finite: bool = False) -> dict[str, torch.Tensor]:
    """Random full HF tensors: bf16 from random bits (every bit pattern, NaNs included, must survive), or
    with `finite` (FP8) normal values whose magnitude varies by row over five decades, so blocks get
    different scales. Cached per process: callers must not modify the tensors."""
    out = {}
    for t in hf_metas(m):
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
        n = 1
        for d in t.shape:
            n *= d
        if finite:
            rows = t.shape[0] if t.shape else 1
            mag = torch.logspace(-4, 1, rows)[torch.randperm(rows, generator=g)]
            x = torch.randn(n, generator=g).view(rows, -1) * mag[:, None]
            out[t.name] = x.to(torch.bfloat16).reshape(t.shape)
        else:
            out[t.name] = torch.randint(-32768, 32768, (n,), dtype=torch.int16, generator=g).view(torch.bfloat16).reshape(t.shape)
    return out


@functools.lru_cache(maxsize=4096)
def ref_quantized(m: ModelShape | DeepSeekShape, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ref_quantize of a reference tensor, once per process."""
    return ref_quantize(hf_full(m, True)[name])


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization, block by block: scale_inv = max|block| / 448, fp8 = block / scale_inv."""
    r, c = w.shape
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-r // 128), -(-c // 128), dtype=torch.float32)
    for i in range(0, r, 128):
        for j in range(0, c, 128):
            blk = w[i:i + 128, j:j + 128].float()
            amax = blk.abs().max()
            sc = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            q[i:i + 128, j:j + 128] = (blk / sc).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            s[i // 128, j // 128] = sc
    return q, s


def megatron_full(m: ModelShape, hf: dict[str, torch.Tensor], layers: range, tp: int, *, first: bool,
                  last: bool, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """A Megatron stage's full tensors from the HF ones, following Megatron-core's layout: linear_qkv is,
    per KV group, that group's query heads then its key head then its value head; linear_fc1 is, per TP
    shard, that shard's gate rows then its up rows (the TP-local [gate; up] concatenated over TP ranks).
    MoE: expert-parallel rank `ep_rank` holds experts ep_rank * E / ep ... as local_experts 0, 1, ...,
    each linear_fc1 = [gate; up] whole (expert TP 1)."""
    hd, qpg = m.head_dim, m.heads // m.kv_heads
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
    for i, layer in enumerate(layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{layer}."
        wq, wk, wv = (hf[q + f"self_attn.{n}_proj.weight"] for n in "qkv")
        rows = []
        for g in range(m.kv_heads):
            rows += [wq[g * qpg * hd:(g + 1) * qpg * hd], wk[g * hd:(g + 1) * hd], wv[g * hd:(g + 1) * hd]]
        out[p + "self_attention.linear_qkv.weight"] = torch.cat(rows)
        if m.qkv_bias:  # Qwen2: the biases fused the same way
            bq, bk, bv = (hf[q + f"self_attn.{n}_proj.bias"] for n in "qkv")
            out[p + "self_attention.linear_qkv.bias"] = torch.cat(
                [x for g in range(m.kv_heads)
                 for x in (bq[g * qpg * hd:(g + 1) * qpg * hd], bk[g * hd:(g + 1) * hd], bv[g * hd:(g + 1) * hd])])
        out[p + "self_attention.linear_qkv.layer_norm_weight"] = hf[q + "input_layernorm.weight"]
        out[p + "self_attention.linear_proj.weight"] = hf[q + "self_attn.o_proj.weight"]
        if m.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = hf[q + "self_attn.q_norm.weight"]
            out[p + "self_attention.k_layernorm.weight"] = hf[q + "self_attn.k_norm.weight"]
        if m.experts:
            out[p + "pre_mlp_layernorm.weight"] = hf[q + "post_attention_layernorm.weight"]
            out[p + "mlp.router.weight"] = hf[q + "mlp.gate.weight"]
            per = m.experts // ep
            for i_local in range(per):
                x, e = f"{p}mlp.experts.local_experts.{i_local}.", f"{q}mlp.experts.{ep_rank * per + i_local}."
                out[x + "linear_fc1.weight"] = torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]])
                out[x + "linear_fc2.weight"] = hf[e + "down_proj.weight"]
            continue
        gate, up = hf[q + "mlp.gate_proj.weight"], hf[q + "mlp.up_proj.weight"]
        out[p + "mlp.linear_fc1.weight"] = torch.cat([x for t in range(tp) for x in (gate.chunk(tp)[t], up.chunk(tp)[t])])
        out[p + "mlp.linear_fc1.layer_norm_weight"] = hf[q + "post_attention_layernorm.weight"]
        out[p + "mlp.linear_fc2.weight"] = hf[q + "mlp.down_proj.weight"]
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not m.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        elif not first:  # tied over several stages: the last stage's copy of the embedding
            out["output_layer.weight"] = hf["model.embed_tokens.weight"]
    return out


def megatron_deepseek_full(m: DeepSeekShape, hf: dict[str, torch.Tensor], layers: range, tp: int, *, first: bool,
                           last: bool, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """A Megatron-core DeepSeek-V3 stage from the HF tensors: MLA projections renamed (the q / kv norms fused
    into linear_q_up_proj / linear_kv_up_proj as layer_norm_weight), dense and shared-expert linear_fc1 =
    [gate; up] per TP shard, routed experts whole and numbered locally per EP rank."""
    def fc1(gate: torch.Tensor, up: torch.Tensor, parts: int) -> torch.Tensor:
        return torch.cat([x for t in range(parts) for x in (gate.chunk(parts)[t], up.chunk(parts)[t])])

    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
    for i, layer in enumerate(layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{layer}."
        a, b = p + "self_attention.", q + "self_attn."
        out[p + "input_layernorm.weight"] = hf[q + "input_layernorm.weight"]
        out[a + "linear_q_down_proj.weight"] = hf[b + "q_a_proj.weight"]
        out[a + "linear_q_up_proj.layer_norm_weight"] = hf[b + "q_a_layernorm.weight"]
        out[a + "linear_q_up_proj.weight"] = hf[b + "q_b_proj.weight"]
        out[a + "linear_kv_down_proj.weight"] = hf[b + "kv_a_proj_with_mqa.weight"]
        out[a + "linear_kv_up_proj.layer_norm_weight"] = hf[b + "kv_a_layernorm.weight"]
        out[a + "linear_kv_up_proj.weight"] = hf[b + "kv_b_proj.weight"]
        out[a + "linear_proj.weight"] = hf[b + "o_proj.weight"]
        if layer < m.dense_layers:
            out[p + "mlp.linear_fc1.layer_norm_weight"] = hf[q + "post_attention_layernorm.weight"]
            out[p + "mlp.linear_fc1.weight"] = fc1(hf[q + "mlp.gate_proj.weight"], hf[q + "mlp.up_proj.weight"], tp)
            out[p + "mlp.linear_fc2.weight"] = hf[q + "mlp.down_proj.weight"]
            continue
        out[p + "pre_mlp_layernorm.weight"] = hf[q + "post_attention_layernorm.weight"]
        out[p + "mlp.router.weight"] = hf[q + "mlp.gate.weight"]
        out[p + "mlp.router.expert_bias"] = hf[q + "mlp.gate.e_score_correction_bias"]
        per = m.experts // ep
        for j in range(per):
            x, e = f"{p}mlp.experts.local_experts.{j}.", f"{q}mlp.experts.{ep_rank * per + j}."
            out[x + "linear_fc1.weight"] = torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]])
            out[x + "linear_fc2.weight"] = hf[e + "down_proj.weight"]
        sx = q + "mlp.shared_experts."
        out[p + "mlp.shared_experts.linear_fc1.weight"] = fc1(hf[sx + "gate_proj.weight"], hf[sx + "up_proj.weight"], tp)
        out[p + "mlp.shared_experts.linear_fc2.weight"] = hf[sx + "down_proj.weight"]
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not m.tie_word_embeddings:
            out["output_layer.weight"] = hf["lm_head.weight"]
        elif not first:
            out["output_layer.weight"] = hf["model.embed_tokens.weight"]
    return out


def expected_slice(m: Any, name: str, full: torch.Tensor, tp: int, rank: int, ep: int = 1) -> torch.Tensor:
    """What an engine's TP rank holds of a tensor, by the engines' rules (vLLM / SGLang Llama): query heads
    split over ranks, KV heads split or (TP > KV heads) replicated, o_proj / down_proj by input columns,
    gate / up / embeddings / head by rows, the rest whole."""
    hd = getattr(m, "head_dim", 0)  # dense GQA models; MLA has no q / k / v projections
    if ".experts." in name:  # the rank's EP group holds the expert; its tp / ep ranks split it like a dense MLP
        group = tp // ep
        return full.chunk(group, dim=1 if name.endswith("down_proj.weight") else 0)[rank % group]
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):  # MLA: per-head up projections, by rows
        return full.chunk(tp, dim=0)[rank]
    if ".q_proj." in name:
        per = m.heads // tp
        return full[rank * per * hd:(rank + 1) * per * hd]
    if ".k_proj." in name or ".v_proj." in name:
        if tp <= m.kv_heads:
            per = m.kv_heads // tp
            return full[rank * per * hd:(rank + 1) * per * hd]
        head = rank * m.kv_heads // tp
        return full[head * hd:(head + 1) * hd]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, dim=1)[rank]
    if name.endswith(("gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return full.chunk(tp, dim=0)[rank]
    return full


# -- worker processes ------------------------------------------------------------------------------------
def native_locals(cfg: LayoutsConfig, lay: Layouts, rank: int,
                  real_dtensors: bool = True) -> tuple[dict[str, torch.Tensor], int]:
    """This trainer rank's local tensors in its own names: slices of the reference (Megatron, HF), or the
    local tensors of real FSDP2-over-TP DTensors (fsdp2-tp-strided), checked against the planned boxes;
    and how many of them are _StridedShard DTensors."""
    m = lay.preset.model
    c = coord(cfg, rank)
    hf = hf_full(m, cfg.fp8)
    if lay.preset.dtensor and real_dtensors:
        return _dtensor_locals(cfg, lay, rank, hf)
    layers = stage_layers(m.layers, cfg.trainer_pp, c.stage)
    first, last = c.stage == 0, c.stage == cfg.trainer_pp - 1
    if not lay.preset.naming.local_layers:
        full = hf
    elif isinstance(m, DeepSeekShape):
        full = megatron_deepseek_full(m, hf, layers, cfg.trainer_tp, first=first, last=last, ep=cfg.trainer_ep,
                                      ep_rank=c.ep)
    else:
        full = megatron_full(m, hf, layers, cfg.trainer_tp, first=first, last=last, ep=cfg.trainer_ep, ep_rank=c.ep)
    return {s.name: full[s.name][s.box.slices_within(Box.full(s.global_shape))] for s in lay.native[rank]}, 0


def _dtensor_locals(cfg: LayoutsConfig, lay: Layouts, rank: int,
                    hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightsync.agent.layout.shards import local_shards

    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{cfg.dtensor_port}", rank=rank,
                            world_size=cfg.num_src)
    # ranks laid out as coord() numbers them (FSDP fastest), viewed as a (pp, dp, tp) mesh
    ranks = torch.arange(cfg.num_src).reshape(cfg.trainer_pp, cfg.trainer_tp, cfg.trainer_fsdp).transpose(1, 2)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "dp", "tp"))
    model = torch.nn.Module()
    plan: dict[str, Any] = {}
    blocks: list[str] = []
    col = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight", "lm_head.weight")
    for s in lay.native[rank]:
        *path, leaf = s.name.split(".")
        parent = model
        for part in path[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        owner = ".".join(path)
        w = hf[s.name].clone()
        mod: torch.nn.Module
        if s.name.endswith(col) or s.name.endswith(("o_proj.weight", "down_proj.weight")):
            mod = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            plan[owner] = ColwiseParallel() if s.name.endswith(col) else RowwiseParallel()
        elif s.name.endswith("embed_tokens.weight"):
            mod = torch.nn.Embedding(w.shape[0], w.shape[1], dtype=w.dtype)
            plan[owner] = RowwiseParallel()  # Shard(0): vocab-parallel
        else:
            mod = torch.nn.Module()
        with torch.no_grad():
            mod.register_parameter(leaf, torch.nn.Parameter(w, requires_grad=False))
        parent.add_module(path[-1], mod)
        if len(path) >= 3 and path[1] == "layers" and ".".join(path[:3]) not in blocks:
            blocks.append(".".join(path[:3]))
    if cfg.trainer_tp > 1:
        parallelize_module(model, mesh["tp"], plan)
    if cfg.trainer_fsdp > 1:
        for b in blocks:
            fully_shard(model.get_submodule(b), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    state = model.state_dict()
    strided = sum(1 for t in state.values() if "_StridedShard" in str(getattr(t, "placements", "")))
    shards, _ = local_shards(state)
    got = {s.name: (s.global_offset, tuple(s.tensor.shape)) for s in shards}
    want = {s.name: (s.box.offset, s.box.shape) for s in lay.native[rank]}
    if got != want:
        bad = sorted(n for n in want if got.get(n) != want[n])[:3]
        raise AssertionError(f"FSDP2-over-TP boxes differ from the planned ones for {bad}: "
                             f"{[(got.get(n), want[n]) for n in bad]}")
    out = {s.name: s.tensor for s in shards}
    dist.destroy_process_group()
    return out, strided


def stage(lay: Layouts, rank: int, locals_: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
    """What a trainer's publish does with a layout: each engine box copied once out of the local trainer
    tensor into the rank's staging views (fused components read strided), or, for block-FP8 weights,
    quantized where the bytes are and the fp8 weight and its scales written there."""
    quantized = {s.name for s in lay.sources[rank] if s.dtype == "float8_e4m3fn"}
    for p in lay.parts[rank]:
        if p.shard.name in quantized:
            q, sc = quantize_blocks(p.view.of(locals_[p.trainer_name]))
            if p.shard.name in views:
                views[p.shard.name].copy_(q)
            if scale_name(p.shard.name) in views:
                views[scale_name(p.shard.name)].copy_(sc)
        elif p.shard.name in views:
            p.view.copy_into(views[p.shard.name], locals_[p.trainer_name])


def _run(cfg: LayoutsConfig, role: str, rank: int, port: int) -> dict[str, Any]:
    from weightsync.agent.transports.nccl import make_store

    torch.set_num_threads(1)
    store = make_store(HOST, port, is_master=False, timeout=cfg.timeout)
    lay = build_layouts(cfg)
    plan = lay.plan
    world = cfg.num_src + cfg.num_dst
    shm_path = None
    if role == "src" and cfg.transport == "ipc":
        shm_path = f"/dev/shm/weightsync-bench-{os.getpid()}-{os.urandom(4).hex()}-s9"
    flat, owner, views = _arena(plan.arena(role, rank), "cpu", shm_path)
    result: dict[str, Any] = {}
    if role == "src":
        locals_, result["strided_dtensors"] = native_locals(cfg, lay, rank)
        stage(lay, rank, locals_, views)
        del locals_
    peers = _links(cfg, plan, role, rank, store)
    transport = _make_transport(cfg, store)
    if owner is not None and hasattr(transport, "register_shared"):
        transport.register_shared(owner.path, flat)
    # The raw transport under the same plan (one torch.distributed op, or one memcpy for IPC, per (source,
    # destinations) stream; no plan, no control messages), in rounds alternating with the agent's.
    _barrier(store, "raw-setup", world)
    raw_step, raw_close = _raw(cfg, plan, role, rank, store, flat, peers, world, owner)
    times: list[float] = []
    cpu: list[float] = []
    raw_times: list[float] = []
    raw_cpu: list[float] = []
    last = cfg.warmup + cfg.iters - 1
    if role == "src":
        sender = WeightSender(plan, rank, transport, peers, device="cpu", timeout=cfg.timeout)
    else:
        receiver = WeightReceiver(plan, rank, transport, peers, device="cpu", timeout=cfg.timeout)
    for v in range(cfg.warmup + cfg.iters):
        if role == "dst":
            flat.zero_()
        _barrier(store, f"v{v}", world)
        t0, c0 = time.perf_counter(), time.process_time()
        if role == "src":
            sender.send_version(v, views)
        else:
            receiver.receive_version(None, expected_version=v, into=views)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if role == "dst" and v == last:  # before the raw round overwrites the destination
            result.update(verify(cfg, lay, rank, views))
        c0 = time.process_time()
        r0, r1 = raw_step(v)
        raw_times.append(r1 - r0)
        raw_cpu.append(time.process_time() - c0)
    result["seconds"] = times[cfg.warmup:]
    result["cpu_seconds"] = cpu[cfg.warmup:]
    result["raw_seconds"] = raw_times[cfg.warmup:]
    result["raw_cpu_seconds"] = raw_cpu[cfg.warmup:]
    raw_close()
    transport.close()
    if owner is not None:
        del views, flat
        owner.close()
        owner.unlink()
    return result


def verify(cfg: LayoutsConfig, lay: Layouts, rank: int, views: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every needed tensor against the reference, bit for bit; with --fp8 the fp8 weights and scales
    against the reference quantization of the full tensor, and each block's dequantization error."""
    m = lay.preset.model
    hf = hf_full(m, cfg.fp8)
    bad = []
    max_rel = 0.0
    for s in lay.needs[rank]:
        base = s.name.removesuffix("_scale_inv")
        if s.dtype == "float8_e4m3fn" or s.name.endswith(".weight_scale_inv"):
            full = ref_quantized(m, base)[1 if s.name.endswith("_scale_inv") else 0]
        else:
            full = hf[s.name]
        want = expected_slice(m, base, full, cfg.inference_tp, rank, cfg.inference_ep)
        got = views[s.name]
        if got.shape != want.shape or not torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
            bad.append(s.name)
        if s.dtype == "float8_e4m3fn":
            ref = expected_slice(m, s.name, hf[s.name], cfg.inference_tp, rank, cfg.inference_ep).float()
            max_rel = max(max_rel, block_rel_err(ref, got, views[scale_name(s.name)]))
    return {"bit_exact": not bad, "mismatched": bad[:5], "verified_tensors": len(lay.needs[rank]),
            "max_rel_err": max_rel, "fp8_tensors": sum(1 for s in lay.needs[rank] if s.dtype == "float8_e4m3fn")}


# -- the run ---------------------------------------------------------------------------------------------
def run(cfg: LayoutsConfig) -> dict[str, Any]:
    head = {"preset": cfg.preset, "trainer_tp": cfg.trainer_tp, "trainer_fsdp": cfg.trainer_fsdp,
            "trainer_pp": cfg.trainer_pp, "trainer_ep": cfg.trainer_ep, "inference_tp": cfg.inference_tp,
            "inference_ep": cfg.inference_ep, "fp8": cfg.fp8, "transport": cfg.transport}
    try:
        lay = build_layouts(cfg)
    except Refused as exc:
        return {**head, "refused": str(exc), "bit_exact": None}
    if lay.preset.dtensor:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            cfg.dtensor_port = s.getsockname()[1]
    results = run_workers(cfg, _run, ["weightsync.agent.layout.spec", "weightsync.agent.transports.nccl",
                                         "weightsync.agent.transports.ipc"])
    dst = [r for r in results if r["role"] == "dst"]
    per_iter = [max(r["seconds"][i] for r in results) for i in range(cfg.iters)]
    sec = statistics.median(per_iter)
    cpu = statistics.median(sum(r["cpu_seconds"][i] for r in results) for i in range(cfg.iters))
    raw = statistics.median(max(r["raw_seconds"][i] for r in results) for i in range(cfg.iters))
    raw_cpu = statistics.median(sum(r["raw_cpu_seconds"][i] for r in results) for i in range(cfg.iters))
    plan = lay.plan
    return {
        **head,
        "refused": None,
        "bit_exact": all(r["bit_exact"] for r in dst),
        "mismatched": [n for r in dst for n in r["mismatched"]][:5],
        "verified_tensors": sum(r["verified_tensors"] for r in dst),
        **({"max_rel_err": max(r["max_rel_err"] for r in dst), "fp8_tensors": sum(r["fp8_tensors"] for r in dst)}
           if cfg.fp8 else {}),
        "trainer_tensors": len({s.name for rank in lay.native for s in rank}),
        "engine_tensors": len({s.name for rank in lay.needs for s in rank}),
        "strided_dtensors": sum(r.get("strided_dtensors", 0) for r in results),
        "fused_parts": sum(1 for ps in lay.parts for p in ps if p.view.groups > 1 or p.view.rows != p.view.period),
        "buckets": len(plan.buckets),
        "broadcast_buckets": sum(1 for b in plan.buckets if b.broadcast),
        "bytes_delivered": plan.delivered_bytes(),
        "plan_hash": plan.hash,
        "seconds": sec,
        "cpu_seconds": cpu,
        "processes": len(results),
        "raw_seconds": raw,
        "raw_cpu_seconds": raw_cpu,
        "ratio": raw / sec if sec > 0 else None,
        "gbps": plan.delivered_bytes() / sec / 1e9 if sec > 0 else None,
        "iters": cfg.iters,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help=f"one of {', '.join(sorted(PRESETS))}")
    p.add_argument("--trainer-tp", type=int, default=1)
    p.add_argument("--trainer-fsdp", type=int, default=1)
    p.add_argument("--trainer-pp", type=int, default=1)
    p.add_argument("--trainer-ep", type=int, default=1)
    p.add_argument("--inference-tp", type=int, default=1)
    p.add_argument("--inference-ep", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="convert bf16 to FP8 e4m3 with 128x128 block scales")
    p.add_argument("--transport", choices=("nccl", "ipc"), default="nccl", help="nccl: gloo on CPU")
    p.add_argument("--bucket-kb", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print one JSON object (the only output)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = LayoutsConfig(transport=a.transport, size_mb=0, trainer_tp=a.trainer_tp, inference_tp=a.inference_tp,
                        warmup=1, iters=a.iters, timeout=a.timeout, preset=a.preset, trainer_fsdp=a.trainer_fsdp,
                        trainer_pp=a.trainer_pp, trainer_ep=a.trainer_ep, inference_ep=a.inference_ep, fp8=a.fp8,
                        bucket_kb=a.bucket_kb)
    res = run(cfg)
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    if res["refused"]:
        return 3
    return 0 if res["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
