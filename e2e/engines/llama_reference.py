"""The independent reference a real engine's outputs are checked against: transformers' LlamaForCausalLM on CPU.

Runs in the engine venv (it has transformers; the project's .venv does not):

    python -m weightsync.e2e.engines.llama_reference --weights W.pt --prompts '[[1, 5, 9]]' --max-tokens 8

`W.pt` is a torch.save'd state dict (HF names, as the trainer published it). The forward runs in float32 over the
bf16 weights (bf16 -> fp32 is exact), a stricter computation than the engine's bf16 one. With `--forced` (the
engine's tokens) it scores the engine's continuation step by step: e2e/engines/vllm_server.py `differences`
then requires the engine's token to be the reference's best at every step (a near-tie within bf16 noise
excepted) and every logprob within bf16 tolerance. Prints JSON, per prompt: tokens, token_logprobs, top,
top_logprobs, prompt_logprobs (token i given tokens < i; None for the first).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from weightsync.agent.demo.tiny_llama import CONFIG


def reference(state: dict[str, torch.Tensor], prompts: list[list[int]], max_tokens: int,
              config: dict[str, Any] | None = None, forced: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """Per prompt: the continuation (the reference's own greedy tokens, or `forced`: the engine's, teacher-forced
    so that every step is compared even after a near-tie), the reference's logprob of each of its tokens, its
    own best token and that token's logprob at each step, and the prompt logprobs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in (config or CONFIG).items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise SystemExit(f"reference: state dict mismatch: missing {missing}, unexpected {unexpected}")
    out = []
    with torch.no_grad():
        for n, prompt in enumerate(prompts):
            ids = list(prompt)
            if forced is None:
                for _ in range(max_tokens):
                    ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
            else:
                ids += list(forced[n])
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            k = len(prompt)
            steps = range(k - 1, len(ids) - 1)  # position i predicts token i + 1
            out.append({
                "tokens": ids[k:],
                "token_logprobs": [float(lp[i, ids[i + 1]]) for i in steps],
                "top": [int(torch.argmax(lp[i])) for i in steps],
                "top_logprobs": [float(lp[i].max()) for i in steps],
                "prompt_logprobs": [None] + [float(lp[i - 1, ids[i]]) for i in range(1, k)],
            })
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--forced", default="", help="JSON list of continuations (the engine's tokens) to score")
    a = ap.parse_args(argv)
    state = torch.load(a.weights, map_location="cpu", weights_only=True)
    forced = json.loads(a.forced) if a.forced else None
    json.dump(reference(state, json.loads(a.prompts), a.max_tokens, forced=forced), sys.stdout)


if __name__ == "__main__":
    main()
