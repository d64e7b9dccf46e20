"""The per-version copy of many tensors into their places (`copy_all`): the trainer's shards into staging, an
engine's bucket into its parameters.

An MoE version is tens of thousands of small tensors. Copied with one `torch._foreach_copy_` on CPU (a loop of
`copy_` calls in C++), each copy of a tensor below ATen's grain size runs on the caller's thread alone, so a
version of 16,384 tensors of 64 KiB took 0.21 s where one copy of the same bytes on two threads took 0.14 s
(bench/agent_pipeline.py --tensors 16384: the trainer was held 0.22-0.26 s against 0.11 s at 256 tensors).
Here the small tensors are split into chunks by bytes, one foreach call per chunk on up to
`torch.get_num_threads()` threads (the caller's among them): the threads the process already allows torch,
no more. Large tensors stay on the caller's thread, where ATen already splits each copy across those threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

#: a tensor of at least this many bytes is copied by ATen on all its intra-op threads already
LARGE_BYTES = 1 << 20
#: fewer small tensors than this, or fewer bytes in them, are not worth a thread hand-off (tens of microseconds)
PARALLEL_MIN_TENSORS = 256
PARALLEL_MIN_BYTES = 16 << 20
#: the most threads one copy uses (memory bandwidth, not cores, bounds it beyond a few)
MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reset_after_fork() -> None:
    """A forked child (a dataloader worker of the trainer) has none of the parent's pool threads."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_reset_after_fork)


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_THREADS - 1, thread_name_prefix="weightsync-copy")
        return _pool


def _copy_chunk(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # grad mode is per thread: a worker's copy of a parameter that requires grad must not record autograd history
    # into the staging segment, as the caller's no_grad() copy does not
    with torch.no_grad():
        torch._foreach_copy_(dsts, srcs)


#: a split of copy pairs into chunks by position, the caller's chunk first (see `split_for_threads`)
Chunks = list[list[int]]


def split_for_threads(nbytes: Sequence[int], threads: int) -> Chunks:
    """The positions of `nbytes` (each pair's size) split for `threads` threads: the first chunk (the caller's) holds
    every large tensor and the last run of small ones, each other chunk a run of small ones, of about equal bytes.
    One chunk when a split does not pay. Pure, and it depends on the sizes only: a caller that copies the same
    tensors every version keeps it."""
    threads = max(1, min(threads, MAX_THREADS))
    everything = [list(range(len(nbytes)))]
    if threads < 2 or len(nbytes) < PARALLEL_MIN_TENSORS:
        return everything
    small = [i for i, n in enumerate(nbytes) if n < LARGE_BYTES]
    small_bytes = sum(nbytes[i] for i in small)
    if len(small) < PARALLEL_MIN_TENSORS or small_bytes < PARALLEL_MIN_BYTES:
        return everything
    groups: Chunks = [[i for i, n in enumerate(nbytes) if n >= LARGE_BYTES]]
    share, acc, cur = small_bytes / threads, 0, []
    for i in small:
        cur.append(i)
        acc += nbytes[i]
        if acc >= share * len(groups) and len(groups) < threads:  # cut by cumulative bytes: chunks of equal bytes
            groups.append(cur)
            cur = []
    groups[0] += cur
    return [g for g in groups if g]


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], chunks: Chunks | None = None) -> None:
    """Every src into its dst (the dsts never overlap: staging places, an engine's parameters). CPU tensors: one
    foreach call per chunk of `chunks` (`split_for_threads` of the sizes when not given), the caller's chunk on its
    own thread. Not on CUDA: into a staging
    segment opened from the agent's CUDA IPC handle, `_foreach_copy_` left the engines with other bytes
    (bench/agent_pipeline.py --device cuda on an H200, torch 2.11: bit_exact false; the same copies one by one, and
    foreach between one process's own views, were exact). CUDA copies are asynchronous launches anyway."""
    if not dsts:
        return
    if not (all(t.is_cpu for t in dsts) and all(t.is_cpu for t in srcs)):  # is_cpu: no device object per tensor
        for d, t in zip(dsts, srcs, strict=True):
            d.copy_(t)
        return
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_all: {len(dsts)} destinations for {len(srcs)} sources")
    if chunks is None:
        threads = torch.get_num_threads()
        chunks = split_for_threads([t.nbytes for t in srcs], threads) if threads > 1 else [list(range(len(srcs)))]
    if len(chunks) == 1:
        _copy_chunk(dsts, srcs)
        return
    pool = _workers()
    futures: list[Future[None]] = [pool.submit(_copy_chunk, [dsts[i] for i in g], [srcs[i] for i in g])
                                   for g in chunks[1:]]
    error: BaseException | None = None
    try:
        _copy_chunk([dsts[i] for i in chunks[0]], [srcs[i] for i in chunks[0]])
    except BaseException as exc:
        error = exc
    for f in futures:  # every chunk is done (or failed) before the caller reads or frees the memory
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
