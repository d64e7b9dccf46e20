"""Real model layouts through real agent processes: a Megatron TP 2 trainer (fused linear_qkv / linear_fc1,
Megatron names) publishes through `engine_weights`, a Custom engine with TP 4 declares its heads with
`InferenceSession(layout=...)`, and each engine rank must hold exactly its head-wise boxes of the HF model
(2 KV heads on TP 4: each replicated on two ranks), optionally as block-FP8 with weight_scale_inv. The
expected slices are written out here from the engines' rules, independently of the agent's layouts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from podprocs import Cluster, wait_for

from weightsync.crds import contract

sys.path.insert(0, str(Path(__file__).parent))
from layout_apps import HEADS, KV_HEADS, head_dim, hf_model

TP = 4


def expected_slice(name: str, full: torch.Tensor, rank: int, hd: int) -> torch.Tensor:
    if ".k_proj." in name or ".v_proj." in name:
        head = rank * KV_HEADS // TP  # TP 4 > 2 KV heads: ranks 0, 1 hold head 0; ranks 2, 3 head 1
        return full[head * hd:(head + 1) * hd]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(TP, dim=1)[rank]
    if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return full.chunk(TP, dim=0)[rank]
    return full


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale_inv = max|block| / 448, fp8 = block / scale_inv."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            blk = w[i:i + 128, j:j + 128].float()
            sc = blk.abs().max() / 448.0
            q[i:i + 128, j:j + 128] = (blk / sc).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            s[i // 128, j // 128] = sc
    return q, s


def check(out: Path, version: int, fp8: bool) -> None:
    hd = head_dim(fp8)
    full = hf_model(version, fp8)
    for rank in range(TP):
        got = torch.load(out / f"v{version}-rank{rank}.pt")
        want: dict[str, torch.Tensor] = {}
        for name, t in full.items():
            if fp8 and ".layers." in name and name.endswith("proj.weight"):
                q, s = quantize(t)
                want[name] = expected_slice(name, q, rank, hd)
                # the scale grid is sliced like the weight, in blocks (every box here holds whole blocks)
                want[name + "_scale_inv"] = expected_slice(name, s, rank, hd // 128)
            else:
                want[name] = expected_slice(name, t, rank, hd)
        assert sorted(got) == sorted(want), f"rank {rank} got {sorted(got)}"
        for name, w in want.items():
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
            assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), \
                f"{name} rank {rank} v{version} is not bit-exact"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_megatron_trainer_to_custom_engine_with_kv_heads_replicated(tmp_path: Path, clusters: list[Cluster],
                                                                     fp8: bool) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    trainers = [c.add_pod(f"demo-trainer-{i}", contract.ROLE_TRAINER, rank=i, world_size=2) for i in range(2)]
    inf = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE, ranks=list(range(TP)), world_size=TP)
    c.write_topology()
    for p in (*trainers, inf):
        c.start_agent(p)
    out = c.root / "engine-out"
    flag = ["--fp8"] if fp8 else []
    c.start_script(inf, "engine", "layout_apps.py", "engine", "--ranks", ",".join(map(str, range(TP))),
                   "--out", str(out), *flag)
    for i, p in enumerate(trainers):
        c.start_script(p, "trainer", "layout_apps.py", "trainer", "--rank", str(i), "--tp", "2", "--versions", "2",
                       "--interval", "1.0", *flag)
    wait_for(lambda: all((out / f"v2-rank{r}.pt").exists() for r in range(TP)), 180,
             f"all {TP} engine ranks committed version 2", c)
    check(out, 2, fp8)
    assert HEADS // TP == 2  # each rank: two query heads, and one of the two KV heads (shared with a neighbour)
