"""The tiny Llama (agent/demo/tiny_llama.py) as a trainable policy in plain torch: the RL demo's trainer side.

The forward is Llama's (RMSNorm, rotary embeddings in the rotate-half layout vLLM's Llama also uses, grouped-
query attention, SwiGLU MLP) over a dict of Hugging Face named parameters, so the very tensors the optimizer
updates are the ones published to the engines; `tests/agent/test_llama_policy.py` checks it against
transformers' `LlamaForCausalLM` (the reference the vLLM server's outputs are held to). Only torch is imported:
the trainer container needs neither transformers nor vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from weightsync.agent.demo.tiny_llama import CONFIG


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rotary(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def forward(params: dict[str, torch.Tensor], tokens: torch.Tensor, config: dict[str, Any] | None = None
            ) -> torch.Tensor:
    """Logits [batch, seq, vocab] of `tokens` [batch, seq] (causal: position i sees tokens <= i)."""
    c = config or CONFIG
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    eps = c["rms_norm_eps"]
    batch, seq = tokens.shape
    cos, sin = _rotary(seq, d, c["rope_theta"])
    x = params["model.embed_tokens.weight"][tokens]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = _rms_norm(x, params[p + "input_layernorm.weight"], eps)
        q = (h @ params[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, d).transpose(1, 2)
        k = (h @ params[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, d).transpose(1, 2)
        v = (h @ params[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, d).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.transpose(1, 2).reshape(batch, seq, heads * d) @ params[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, params[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ params[p + "mlp.gate_proj.weight"].T, h @ params[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ params[p + "mlp.down_proj.weight"].T
    return _rms_norm(x, params["model.norm.weight"], eps) @ params["lm_head.weight"].T


def token_logprobs(params: dict[str, torch.Tensor], prompt: list[int], completions: list[list[int]],
                   config: dict[str, Any] | None = None) -> torch.Tensor:
    """Log-probability [n, tokens] of each token of each completion (equal lengths) after `prompt`, given the
    prompt and the tokens before it; differentiable in `params`."""
    seqs = torch.tensor([prompt + c for c in completions], dtype=torch.long)
    logp = forward(params, seqs[:, :-1], config).log_softmax(-1)
    start = len(prompt) - 1  # position whose next token is the first completion token
    return logp[:, start:].gather(-1, seqs[:, len(prompt):].unsqueeze(-1)).squeeze(-1)


def completion_logprobs(params: dict[str, torch.Tensor], prompt: list[int], completions: list[list[int]],
                        config: dict[str, Any] | None = None) -> torch.Tensor:
    """Log-probability [n] of each completion: the sum over its tokens (token_logprobs)."""
    return token_logprobs(params, prompt, completions, config).sum(-1)
