"""Layout presets: model shape rules and trainer namings of real model families, scaled by config.

`MEGATRON_LLAMA` maps Megatron-core names (local layer numbers per pipeline stage, fused `linear_qkv`
per KV group, fused `linear_fc1` = [gate, up] per TP shard, TE's fused layer norms) to Hugging Face
Llama / Qwen2 names; `HF` (layout/spec.py) is the identity for trainers that already use HF names (FSDP2).
The shape functions give both sides' tensor metadata for a `ModelShape` (the bench scales them down).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.agent.layout.rules import Rule, TensorMeta
from weightsync.agent.layout.spec import HF, Attention, Fuse, Naming, Rename

_L = r"decoder\.layers\.(?P<layer>\d+)\."
_H = "model.layers.{layer}."

MEGATRON_LLAMA = Naming(
    "megatron",
    rules=(
        Rename(r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
        Fuse(_L + r"self_attention\.linear_qkv\.weight",
             (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"), "qkv"),
        Fuse(_L + r"self_attention\.linear_qkv\.bias",
             (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"), "qkv"),
        Rename(_L + r"self_attention\.linear_qkv\.layer_norm_weight", _H + "input_layernorm.weight"),
        Rename(_L + r"self_attention\.linear_proj\.weight", _H + "self_attn.o_proj.weight"),
        Fuse(_L + r"mlp\.linear_fc1\.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
        Rename(_L + r"mlp\.linear_fc1\.layer_norm_weight", _H + "post_attention_layernorm.weight"),
        Rename(_L + r"mlp\.linear_fc2\.weight", _H + "mlp.down_proj.weight"),
        Rename(r"decoder\.final_layernorm\.weight", "model.norm.weight"),
        Rename(r"output_layer\.weight", "lm_head.weight"),
    ),
    tp_rules={
        r"\.linear_qkv\.(weight|bias)$": "column",
        r"\.linear_fc1\.weight$": "column",
        r"\.linear_proj\.weight$": "row",
        r"\.linear_fc2\.weight$": "row",
        r"(^|\.)(word_embeddings|output_layer)\.weight$": "vocab",
        r"layer_norm_weight$": "replicated",
    },
    local_layers=True,
)

_E = _L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\."

MEGATRON_MOE = Naming(
    "megatron-moe",
    rules=(
        *MEGATRON_LLAMA.rules,
        Rename(_L + r"self_attention\.q_layernorm\.weight", _H + "self_attn.q_norm.weight"),
        Rename(_L + r"self_attention\.k_layernorm\.weight", _H + "self_attn.k_norm.weight"),
        Rename(_L + r"pre_mlp_layernorm\.weight", _H + "post_attention_layernorm.weight"),
        Rename(_L + r"mlp\.router\.weight", _H + "mlp.gate.weight"),
        Fuse(_E + r"linear_fc1\.weight",
             (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"), "gate_up",
             per_tp=False),
        Rename(_E + r"linear_fc2\.weight", _H + "mlp.experts.{expert}.down_proj.weight"),
    ),
    # expert TP 1: an expert is whole on its expert-parallel rank; checked before the dense rules
    tp_rules={r"\.local_experts\.\d+\.linear_fc[12]\.weight$": "replicated", **MEGATRON_LLAMA.tp_rules},
    local_layers=True,
    local_experts=True,
)

_A = _L + r"self_attention\."

MEGATRON_DEEPSEEK = Naming(
    "megatron-deepseek",
    rules=(
        Rename(_A + r"linear_q_down_proj\.weight", _H + "self_attn.q_a_proj.weight"),
        Rename(_A + r"linear_q_up_proj\.layer_norm_weight", _H + "self_attn.q_a_layernorm.weight"),
        Rename(_A + r"linear_q_up_proj\.weight", _H + "self_attn.q_b_proj.weight"),
        Rename(_A + r"linear_kv_down_proj\.weight", _H + "self_attn.kv_a_proj_with_mqa.weight"),
        Rename(_A + r"linear_kv_up_proj\.layer_norm_weight", _H + "self_attn.kv_a_layernorm.weight"),
        Rename(_A + r"linear_kv_up_proj\.weight", _H + "self_attn.kv_b_proj.weight"),
        Rename(_L + r"input_layernorm\.weight", _H + "input_layernorm.weight"),
        Rename(_L + r"mlp\.router\.expert_bias", _H + "mlp.gate.e_score_correction_bias"),
        Fuse(_L + r"mlp\.shared_experts\.linear_fc1\.weight",
             (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), "gate_up"),
        Rename(_L + r"mlp\.shared_experts\.linear_fc2\.weight", _H + "mlp.shared_experts.down_proj.weight"),
        *MEGATRON_MOE.rules,
    ),
    tp_rules={
        r"\.(linear_q_down_proj|linear_kv_down_proj)\.weight$": "replicated",  # MLA's down projections: duplicated
        r"\.(linear_q_up_proj|linear_kv_up_proj)\.weight$": "column",
        r"\.shared_experts\.linear_fc1\.weight$": "column",
        r"\.shared_experts\.linear_fc2\.weight$": "row",
        **MEGATRON_MOE.tp_rules,
    },
    local_layers=True,
    local_experts=True,
)

NAMINGS: dict[str, Naming] = {"hf": HF, "megatron": MEGATRON_LLAMA, "megatron-moe": MEGATRON_MOE,
                              "megatron-deepseek": MEGATRON_DEEPSEEK}


@dataclass(frozen=True)
class ModelShape:
    """The shape rules of a Llama / Qwen2-style decoder (GQA when kv_heads < heads), or of a Qwen3-MoE-style
    one when `experts` > 0 (a router and `experts` MLPs of `moe_ffn` per layer, q / k norms)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype: str = "bfloat16"
    experts: int = 0
    moe_ffn: int = 0
    qk_norm: bool = False

    @property
    def attention(self) -> Attention:
        return Attention(self.heads, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class DeepSeekShape:
    """DeepSeek-V3's shape rules: MLA attention (q / kv low-rank projections, per-head q_b / kv_b), the first
    `dense_layers` layers with a dense MLP, the rest MoE (router with score-correction bias, `experts`
    routed experts of `moe_ffn`, shared experts of `shared_ffn`)."""

    layers: int
    dense_layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    ffn: int
    moe_ffn: int
    experts: int
    shared_ffn: int
    vocab: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    @property
    def attention(self) -> Attention:
        """o_proj's input is heads x v_head (MLA has no k / v projections per KV head to replicate)."""
        return Attention(self.heads, self.heads, self.v_head)

    @property
    def tp_overrides(self) -> dict[str, Rule]:
        return {r"\.(q_b_proj|kv_b_proj)\.weight$": "column"}


def deepseek_metas(m: DeepSeekShape) -> list[TensorMeta]:
    dt, h = m.dtype, m.hidden
    out = [TensorMeta("model.embed_tokens.weight", dt, (m.vocab, h))]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [TensorMeta(p + "input_layernorm.weight", dt, (h,)),
                TensorMeta(a + "q_a_proj.weight", dt, (m.q_lora_rank, h)),
                TensorMeta(a + "q_a_layernorm.weight", dt, (m.q_lora_rank,)),
                TensorMeta(a + "q_b_proj.weight", dt, (m.heads * (m.qk_nope + m.qk_rope), m.q_lora_rank)),
                TensorMeta(a + "kv_a_proj_with_mqa.weight", dt, (m.kv_lora_rank + m.qk_rope, h)),
                TensorMeta(a + "kv_a_layernorm.weight", dt, (m.kv_lora_rank,)),
                TensorMeta(a + "kv_b_proj.weight", dt, (m.heads * (m.qk_nope + m.v_head), m.kv_lora_rank)),
                TensorMeta(a + "o_proj.weight", dt, (h, m.heads * m.v_head)),
                TensorMeta(p + "post_attention_layernorm.weight", dt, (h,))]
        mlp = p + "mlp."
        if i < m.dense_layers:
            out += [TensorMeta(mlp + "gate_proj.weight", dt, (m.ffn, h)), TensorMeta(mlp + "up_proj.weight", dt, (m.ffn, h)),
                    TensorMeta(mlp + "down_proj.weight", dt, (h, m.ffn))]
            continue
        out += [TensorMeta(mlp + "gate.weight", dt, (m.experts, h)),
                TensorMeta(mlp + "gate.e_score_correction_bias", dt, (m.experts,))]
        for e in range(m.experts):
            x = f"{mlp}experts.{e}."
            out += [TensorMeta(x + "gate_proj.weight", dt, (m.moe_ffn, h)), TensorMeta(x + "up_proj.weight", dt, (m.moe_ffn, h)),
                    TensorMeta(x + "down_proj.weight", dt, (h, m.moe_ffn))]
        x = mlp + "shared_experts."
        out += [TensorMeta(x + "gate_proj.weight", dt, (m.shared_ffn, h)), TensorMeta(x + "up_proj.weight", dt, (m.shared_ffn, h)),
                TensorMeta(x + "down_proj.weight", dt, (h, m.shared_ffn))]
    out.append(TensorMeta("model.norm.weight", dt, (h,)))
    if not m.tie_word_embeddings:
        out.append(TensorMeta("lm_head.weight", dt, (m.vocab, h)))
    return out


def hf_metas(m: ModelShape | DeepSeekShape) -> list[TensorMeta]:
    """The engine's (HF) tensors of the model; lm_head is left out when tied."""
    if isinstance(m, DeepSeekShape):
        return deepseek_metas(m)
    dt, h, q, kv = m.dtype, m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = [TensorMeta("model.embed_tokens.weight", dt, (m.vocab, h))]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [TensorMeta(p + "input_layernorm.weight", dt, (h,)),
                TensorMeta(p + "self_attn.q_proj.weight", dt, (q, h)),
                TensorMeta(p + "self_attn.k_proj.weight", dt, (kv, h)),
                TensorMeta(p + "self_attn.v_proj.weight", dt, (kv, h))]
        if m.qkv_bias:
            out += [TensorMeta(p + "self_attn.q_proj.bias", dt, (q,)), TensorMeta(p + "self_attn.k_proj.bias", dt, (kv,)),
                    TensorMeta(p + "self_attn.v_proj.bias", dt, (kv,))]
        if m.qk_norm:
            out += [TensorMeta(p + "self_attn.q_norm.weight", dt, (m.head_dim,)),
                    TensorMeta(p + "self_attn.k_norm.weight", dt, (m.head_dim,))]
        out += [TensorMeta(p + "self_attn.o_proj.weight", dt, (h, q)),
                TensorMeta(p + "post_attention_layernorm.weight", dt, (h,))]
        if m.experts:
            out.append(TensorMeta(p + "mlp.gate.weight", dt, (m.experts, h)))
            for e in range(m.experts):
                x = f"{p}mlp.experts.{e}."
                out += [TensorMeta(x + "gate_proj.weight", dt, (m.moe_ffn, h)),
                        TensorMeta(x + "up_proj.weight", dt, (m.moe_ffn, h)),
                        TensorMeta(x + "down_proj.weight", dt, (h, m.moe_ffn))]
            continue
        out += [TensorMeta(p + "mlp.gate_proj.weight", dt, (m.ffn, h)),
                TensorMeta(p + "mlp.up_proj.weight", dt, (m.ffn, h)),
                TensorMeta(p + "mlp.down_proj.weight", dt, (h, m.ffn))]
    out.append(TensorMeta("model.norm.weight", dt, (h,)))
    if not m.tie_word_embeddings:
        out.append(TensorMeta("lm_head.weight", dt, (m.vocab, h)))
    return out


def megatron_metas(m: ModelShape, layers: Sequence[int], *, first: bool, last: bool,
                   ep_size: int = 1) -> list[TensorMeta]:
    """A Megatron pipeline stage's tensors (layers numbered from 0 on every stage); with experts, the
    num_experts / ep_size experts of one expert-parallel rank (numbered from 0 on every EP rank)."""
    dt, h = m.dtype, m.hidden
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    out = [TensorMeta("embedding.word_embeddings.weight", dt, (m.vocab, h))] if first else []
    for i in range(len(layers)):
        p = f"decoder.layers.{i}."
        out += [TensorMeta(p + "self_attention.linear_qkv.layer_norm_weight", dt, (h,)),
                TensorMeta(p + "self_attention.linear_qkv.weight", dt, (qkv, h))]
        if m.qkv_bias:
            out.append(TensorMeta(p + "self_attention.linear_qkv.bias", dt, (qkv,)))
        if m.qk_norm:
            out += [TensorMeta(p + "self_attention.q_layernorm.weight", dt, (m.head_dim,)),
                    TensorMeta(p + "self_attention.k_layernorm.weight", dt, (m.head_dim,))]
        out.append(TensorMeta(p + "self_attention.linear_proj.weight", dt, (h, m.heads * m.head_dim)))
        if m.experts:
            out += [TensorMeta(p + "pre_mlp_layernorm.weight", dt, (h,)),
                    TensorMeta(p + "mlp.router.weight", dt, (m.experts, h))]
            for e in range(m.experts // ep_size):
                x = f"{p}mlp.experts.local_experts.{e}."
                out += [TensorMeta(x + "linear_fc1.weight", dt, (2 * m.moe_ffn, h)),
                        TensorMeta(x + "linear_fc2.weight", dt, (h, m.moe_ffn))]
            continue
        out += [TensorMeta(p + "mlp.linear_fc1.layer_norm_weight", dt, (h,)),
                TensorMeta(p + "mlp.linear_fc1.weight", dt, (2 * m.ffn, h)),
                TensorMeta(p + "mlp.linear_fc2.weight", dt, (h, m.ffn))]
    if last:
        out.append(TensorMeta("decoder.final_layernorm.weight", dt, (h,)))
        # tied: one stage holds the embedding for both; with several stages the last keeps its own copy
        # as output_layer.weight (the engine, tied too, needs no lm_head, so the plan leaves it unsent)
        if not m.tie_word_embeddings or not first:
            out.append(TensorMeta("output_layer.weight", dt, (m.vocab, h)))
    return out


def deepseek_megatron_metas(m: DeepSeekShape, layers: Sequence[int], *, first: bool, last: bool,
                            ep_size: int = 1) -> list[TensorMeta]:
    """A Megatron-core DeepSeek-V3 pipeline stage (MLA with TE-fused q / kv norms, dense first layers, MoE with
    router expert bias, shared experts with fused [gate; up]); local layer and expert numbers."""
    dt, h = m.dtype, m.hidden
    out = [TensorMeta("embedding.word_embeddings.weight", dt, (m.vocab, h))] if first else []
    for i, layer in enumerate(layers):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        out += [TensorMeta(p + "input_layernorm.weight", dt, (h,)),
                TensorMeta(a + "linear_q_down_proj.weight", dt, (m.q_lora_rank, h)),
                TensorMeta(a + "linear_q_up_proj.layer_norm_weight", dt, (m.q_lora_rank,)),
                TensorMeta(a + "linear_q_up_proj.weight", dt, (m.heads * (m.qk_nope + m.qk_rope), m.q_lora_rank)),
                TensorMeta(a + "linear_kv_down_proj.weight", dt, (m.kv_lora_rank + m.qk_rope, h)),
                TensorMeta(a + "linear_kv_up_proj.layer_norm_weight", dt, (m.kv_lora_rank,)),
                TensorMeta(a + "linear_kv_up_proj.weight", dt, (m.heads * (m.qk_nope + m.v_head), m.kv_lora_rank)),
                TensorMeta(a + "linear_proj.weight", dt, (h, m.heads * m.v_head))]
        if layer < m.dense_layers:
            out += [TensorMeta(p + "mlp.linear_fc1.layer_norm_weight", dt, (h,)),
                    TensorMeta(p + "mlp.linear_fc1.weight", dt, (2 * m.ffn, h)),
                    TensorMeta(p + "mlp.linear_fc2.weight", dt, (h, m.ffn))]
            continue
        out += [TensorMeta(p + "pre_mlp_layernorm.weight", dt, (h,)),
                TensorMeta(p + "mlp.router.weight", dt, (m.experts, h)),
                TensorMeta(p + "mlp.router.expert_bias", dt, (m.experts,))]
        for e in range(m.experts // ep_size):
            x = f"{p}mlp.experts.local_experts.{e}."
            out += [TensorMeta(x + "linear_fc1.weight", dt, (2 * m.moe_ffn, h)),
                    TensorMeta(x + "linear_fc2.weight", dt, (h, m.moe_ffn))]
        out += [TensorMeta(p + "mlp.shared_experts.linear_fc1.weight", dt, (2 * m.shared_ffn, h)),
                TensorMeta(p + "mlp.shared_experts.linear_fc2.weight", dt, (h, m.shared_ffn))]
    if last:
        out.append(TensorMeta("decoder.final_layernorm.weight", dt, (h,)))
        if not m.tie_word_embeddings or not first:
            out.append(TensorMeta("output_layer.weight", dt, (m.vocab, h)))
    return out


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")


def hf_stage_metas(metas: Sequence[TensorMeta], layers: Sequence[int], *, first: bool, last: bool,
                   experts: range | None = None) -> list[TensorMeta]:
    """The HF tensors a pipeline stage holds: its layers, the embeddings on the first, the final norm and
    head on the last; of the routed experts only those in `experts` (the trainer's EP rank; None: all)."""
    keep = set(layers)
    out = []
    for t in metas:
        mm = _LAYER.search(t.name)
        if mm:
            ex = _EXPERT.search(t.name)
            if int(mm.group(2)) in keep and (experts is None or ex is None or int(ex.group(2)) in experts):
                out.append(t)
        elif "embed_tokens" in t.name:
            if first:
                out.append(t)
        elif last:
            out.append(t)
    return out


@dataclass(frozen=True)
class Preset:
    """A model family's shape rules and a trainer's naming, as the bench and tests run them."""

    name: str
    model: ModelShape | DeepSeekShape
    naming: Naming
    dtensor: bool = False  # the trainer publishes real FSDP2-over-TP DTensors
    about: str = ""


LLAMA_GQA = ModelShape(layers=4, hidden=128, heads=32, kv_heads=8, head_dim=4, ffn=384, vocab=512)
# Qwen3-30B-A3B's rules (128 experts, 32 query / 4 KV heads, q / k norms), scaled down
QWEN_MOE = ModelShape(layers=2, hidden=64, heads=16, kv_heads=4, head_dim=4, ffn=0, vocab=256, experts=128,
                      moe_ffn=32, qk_norm=True)

# DeepSeek-V3's rules scaled down, every TP-split dim a multiple of the 128 FP8 block up to TP 4
DEEPSEEK_V3 = DeepSeekShape(layers=2, dense_layers=1, hidden=256, heads=8, q_lora_rank=128, kv_lora_rank=128,
                            qk_nope=64, qk_rope=64, v_head=64, ffn=512, moe_ffn=256, experts=16, shared_ffn=512,
                            vocab=512)

PRESETS: dict[str, Preset] = {
    "llama-gqa": Preset("llama-gqa", LLAMA_GQA, HF,
                        about="Llama-3 shape rules (32 query heads, 8 KV heads), HF names on both sides"),
    "megatron-fused": Preset("megatron-fused", LLAMA_GQA, MEGATRON_LLAMA,
                             about="Megatron-core names, fused linear_qkv and linear_fc1 on the trainer, HF names "
                                   "on the engine"),
    "qwen-moe": Preset("qwen-moe", QWEN_MOE, MEGATRON_MOE,
                       about="Qwen3-MoE rules (128 experts), Megatron names with local expert numbers per trainer "
                             "EP rank and fused expert linear_fc1, HF names and expert parallelism on the engine"),
    "deepseek-fp8": Preset("deepseek-fp8", DEEPSEEK_V3, MEGATRON_DEEPSEEK,
                           about="DeepSeek-V3 rules (MLA, first layer dense, routed + shared experts), Megatron names "
                                 "on the trainer, HF names on the engine, served as block-FP8 (--fp8: e4m3 + "
                                 "128x128 weight_scale_inv)"),
    "fsdp2-tp-strided": Preset("fsdp2-tp-strided", LLAMA_GQA, HF, dtensor=True,
                               about="FSDP2 fully_shard over TP parallelize_module: _StridedShard DTensors"),
}
