"""One NIXL agent per agent process (nixl_endpoint.NixlEndpoint), shared by its GDR transports: in-place memory is
registered once and released with its last holder, a remote agent is never reloaded with older metadata, and
a reload waits for the READs in flight. Real NIXL agents over UCX (tcp/cma), in one process."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.agent.staging import segments
from weightsync.agent.transfer.groups import TransportCache
from weightsync.agent.transports.base import TransportError
from weightsync.agent.transports.gdr import GdrTransport
from weightsync.agent.transports.nixl_endpoint import NixlEndpoint


def test_the_gdr_transports_of_one_agent_share_one_nixl_agent() -> None:
    cache = TransportCache(mode="GDR", job="j", pod_ip="127.0.0.1", transport_port=0)
    try:
        plan: Any = None  # the cache does not read the plan to make a transport
        a, _ = cache.get({"name": "replica-0", "generation": 1, "epoch": "e1"}, plan, role="dst0<-src0")
        b, _ = cache.get({"name": "replica-0", "generation": 1, "epoch": "e1"}, plan, role="dst0<-src1")
        c, _ = cache.get({"name": "replica-1", "generation": 1, "epoch": "e1"}, plan, role="src0")
        assert isinstance(a, GdrTransport) and isinstance(b, GdrTransport) and isinstance(c, GdrTransport)
        assert a.nixl is b.nixl is c.nixl
        shared = a.nixl
    finally:
        cache.close()
    assert cache._nixl is None and shared._regs == [] and shared.held_bytes() == 0


def test_in_place_memory_is_registered_once_and_released_with_its_last_holder() -> None:
    nx = NixlEndpoint()
    try:
        slots = torch.zeros(1 << 20, dtype=torch.uint8)
        first, second = object(), object()
        assert nx.hold(slots[4096:8192], first)
        gen = nx.md_gen
        assert nx.held_bytes() == slots.numel()  # the whole storage, once
        assert nx.hold(slots[: 1 << 19], second)  # a second transport, another part of the same storage
        assert nx.md_gen == gen and len(nx._regs) == 1  # no second registration, peers need no new metadata
        nx.release(first)
        assert nx.held_bytes() == slots.numel() and len(nx._regs) == 1  # still held by `second`
        nx.release(second)
        assert nx.held_bytes() == 0 and nx._regs == []
        assert nx.hold(slots, first) and nx.md_gen == gen + 1  # registered again: peers learn a new generation
    finally:
        nx.close()


def _read_back(reader: NixlEndpoint, remote: NixlEndpoint, src: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(src)
    reader.hold(out, reader)
    reader.read(out, (int(src.data_ptr()), src.numel(), 0), "DRAM", remote.name, timeout=30.0,
                aborted=threading.Event())
    return out


def test_a_remote_is_never_reloaded_with_older_metadata() -> None:
    remote, reader = NixlEndpoint(), NixlEndpoint()
    try:
        x = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        y = (torch.arange(4096, dtype=torch.int32) * 7).view(torch.uint8)
        assert remote.hold(x, remote)
        old_gen, old_md = remote.snapshot()
        assert remote.hold(y, remote)
        new_gen, new_md = remote.snapshot()
        assert new_gen == old_gen + 1 and new_md != old_md
        reader.load_remote(remote.name, new_md, new_gen)
        # another transport of the reader's process learns the older generation late: ignored
        reader.load_remote(remote.name, old_md, old_gen)
        assert reader._remote_md[remote.name] == new_md and reader._remote_gen[remote.name] == new_gen
        assert torch.equal(_read_back(reader, remote, y), y)  # memory of the newer generation is readable
        assert torch.equal(_read_back(reader, remote, x), x)
    finally:
        reader.close()
        remote.close()


def test_a_reload_waits_for_the_reads_in_flight_from_that_remote() -> None:
    remote, reader = NixlEndpoint(), NixlEndpoint()
    try:
        x = torch.ones(4096, dtype=torch.uint8)
        remote.hold(x, remote)
        gen1, md1 = remote.snapshot()
        reader.load_remote(remote.name, md1, gen1)
        remote.hold(torch.ones(8192, dtype=torch.uint8), remote)
        gen2, md2 = remote.snapshot()
        with reader._lock:
            reader._reading[remote.name] = 1  # a READ of another transport is in flight
        done = threading.Event()

        def reload() -> None:
            reader.load_remote(remote.name, md2, gen2)
            done.set()

        t = threading.Thread(target=reload, daemon=True)
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and reader._remote_gen[remote.name] == gen1  # not swapped under the READ
        with reader._lock:
            reader._done_reading(remote.name)
        t.join(10)
        assert done.is_set() and reader._remote_gen[remote.name] == gen2
        with reader._lock:
            reader._reading[remote.name] = 1
        remote.hold(torch.ones(16384, dtype=torch.uint8), remote)
        gen3, md3 = remote.snapshot()
        with pytest.raises(TransportError, match="stayed in flight"):
            reader.load_remote(remote.name, md3, gen3, timeout=0.2)
        with reader._lock:
            reader._done_reading(remote.name)
    finally:
        reader.close()
        remote.close()


def test_an_idle_nixl_agent_does_not_spin_a_core() -> None:
    """NIXL's wrapper makes its progress thread poll without pause (a whole core per agent, idle or not); the
    endpoint gives it a wait (WEIGHTSYNC_NIXL_PROGRESS_DELAY_US), and READs still complete."""
    nx = NixlEndpoint()
    try:
        assert nx.progress_delay_us == 1000
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert busy < 0.3, f"an idle NIXL agent used {busy:.2f} CPU seconds per second"
        peer = NixlEndpoint()
        try:
            src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
            peer.hold(src, peer)
            peer_gen, peer_md = peer.snapshot()
            nx.load_remote(peer.name, peer_md, peer_gen)
            assert torch.equal(_read_back(nx, peer, src), src)
        finally:
            peer.close()
    finally:
        nx.close()


def test_the_progress_delay_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.agent.transports import nixl_endpoint

    monkeypatch.setenv(nixl_endpoint.PROGRESS_DELAY_ENV, "250")
    assert nixl_endpoint.progress_delay_us() == 250
    for bad in ("-1", "fast"):
        monkeypatch.setenv(nixl_endpoint.PROGRESS_DELAY_ENV, bad)
        with pytest.raises(TransportError, match=nixl_endpoint.PROGRESS_DELAY_ENV):
            nixl_endpoint.progress_delay_us()


def test_a_freed_staging_segment_is_deregistered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool replaces a slot (unlink): the NIXL registration of its memory goes with it, so the memory is
    really freed and a later segment mapped at the same address is never taken for the old registration."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    hooks_before = len(segments._FREED_HOOKS)
    nx = NixlEndpoint()
    assert len(segments._FREED_HOOKS) == hooks_before + 1
    try:
        seg = segments.create_segment(1 << 20, "wsfreed")
        keep = segments.create_segment(1 << 20, "wskept")
        assert nx.hold(seg.tensor[4096:8192], object()) and nx.hold(keep.tensor, object())
        assert nx.held_bytes() == 2 << 20 and len(nx._regs) == 2
        seg.unlink()
        assert nx.held_bytes() == 1 << 20 and len(nx._regs) == 1  # only the freed one went
        keep.unlink()
        assert nx.held_bytes() == 0 and nx._regs == []
    finally:
        nx.close()
    assert len(segments._FREED_HOOKS) == hooks_before  # a closed endpoint no longer listens
