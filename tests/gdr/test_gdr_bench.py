"""The bench CLI's GDR, verify and delta options run end to end (tiny sizes; the timings are printed in
the JSON, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# benchmark code lives in bench/, out of the product package
BENCH = str(Path(__file__).resolve().parents[2] / "bench" / "transport_ratio.py")


def _bench(*args: str) -> dict:
    cmd = [sys.executable, BENCH, "--json", "--size-mb", "8", "--bucket-mb", "2",
           "--iters", "2", "--timeout", "240", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_gdr_agent_vs_raw() -> None:
    r = _bench("--transport", "gdr", "--inference-tp", "2")
    assert r["transport"] == "gdr" and r["bit_exact"] and r["compared"] > 0
    for key in ("agent_gbps", "raw_gbps", "ratio"):
        assert r[key] > 0
    assert r["receiver"]["wire_bytes"] == r["receiver"]["full_bytes"]


@pytest.mark.slow
def test_bench_gdr_delta_wire_fraction() -> None:
    r = _bench("--transport", "gdr", "--delta-fraction", "0.05", "--verify")
    assert r["bit_exact"] and r["compared"] > 0
    assert r["verify_gbps"] > 0
    assert r["wire_fraction"] <= 0.15, r
    assert r["receiver"]["delta_buckets"] > 0


def test_bench_rejects_delta_without_gdr() -> None:
    out = subprocess.run([sys.executable, BENCH, "--transport", "nccl",
                          "--delta-fraction", "0.05"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--transport gdr" in out.stderr
