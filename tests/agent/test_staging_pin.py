"""Host staging's pin, on the CPU up to the CUDA driver call (the `gpu` tier runs it against a real driver:
tests/agent/test_agent_gpu.py). A recording stand-in for libcuda checks what the GPU run cannot show in
one assertion: the primary context is retained once and never released, every push is popped, a refused
registration is a warning naming the directory and the driver's error, and nothing is left registered."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.agent.staging import cuda_driver, segments


class _Driver:
    """Records every driver call. The calls with state (register / unregister) are methods; any other cu*
    entry point returns the code `rc` names for it (default 0, success)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.rc: dict[str, int] = {}
        self.registered: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args: Any) -> int:
            self.calls.append(name)
            return self.rc.get(name, 0)
        return call

    def cuMemHostRegister_v2(self, ptr: int, n: int, flags: int) -> int:
        self.calls.append("cuMemHostRegister_v2")
        if ptr in self.registered:
            return 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        rc = self.rc.get("cuMemHostRegister_v2", 0)
        if rc == 0:
            self.registered.add(ptr)
        return rc

    def cuMemHostUnregister(self, ptr: int) -> int:
        self.calls.append("cuMemHostUnregister")
        if ptr not in self.registered:
            return 713  # CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        self.registered.discard(ptr)
        return 0


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[_Driver]:
    lib = _Driver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_driver, "_cuda_driver", lambda: lib)
    cuda_driver._primary_context.cache_clear()
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    yield lib
    cuda_driver._primary_context.cache_clear()


def test_pins_retain_the_primary_context_once_and_balance_every_push(driver: _Driver) -> None:
    segs = [segments.create_segment(1 << 16, "wspin") for _ in range(3)]
    assert all(isinstance(s, segments.ShmSegment) and s.pinned for s in segs)
    for s in segs:
        s.unlink()
    assert not driver.registered and all(not s.pinned for s in segs)
    assert driver.calls.count("cuDevicePrimaryCtxRetain") == 1  # once per device, never released
    assert not any("Release" in c for c in driver.calls)
    assert driver.calls.count("cuCtxPushCurrent_v2") == driver.calls.count("cuCtxPopCurrent_v2") == 6
    assert driver.calls.count("cuMemHostRegister_v2") == driver.calls.count("cuMemHostUnregister") == 3


def test_a_refused_pin_is_a_warning_and_staging_stays_pageable(driver: _Driver,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    driver.rc["cuMemHostRegister_v2"] = 1  # CUDA_ERROR_INVALID_VALUE: the kernel refused (a disk-backed file)
    with caplog.at_level(logging.WARNING, logger=segments.log.name):
        seg = segments.create_segment(1 << 16, "wspin")
    assert isinstance(seg, segments.ShmSegment) and not seg.pinned
    assert "staging.pin_failed" in caplog.text and str(segments.shm_dir()) in caplog.text
    seg.unlink()
    assert "cuMemHostUnregister" not in driver.calls  # nothing to undo
    assert driver.calls.count("cuCtxPushCurrent_v2") == driver.calls.count("cuCtxPopCurrent_v2")


def test_a_driver_without_a_device_leaves_staging_pageable(driver: _Driver) -> None:
    driver.rc["cuDeviceGet"] = 101  # CUDA_ERROR_INVALID_DEVICE
    seg = segments.create_segment(1 << 16, "wspin")
    assert not seg.pinned and "cuMemHostRegister_v2" not in driver.calls
    seg.unlink()

