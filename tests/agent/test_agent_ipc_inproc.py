"""IPC transport in one process (sender and receiver threads over real links and real /dev/shm):
handle reuse across versions and the refusal to release a bucket whose views leaked."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from weightsync.agent.plan import TensorShard, build_plan
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import PeerFailed, SyncError
from weightsync.agent.transports.ipc import IpcTransport
from weightsync.agent.wire.link import LinkListener, connect


def _pair(plan: Any, prefix: str, strict: bool = False) -> tuple[WeightSender, WeightReceiver, IpcTransport,
                                                                  IpcTransport]:
    lst = LinkListener("127.0.0.1", 0, "tok")
    client = connect("127.0.0.1", lst.port, "tok")
    server = lst.accept(timeout=5)
    lst.close()
    ts, tr = IpcTransport(prefix=prefix), IpcTransport(prefix=prefix, close_each_bucket=strict)
    return (WeightSender(plan, 0, ts, {0: server}, timeout=10), WeightReceiver(plan, 0, tr, {0: client}, timeout=10),
            ts, tr)


def _run(sender: WeightSender, version: int, tensors: dict[str, torch.Tensor]) -> list[BaseException]:
    errors: list[BaseException] = []

    def go() -> None:
        try:
            sender.send_version(version, tensors)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return errors


@pytest.mark.parametrize("strict", [False, True])
def test_handles_are_mapped_once_and_segments_cleaned_up(strict: bool) -> None:
    shards = [TensorShard.full(f"w{i}", "float32", (256,)) for i in range(8)]
    plan = build_plan([shards], [shards], 2048)  # 8 KiB of tensors in 2 KiB buckets: 4 buckets
    prefix = f"weightsync-test-{os.getpid()}-{strict}"
    sender, receiver, ts, tr = _pair(plan, prefix, strict)
    for v in (1, 2, 3):
        tensors = {s.name: torch.full((256,), float(v * 100 + i)) for i, s in enumerate(shards)}
        errors = _run(sender, v, tensors)
        got: dict[str, torch.Tensor] = {}
        receiver.receive_version(lambda items, got=got: got.update((n, t.clone()) for n, t in items),
                                 expected_version=v)
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        assert not errors
    # one mapping per owner slot, reused by 12 buckets over 3 versions; strict: one per bucket
    assert tr.handles_opened == (12 if strict else 2)
    assert not tr._maps if strict else len(tr._maps) == 2
    ts.close()
    tr.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def test_a_leaked_view_is_refused_not_left_dangling() -> None:
    shards = [TensorShard.full("w", "float32", (64,))]
    plan = build_plan([shards], [shards], 1024)
    sender, receiver, ts, tr = _pair(plan, f"weightsync-test-{os.getpid()}-leak")
    errors = _run(sender, 1, {"w": torch.ones(64)})
    kept: list[torch.Tensor] = []
    with pytest.raises(PeerFailed, match="still alive after on_bucket returned"):
        receiver.receive_version(lambda items: kept.extend(t for _, t in items))
    assert float(kept[0].sum()) == 64.0  # the leaked view still points at mapped memory
    ts.close()
    tr.close()
    del errors


def test_sender_rejects_tensors_that_do_not_match_the_plan() -> None:
    shards = [TensorShard.full("w", "float32", (64,))]
    plan = build_plan([shards], [shards], 1024)
    sender, receiver, ts, tr = _pair(plan, f"weightsync-test-{os.getpid()}-bad")
    with pytest.raises(SyncError, match="'w' is float32\\[32\\], the plan says float32\\[64\\]"):
        sender.send_version(1, {"w": torch.ones(32)})
    with pytest.raises(PeerFailed, match="aborted"):
        receiver.receive_version(lambda items: None)
    ts.close()
    tr.close()


def test_whole_bucket_copies_never_overwrite_tensors_in_padding_gaps() -> None:
    # Source 1 sends z_a (16 B at offset 0) and z_b (400 B at offset 256): a 240-byte padding gap.
    # The destination keeps y1 (from source 0, arriving first) inside that gap. Copying bucket z in
    # one piece would overwrite y1 with padding; the receiver must notice and copy per tensor.
    f = "float32"
    x1, y1 = TensorShard.full("x1", f, (4,)), TensorShard.full("y1", f, (4,))
    za, zb = TensorShard.full("z_a", f, (4,)), TensorShard.full("z_b", f, (100,))
    plan = build_plan([[x1, y1], [za, zb]], [[x1, y1, za, zb]], 1 << 20)
    assert [b.src for b in plan.buckets] == [0, 1]
    zbucket = plan.buckets[1]
    assert [e.offset for e in zbucket.entries] == [0, 256]
    flat = torch.zeros(1024, dtype=torch.uint8)
    into = {"z_a": flat[0:16].view(torch.float32), "y1": flat[64:80].view(torch.float32),
            "z_b": flat[256:656].view(torch.float32), "x1": flat[704:720].view(torch.float32)}
    from weightsync.agent.transfer.receive import gaps_are_free, memory_spans
    from weightsync.agent.transfer.sync import in_place

    target = in_place(zbucket, [into["z_a"], into["z_b"]])
    assert target is not None  # laid out like the bucket...
    assert not gaps_are_free(zbucket, target, memory_spans(into.values()))  # ...but y1 sits in the gap

    prefix = f"weightsync-test-{os.getpid()}-gap"
    listeners = [LinkListener("127.0.0.1", 0, "tok") for _ in range(2)]
    clients = [connect("127.0.0.1", lst.port, "tok") for lst in listeners]
    servers = [lst.accept(timeout=5) for lst in listeners]
    transports = [IpcTransport(prefix=prefix) for _ in range(3)]
    senders = [WeightSender(plan, r, transports[r], {0: servers[r]}, timeout=10) for r in range(2)]
    receiver = WeightReceiver(plan, 0, transports[2], {0: clients[0], 1: clients[1]}, timeout=10)
    want = {"x1": torch.full((4,), 1.0), "y1": torch.full((4,), 2.0), "z_a": torch.full((4,), 3.0),
            "z_b": torch.full((100,), 4.0)}
    errs = _run(senders[0], 1, {"x1": want["x1"], "y1": want["y1"]})
    errs += _run(senders[1], 1, {"z_a": want["z_a"], "z_b": want["z_b"]})
    receiver.receive_version(None, into=into)
    for n, t in want.items():
        assert torch.equal(into[n], t), n
    for t in transports:
        t.close()
    for lst in listeners:
        lst.close()
    assert not errs


def test_segments_of_crashed_owners_are_cleaned_up() -> None:
    import subprocess
    import sys

    from weightsync.agent.transports.ipc import cleanup_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    prefix = f"weightsync-cleanup-{os.getpid()}"
    stale = f"/dev/shm/{prefix}-{dead_pid}-abc123-s0"
    live = f"/dev/shm/{prefix}-{os.getppid()}-abc123-s1"
    other = f"/dev/shm/{prefix}-staging-{dead_pid}"
    for path in (stale, live, other):
        with open(path, "wb") as fh:
            fh.write(b"x")
    try:
        assert cleanup_stale("/dev/shm", prefix) == 1
        assert not os.path.exists(stale)
        assert os.path.exists(live) and os.path.exists(other)
    finally:
        for path in (stale, live, other):
            if os.path.exists(path):
                os.unlink(path)


def test_ranks_with_nothing_to_move_finish_at_once() -> None:
    w = TensorShard.full("w", "float32", (4,))
    idle_dst = WeightReceiver(build_plan([[w]], [[w], []], 64), 1, IpcTransport(), {})
    assert idle_dst.receive_version(None, expected_version=3).buckets == 0
    idle_src = WeightSender(build_plan([[w], []], [[w]], 64), 1, IpcTransport(), {})
    assert idle_src.send_version(3, {}).buckets == 0


def test_an_own_cuda_export_is_lent_to_the_custom_engine_in_place_until_unmapped() -> None:
    """CPU path of the colocated GPU case up to the CUDA call: the staged tensor an agent resolved from its own
    export is found in shared memory by the Custom engine adapter (handed over in place, nothing packed), and
    once the reader drops the mapping its name is given to the engine to unmap (take_gone) and nothing finds
    it any more. On a GPU: test_agent_gpu.py::test_the_product_path_on_the_gpu_is_bit_exact_with_one_copy."""
    from weightsync.agent.engines.custom import CustomEngineAdapter
    from weightsync.agent.staging.segments import SHARED
    from weightsync.agent.transports.ipc import IpcTransport

    SHARED.take_gone()
    staged = torch.arange(1024, dtype=torch.uint8)  # stands for the staging storage the export names
    reader = IpcTransport(prefix="wstest")
    reader._maps["cuda:own"] = staged
    reader._lend_own(staged)
    weight = staged[256:512].view(torch.float32)
    shared, packed = CustomEngineAdapter.in_place([("w", weight)])
    assert packed == [] and len(shared) == 1
    seg, layout = shared[0]
    assert seg.tensor.data_ptr() == staged.data_ptr() and layout.entries[0].offset == 256
    name = seg.name
    reader._close_map(reader._maps.pop("cuda:own"))  # as when its owner slot moves to another segment
    assert name in SHARED.take_gone()
    assert SHARED.locate(weight) is None
