"""FSDP1 ShardedTensor in publish(): each rank's local shard becomes a LocalShard with the truthful global
shape and global offset, read from the shard's own metadata.

World size 1 runs in this process (gloo, HashStore); world size 2 runs real FSDP1 (SHARDED_STATE_DICT) in
two spawned gloo processes, publishes through TrainerSession into a real StagedVersions per rank and checks
every staged byte against the unsharded model, and that the two ranks' boxes tile every tensor exactly.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weightsync.agent.client import TrainerSession
from weightsync.agent.layout.shards import local_shards
from weightsync.agent.staging import segments
from weightsync.agent.staging.versions import StagedVersions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent_process"))
from staging_agent import serve_staging


def _default_group() -> Any:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.distributed_c10d._get_default_group()


def _fsdp1_chunk(t: torch.Tensor) -> Any:
    """The ShardedTensor FSDP1's SHARDED_STATE_DICT builds for a parameter (its own helper)."""
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

    return _create_chunk_sharded_tensor(t, 0, 1, 1, _default_group())


def test_world_size_1_fsdp1_sharded_tensor_is_one_full_local_shard() -> None:
    full = torch.arange(24.0).reshape(6, 4)
    st = _fsdp1_chunk(full)
    assert type(st).__name__ == "ShardedTensor"
    shards, aliases = local_shards({"w": st, "b": torch.ones(3)})
    assert [s.name for s in shards] == ["w", "b"] and aliases == {}
    w = shards[0]
    assert w.global_shape == (6, 4) and w.global_offset == (0, 0)
    assert type(w.tensor) is torch.Tensor and torch.equal(w.tensor, full)


def test_world_size_1_chunk_and_enumerable_specs() -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    _default_group()
    st = sharded_tensor.empty(ChunkShardingSpec(dim=1, placements=["rank:0/cpu"]), 3, 5)
    st.local_shards()[0].tensor.copy_(torch.arange(15.0).reshape(3, 5))
    (s,), _ = local_shards([("x", st)])
    assert s.global_shape == (3, 5) and s.global_offset == (0, 0) and torch.equal(s.tensor, torch.arange(15.0).reshape(3, 5))

    one = EnumerableShardingSpec([ShardMetadata([0, 0], [4, 2], "rank:0/cpu")])
    (s,), _ = local_shards({"e": sharded_tensor.empty(one, 4, 2)})
    assert s.global_shape == (4, 2) and s.global_offset == (0, 0)


def test_more_than_one_local_shard_is_a_clear_error() -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    _default_group()
    two = EnumerableShardingSpec([ShardMetadata([0, 0], [2, 4], "rank:0/cpu"),
                                  ShardMetadata([2, 0], [2, 4], "rank:0/cpu")])
    st = sharded_tensor.empty(two, 4, 4)
    with pytest.raises(ValueError, match=r"layers\.0\.w: this rank holds 2 local shards of the ShardedTensor"):
        local_shards({"layers.0.w": st})


def test_unsupported_sharding_spec_is_a_clear_error() -> None:
    from torch.distributed._shard.sharding_spec import ShardingSpec

    class BlockCyclic(ShardingSpec):  # a user-defined spec: its boxes are not what the metadata describes
        def build_metadata(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

        def shard(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    st = _fsdp1_chunk(torch.zeros(4, 2))
    st._sharding_spec = BlockCyclic()
    with pytest.raises(ValueError, match=r"^emb: a ShardedTensor with sharding spec BlockCyclic is not supported"):
        local_shards({"emb": st})


# --- two ranks, real FSDP1 -----------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    # Linear(5, 1): its weight and bias have one row, so torch.chunk leaves rank 1 without a shard of them
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7), torch.nn.Linear(7, 1))


def _rank_main(rank: int, world: int, root: str) -> None:
    try:
        os.environ[segments.SHM_DIR_ENV] = root
        dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        model = _model()
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            sd = fsdp.state_dict()
        assert all(type(v).__name__ == "ShardedTensor" for v in sd.values()), {k: type(v) for k, v in sd.items()}

        store = StagedVersions([rank], f"wstest-st{rank}")
        server = serve_staging(Path(root) / f"agent{rank}.sock", store)
        try:
            with TrainerSession(Path(root) / f"agent{rank}.sock", rank=rank) as s:
                s.publish(sd, version=1)
            sv = store.get(1)
            assert sv is not None
            staged = sv.ranks[rank]
            tensors = staged.tensors()
            boxes = {}
            for shard in staged.shards():
                name = shard.name
                assert shard.global_shape == tuple(full[name].shape), (name, shard.global_shape)
                box = tuple(slice(o, o + n) for o, n in zip(shard.box.offset, shard.box.shape, strict=True))
                assert torch.equal(tensors[name], full[name][box]), f"rank {rank}: {name} bytes differ"
                boxes[name] = (shard.box.offset, shard.box.shape)
            if rank == 1:
                assert "2.weight" not in boxes and "2.bias" not in boxes, "rank 1 holds no chunk of layer 2"
        finally:
            server.close()
            store.close()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, boxes)
        if rank == 0:
            for name, t in full.items():
                covered = torch.zeros(t.shape, dtype=torch.int64)
                for b in gathered:
                    if name in b:
                        off, shape = b[name]
                        covered[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))] += 1
                assert bool((covered == 1).all()), f"{name}: the ranks' boxes do not tile the tensor exactly"
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise
    # Leave without interpreter teardown: gloo's C++ threads at exit aborted a rank once under load
    # ("terminate called without an active exception"); the checks above already passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_ranks_real_fsdp1_publish_truthful_boxes(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
