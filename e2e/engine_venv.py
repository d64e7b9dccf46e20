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
ENV_ENGINE_PYTHON = "WEIGHTSYNC_ENGINE_PYTHON"


class EngineVenvMissing(RuntimeError):
    """The engine venv is not built; `make setup` (or e2e/scripts/engine-venv.sh) builds it."""


def engine_python() -> Path:
    """The engine venv's python ($WEIGHTSYNC_ENGINE_PYTHON overrides it); a venv not built yet raises
    EngineVenvMissing with the command that builds it (a test then fails, never skips)."""
    override = os.environ.get(ENV_ENGINE_PYTHON)
    if override:
        return Path(override)
    out = subprocess.run(["bash", str(SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE,
                         text=True).stdout.strip()
    venv = Path(out)
    if not (venv / ".installed").is_file():
        raise EngineVenvMissing(f"the engine venv {out} is not built: run `make setup` or `bash {SCRIPT}`")
    src = venv / ".weightsync-src"
    if (src.read_text().strip() if src.is_file() else "") != str(REPO):
        # the venv is shared by every checkout on the machine, and its editable weightsync (the vLLM plugin)
        # points at the one that last ran the script: another checkout's code, or a removed one, would load
        subprocess.run(["bash", str(SCRIPT)], check=True, stdout=subprocess.DEVNULL)
    return venv / "bin" / "python"
