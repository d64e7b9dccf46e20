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
