"""bf16 -> FP8 e4m3 with 128x128 block scales on the way, as block-FP8 engines load it (DeepSeek-V3 format).

A quantized weight `X.weight` travels as float8_e4m3fn plus `X.weight_scale_inv` (float32, one per
128x128 block, shape ceil(rows / 128) x ceil(cols / 128)); dequantizing is `fp8 * scale_inv` per block,
the convention vLLM and SGLang read from DeepSeek-V3 / Qwen3-FP8 checkpoints. The scale of a block is
its absolute maximum / 448 (e4m3's largest finite value), so the block's largest element maps to +-448
and every element's error is at most half a unit of e4m3's 3-bit mantissa: 1/16 of the block maximum,
hence `max_rel_err` <= 0.0625 per block (the bench checks <= 0.07 after the transfer).

The conversion runs where the bytes are: the trainer side quantizes its own local box before it is
staged (torch ops on the tensor's device: the sender GPU, or CPU in tests), so the wire carries one
byte per weight. That needs each rank's box to hold whole blocks; a box (trainer or engine side) whose
edges are not on 128-element block boundaries (other than the tensor's end) is refused with the
numbers, as the engines refuse such TP splits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from weightsync.agent.layout.rules import LayoutError
from weightsync.agent.plan import Box, TensorShard

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# DeepSeek-V3's checkpoint quantizes every linear weight of the decoder layers except the router
DEEPSEEK_QUANTIZED = r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(.+\.)?[a-z_]*proj[a-z_]*\.weight$"


def scale_name(weight: str) -> str:
    """`X.weight` -> `X.weight_scale_inv`, the name the engines load the block scales under."""
    if not weight.endswith(".weight"):
        raise LayoutError(f"{weight!r}: only `.weight` tensors are block-quantized")
    return weight + "_scale_inv"


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """w (2-D) zero-padded to whole blocks, as (rows / b, b, cols / b, b) float32."""
    r, c = w.shape
    br, bc = -(-r // block), -(-c // block)
    pad = torch.zeros(br * block, bc * block, dtype=torch.float32, device=w.device)
    pad[:r, :c] = w
    return pad.view(br, block, bc, block), (r, c)


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight shaped like w, float32 scale_inv of shape (ceil(r / b), ceil(c / b)))."""
    if w.dim() != 2:
        raise LayoutError(f"block quantization takes 2-D weights, got shape {list(w.shape)}")
    x, (r, c) = _blocks(w, block)
    amax = x.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(x.shape[0] * block, x.shape[2] * block)[:r, :c].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight from fp8 and its block scales."""
    x, (r, c) = _blocks(q.to(torch.float32), block)
    return (x * scale_inv[:, None, :, None]).view(x.shape[0] * block, x.shape[2] * block)[:r, :c]


def block_rel_err(w: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> float:
    """The largest per-block error of the dequantized weight, relative to that block's largest |w|."""
    ref, _ = _blocks(w, block)
    got, _ = _blocks(dequantize_blocks(q, scale_inv, block), block)
    err = (ref - got).abs().amax(dim=(1, 3))
    amax = ref.abs().amax(dim=(1, 3))
    rel = torch.where(amax > 0, err / amax, torch.where(err > 0, torch.inf, 0.0))
    return float(rel.max()) if rel.numel() else 0.0


def scale_shard(s: TensorShard, block: int = BLOCK, *, who: str = "") -> TensorShard:
    """The scale box that goes with weight box `s`: refused unless `s` holds whole blocks."""
    if len(s.global_shape) != 2:
        raise LayoutError(f"{s.name!r} {list(s.global_shape)}: block-FP8 weights are 2-D")
    for d, (o, n, g) in enumerate(zip(s.box.offset, s.box.shape, s.global_shape, strict=True)):
        end = o + n
        if o % block or (end % block and end != g):
            raise LayoutError(
                f"{s.name!r}: {who}box [{o}, {end}) of dim {d} (size {g}) is not on {block}-element block boundaries; "
                f"block-FP8 needs every shard to hold whole {block}x{block} blocks (engines refuse such TP splits, and "
                "a trainer rank can only quantize blocks it holds whole)")
    gshape = tuple(-(-g // block) for g in s.global_shape)
    off = tuple(o // block for o in s.box.offset)
    shape = tuple(-(-(o + n) // block) - o // block for o, n in zip(s.box.offset, s.box.shape, strict=True))
    return TensorShard(scale_name(s.name), "float32", gshape, Box(off, shape))


def fp8_shards(shards: Iterable[TensorShard], quantized: str = DEEPSEEK_QUANTIZED, block: int = BLOCK,
               *, who: str = "") -> list[TensorShard]:
    """A rank's shards as they travel with block-FP8: each weight matching `quantized` becomes an fp8
    shard plus its scale shard; the rest are unchanged."""
    pat = re.compile(quantized)
    out = []
    for s in shards:
        if pat.search(s.name) and s.box.numel:
            out.append(TensorShard(s.name, "float8_e4m3fn", s.global_shape, s.box))
            out.append(scale_shard(s, block, who=who))
        else:
            out.append(s)
    return out
