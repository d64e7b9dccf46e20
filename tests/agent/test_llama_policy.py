"""The RL demo's plain-torch tiny Llama (agent/demo/llama_policy.py) against transformers' LlamaForCausalLM, the
reference every real vLLM server's outputs are held to (e2e/engines/llama_reference.py, in the engine venv):
a policy whose forward differed from the engine's would train one model and publish another."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from weightsync.agent.demo.llama_policy import completion_logprobs, forward
from weightsync.agent.demo.tiny_llama import init_weights
from weightsync.e2e.engine_venv import engine_python

pytestmark = pytest.mark.engine_servers


def test_policy_logprobs_equal_transformers_llama(tmp_path: Path) -> None:
    weights = init_weights(7)  # fp32: both sides compute in fp32 over the same values
    torch.save(weights, tmp_path / "w.pt")
    prompt = [1, 17, 42, 99, 3]
    completions = [[5, 9, 9, 200, 7, 7, 301, 2], [11, 12, 13, 14, 15, 16, 17, 18]]
    out = subprocess.run(
        [str(engine_python()), "-m", "weightsync.e2e.engines.llama_reference", "--weights", str(tmp_path / "w.pt"),
         "--prompts", json.dumps([prompt] * 2), "--forced", json.dumps(completions)],
        check=True, stdout=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1",
                                                            "PATH": "/usr/bin:/bin"}).stdout
    ref = json.loads(out)
    mine = completion_logprobs(weights, prompt, completions)
    for got, want in zip(mine.tolist(), ref, strict=True):
        assert got == pytest.approx(sum(want["token_logprobs"]), abs=1e-3)
    # per position too, over the prompt: every next-token distribution, not only the sampled tokens' sum
    logp = forward(weights, torch.tensor([prompt])).log_softmax(-1)[0]
    mine_prompt = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert mine_prompt == pytest.approx(ref[0]["prompt_logprobs"][1:], abs=1e-4)
    # and it is not the same for other weights (the comparison can fail)
    other = completion_logprobs(init_weights(8), prompt, completions)
    assert abs(float(other[0]) - sum(ref[0]["token_logprobs"])) > 0.1


def test_policy_is_differentiable_in_every_parameter() -> None:
    params = {k: v.clone().requires_grad_() for k, v in init_weights(1, dtype=torch.float32).items()}
    completion_logprobs(params, [1, 2, 3], [[4, 5], [6, 7]]).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params.values())
    assert set(params) == set(init_weights(1)), "the policy trains exactly the tensors the engine loads"
