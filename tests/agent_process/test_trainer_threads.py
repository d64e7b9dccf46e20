"""A trainer rank warns when its copy into staging would run on oversubscribed intra-op threads: several ranks
per pod, each with one torch thread per core (what torchrun's OMP_NUM_THREADS=1 prevents). Measured: two such
ranks on two cores took up to 2 s instead of 0.06 s to publish 512 MiB each."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from staging_agent import serve_staging

from weightsync.agent.client import TrainerSession
from weightsync.agent.staging import places, segments
from weightsync.agent.staging.versions import StagedVersions


@pytest.fixture
def four_cores_four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


@pytest.mark.usefixtures("four_cores_four_threads")
def test_several_local_ranks_each_with_a_thread_per_core_are_oversubscribed() -> None:
    why = places.oversubscribed_threads({"LOCAL_WORLD_SIZE": "2"})
    assert why is not None and "2 local ranks x 4 intra-op threads each > 4 cores" in why
    assert "OMP_NUM_THREADS to at most 2" in why
    assert places.oversubscribed_threads({}) is None  # one rank (or a launcher that does not say)
    assert places.oversubscribed_threads({"LOCAL_WORLD_SIZE": "1"}) is None
    assert places.oversubscribed_threads({"LOCAL_WORLD_SIZE": "eight"}) is None


def test_ranks_that_share_the_cores_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert places.oversubscribed_threads({"LOCAL_WORLD_SIZE": "4"}) is None
    assert places.oversubscribed_threads({"LOCAL_WORLD_SIZE": "5"}) is not None


@pytest.mark.usefixtures("four_cores_four_threads")
def test_a_publish_of_cpu_tensors_warns_once_per_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    store = StagedVersions([0], "wstest")
    server = serve_staging(tmp_path / "agent.sock", store)
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync.agent.client"), \
                TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            for v in (1, 2):
                s.publish({"w": torch.randn(64, 16)}, version=v)
        warned = [r for r in caplog.records if "trainer.threads_oversubscribed" in r.getMessage()]
        assert len(warned) == 1 and "8 local ranks x 4 intra-op threads" in warned[0].getMessage()
        assert store.get(2) is not None  # a warning, not a refusal
    finally:
        server.close()
        store.close()
