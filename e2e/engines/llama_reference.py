"""The independent reference a real engine's outputs are checked against: transformers' LlamaForCausalLM on CPU.

Runs in the engine venv (it has transformers; the project's .venv does not):

    python -m weightsync.e2e.engines.llama_reference --weights W.pt --prompts '[[1, 5, 9]]' --max-tokens 8

`W.pt` is a torch.save'd state dict (HF names, as the trainer published it). The forward runs in float32 over the
bf16 weights (bf16 -> fp32 is exact), so the reference is a stricter computation than the engine's bf16 one: the
greedy tokens must be identical, the logprobs equal within bf16 tolerance. Prints JSON: per prompt the greedy
token ids, their logprobs, and the prompt logprobs (token i given tokens < i; None for the first).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from weightsync.agent.demo.tiny_llama import CONFIG


def reference(state: dict[str, torch.Tensor], prompts: list[list[int]], max_tokens: int,
              config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in (config or CONFIG).items() if k not in ("architectures", "model_type")})
    cfg.torch_dtype = torch.float32
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise SystemExit(f"reference: state dict mismatch: missing {missing}, unexpected {unexpected}")
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            logits = model(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            prompt_lp: list[float | None] = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
            tokens, token_lp = [], []
            for _ in range(max_tokens):
                last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                nxt = int(torch.argmax(last))
                tokens.append(nxt)
                token_lp.append(float(last[nxt]))
                ids.append(nxt)
            out.append({"tokens": tokens, "token_logprobs": token_lp, "prompt_logprobs": prompt_lp})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args(argv)
    state = torch.load(a.weights, map_location="cpu", weights_only=True)
    json.dump(reference(state, json.loads(a.prompts), a.max_tokens), sys.stdout)


if __name__ == "__main__":
    main()
