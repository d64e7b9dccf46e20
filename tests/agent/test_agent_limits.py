"""The connection limiter behind the agent's ports: one address cannot take every slot."""

from __future__ import annotations

import pytest

from weightsync.agent.wire.limits import ConnectionLimiter


def test_per_peer_bound_leaves_room_for_others() -> None:
    lim = ConnectionLimiter(total=10, per_peer=3)
    assert [lim.acquire("10.0.0.66") for _ in range(5)] == [True, True, True, False, False]
    assert lim.acquire("10.0.0.7") and lim.in_use == 4 and lim.refused == 2
    lim.release("10.0.0.66")
    assert lim.acquire("10.0.0.66") and not lim.acquire("10.0.0.66")


def test_total_bound_and_release() -> None:
    lim = ConnectionLimiter(total=2, per_peer=2)
    assert lim.acquire("a") and lim.acquire("b") and not lim.acquire("c")
    lim.release("a")
    lim.release("b")
    assert lim.in_use == 0 and lim.acquire("c")


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ConnectionLimiter(0, 1)
