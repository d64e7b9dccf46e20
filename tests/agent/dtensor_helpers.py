"""Worker processes for the DTensor placement tests: real gloo ranks, real distribute_tensor and real
FSDP2 (fully_shard) over TP (parallelize_module), so the boxes are checked against torch's own data."""

from __future__ import annotations

from typing import Any

import torch

# (name, global shape, placements spelled as (kind, dim[, split factor]) per mesh dim) on a (2, 2) mesh
CASES: tuple[tuple[str, tuple[int, ...], tuple[tuple[Any, ...], ...]], ...] = (
    ("ss_s_even", (8, 4), (("ss", 0, 2), ("s", 0))),
    ("ss_s_uneven6", (6, 4), (("ss", 0, 2), ("s", 0))),
    ("ss_s_uneven7", (7, 4), (("ss", 0, 2), ("s", 0))),
    ("ss_s_dim1", (4, 8), (("ss", 1, 2), ("s", 1))),
    ("s_s_uneven", (5, 4), (("s", 0), ("s", 0))),
    ("s0_s1", (8, 6), (("s", 0), ("s", 1))),
    ("s_ss_noncontiguous", (8, 4), (("s", 0), ("ss", 0, 2))),
    ("r_ss_noncontiguous", (8, 4), (("r",), ("ss", 0, 2))),
)


def _placement(spec: tuple[Any, ...]) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if spec[0] == "r":
        return Replicate()
    if spec[0] == "s":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


def _report(name: str, dt: Any, full: torch.Tensor) -> dict[str, Any]:
    """What the client publishes for this DTensor, and whether its box holds exactly the local bytes."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from weightsync.agent.layout.shards import local_shards
    from weightsync.agent.plan import Box

    local = dt.to_local()
    shape, first = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    old_box = Box(tuple(int(o) for o in first), tuple(int(s) for s in shape))
    old_right = old_box.numel == 0 or torch.equal(local, full[old_box.slices_within(Box.full(full.shape))])
    try:
        shards, _ = local_shards({name: dt})
    except ValueError as exc:
        return {"refused": str(exc), "torch_first_offset_right": old_right}
    (s,) = shards
    box = Box(s.global_offset, tuple(s.tensor.shape))
    right = box.numel == 0 or torch.equal(s.tensor, full[box.slices_within(Box.full(full.shape))])
    return {"offset": box.offset, "shape": box.shape, "right": right, "torch_first_offset_right": old_right}


def placements_worker(rank: int, port: int, out: Any) -> None:
    """One of 4 ranks on a (dp=2, tp=2) mesh: every CASE through distribute_tensor, then a real FSDP2 over
    TP model (colwise / rowwise Linear, odd sizes), each through the client's publish normalisation."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    res: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for name, shape, specs in CASES:
            full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
            # src_data_rank=None: every rank splits the full tensor itself (torch scatters no uneven strided)
            dt = distribute_tensor(full, mesh, [_placement(p) for p in specs], src_data_rank=None)
            res[name] = _report(name, dt, full)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12, bias=True), torch.nn.Linear(12, 8, bias=False),
                                    torch.nn.Linear(8, 14, bias=False))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                                "2": ColwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        for pname, p in model.named_parameters():
            full = p.full_tensor().detach()
            r = _report(pname, p.detach(), full)
            r["placements"] = str(tuple(p.placements))
            res[f"fsdp2_tp.{pname}"] = r
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put((rank, res))
