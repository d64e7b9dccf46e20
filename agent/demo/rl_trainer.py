"""An RL loop through real engines: a policy-gradient trainer whose rollouts come from the job's vLLM servers.

    python -m weightsync.agent.demo.rl_trainer --steps 20 --max-staleness 1

The policy is the tiny Llama (agent/demo/tiny_llama.py) in fp32, trained in plain torch
(agent/demo/llama_policy.py) with REINFORCE and a group-mean baseline. The task: after a fixed prompt, emit one
target token; the reward of a sample is the share of its `--tokens` sampled tokens that equal it. The target is
the token the initial policy samples about `--target-share` of the time (1 %: rare enough that the reward has
far to climb, frequent enough that 16 samples see it). Each token is credited with its own reward (1/`--tokens`
if it is the target), less the group's mean at that position. Two other choices failed on the real servers:
- a whole-sequence advantage: Adam's first step (every weight moves by about the learning rate) pushed up the
  rest of a lucky sample so hard that the target's share fell from 1 % to 0 and never came back (vLLM's own
  samples of step 3 of the seeded run, replayed offline);
- reward-to-go: the tokens before a hit are reinforced too, the policy soon samples one sequence, a group of
  identical samples has no advantage, and the reward stayed at 2/8 for 25 steps.
The initial policy is `init_weights(seed)` with its output head scaled by `--head-scale` (0.25): at full scale
it samples nearly one sequence from the start. Every step:

1. Rollouts: `--requests` POSTs to vLLM's `/inference/v1/generate` (prompt token ids in, token ids out) through
   the job's routing Service `<job>-inference` (Ready replicas only), `n` samples each, temperature 1, a seed
   per request. Every choice names the weight versions that sampled its tokens (`weight_versions`, the label
   the agent set when it committed the version: `N-<digest prefix>`); a rollout generated more than
   `max_staleness` versions behind the trainer's (`step`) is dropped and asked again, so the bound holds per
   rollout.
2. The update: Adam on -(reward - mean reward) * log p(sample).
3. `wait_served(step + 1 - max_staleness, only_serving=True)`, then `publish(weights, version=step + 1)`: a
   version goes out only once every replica that serves something is within `max_staleness` of it. So the
   next step's rollouts are within the bound, the sync of a version overlaps the next step's generation and
   training (one-step off-policy), and no replica skips a version (publishing faster than the fleet loads
   would send each agent straight to the newest). `only_serving`: the loop goes on while a replica is
   replaced.

Each step is one JSON line in `<socket dir>/rl-steps.jsonl` (the demo and the tests read it) and one log line:
mean reward, the versions its rollouts were generated with, and seconds spent generating, training, waiting
for the fleet (`wait_served`) and publishing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.agent.client import TrainerSession
from weightsync.agent.demo.llama_policy import forward, token_logprobs
from weightsync.agent.demo.tiny_llama import init_weights
from weightsync.agent.engines.base import parse_version
from weightsync.crds import contract

log = logging.getLogger("weightsync.demo.rl_trainer")

PROMPT = [1, 17, 42, 99]
STEPS_FILE = "rl-steps.jsonl"


def routing_url(env: Mapping[str, str], job: str, default_port: int = 8001) -> str:
    """The job's routing Service `<job>-inference`: the address the kubelet's service links give
    (`<JOB>_INFERENCE_SERVICE_HOST` / `_SERVICE_PORT_HTTP`), else its DNS name."""
    name = contract.routing_service_name(job)
    prefix = name.upper().replace("-", "_")
    host = env.get(f"{prefix}_SERVICE_HOST")
    if host:
        port = env.get(f"{prefix}_SERVICE_PORT_HTTP") or env.get(f"{prefix}_SERVICE_PORT") or str(default_port)
        return f"http://{host}:{port}"
    return f"http://{name}:{default_port}"


def pick_target(params: dict[str, torch.Tensor], share: float, tokens: int, samples: int = 256,
                seed: int = 0) -> tuple[int, float]:
    """The token whose share of `samples` completions of the initial policy (sampled here, temperature 1) is
    closest to `share`, and that share."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.tensor([PROMPT] * samples)
    with torch.no_grad():
        for _ in range(tokens):
            probs = forward(params, seqs)[:, -1].softmax(-1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=gen)], dim=1)
    counts = torch.bincount(seqs[:, len(PROMPT):].flatten(), minlength=params["lm_head.weight"].shape[0])
    shares = counts.double() / (samples * tokens)
    target = int((shares - share).abs().argmin())
    return target, float(shares[target])


