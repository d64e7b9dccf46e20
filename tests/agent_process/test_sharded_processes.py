"""Resharding through real agent processes: FSDP Shard(0) trainers -> tensor-parallel inference replicas,
with several ranks per agent and a replica spread over two pods. Every byte is compared with the box of
the model that the inference TP rank must hold (agent/layout/rules.py rules)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from podprocs import Cluster, wait_for

from weightsync.agent.layout.rules import TensorMeta, inference_layout
from weightsync.crds import contract

sys.path.insert(0, str(Path(__file__).parent))
from shard_apps import model


def expected(version: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    full = model(version)
    metas = [TensorMeta.of(n, t) for n, t in sorted(full.items())]
    return {s.name: full[s.name][s.box.slices_within(type(s.box).full(s.global_shape))]
            for s in inference_layout(metas, tp, rank)}


def check(out: Path, version: int, tp: int) -> None:
    for rank in range(tp):
        got = torch.load(out / f"v{version}-rank{rank}.pt")
        want = expected(version, tp, rank)
        assert sorted(got) == sorted(want), f"rank {rank} got {sorted(got)}"
        for name, t in want.items():
            g = got[name]
            assert g.dtype == t.dtype and g.shape == t.shape, f"{name}: {g.dtype}{list(g.shape)} vs {t.dtype}{list(t.shape)}"
            assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), \
                f"{name} rank {rank} v{version} is not bit-exact"


def fsdp2_pods_to_tp2_replica(c: Cluster, versions: int) -> None:
    """Two trainer pods (FSDP Shard(0), one rank each) -> one inference pod serving TP ranks 0 and 1, every
    destination rank reading from both sources; checked bit for bit at the last version."""
    trainers = [c.add_pod(f"demo-trainer-{i}", contract.ROLE_TRAINER, rank=i, world_size=2) for i in range(2)]
    inf = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE, ranks=[0, 1], world_size=2)
    c.write_topology()
    for p in (*trainers, inf):
        c.start_agent(p)
    out = c.root / "engine-out"
    c.start_script(inf, "engine", "shard_apps.py", "engine", "--ranks", "0,1", "--out", str(out))
    for i, p in enumerate(trainers):
        c.start_script(p, "trainer", "shard_apps.py", "trainer", "--rank", str(i), "--fsdp", "2",
                       "--versions", str(versions), "--interval", "1.0")
    wait_for(lambda: (out / f"v{versions}-rank0.pt").exists() and (out / f"v{versions}-rank1.pt").exists(), 120,
             f"both TP ranks committed version {versions}", c)
    check(out, versions, 2)


def test_fsdp2_trainer_pods_to_tp2_replica_in_one_agent(tmp_path: Path, clusters: list[Cluster]) -> None:
    """Two trainer pods (FSDP Shard(0), one rank each) -> one inference pod serving TP ranks 0 and 1."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1, verify="Checksum")
    clusters.append(c)
    fsdp2_pods_to_tp2_replica(c, 3)


def test_two_rank_trainer_pod_to_tp2_replica_over_two_pods(tmp_path: Path, clusters: list[Cluster]) -> None:
    """One trainer pod serving FSDP ranks 0 and 1 (two trainer processes) -> a TP 2 replica whose ranks
    live in two pods: replicated tensors are broadcast to both pods in one group, so both pods must
    agree on the group's epoch."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER, ranks=[0, 1], world_size=2)
    infs = [c.add_pod(f"demo-inference-0-{j}", contract.ROLE_INFERENCE, rank=j, world_size=2) for j in range(2)]
    c.write_topology()
    for p in (t, *infs):
        c.start_agent(p)
    out = tmp_path / "engine-out"
    for j, p in enumerate(infs):
        c.start_script(p, "engine", "shard_apps.py", "engine", "--ranks", str(j), "--out", str(out))
    for r in range(2):
        c.start_script(t, f"trainer{r}", "shard_apps.py", "trainer", "--rank", str(r), "--fsdp", "2",
                       "--versions", "3", "--interval", "1.0")
    wait_for(lambda: (out / "v3-rank0.pt").exists() and (out / "v3-rank1.pt").exists(), 120,
             "both pods of the replica committed version 3", c)
    check(out, 3, 2)
