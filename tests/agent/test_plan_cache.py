"""Plans computed once per layout (agent/plan/cache.py): a later version with the same inputs reuses the
plan on both sides; different inputs, a failed build and eviction behave."""

from __future__ import annotations

import threading

import pytest

from weightsync.agent.plan import PlanError, TensorShard, TransferPlan, build_plan
from weightsync.agent.plan.cache import PlanCache
from weightsync.agent.wire import protocol as P


def _inputs(cols: int = 8) -> tuple[list[list[TensorShard]], list[list[TensorShard]]]:
    shape = (4, cols)
    sources = [[TensorShard.of("w", "float32", shape, (0, 0), (2, cols))],
               [TensorShard.of("w", "float32", shape, (2, 0), (2, cols))]]
    needs = [[TensorShard.full("w", "float32", shape)]]
    return sources, needs


def test_same_inputs_build_once_and_give_the_same_plan() -> None:
    cache = PlanCache()
    sources, needs = _inputs()
    calls: list[int] = []

    def build() -> TransferPlan:
        calls.append(1)
        return build_plan(sources, needs, 1 << 20)

    first = cache.get_or_build(P.encode_plan_inputs(sources, needs, 1 << 20), build)
    again = cache.get_or_build(P.encode_plan_inputs(sources, needs, 1 << 20), build)
    assert again is first and len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    other = cache.get_or_build(P.encode_plan_inputs(*_inputs(cols=16), 1 << 20), lambda: build_plan(*_inputs(16), 1 << 20))
    assert other.hash != first.hash and cache.misses == 2


def test_a_failed_build_is_not_cached() -> None:
    cache = PlanCache()

    def bad() -> TransferPlan:
        raise PlanError("tensor 'w': no source holds rows 0..4")

    for _ in range(2):
        with pytest.raises(PlanError):
            cache.get_or_build(b"inputs", bad)
    assert len(cache) == 0 and cache.misses == 0


def test_least_recently_used_plan_is_evicted() -> None:
    cache = PlanCache(capacity=2)
    plans = {c: build_plan(*_inputs(c), 1 << 20) for c in (8, 16, 24)}
    for c in (8, 16):
        cache.get_or_build(str(c).encode(), lambda c=c: plans[c])
    cache.get_or_build(b"8", lambda: pytest.fail("8 is cached"))  # 8 is now the most recent
    cache.get_or_build(b"24", lambda: plans[24])                  # evicts 16
    assert len(cache) == 2
    rebuilt: list[int] = []
    cache.get_or_build(b"16", lambda: rebuilt.append(1) or plans[16])
    assert rebuilt == [1]


def test_concurrent_callers_wait_for_one_build() -> None:
    cache = PlanCache()
    sources, needs = _inputs()
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow() -> TransferPlan:
        calls.append(1)
        started.set()
        release.wait(10)
        return build_plan(sources, needs, 1 << 20)

    out: list[TransferPlan] = []
    threads = [threading.Thread(target=lambda: out.append(cache.get_or_build(b"k", slow))) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(10)
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(out) == 4 and all(p is out[0] for p in out)


def test_the_serving_side_reuses_the_plan_of_identical_inputs() -> None:
    sources, needs = _inputs(cols=40)
    payload = P.encode_plan_inputs(sources, needs, 1 << 20)
    assert P.plan_from_inputs(payload) is P.plan_from_inputs(memoryview(payload))


def test_inputs_objects_are_keyed_once_by_the_bytes_they_send() -> None:
    sources, needs = _inputs(cols=24)
    inputs = P.plan_inputs(sources, needs, 1 << 20)
    assert inputs.key == PlanCache.key(inputs.payload)  # the key the serving side computes from the bytes
    cache = PlanCache()
    first = cache.get_or_build(inputs, inputs.build)
    assert cache.get_or_build(inputs.payload, lambda: pytest.fail("built twice")) is first
    assert cache.get_or_build_key(inputs.key, lambda: pytest.fail("built twice")) is first


def test_plans_are_also_bounded_by_bytes() -> None:
    plans = {c: build_plan(*_inputs(c), 1 << 20) for c in (8, 16, 24)}
    cache = PlanCache(capacity=8, max_bytes=2 * max(p.nbytes for p in plans.values()))
    for c in (8, 16, 24):
        cache.get_or_build(str(c).encode(), lambda c=c: plans[c])
    assert len(cache) == 2  # 8 went; the newest always stays, however big
    tiny = PlanCache(max_bytes=1)
    tiny.get_or_build(b"24", lambda: plans[24])
    assert len(tiny) == 1
