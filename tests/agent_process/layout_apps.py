"""Test apps for real model layouts, run as processes next to real agents.

    python layout_apps.py trainer --rank R --tp T --versions N [--fp8]   # a Megatron TP rank: engine_weights
    python layout_apps.py engine --ranks 0,1,2,3 --out DIR               # InferenceSession(layout=...) per rank

The model is a small GQA Llama (8 query heads, 2 KV heads, head_dim 16; with --fp8 every dim a multiple
of 128 and the projections published as block-FP8) that is a deterministic function of the version. The
trainer holds it in Megatron names (fused linear_qkv / linear_fc1, TP-sharded) and publishes it through
`engine_weights`; the engine declares its heads, so each of its TP ranks gets its head-wise boxes (KV
heads replicated when TP exceeds them) instead of the default row split.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

HEADS, KV_HEADS = 8, 2


def head_dim(fp8: bool) -> int:
    return 128 if fp8 else 16


def hf_model(version: int, fp8: bool) -> dict[str, torch.Tensor]:
    """The engine-named model (HF Llama names, one layer)."""
    hd = head_dim(fp8)
    h, ffn = HEADS * hd, (512 if fp8 else 48)
    shapes = {"model.embed_tokens.weight": (64, h), "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (HEADS * hd, h),
              "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * hd, h),
              "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * hd, h),
              "model.layers.0.self_attn.o_proj.weight": (h, HEADS * hd),
              "model.layers.0.post_attention_layernorm.weight": (h,),
              "model.layers.0.mlp.gate_proj.weight": (ffn, h), "model.layers.0.mlp.up_proj.weight": (ffn, h),
              "model.layers.0.mlp.down_proj.weight": (h, ffn), "model.norm.weight": (h,), "lm_head.weight": (64, h)}
    g = torch.Generator().manual_seed(2000 + version)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def megatron_local(version: int, tp: int, rank: int, fp8: bool) -> dict[str, object]:
    """TP rank `rank`'s Megatron tensors: linear_qkv per KV group [q heads, k, v], linear_fc1 per TP shard
    [gate; up], each split like Megatron splits it, as PlacedShards with their global placement."""
    from weightsync.agent.client import PlacedShard

    hf = hf_model(version, fp8)
    hd = head_dim(fp8)
    p, q = "decoder.layers.0.", "model.layers.0."
    qpg = HEADS // KV_HEADS
    wq, wk, wv = (hf[q + f"self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = torch.cat([x for g in range(KV_HEADS) for x in (wq[g * qpg * hd:(g + 1) * qpg * hd],
                                                         wk[g * hd:(g + 1) * hd], wv[g * hd:(g + 1) * hd])])
    gate, up = hf[q + "mlp.gate_proj.weight"], hf[q + "mlp.up_proj.weight"]
    fc1 = torch.cat([x for t in range(tp) for x in (gate.chunk(tp)[t], up.chunk(tp)[t])])
    full = {"embedding.word_embeddings.weight": (hf["model.embed_tokens.weight"], 0),
            p + "self_attention.linear_qkv.layer_norm_weight": (hf[q + "input_layernorm.weight"], None),
            p + "self_attention.linear_qkv.weight": (qkv, 0),
            p + "self_attention.linear_proj.weight": (hf[q + "self_attn.o_proj.weight"], 1),
            p + "mlp.linear_fc1.layer_norm_weight": (hf[q + "post_attention_layernorm.weight"], None),
            p + "mlp.linear_fc1.weight": (fc1, 0), p + "mlp.linear_fc2.weight": (hf[q + "mlp.down_proj.weight"], 1),
            "decoder.final_layernorm.weight": (hf["model.norm.weight"], None),
            "output_layer.weight": (hf["lm_head.weight"], 0)}
    out: dict[str, object] = {}
    for name, (t, dim) in full.items():
        if dim is None:
            out[name] = t
            continue
        n = t.shape[dim] // tp
        off = [0] * t.dim()
        off[dim] = rank * n
        out[name] = PlacedShard(t.narrow(dim, rank * n, n).clone(), tuple(t.shape), tuple(off))
    return out


def run_trainer(rank: int, tp: int, versions: int, interval: float, fp8: bool) -> None:
    from weightsync.agent.client import TrainerSession
    from weightsync.agent.layout.fp8 import DEEPSEEK_QUANTIZED
    from weightsync.agent.layout.presets import MEGATRON_LLAMA
    from weightsync.agent.layout.spec import Attention, engine_weights

    attention = Attention(HEADS, KV_HEADS, head_dim(fp8))
    with TrainerSession(rank=rank) as s:
        for v in range(1, versions + 1):
            weights = engine_weights(megatron_local(v, tp, rank, fp8), MEGATRON_LLAMA, attention=attention,
                                     tp_size=tp, fp8=DEEPSEEK_QUANTIZED if fp8 else None)
            s.publish(weights, v)
            print(f"published version={v} rank={rank}", flush=True)
            time.sleep(interval)
    while True:
        time.sleep(3600)


def run_engine(ranks: list[int], out: Path, fp8: bool) -> None:
    from weightsync.agent.client import InferenceSession

    out.mkdir(parents=True, exist_ok=True)
    layout = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": head_dim(fp8)}

    def session(rank: int) -> InferenceSession:
        got: dict[str, torch.Tensor] = {}

        def on_begin(version: int) -> None:
            got.clear()

        def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
            for n, t in tensors:
                got[n] = t.clone()

        def on_commit(version: int) -> None:
            final = out / f"v{version}-rank{rank}.pt"
            partial = final.with_suffix(".pt.partial")
            torch.save(dict(got), partial)
            partial.replace(final)
            print(f"committed version={version} rank={rank}", flush=True)

        return InferenceSession(on_bucket, on_commit, on_begin=on_begin, rank=rank, layout=layout).start()

    sessions = [session(r) for r in ranks]
    print(f"engine ranks={ranks} sessions={len(sessions)}", flush=True)
    threading.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trainer")
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--tp", type=int, required=True)
    t.add_argument("--versions", type=int, default=2)
    t.add_argument("--interval", type=float, default=1.0)
    t.add_argument("--fp8", action="store_true")
    e = sub.add_parser("engine")
    e.add_argument("--ranks", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--fp8", action="store_true")
    a = p.parse_args()
    if a.what == "trainer":
        run_trainer(a.rank, a.tp, a.versions, a.interval, a.fp8)
    else:
        run_engine([int(r) for r in a.ranks.split(",")], Path(a.out), a.fp8)


if __name__ == "__main__":
    main()
