"""The per-version copy of many tensors (agent/staging/copies.py): split across the threads torch is allowed,
every byte in its place, no autograd history, errors raised, and one chunk where a split does not pay."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.agent.staging import copies
from weightsync.agent.staging.copies import LARGE_BYTES, copy_all, split_for_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def moe_like(n_small: int, small_elems: int = 16384, n_large: int = 2) -> list[torch.Tensor]:
    """`n_small` expert-sized bf16 tensors of their own allocations plus `n_large` dense ones of 2 MiB."""
    g = torch.Generator().manual_seed(7)
    small = [torch.randn(small_elems, generator=g).to(torch.bfloat16) for _ in range(n_small)]
    large = [torch.randn(LARGE_BYTES, generator=g).to(torch.bfloat16) for _ in range(n_large)]
    return small[: n_small // 2] + large + small[n_small // 2:]


def test_split_covers_every_position_once_large_ones_with_the_caller_and_small_ones_by_equal_bytes():
    sizes = [32 << 10] * 1000 + [4 << 20, 8 << 20] + [32 << 10] * 1000
    chunks = split_for_threads(sizes, threads=4)
    assert len(chunks) == 4
    assert sorted(i for c in chunks for i in c) == list(range(len(sizes)))
    assert {1000, 1001} <= set(chunks[0])  # the large ones: ATen splits each of them across its threads already
    small_bytes = [sum(sizes[i] for i in c if sizes[i] < LARGE_BYTES) for c in chunks]
    assert max(small_bytes) - min(small_bytes) <= (32 << 10) * 2, small_bytes
    for c in chunks[1:]:  # a run each: contiguous positions, so each worker walks memory in order
        assert c == list(range(c[0], c[-1] + 1))


@pytest.mark.parametrize(("sizes", "threads"), [
    ([32 << 10] * 4000, 1),                          # torch allows one thread
    ([32 << 10] * (copies.PARALLEL_MIN_TENSORS - 1), 4),  # too few tensors for a hand-off
    ([1 << 10] * 4000, 4),                           # too few bytes (4 MiB)
    ([4 << 20] * 600, 4),                            # only large tensors: ATen's own threads copy each
])
def test_one_chunk_where_a_split_does_not_pay(sizes, threads):
    assert split_for_threads(sizes, threads) == [list(range(len(sizes)))]


def test_threads_are_capped():
    assert len(split_for_threads([64 << 10] * 4096, threads=64)) == copies.MAX_THREADS


def test_copy_all_on_two_threads_is_bit_exact_and_uses_a_worker(two_threads, monkeypatch):
    srcs = moe_like(600)
    flat = torch.zeros(sum(t.numel() for t in srcs), dtype=torch.bfloat16)
    dsts = list(flat.split([t.numel() for t in srcs]))
    ran_on: set[str] = set()
    real = copies._copy_chunk

    def spy(d, s):
        ran_on.add(threading.current_thread().name)
        real(d, s)

    monkeypatch.setattr(copies, "_copy_chunk", spy)
    copy_all(dsts, srcs)
    assert len(ran_on) == 2 and any(n.startswith("weightsync-copy") for n in ran_on), ran_on
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d.view(torch.int16), s.view(torch.int16))


def test_given_chunks_are_used_as_given(two_threads, monkeypatch):
    """A caller that keeps its split (StagingLayout.chunks) gets exactly that split, not one made again."""
    srcs = moe_like(600)
    dsts = [torch.zeros_like(t) for t in srcs]
    chunks = [list(range(len(srcs) - 7)), list(range(len(srcs) - 7, len(srcs)))]  # uneven: not split_for_threads
    made = split_for_threads([t.nbytes for t in srcs], 2)
    assert sorted(len(c) for c in chunks) != sorted(len(c) for c in made)
    sizes: list[int] = []
    real = copies._copy_chunk

    def spy(d, s):
        sizes.append(len(s))
        real(d, s)

    monkeypatch.setattr(copies, "_copy_chunk", spy)
    copy_all(dsts, srcs, chunks)
    assert sorted(sizes) == sorted(len(c) for c in chunks)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_a_worker_copies_a_parameter_without_autograd_history(two_threads):
    """Grad mode is per thread: the caller's no_grad() must hold in the workers too, or the staging segment
    would be rebased onto the parameters' graph (and keep them alive)."""
    srcs = [t.float().requires_grad_() for t in moe_like(600, n_large=0)]
    flat = torch.zeros(sum(t.numel() for t in srcs))
    dsts = list(flat.split([t.numel() for t in srcs]))
    with torch.no_grad():
        copy_all(dsts, srcs)
    assert not flat.requires_grad and flat.grad_fn is None
    assert all(not d.requires_grad for d in dsts)
    assert torch.equal(flat, torch.cat([s.detach() for s in srcs]))


def test_a_failing_chunk_raises_after_every_chunk_finished(two_threads):
    srcs = moe_like(600, n_large=0)
    dsts = [torch.zeros_like(t) for t in srcs]
    dsts[0] = torch.zeros(3, dtype=torch.bfloat16)  # the shapes cannot broadcast
    chunks = split_for_threads([t.nbytes for t in srcs], 2)
    assert 0 in chunks[1]  # the first run is a worker's, the last one the caller's
    with pytest.raises(RuntimeError):
        copy_all(dsts, srcs, chunks)
    assert torch.equal(dsts[-1], srcs[-1])  # the caller's chunk was copied, and raised only after the worker's


def test_mismatched_lists_are_refused():
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        copy_all([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
