"""Which container boundaries a CUDA IPC handle crosses: one exporter, one importer per namespace set.

    python bench/cuda_ipc_namespaces.py --json      (needs a CUDA GPU and root for unshare)

Why: on an H100 (driver 580, torch 2.11) the SGLang adapter's handles failed in an engine stand-in that ran in
its own mount namespace with a private /dev/shm ("mapping of buffer object failed"), while the same exchange
between two plain processes worked. In a Kubernetes pod, containers share the IPC namespace and the pod's
/dev/shm, and share PIDs only with shareProcessNamespace; this tells which of those CUDA IPC needs.

The exporter (this process) shares one CUDA tensor through torch's own reduction; each importer rebuilds it
in the namespaces named, checks the bytes and writes back; the result is one JSON object: case -> "ok" or
the importer's error.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import re
import subprocess
import sys
from typing import Any

import torch

CASES: dict[str, list[str]] = {
    "same_namespaces": [],
    "own_mount_namespace": ["unshare", "--mount", "--propagation", "private"],
    "own_mount_and_dev_shm": ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                              'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"'],
    # with its own /proc, as a container with its own PID namespace has (the host's /proc there stopped CUDA from
    # initialising at all on the H100: error 304, which says nothing about IPC)
    "own_pid_namespace": ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"],
    "own_ipc_namespace": ["unshare", "--ipc"],
}

IMPORTER = """
import base64, pickle, sys, torch
fn, args = pickle.loads(base64.b64decode(sys.stdin.read()))
t = fn(*args)
torch.cuda.synchronize()
ok = bool(torch.equal(t.cpu(), torch.arange(t.numel(), dtype=torch.int32)))
t.add_(1)
torch.cuda.synchronize()
print("ok" if ok else "wrong bytes")
"""


def _error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The importer's exception itself: torch's CUDA errors end with hints ("Compile with TORCH_USE_CUDA_DSA
    ..."), so the last line that starts with an exception's name, else the last line."""
    lines = r.stderr.strip().splitlines() or [f"exit {r.returncode}"]
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception): ", ln)]
    return (raised or lines)[-1].strip()


def probe() -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, prefix in CASES.items():
        t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        blob = base64.b64encode(pickle.dumps(reduce_tensor(t))).decode()
        try:
            r = subprocess.run([*prefix, sys.executable, "-c", IMPORTER], input=blob, capture_output=True,
                               text=True, timeout=120)
            text = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else _error_line(r)
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"{type(exc).__name__}: {exc}"
        torch.cuda.synchronize()
        written = bool(torch.equal(t.cpu(), torch.arange(1, (1 << 20) + 1, dtype=torch.int32)))
        out[name] = text if text != "ok" or written else "ok, but the exporter did not see the write"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/cuda_ipc_namespaces.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(json.dumps(probe(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
