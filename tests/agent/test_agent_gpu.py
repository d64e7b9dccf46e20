"""CUDA paths (run on a GPU machine: `pytest -m gpu`). Same harness, same bit-for-bit checks as the CPU
tests: CUDA IPC handles between two processes on one GPU, and NCCL where a second GPU exists."""

from __future__ import annotations

import pytest
import torch
from test_agent_sync import assert_all_ok, llama_metas, tp_scenario
from wsagent_helpers import run_scenario

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("into", [False, True])
def test_cuda_ipc_one_gpu_bit_exact(into: bool) -> None:
    # two trainer ranks and two inference ranks, all on GPU 0, talking through CUDA IPC handles
    scn = tp_scenario(llama_metas(hidden=64, inter=128, vocab=256), 2, 2, transport="ipc", device="cuda",
                      into=into, versions=[1, 2, 3])
    results = run_scenario(scn, deadline=180)
    assert_all_ok(results, 2, [1, 2, 3])


def test_cuda_ipc_large_bucket_reuse() -> None:
    big = [m for m in llama_metas(layers=4, hidden=512, inter=1024, vocab=1024)]
    scn = tp_scenario(big, 1, 1, transport="ipc", device="cuda", bucket=1 << 20, versions=[1, 2])
    assert_all_ok(run_scenario(scn, deadline=180), 1, [1, 2])
