"""A tiny Llama that a real vLLM server serves on 2 CPU cores, and the weights a demo trainer publishes for it.

Why this size: vLLM's CPU attention kernel refuses head_dim 16; 64 works (hidden 256, 4 heads, 2 KV heads,
GQA like real Llamas). The server is started with `--load-format dummy --skip-tokenizer-init` on the config
alone (`write_model_dir`), so every weight it serves comes from weightsync. Names are Hugging Face's
(`model.layers.N.self_attn.q_proj.weight`, ...), what vLLM's `LlamaForCausalLM.load_weights` and transformers'
`LlamaForCausalLM.load_state_dict` both take. Only torch is imported: the trainer, the engine container and
the reference forward (transformers, in the engine venv) share this one definition.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: The vLLM server flags that serve it (with `--model <write_model_dir()>`). `--enable-scale-out` serves
#: vLLM's token-in/token-out `/inference/v1/generate`, whose every choice names the weight versions that
#: sampled its tokens (`weight_versions`): what an RL loop tags its rollouts with (agent/demo/rl_trainer.py).
VLLM_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
             "--max-model-len", "128", "--max-num-seqs", "16", "--enable-scale-out"]
#: The engine process's environment: a 1 GiB KV cache, and vLLM's RL routes (dev mode).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


def write_model_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A model directory with config.json only (the server's weights are dummy until a version loads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or CONFIG, indent=1))
    return path


def param_shapes(config: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """Every parameter's HF name and shape, in the order transformers' LlamaForCausalLM declares them."""
    c = config or CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out: dict[str, list[int]] = {"model.embed_tokens.weight": [v, h]}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h]}
    out |= {"model.norm.weight": [h], "lm_head.weight": [v, h]}
    return out


def init_weights(seed: int, config: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
                 ) -> dict[str, torch.Tensor]:
    """Weights a forward pass can tell apart: norms near 1, matrices N(0, 0.05^2) (std 0.5 for the
    embedding and head, so greedy tokens depend on them), from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = 0.5 * torch.randn(shape, generator=gen)
        else:
            t = 0.05 * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype)
    return out
