"""CUDA paths (run on a GPU machine: `pytest -m gpu`). Same harness, same bit-for-bit checks as the CPU
tests: CUDA IPC handles between two processes on one GPU, and NCCL where a second GPU exists."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ProcessGroupNCCL needs one GPU per rank")
@pytest.mark.parametrize("into", [False, True])
def test_process_group_nccl_reshard_bit_exact(into: bool) -> None:
    # FSDP 2 -> TP 2 over ProcessGroupNCCL (the transport picks NCCL for CUDA buffers), one GPU per process
    scn = tp_scenario(llama_metas(hidden=64, inter=128, vocab=256), 1, 2, fsdp=2, transport="nccl",
                      device="cuda:spread", into=into, versions=[1, 2, 3])
    assert_all_ok(run_scenario(scn, deadline=240), 2, [1, 2, 3])


def test_host_staging_is_pinned_on_gpu_nodes(memory_staging_dir: Path) -> None:
    from weightsync.agent.staging import segments

    seg = segments.create_segment(4 << 20, "wsgpu")
    try:
        assert isinstance(seg, segments.ShmSegment) and seg.pinned and seg.tensor.is_pinned()
        seg.tensor.copy_(torch.arange(4 << 20, dtype=torch.int64).to(torch.uint8))
        on_gpu = seg.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), seg.tensor)
    finally:
        seg.unlink()
    assert not seg.pinned


def test_a_refused_pin_leaves_staging_pageable_and_cuda_usable(memory_staging_dir: Path) -> None:
    """A registration the driver refuses (here: the same memory twice) is a warning, not an error, and does not
    leave a CUDA error behind for the next, unrelated call to report (it did with cudaHostRegister)."""
    from weightsync.agent.staging import segments

    seg = segments.create_segment(1 << 20, "wsgpu")
    try:
        assert seg.pinned
        assert segments.pin_host(seg.tensor) is False  # already registered
        x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
        assert float((x * 2).sum().item()) == float(2 * sum(range(1 << 16)))
    finally:
        seg.unlink()


def test_custom_engine_receive_slots_on_gpu_are_cuda_ipc_segments() -> None:
    from weightsync.agent.engines.custom import CustomEngineAdapter
    from weightsync.agent.staging import segments
    from weightsync.agent.staging.slots import SharedSlotAllocator

    alloc = SharedSlotAllocator("wsgpu-recv")
    slot = alloc(1 << 20, torch.device("cuda"))
    t = slot[:4096].view(torch.float32)
    shared, rest = CustomEngineAdapter.in_place([("w", t)])
    assert len(shared) == 1 and not rest
    seg, layout = shared[0]
    assert isinstance(seg, segments.CudaSegment) and seg.handle()["kind"] == "cuda"
    assert layout.entries[0].offset == 0 and layout.nbytes == 4096
    del slot, t, shared, seg
    import gc

    gc.collect()
    dead = alloc.reap()
    assert len(dead) == 1
    dead[0].unlink()


def test_a_colocated_agent_opens_its_own_cuda_export() -> None:
    """A colocated agent stages the trainer's version and hands it to its own engine: it opens a handle it
    exported itself, which CUDA refuses ('invalid device context'), so the handle resolves to the exported
    memory in this process: the same bytes, no copy."""
    from weightsync.agent.transports.ipc import _cuda_handle, _open_cuda

    t = torch.arange(1 << 12, dtype=torch.int32, device="cuda")
    view = t[256:512]
    h = _cuda_handle(view)
    whole = _open_cuda(h, int(h["size"]), torch.device("cuda"))
    assert whole.data_ptr() == t.untyped_storage().data_ptr() and whole.numel() == int(h["size"])
    got = whole[h["offset"]: h["offset"] + view.numel() * 4].view(torch.int32)
    assert torch.equal(got, view)
    view.add_(1)  # it is the exported memory itself
    assert torch.equal(got, view)


@pytest.mark.parametrize("mode", ["ipc", "gdr"])
def test_the_product_path_on_the_gpu_is_bit_exact_with_one_copy(mode: str) -> None:
    """bench/agent_pipeline.py --device cuda, small: trainer weights, agent buffers and engine parameters on
    the GPU, through real agent, trainer and engine processes (ipc: one colocated pod, the agent opening its
    own export; gdr: NIXL between two pods' GPU memory)."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "agent_pipeline.py"
    out = subprocess.run([sys.executable, str(bench), "--mode", mode, "--device", "cuda", "--size-mb", "16",
                          "--bucket-mb", "2", "--versions", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["bit_exact"] is True and result["trainer_device"] == "cuda:0"
    assert result["copies_per_byte"] <= 1.01