@dataclass
class Rollout:
    """One sampled completion and the weight version that generated it (the oldest one, should its tokens
    straddle a version switch)."""

    tokens: list[int]
    version: int
    labels: list[str]


class StaleRollout(Exception):
    pass


def rollout_version(spans: list[dict[str, Any]] | None) -> tuple[int, list[str]]:
    """The version a choice was generated with, from vLLM's `weight_versions` spans: the oldest version that
    sampled any of its tokens; 0 when the engine labelled none (it served no weightsync version yet)."""
    labels = [str(s.get("version")) for s in spans or []]
    versions = [parse_version(label) for label in labels]
    if not versions or any(v is None for v in versions):
        return 0, labels
    return min(v for v in versions if v is not None), labels


def generate(url: str, prompt: list[int], n: int, max_tokens: int, seed: int, timeout: float = 60.0
             ) -> list[Rollout]:
    body = {"token_ids": prompt, "model": "tiny-llama",
            "sampling_params": {"n": n, "temperature": 1.0, "max_tokens": max_tokens, "seed": seed,
                                "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply = json.load(resp)
    out = []
    for choice in reply["choices"]:
        version, labels = rollout_version(choice.get("weight_versions"))
        out.append(Rollout(list(choice["token_ids"]), version, labels))
    return out


@dataclass
class StepRecord:
    step: int
    version: int                    # the trainer's weights during the step (it publishes version + 1)
    reward: float
    rollout_versions: list[int]     # per request: the version its rollouts were generated with
    stale_dropped: int = 0          # requests answered by a version too old, asked again
    generate_s: float = 0.0
    train_s: float = 0.0
    wait_s: float = 0.0             # wait_served before publishing: the trainer blocked on the fleet
    publish_s: float = 0.0
    labels: list[str] = field(default_factory=list)


def rollouts_for_step(url: str, step: int, *, oldest: int, requests: int, per_request: int, max_tokens: int,
                      seed: int, retries: int = 20) -> tuple[list[Rollout], list[int], int]:
    """`requests` batches of `per_request` samples, each generated by a version >= `oldest` (a batch from an
    older version is asked again with the next seed; so are connection errors and answers cut short while a
    replica goes away)."""
    rollouts: list[Rollout] = []
    versions: list[int] = []
    dropped = 0
    for r in range(requests):
        for attempt in range(retries):
            try:
                got = generate(url, PROMPT, per_request, max_tokens, seed * 100_000 + step * 100 + r * 10 + attempt)
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                log.warning("rollout request failed step=%d request=%d attempt=%d error=%s", step, r, attempt, exc)
                time.sleep(0.2)
                continue
            if any(len(x.tokens) != max_tokens for x in got):
                # ignore_eos: a whole answer has max_tokens tokens; a shorter one was cut short (its replica
                # was stopped mid-request and answered with what it had): asked again like a lost connection
                log.warning("rollout cut short step=%d request=%d attempt=%d tokens=%s of %d", step, r, attempt,
                            sorted({len(x.tokens) for x in got}), max_tokens)
                time.sleep(0.2)
                continue
            v = min(x.version for x in got)
            if v < oldest:
                dropped += 1
                log.info("rollout dropped step=%d version=%d oldest_allowed=%d", step, v, oldest)
                time.sleep(0.05)
                continue
            rollouts += got
            versions.append(v)
            break
        else:
            raise StaleRollout(f"step {step}: no rollout from version >= {oldest} after {retries} requests")
    return rollouts, versions, dropped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-staleness", type=int, default=1,
                   help="spec.updatePolicy.maxStaleness: rollouts at most this many versions behind")
    p.add_argument("--samples", type=int, default=16, help="rollouts per step")
    p.add_argument("--requests", type=int, default=4, help="generate requests per step (spread over replicas)")
    p.add_argument("--tokens", type=int, default=8, help="tokens sampled per rollout")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--head-scale", type=float, default=0.25, help="the initial policy's output head, scaled")
    p.add_argument("--target-share", type=float, default=0.01,
                   help="the target token: the one the initial policy samples about this often")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inference-url", default="", help="default: the job's routing Service <job>-inference")
    p.add_argument("--out-dir", default="", help=f"where {STEPS_FILE} goes (default: the socket dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.samples % args.requests:
        raise SystemExit("--samples must be a multiple of --requests")
    url = args.inference_url or routing_url(os.environ, os.environ.get(contract.ENV_JOB, "weightsync"))
    out_dir = Path(args.out_dir or os.environ.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_file = out_dir / STEPS_FILE
    steps_file.unlink(missing_ok=True)
    torch.manual_seed(args.seed)
    initial = init_weights(args.seed, dtype=torch.float32)
    initial["lm_head.weight"] *= args.head_scale
    params = {k: v.requires_grad_() for k, v in initial.items()}
    opt = torch.optim.Adam(params.values(), lr=args.lr)
    target, share = pick_target(params, args.target_share, args.tokens, seed=args.seed)

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in params.items()}  # what the engine serves (bf16)

    log.info("rl trainer url=%s steps=%d max_staleness=%d samples=%d requests=%d target=%d initial_share=%.4f",
             url, args.steps, args.max_staleness, args.samples, args.requests, target, share)
    with TrainerSession() as session:
        session.publish(weights(), 1)
        session.wait_served(1)  # the whole fleet serves the initial policy before the first rollout
        log.info("version 1 served by every replica; training")
        for step in range(1, args.steps + 1):
            rec = StepRecord(step=step, version=step, reward=0.0, rollout_versions=[])
            oldest = max(1, step - args.max_staleness)  # never the engine's own dummy weights (no label)
            t1 = time.perf_counter()
            rollouts, rec.rollout_versions, rec.stale_dropped = rollouts_for_step(
                url, step, oldest=oldest, requests=args.requests, per_request=args.samples // args.requests,
                max_tokens=args.tokens, seed=args.seed)
            rec.labels = sorted({label for r in rollouts for label in r.labels})
            t2 = time.perf_counter()
            hits = torch.tensor([[float(t == target) for t in r.tokens] for r in rollouts])  # [samples, tokens]
            rewards = hits.mean(1)
            # each token's own reward, less the group's mean at its position
            advantages = (hits - hits.mean(0, keepdim=True)) / hits.shape[1]
            logp = token_logprobs(params, PROMPT, [r.tokens for r in rollouts])
            loss = -(advantages * logp).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t3 = time.perf_counter()
            session.wait_served(step + 1 - args.max_staleness, only_serving=True)
            t4 = time.perf_counter()
            session.publish(weights(), step + 1)
            t5 = time.perf_counter()
            rec.reward = float(rewards.mean())
            rec.generate_s, rec.train_s, rec.wait_s, rec.publish_s = t2 - t1, t3 - t2, t4 - t3, t5 - t4
            with steps_file.open("a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")
            log.info("step=%d reward=%.3f rollout_versions=%s dropped=%d generate=%.3f train=%.3f wait=%.3f "
                     "publish=%.3f", step, rec.reward, rec.rollout_versions, rec.stale_dropped, rec.generate_s,
                     rec.train_s, rec.wait_s, rec.publish_s)
        session.wait_served(args.steps + 1, only_serving=True)
        log.info("all %d steps done; version %d served; idling", args.steps, args.steps + 1)
        (out_dir / "rl-done").write_text(str(args.steps + 1))
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
