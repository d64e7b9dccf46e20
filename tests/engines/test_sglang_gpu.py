"""SGLang's GPU paths (needs a CUDA GPU; `pytest -m gpu`): the stand-in engine keeps its weights on the GPU
and runs SGLang's own receive code there, in its own mount namespace with its own /dev/shm.

* tensor path (Colocated): CUDA IPC handles of flattened buckets, the device named by GPU UUID, rebuilt by
  SGLang's deserializer (with SGLang's UUID patch) in the engine process;
* distributed path (Separated): SGLang's weight-update group receiving into CUDA memory over gloo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_sglang_released import Standin, _buckets, _weights

from weightsync.agent.engines import sglang
from weightsync.agent.engines.base import load_version
from weightsync.agent.layout.shards import checksums

pytestmark = [pytest.mark.gpu]  # not `engines`: that tier runs without a GPU, with no skips

MOUNT_ONLY = ["unshare", "--mount", "--propagation", "private"]  # one PID namespace (shareProcessNamespace)


@pytest.fixture
def gpu_standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA GPU")
    import test_sglang_released as t

    monkeypatch.setattr(t, "UNSHARE", MOUNT_ONLY)
    # The engine container of a Colocated pod shares the pod's /dev/shm with the agent (the pod's IPC
    # namespace), and torch's CUDA IPC needs it: each export's reference count is a file in the exporter's
    # /dev/shm that the receiver opens by name. On an H100 the stand-in with a private /dev/shm failed to
    # open the handles ("mapping of buffer object failed"); bench/cuda_ipc_namespaces.py isolates why.
    monkeypatch.setattr(t, "PRIVATE_DEV_SHM", False)
    made: list[Standin] = []
    yield lambda *a: made.append(Standin(tmp_path, "--device", "cuda", *a)) or made[-1]
    for s in made:
        s.close()


def _cuda(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.cuda()) for n, t in items]


@pytest.mark.parametrize("path", ["tensor", "distributed"])
def test_sglang_gpu_paths_are_bit_exact(gpu_standin: Any, path: str) -> None:
    eng = gpu_standin()
    devices = ["cuda:0"] if path == "tensor" else None
    a = sglang.SGLangAdapter(eng.url, path=path, devices=devices, timeout=120)  # type: ignore[arg-type]
    for v in (1, 2):
        items = _weights(v)
        load_version(a, v, _buckets(_cuda(items)), pause_generation=True)
        got = eng.get("/standin/checksums")
        assert got["version"] == v and got["checksums"] == checksums(items)
    assert "refused" not in eng.ops()
