"""Bucketing: the byte layout of the plan's streams. Each (source, destinations) stream of pieces is cut
into buckets greedily, in order, with buckets.entry_offset's alignment rules, and every piece gets its
offset in its bucket: the same answer as a loop over the pieces, computed with prefix sums over millions of
them. The planner (plan/build.py) decides the pieces and their order; this only lays them out."""

from __future__ import annotations

import numpy as np

from weightsync.agent.plan.buckets import SMALL_ALIGNMENT, align_up, entry_offset


def bucket_streams(nb: np.ndarray, lens: np.ndarray, bucket_bytes: int, alignment: int
                   ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Entry offsets, and buckets as (stream, seq, lo, hi, nbytes) arrays: each stream (`lens[i]`
    consecutive pieces) is packed greedily in order with buckets.entry_offset alignment, a new bucket
    starting where the next entry would not fit (exactly what a loop over the pieces would do)."""
    P, S = len(nb), len(lens)
    starts = np.cumsum(lens) - lens
    ends = starts + lens
    if alignment > SMALL_ALIGNMENT and alignment % SMALL_ALIGNMENT:
        return _greedy(nb, starts, ends, bucket_bytes, alignment)
    # Offsets as if streams had no bucket bound. In a stream whose entries all take the same alignment
    # each one starts at the previous start plus its aligned size: a prefix sum. Streams mixing entries
    # of >= alignment bytes with smaller ones (16-byte steps) take the block computation.
    small = min(alignment, SMALL_ALIGNMENT)
    step = nb + (small - 1)
    step //= small
    step *= small
    big: np.ndarray | None = None
    mixed = np.zeros(S, dtype=bool)
    if alignment > small:
        big = nb >= alignment
        nbig = np.add.reduceat(big, starts, dtype=np.int64) if S else np.zeros(0, dtype=np.int64)
        mixed = (nbig > 0) & (nbig < lens)
        if int(nbig.sum()) == P:
            step += alignment - 1
            step //= alignment
            step *= alignment
        elif nbig.any():
            bi = np.flatnonzero(big)
            step[bi] = (step[bi] + alignment - 1) // alignment * alignment
    G = np.cumsum(step)
    G -= step
    del step
    if S <= 4096:  # relative to each stream's start, in place
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            if s:
                G[s:e] -= G[s]
    else:
        G -= np.repeat(G[starts], lens)
    if mixed.any():
        assert big is not None
        ms = np.flatnonzero(mixed)
        idx = np.concatenate([np.arange(starts[i], ends[i]) for i in ms.tolist()])
        G[idx] = _block_offsets(nb[idx], big[idx], lens[ms], alignment)
    e_last = G[ends - 1] + nb[ends - 1]
    fits = e_last <= bucket_bytes
    one = np.flatnonzero(fits)
    cols: list[list[np.ndarray]] = [[one], [np.zeros(len(one), dtype=np.int64)], [starts[one]], [ends[one]],
                                    [e_last[one]]]
    extra: list[tuple[int, int, int, int, int]] = []
    for s_i in np.flatnonzero(~fits).tolist():  # streams of more than one bucket, on local arrays
        s0, e0 = int(starts[s_i]), int(ends[s_i])
        g, n = G[s0:e0].copy(), nb[s0:e0]
        L = e0 - s0
        E = g + n
        if big is not None and mixed[s_i]:
            u = (n + (SMALL_ALIGNMENT - 1)) // SMALL_ALIGNMENT * SMALL_ALIGNMENT
            U = np.cumsum(u) - u
            nxt = np.minimum.accumulate(np.where(big[s0:e0], np.arange(L), L)[::-1])[::-1]
        elif big is not None and not big[s0]:  # only small entries
            U, nxt = g, np.full(L, L)
        else:  # only aligned entries
            U, nxt = g, np.arange(L)
        UE = U + n
        s, seq = 0, 0
        while s < L:
            nbi = min(int(nxt[s]), L)
            hi = nbi
            if nbi > s:  # the small entries before the next aligned one
                hi = s + int(np.searchsorted(UE[s:nbi], bucket_bytes + U[s], side="right"))
                G[s0 + s:s0 + hi] = U[s:hi] - U[s]
            if hi == nbi and nbi < L:
                base = 0 if nbi == s else align_up(int(U[nbi] - U[s]), alignment)
                hi = nbi + int(np.searchsorted(E[nbi:], bucket_bytes - base + g[nbi], side="right"))
                G[s0 + nbi:s0 + hi] = base + g[nbi:hi] - g[nbi]
            extra.append((s_i, seq, s0 + s, s0 + hi, int(G[s0 + hi - 1] + n[hi - 1])))
            seq += 1
            s = hi
    if extra:
        for col, vals in zip(cols, np.array(extra, dtype=np.int64).T, strict=True):
            col.append(vals)
    return G, tuple(np.concatenate(c).astype(np.int64) for c in cols)


def _block_offsets(nb: np.ndarray, big: np.ndarray, lens: np.ndarray, alignment: int) -> np.ndarray:
    """Offsets within their streams (consecutive, `lens` long) of entries mixing aligned (`big`) and
    small ones: an aligned entry starts a block at an aligned offset and the small ones after it follow
    at 16-byte steps (16 divides the alignment), so a block's extent is a prefix sum."""
    P = len(nb)
    starts = np.cumsum(lens) - lens
    U = (nb + (SMALL_ALIGNMENT - 1)) // SMALL_ALIGNMENT * SMALL_ALIGNMENT
    total = int(U.sum())
    U = np.cumsum(U) - U
    head = big.copy()
    head[starts] = True
    bstart = np.flatnonzero(head)
    Ub = U[bstart]
    bal = (np.diff(Ub, append=total) + alignment - 1) // alignment * alignment
    BA = np.cumsum(bal) - bal
    first_block = np.searchsorted(bstart, starts)  # every stream starts a block
    sid = np.zeros(len(bstart), dtype=np.int64)
    sid[first_block[1:]] = 1
    np.cumsum(sid, out=sid)
    return U + np.repeat(BA - BA[first_block][sid] - Ub, np.diff(bstart, append=P))


def _greedy(nb: np.ndarray, starts: np.ndarray, ends: np.ndarray, bucket_bytes: int, alignment: int
            ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The loop bucket_streams stands for, piece by piece: for an alignment above 16 bytes that 16 does not
    divide, where its prefix sums do not apply."""
    off = np.zeros(len(nb), dtype=np.int64)
    rows: list[tuple[int, int, int, int, int]] = []
    sizes = nb.tolist()
    for s_i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        seq, lo, cur = 0, s, 0
        for i in range(s, e):
            o = entry_offset(cur, sizes[i], alignment) if i > lo else 0
            if o + sizes[i] > bucket_bytes:
                rows.append((s_i, seq, lo, i, cur))
                seq, lo, o = seq + 1, i, 0
            off[i] = o
            cur = o + sizes[i]
        rows.append((s_i, seq, lo, e, cur))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return off, tuple(np.ascontiguousarray(c) for c in arr.T)
