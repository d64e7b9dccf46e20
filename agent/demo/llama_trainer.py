"""A trainer that publishes tiny-Llama versions (agent/demo/tiny_llama.py) for a real vLLM server to serve.

    python -m weightsync.agent.demo.llama_trainer --versions 3 --interval 2 --save-dir DIR

Version N is `init_weights(seed + N)` in bf16, published through TrainerSession like any trainer's weights.
Each version's exact state dict is written to `<save-dir>/v<N>.pt` before it is published, so a checker
(tests, `make demo DEMO_ARGS='--example vllm'`) runs an independent reference forward over the very weights the
engine should serve. `--gate-dir`: version N > 1 is published only once `<gate-dir>/go-<N>` exists (a test
checks every version's outputs before the next one replaces it); `--wait-served`: each version is waited for
until the fleet serves it (TrainerSession.wait_served).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch

from weightsync.agent.client import TrainerSession
from weightsync.agent.demo.tiny_llama import init_weights
from weightsync.crds import contract

log = logging.getLogger("weightsync.demo.llama_trainer")


def version_path(save_dir: Path, version: int) -> Path:
    return save_dir / f"v{version}.pt"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default="",
                   help="where each version's state dict goes (default: <socket dir>/llama-versions)")
    p.add_argument("--gate-dir", default="", help="publish version N > 1 only once <gate-dir>/go-<N> exists")
    p.add_argument("--wait-served", action="store_true", help="wait until the fleet serves each version")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    save_dir = Path(args.save_dir) if args.save_dir else (
        Path(os.environ.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR) / "llama-versions")
    save_dir.mkdir(parents=True, exist_ok=True)
    with TrainerSession() as session:
        for version in range(1, args.versions + 1):
            if args.gate_dir and version > 1:
                gate = Path(args.gate_dir) / f"go-{version}"
                while not gate.exists():
                    time.sleep(0.2)
            weights = init_weights(args.seed + version, dtype=torch.bfloat16)
            tmp = version_path(save_dir, version).with_suffix(".tmp")
            torch.save(weights, tmp)
            os.replace(tmp, version_path(save_dir, version))  # before publish: whoever sees N finds its weights
            res = session.publish(weights, version)
            log.info("published version=%d bytes=%d seconds=%.4f", version, res.bytes, res.seconds)
            if args.wait_served:
                session.wait_served(version)
                log.info("version=%d served by the fleet", version)
            if version < args.versions and not args.gate_dir:
                time.sleep(args.interval)
    log.info("all %d versions published; idling", args.versions)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
