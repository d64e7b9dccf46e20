"""The collector's pause over per-tensor bursts (agent/gcpause.py): paused inside, resumed once the last burst
ends, never resumed when the application had disabled it, resumed on errors too."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from weightsync.agent.gcpause import collector_paused, paused_depth


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    assert paused_depth() == 0
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_resumed_after() -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_nested_bursts_resume_once_the_outermost_ends() -> None:
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_concurrent_bursts_resume_when_the_last_one_ends() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with collector_paused():
        t.start()
        assert entered.wait(10)
    assert not gc.isenabled(), "the other thread's burst still runs"
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_collector_the_application_disabled_stays_disabled() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_resumes_the_collector() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_publish_pauses_the_collector_while_it_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainerSession.publish runs its per-tensor work inside the pause (the session's agent is not needed to
    see it: the first request is where it would block)."""
    from weightsync.agent.client import TrainerSession

    seen: list[bool] = []

    def publish_paused(self: TrainerSession, weights: object, version: int, paused: object) -> None:
        seen.append(gc.isenabled())

    monkeypatch.setattr(TrainerSession, "_publish_paused", publish_paused)
    session = TrainerSession("/nonexistent.sock", rank=0)
    session.publish({}, 1)
    assert seen == [False]
    assert gc.isenabled()
