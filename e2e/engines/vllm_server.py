"""A real vLLM server (the CPU build, in the engine venv) serving the tiny Llama, and the checks against it.

Used by the real-server test tier (tests/engine_servers/), the local cluster's vLLM example
(examples/demo-vllm.yaml: `python -m weightsync.e2e.engines.vllm_server serve --port 8001`) and
bench/engine_stall.py. The server is vLLM's own OpenAI server with the weightsync weight-transfer backend
(the plugin in agent/engines/vllm_plugin.py), `--load-format dummy` on the tiny Llama's config: every weight it
serves after the first version came from weightsync.

`completions()` asks the server for greedy tokens with their logprobs and the prompt logprobs; `reference()` runs
transformers' LlamaForCausalLM over a version's saved state dict (in the engine venv: the project's .venv has no
transformers), scoring the engine's tokens step by step; `check()` does both and returns `differences()`: every
token the reference's best (a near-tie within bf16 noise excepted), every logprob within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from weightsync.agent.demo import tiny_llama
from weightsync.e2e.engine_venv import engine_python

#: Prompts (token ids) the checks generate from: short, distinct, no special tokens.
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302], [1, 5, 9, 33, 128, 64]]
MAX_TOKENS = 8
#: |engine - reference| <= ATOL + RTOL * |reference| for every logprob: the engine computes in bf16, the
#: reference in fp32 over the same bf16 weights (measured here: up to 0.17 on prompt logprobs near -30 and 0.08 on a generated token near -1 after 7 bf16 decode steps).
ATOL, RTOL = 0.15, 0.02
#: A greedy step where the reference's best token beats the engine's by at most this is a near-tie: the logprob
#: tolerance itself, since two logprobs that close cannot be told apart (measured: 0.107 on an AVX2-only AMD EPYC,
#: whose bf16 kernels round differently from AVX-512's; a wrong or partial load moves logprobs by whole nats).
TIE_NATS = ATOL
BACKEND_CONFIG = json.dumps({"backend": "weightsync"})


def server_command(model_dir: Path, host: str, port: int, python: Path | None = None) -> list[str]:
    return [str(python or engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "tiny-llama", "--host", host, "--port", str(port), *tiny_llama.VLLM_ARGS,
            "--weight-transfer-config", BACKEND_CONFIG]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    env.update(tiny_llama.VLLM_ENV)
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: the engine core and the API server share them
    return env


def wait_ready(url: str, timeout: float = 300.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until the server answers /version with its worker up (GET /health 200)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was ready")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the vLLM server at {url} was not ready within {timeout:.0f}s")


def completions(url: str, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
                timeout: float = 120.0) -> list[dict[str, Any]]:
    """Greedy completions from the server: per prompt the token ids, their logprobs and the prompt logprobs
    (the shape llama_reference prints)."""
    out = []
    for prompt in prompts:
        r = requests.post(f"{url}/v1/completions", timeout=timeout, json={
            "model": "tiny-llama", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0, "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        plp: list[float | None] = [None]
        for tok, entry in zip(prompt[1:], (choice.get("prompt_logprobs") or [None])[1:], strict=True):
            plp.append(float(entry[str(tok)]["logprob"]) if entry else None)
        out.append({"tokens": list(choice["token_ids"]),
                    "token_logprobs": [float(x) for x in choice["logprobs"]["token_logprobs"]],
                    "prompt_logprobs": plp})
    return out


def reference(weights: Path, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS,
              python: Path | None = None, forced: Sequence[Sequence[int]] | None = None) -> list[dict[str, Any]]:
    """transformers' forward over the saved state dict, in the engine venv; `forced`: score these
    continuations (the engine's tokens) instead of generating its own."""
    cmd = [str(python or engine_python()), "-m", "weightsync.e2e.engines.llama_reference", "--weights", str(weights),
           "--prompts", json.dumps([list(p) for p in prompts]), "--max-tokens", str(max_tokens)]
    if forced is not None:
        cmd += ["--forced", json.dumps([list(f) for f in forced])]
    res = subprocess.run(cmd, env=server_env(), check=True, capture_output=True, timeout=300)
    return list(json.loads(res.stdout))


def check(url: str, weights: Path, prompts: Sequence[Sequence[int]] = PROMPTS,
          max_tokens: int = MAX_TOKENS) -> tuple[list[dict[str, Any]], list[str]]:
    """The server's outputs and what differs from the reference over `weights` (empty: the same outputs)."""
    got = completions(url, prompts, max_tokens)
    want = reference(weights, prompts, max_tokens, forced=[g["tokens"] for g in got])
    return got, differences(got, want)


def differences(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[str]:
    """What differs between the engine's outputs and the reference's scoring of them (empty: the same outputs).
    Each engine token must be the reference's best one; where the reference's best beats it by no more than
    TIE_NATS (a near-tie that bf16 rounding may break either way) the step is accepted, and counted."""
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g["tokens"] != w["tokens"]:
            out.append(f"prompt {i}: the reference scored {w['tokens']}, not the engine's {g['tokens']}")
            continue
        for j, (tok, top, lp, top_lp) in enumerate(zip(g["tokens"], w["top"], w["token_logprobs"], w["top_logprobs"],
                                                       strict=True)):
            if tok != top and top_lp - lp > TIE_NATS:
                out.append(f"prompt {i} step {j}: the engine chose {tok} (reference logprob {lp:.3f}), the reference "
                           f"{top} ({top_lp:.3f})")
        for what in ("token_logprobs", "prompt_logprobs"):
            for j, (a, b) in enumerate(zip(g[what], w[what], strict=True)):
                if (a is None) != (b is None) or (b is not None and abs(a - b) > ATOL + RTOL * abs(b)):
                    out.append(f"prompt {i}: {what}[{j}] {a} != reference {b}")
    return out


def serve(host: str, port: int, model_dir: str = "") -> None:
    """The engine container of the local cluster's vLLM example: write the model directory, exec vLLM."""
    # one directory per config, reused by every server (it holds config.json only; the process execs vLLM and
    # cannot clean up after itself)
    digest = hashlib.sha256(json.dumps(tiny_llama.CONFIG, sort_keys=True).encode()).hexdigest()[:12]
    path = tiny_llama.write_model_dir(Path(model_dir) if model_dir else
                                      Path(os.environ.get("TMPDIR", "/tmp")) / f"weightsync-tiny-llama-{digest}")
    cmd = server_command(path, host, port)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, server_env())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m weightsync.e2e.engines.vllm_server",
                                description="a real vLLM server (engine venv) serving the tiny Llama with the "
                                "weightsync weight-transfer backend")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("serve", help="write the model directory and exec vLLM's OpenAI server")
    sp.add_argument("--host", default=os.environ.get("WEIGHTSYNC_POD_IP", "127.0.0.1"))
    sp.add_argument("--port", type=int, default=8001)
    sp.add_argument("--model-dir", default="")
    a = p.parse_args(argv)
    serve(a.host, a.port, a.model_dir)


if __name__ == "__main__":
    main()
