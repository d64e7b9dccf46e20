"""The vectorized planner, the body of `build_plan` (the bulk of the plan code): every source box intersected
with every destination box, owners, splits, streams (laid out in buckets by plan/bucketing.py), the hash."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import numpy as np

from weightsync.agent.plan.bucketing import bucket_streams
from weightsync.agent.plan.buckets import itemsize
from weightsync.agent.plan.result import BucketPlan, TransferPlan, _Core, _Entries, _Ranks
from weightsync.agent.plan.table import _I32_MAX, ShardTable
from weightsync.agent.plan.types import PLAN_FORMAT, Box, PlanError


class _Columns:
    """Output columns of the pieces (tensor id, dim-major offset and shape), grown as blocks arrive: the
    blocks are computed in place here, so nothing is copied to join them."""

    def __init__(self, dims: int, cdt: Any, bound: int) -> None:
        self.bound = bound  # no more pieces than (source rank, destination, tensor) cells
        self.used = 0
        cap = bound if bound <= 1 << 28 else 1 << 24  # untouched capacity costs address space, not memory
        self.t = np.empty(cap, dtype=np.int32)
        self.off = np.empty((dims, cap), dtype=cdt)
        self.shp = np.empty((dims, cap), dtype=cdt)

    def reserve(self, n: int) -> int:
        """Room for n more cells after the used ones; returns where they start."""
        need = self.used + n
        if need > len(self.t):
            cap = min(self.bound, max(need, 2 * len(self.t)))
            for name in ("t", "off", "shp"):
                old = getattr(self, name)
                new = np.empty((*old.shape[:-1], cap), dtype=old.dtype)
                new[..., : self.used] = old[..., : self.used]
                setattr(self, name, new)
        return self.used


_CHUNK = 1 << 22  # (source rank, destination, tensor) cells per intersection block: ~16 MiB per int32 array


def _first_rank(table: ShardTable, t: int) -> int:
    return table.rank_of(int(np.argmax(table.tensor == t)))


def _check_same_model(S: ShardTable, N: ShardTable, n2s: np.ndarray) -> None:
    common = np.flatnonzero(n2s >= 0)
    if not common.size:
        return
    s_ids = n2s[common]
    bad = (S.ndim[s_ids] != N.ndim[common]) | (S.gshape[s_ids] != N.gshape[common]).any(axis=1)
    bad |= np.array([S.dtypes[a] != N.dtypes[b] for a, b in zip(s_ids.tolist(), common.tolist(), strict=True)])
    if bad.any():
        j = int(np.argmax(bad))
        tn, ts = int(common[j]), int(s_ids[j])
        raise PlanError(
            f"tensor {N.names[tn]!r}: source rank {_first_rank(S, ts)} says {S.dtypes[ts]}{list(S.global_shape(ts))} "
            f"but destination rank {_first_rank(N, tn)} says {N.dtypes[tn]}{list(N.global_shape(tn))}; trainer "
            "and inference must describe the same model"
        )


def _all_dims(a: np.ndarray) -> np.ndarray:
    """[dims, ...] -> whether every dim is > 0 (a loop over the few dims beats a reduction over them)."""
    out = a[0] > 0
    for k in range(1, len(a)):
        out &= a[k] > 0
    return out


def _precedes(aoff: np.ndarray, ashp: np.ndarray, boff: np.ndarray, bshp: np.ndarray) -> np.ndarray:
    """[dims, ...] boxes: whether box a lies wholly before box b along the first dim in which their
    extents differ. A chain of such boxes is pairwise disjoint (FSDP chunks and TP x FSDP grids in rank
    order are such chains)."""
    out = np.zeros(aoff.shape[1:], dtype=bool)
    same = np.ones(aoff.shape[1:], dtype=bool)
    for k in range(len(aoff)):
        ao, bo = aoff[k], boff[k]
        diff = (ao != bo) | (ashp[k] != bshp[k])
        out |= same & diff & (ao + ashp[k] <= bo)
        same &= ~diff
    return out


def _owners(S: ShardTable, soff: np.ndarray, sshp: np.ndarray, ne: np.ndarray) -> np.ndarray:
    """[ranks, tensors]: whether a rank sends its box of a tensor. Every distinct non-empty box has one
    owner, rotated over its replicas by a counter running over (tensor name, box) in sorted order; a
    PlanError if two distinct boxes of a tensor overlap."""
    R, T = ne.shape
    owned = ne.copy()
    if R < 2 or T == 0:
        return owned
    # Fast path: in rank order, each box precedes the next one (no gaps, replicas or overlaps).
    gap = (~ne[:-1] & ne[1:]).any(axis=0)
    chain = _precedes(soff[:, :-1], sshp[:, :-1], soff[:, 1:], sshp[:, 1:])
    hard = np.flatnonzero(gap | (ne[:-1] & ne[1:] & ~chain).any(axis=0))
    if hard.size:
        _owners_sorted(S, soff, sshp, ne, owned, hard)
    return owned


def _owners_sorted(S: ShardTable, soff: np.ndarray, sshp: np.ndarray, ne: np.ndarray, owned: np.ndarray,
                   hard: np.ndarray) -> None:
    r_idx, h_idx = np.nonzero(ne[:, hard])
    t_idx = hard[h_idx]
    off, shp = soff[:, r_idx, t_idx], sshp[:, r_idx, t_idx]
    order = np.lexsort([r_idx, *shp[::-1], *off[::-1], t_idx])  # Box order within a tensor, replicas by rank
    r_idx, t_idx, off, shp = r_idx[order], t_idx[order], off[:, order], shp[:, order]
    dup = (t_idx[1:] == t_idx[:-1]) & (off[:, 1:] == off[:, :-1]).all(axis=0) & (shp[:, 1:] == shp[:, :-1]).all(axis=0)
    starts = np.flatnonzero(np.concatenate([[True], ~dup]))  # first row of each distinct box
    a, b = starts[:-1], starts[1:]
    suspect = (t_idx[a] == t_idx[b]) & ~_precedes(off[:, a], shp[:, a], off[:, b], shp[:, b])
    run_end = np.concatenate([starts[1:], [len(r_idx)]])
    for t in np.unique(t_idx[b][suspect]).tolist():
        k = np.flatnonzero(t_idx[starts] == t)
        ranks = [r_idx[i:j].tolist() for i, j in zip(starts[k].tolist(), run_end[k].tolist(), strict=True)]
        _raise_overlap(S, t, off[:, starts[k]], shp[:, starts[k]], ranks)
    box_t = t_idx[starts]
    counts = ne.sum(axis=0)
    counts[hard] = 0
    counts += np.bincount(box_t, minlength=len(counts))
    before = np.cumsum(counts) - counts
    local = np.arange(len(starts)) - np.searchsorted(box_t, box_t, side="left")
    owner = starts + (before[box_t] + local) % (run_end - starts)
    owned[:, hard] = False
    owned[r_idx[owner], box_t] = True


def _raise_overlap(S: ShardTable, t: int, off: np.ndarray, shp: np.ndarray, ranks: list[list[int]]) -> None:
    """Raise the PlanError for the first overlapping pair of distinct boxes (in Box order), if any."""
    n = off.shape[1]
    hit = np.ones((n, n), dtype=bool)
    for k in range(len(off)):
        end = off[k] + shp[k]
        hit &= np.maximum(off[k][:, None], off[k][None]) < np.minimum(end[:, None], end[None])
    hit = np.triu(hit, k=1)
    if not hit.any():
        return  # disjoint, just not in an order the fast test recognises
    i, j = (int(x) for x in np.argwhere(hit)[0])
    nd = int(S.ndim[t])
    a = Box(tuple(off[:nd, i].tolist()), tuple(shp[:nd, i].tolist()))
    b = Box(tuple(off[:nd, j].tolist()), tuple(shp[:nd, j].tolist()))
    raise PlanError(f"tensor {S.names[t]!r}: source boxes {a} (ranks {ranks[i]}) and {b} (ranks {ranks[j]}) overlap "
                    "without being identical; shards must be disjoint or replicas")


def _merge_broadcast(src: np.ndarray, d: np.ndarray, t: np.ndarray, off: np.ndarray, shp: np.ndarray, Dn: int
                     ) -> tuple[tuple[np.ndarray, ...], list[tuple[int, ...]]]:
    """Pairs (source, destination, tensor, box) of tensors whose needs overlap -> pieces: the pairs of
    one (source, tensor) with equal intersections become one piece for all their destinations. Returns
    (src, group, tensor, off, shp) per piece, group indexing the returned destination tuples."""
    # The pairs come grouped by (source, tensor), destinations ascending within a group.
    idx = np.arange(len(src))
    is_first = np.concatenate([[True], (src[1:] != src[:-1]) | (t[1:] != t[:-1])])
    first = np.flatnonzero(is_first)[np.cumsum(is_first) - 1]
    rep = idx.copy()
    for k in range(1, Dn):  # a (source, tensor) has one pair per destination at most
        cand = np.flatnonzero(idx - k >= first)
        if not cand.size:
            break
        j = cand - k
        same = (off[:, j] == off[:, cand]).all(axis=0) & (shp[:, j] == shp[:, cand]).all(axis=0)
        rep[cand[same]] = j[same]  # the earliest equal pair wins (k grows)
    is_head = rep == idx
    heads = np.flatnonzero(is_head)
    slot = (np.cumsum(is_head) - 1)[rep]
    if Dn <= 52:  # destination sets as bit masks (exact in float64)
        masks = np.bincount(slot, weights=np.ldexp(1.0, d), minlength=len(heads)).astype(np.int64)
        if Dn <= 16:  # few possible sets: count them instead of sorting
            present = np.flatnonzero(np.bincount(masks, minlength=1 << Dn))
            where = np.zeros(1 << Dn, dtype=np.int64)
            where[present] = np.arange(len(present))
            uniq, grp = present, where[masks]
        else:
            uniq, inv = np.unique(masks, return_inverse=True)
            grp = inv.reshape(-1)
        tuples = [tuple(i for i in range(Dn) if int(m) >> i & 1) for m in uniq.tolist()]
    else:
        members: list[list[int]] = [[] for _ in heads]
        for s, dd in zip(slot.tolist(), d.tolist(), strict=True):
            members[s].append(dd)
        ids: dict[tuple[int, ...], int] = {}
        grp = np.array([ids.setdefault(tuple(m), len(ids)) for m in members], dtype=np.int64)
        tuples = list(ids)
    return (src[heads], grp, t[heads], off[:, heads], shp[:, heads]), tuples


def _merge_streams(a: tuple[np.ndarray, np.ndarray, np.ndarray], astream: np.ndarray, alen: np.ndarray,
                   b: tuple[np.ndarray, ...], b_grank: np.ndarray, ng: int, Ts: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Insert the broadcast-merged pieces `b` (src, group, tensor, off, shp) into the stream-ordered
    single-destination pieces `a` (tensor, off, shp; streams `astream` of `alen` pieces). A piece goes
    where its (stream, tensor) key sorts; the pieces of one insertion point are copied as one run, so
    whole broadcast streams between single-destination ones cost a few copies."""
    ten, off, shp = a
    bsrc, bg, bt, boff, bshp = b
    bstream = bsrc.astype(np.int64) * ng + b_grank[bg]
    key = bstream * Ts + bt
    if len(key) > 1 and (key[1:] < key[:-1]).any():
        ob = np.argsort(key, kind="stable")
        bstream, bt, boff, bshp = bstream[ob], bt[ob], boff[:, ob], bshp[:, ob]
    del key
    astart = np.cumsum(alen) - alen
    # where each broadcast piece goes among the others: before every stream of a higher key, and within
    # a stream of its own key (a single destination) before the pieces of higher tensor ids
    si = np.searchsorted(astream, bstream)
    ins = np.where(si < len(astream), astart[np.minimum(si, len(astream) - 1)], len(ten)) if len(astream) else \
        np.zeros(len(bt), dtype=np.int64)
    own = np.flatnonzero((si < len(astream)) & (astream[np.minimum(si, max(len(astream) - 1, 0))] == bstream)) \
        if len(astream) else np.zeros(0, dtype=np.int64)
    for i in own.tolist():  # rare: a shared tensor that is not broadcast to this destination
        s = int(si[i])
        lo, hi = int(astart[s]), int(astart[s] + alen[s])
        ins[i] = lo + int(np.searchsorted(ten[lo:hi], bt[i]))
    cuts = np.flatnonzero(np.diff(ins, prepend=-1, append=len(ten) + 1))  # runs of one insertion point
    P = len(ten) + len(bt)
    out_t = np.empty(P, dtype=ten.dtype)
    out_o = np.empty((off.shape[0], P), dtype=off.dtype)
    out_s = np.empty((off.shape[0], P), dtype=off.dtype)
    pos = a_pos = 0
    for r0, r1 in itertools.pairwise(cuts.tolist()):
        at = int(ins[r0])
        n = at - a_pos  # single-destination pieces before this run
        out_t[pos:pos + n], out_o[:, pos:pos + n], out_s[:, pos:pos + n] = ten[a_pos:at], off[:, a_pos:at], shp[:, a_pos:at]
        pos, a_pos = pos + n, at
        n = r1 - r0
        out_t[pos:pos + n], out_o[:, pos:pos + n], out_s[:, pos:pos + n] = bt[r0:r1], boff[:, r0:r1], bshp[:, r0:r1]
        pos += n
    n = len(ten) - a_pos
    out_t[pos:], out_o[:, pos:], out_s[:, pos:] = ten[a_pos:], off[:, a_pos:], shp[:, a_pos:]
    bs_ids, bs_len = np.unique(bstream, return_counts=True)
    streams, inv = np.unique(np.concatenate([astream, bs_ids]), return_inverse=True)
    lens = np.bincount(inv, weights=np.concatenate([alen, bs_len]), minlength=len(streams)).astype(np.int64)
    return out_t, out_o, out_s, streams // ng, streams % ng, lens


def _split(t: np.ndarray, off: np.ndarray, shp: np.ndarray, big: np.ndarray, mx: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split pieces `big` (of more than mx elements each) into row-major consecutive sub-boxes as
    Box.split does, in place of the piece. Returns (t, off, shp, pieces per original piece)."""
    D, P = shp.shape
    so, ss = off[:, big].astype(np.int64), shp[:, big].astype(np.int64)
    n = len(big)
    suf = np.ones((D, n), dtype=np.int64)  # suf[k] = prod(ss[k+1:])
    for k in range(D - 2, -1, -1):
        suf[k] = suf[k + 1] * ss[k + 1]
    rows = np.arange(n)
    dd = np.argmax(suf <= mx[None, :], axis=0)  # the first dim whose trailing block fits
    step = np.maximum(1, mx // suf[dd, rows])
    pre = np.ones((D + 1, n), dtype=np.int64)
    pre[1:] = np.cumprod(ss, axis=0)
    nch = -(-ss[dd, rows] // step)
    cnt = pre[dd, rows] * nch
    counts = np.ones(P, dtype=np.int64)
    counts[big] = cnt
    rep = np.repeat(np.arange(P), counts)
    t2, off2, shp2 = t[rep], off[:, rep], shp[:, rep]
    js = np.repeat(rows, cnt)
    q = np.arange(len(js)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    c, prefix = q % nch[js], q // nch[js]
    new_off, new_shp, djs = so[:, js], ss[:, js], dd[js]
    for k in range(D - 1, -1, -1):  # unravel the prefix over the dims before the split dim
        inside = k < djs
        sk = ss[k, js]
        new_off[k] += np.where(inside, prefix % sk, 0)
        prefix = np.where(inside, prefix // sk, prefix)
        new_shp[k] = np.where(inside, 1, sk)
    r2 = np.arange(len(js))
    st = step[js]
    new_off[djs, r2] = so[djs, js] + c * st
    new_shp[djs, r2] = np.minimum(st, ss[djs, js] - c * st)
    pos = np.repeat((np.cumsum(counts) - counts)[big], cnt) + q
    off2[:, pos] = new_off
    shp2[:, pos] = new_shp
    return t2, off2, shp2, counts


def _whole_first(ten: np.ndarray, numel: np.ndarray, sshp: np.ndarray, s_src: np.ndarray, s_grp: np.ndarray,
                 s_len: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """Split every (source, group) stream in two: the pieces that are their source rank's whole shard,
    then the others (pieces of a shard: strided in the source's memory). Each part is packed into
    buckets of its own, so a bucket of whole shards lies in the source's staging exactly like the bucket
    (TransferPlan.arena) and is sent from there, instead of being packed because one piece in it is not.
    A piece lies within its source's box, so it is the whole shard when it has as many elements.
    Returns (piece order or None when unchanged, stream sources, groups, lengths)."""
    R, Ts = sshp.shape[1], sshp.shape[2]
    src_numel = sshp[0].astype(np.int64)
    for k in range(1, len(sshp)):
        src_numel *= sshp[k]
    flat = np.repeat(s_src.astype(np.int64) * Ts, s_len)
    flat += ten
    part = src_numel.reshape(R * Ts).take(flat) != numel  # True: not the source's whole shard
    del flat, src_numel
    if not part.any() or part.all():
        return None, s_src, s_grp, s_len
    key = np.repeat(np.arange(len(s_len), dtype=np.int64) * 2, s_len)
    key += part
    order = np.argsort(key, kind="stable") if (key[1:] < key[:-1]).any() else None
    counts = np.bincount(key, minlength=2 * len(s_len))
    keep = counts > 0
    return order, np.repeat(s_src, 2)[keep], np.repeat(s_grp, 2)[keep], counts[keep].astype(np.int64)


def _plan(S0: ShardTable, N0: ShardTable, bucket_bytes: int, alignment: int) -> TransferPlan:
    D = max(S0.ndim_max, N0.ndim_max)
    S, N = S0.padded(D), N0.padded(D)
    R, Ts, Dn = S.num_ranks, len(S.names), N.num_ranks
    sidx = S.index
    n2s = np.array([sidx.get(n, -1) for n in N.names], dtype=np.int64)
    _check_same_model(S, N, n2s)
    cdt = np.int64 if np.int64 in (S.cdt, N.cdt) else np.int32

    soff, sshp, _ = S.dense  # [dims, ranks, tensors]
    ne = _all_dims(sshp)
    owned = _owners(S, soff, sshp, ne)
    has_src: np.ndarray = np.any(ne, axis=0)

    # Needs, re-indexed by source tensor id: [dims, destinations, tensors].
    noff_n, nshp_n, _ = N.dense
    known = n2s >= 0
    src_ok = np.zeros(len(N.names), dtype=bool)
    src_ok[known] = has_src[n2s[known]]
    missing = _all_dims(nshp_n) & ~src_ok[None, :]
    noff = np.zeros((D, Dn, Ts), dtype=cdt)
    nshp = np.zeros((D, Dn, Ts), dtype=cdt)
    noff[:, :, n2s[known]] = noff_n[:, :, known]
    nshp[:, :, n2s[known]] = nshp_n[:, :, known]
    need = _all_dims(nshp) & has_src[None, :]
    nend = noff + nshp

    # Tensors whose needs overlap between destinations may give broadcast pieces; the others never do.
    shared = np.zeros(Ts, dtype=bool)
    for d1 in range(Dn):
        for d2 in range(d1 + 1, Dn):
            both = need[d1] & need[d2]
            if both.any():
                for k in range(D):
                    both &= np.maximum(noff[k, d1], noff[k, d2]) < np.minimum(nend[k, d1], nend[k, d2])
                shared |= both
    any_shared = bool(shared.any())

    # Every owned source box against every need, a block of source ranks at a time, separately for the
    # tensors whose needs are disjoint (each piece goes to one destination) and the shared ones. The
    # former come out in (source, destination, tensor) order: the plan's order, so a stream is one
    # (source, destination) row of a block and its length is a count. They are computed straight into
    # the output columns and compacted there when some cells are not pieces.
    numel_max = int(np.prod(S.gshape.astype(np.float64), axis=1).max()) if Ts else 0
    vdt = np.int32 if numel_max <= _I32_MAX else np.int64  # an intersection never exceeds its tensor
    cov = np.zeros((Dn, Ts), dtype=np.int64)
    needed = need.any(axis=0)
    cols_a = np.flatnonzero(needed & ~shared).astype(np.int32)
    lens: list[np.ndarray] = []
    parts_b: list[tuple[np.ndarray, ...]] = []

    def columns(cols: np.ndarray) -> tuple[np.ndarray, ...]:
        if len(cols) == Ts:
            return soff, sshp, owned, noff, nend, need
        return soff[:, :, cols], sshp[:, :, cols], owned[:, cols], noff[:, :, cols], nend[:, :, cols], need[:, cols]

    def block(arrays: tuple[np.ndarray, ...], r0: int, r1: int, ok: np.ndarray, gt: np.ndarray, vol: np.ndarray,
              los: list[np.ndarray], exts: list[np.ndarray]) -> bool:
        """Intersect source ranks r0:r1 with every need into los/exts; ok: the cells that are pieces,
        vol: their element counts. False when no cell can be one."""
        so_, ss_, ow_, no_, ne_, nd_ = arrays
        np.logical_and(ow_[r0:r1, None, :], nd_[None], out=ok)
        if not ok.any():
            return False
        for k in range(D):
            so = so_[k, r0:r1, None, :]
            np.maximum(so, no_[k, None], out=los[k])
            np.minimum(so + ss_[k, r0:r1, None, :], ne_[k, None], out=exts[k])
            exts[k] -= los[k]
            np.greater(exts[k], 0, out=gt)
            ok &= gt
        np.multiply(exts[0], ok, out=vol, dtype=vdt)
        for e in exts[1:]:
            np.multiply(vol, e, out=vol, dtype=vdt)
        return True

    Ta = len(cols_a)
    out = _Columns(D, cdt, R * Dn * Ta)
    if Ta:
        arrays = columns(cols_a)
        step = max(1, _CHUNK // max(1, Dn * Ta))
        ok_buf, gt_buf, vol_buf = (np.empty(step * Dn * Ta, dtype=dt) for dt in (bool, bool, vdt))
        cov_a = np.zeros((Dn, Ta), dtype=np.int64)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            shape = (r1 - r0, Dn, Ta)
            cells = shape[0] * Dn * Ta
            ok, gt, vol = (b[:cells].reshape(shape) for b in (ok_buf, gt_buf, vol_buf))
            pos = out.reserve(cells)
            los = [out.off[k, pos:pos + cells].reshape(shape) for k in range(D)]
            exts = [out.shp[k, pos:pos + cells].reshape(shape) for k in range(D)]
            if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                lens.append(np.zeros(shape[0] * Dn, dtype=np.int64))
                continue
            cov_a += vol.sum(axis=0, dtype=np.int64)
            counts = ok.sum(axis=2)
            lens.append(counts.reshape(-1))
            hits = int(counts.sum())
            out.t[pos:pos + cells].reshape(-1, Ta)[:] = cols_a
            if hits < cells:  # keep the cells that are pieces, in order
                flat = ok.reshape(-1)
                for col in (out.t, *out.off, *out.shp):
                    col[pos:pos + hits] = col[pos:pos + cells][flat]
            out.used = pos + hits
        cov[:, cols_a] = cov_a
        del arrays, ok_buf, gt_buf, vol_buf
    else:
        lens.append(np.zeros(R * Dn, dtype=np.int64))
    # Shared tensors whose needing destinations all need the same box (replicated: norms, biases) give
    # one piece per owned source box, for all of them: one pseudo-destination, nothing to merge.
    repl_pieces: list[tuple[np.ndarray, ...]] = []
    if any_shared:
        cols_s = np.flatnonzero(shared)
        first_d = np.argmax(need[:, cols_s], axis=0)
        same = np.ones(len(cols_s), dtype=bool)
        for k in range(D):
            ref_o, ref_s = noff[k, first_d, cols_s], nshp[k, first_d, cols_s]
            same &= ((noff[k][:, cols_s] == ref_o) & (nshp[k][:, cols_s] == ref_s) | ~need[:, cols_s]).all(axis=0)
        cols_r = cols_s[same].astype(np.int32)
        shared[cols_r] = False
        any_shared = bool(shared.any())
        if len(cols_r):
            fr = first_d[same]
            arrays = (soff[:, :, cols_r], sshp[:, :, cols_r], owned[:, cols_r], noff[:, fr, cols_r][:, None],
                      nend[:, fr, cols_r][:, None], np.ones((1, len(cols_r)), dtype=bool))
            Tr = len(cols_r)
            step = max(1, _CHUNK // Tr)
            cov_r = np.zeros(Tr, dtype=np.int64)
            for r0 in range(0, R, step):
                r1 = min(R, r0 + step)
                shape = (r1 - r0, 1, Tr)
                ok, gt, vol = np.empty(shape, dtype=bool), np.empty(shape, dtype=bool), np.empty(shape, dtype=vdt)
                los = [np.empty(shape, dtype=cdt) for _ in range(D)]
                exts = [np.empty(shape, dtype=cdt) for _ in range(D)]
                if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                    continue
                cov_r += vol.sum(axis=(0, 1), dtype=np.int64)
                bc, _, bt = np.nonzero(ok)
                repl_pieces.append(((bc + r0).astype(np.int32), cols_r[bt], np.stack([x[ok] for x in los]),
                                    np.stack([x[ok] for x in exts])))
            cov[:, cols_r] = np.where(need[:, cols_r], cov_r[None, :], 0)
            del arrays
    if any_shared:  # pairs in (source, tensor, destination) order, merged into broadcast pieces below
        cols_b = np.flatnonzero(shared).astype(np.int32)
        arrays, Tb = columns(cols_b), len(cols_b)
        step = max(1, _CHUNK // max(1, Dn * Tb))
        cov_b = np.zeros((Dn, Tb), dtype=np.int64)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            shape = (r1 - r0, Dn, Tb)
            ok, gt, vol = np.empty(shape, dtype=bool), np.empty(shape, dtype=bool), np.empty(shape, dtype=vdt)
            los = [np.empty(shape, dtype=cdt) for _ in range(D)]
            exts = [np.empty(shape, dtype=cdt) for _ in range(D)]
            if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                continue
            cov_b += vol.sum(axis=0, dtype=np.int64)
            m = ok.transpose(0, 2, 1)
            bc, bt, bd = np.nonzero(m)
            parts_b.append(((bc + r0).astype(np.int32), bd.astype(np.int32), cols_b[bt],
                            np.stack([x.transpose(0, 2, 1)[m] for x in los]),
                            np.stack([x.transpose(0, 2, 1)[m] for x in exts])))
        cov[:, cols_b] = cov_b
        del arrays

    need_vol = np.ones((Dn, Ts), dtype=np.int64)
    for k in range(D):
        need_vol *= nshp[k]
    need_vol *= need
    short = need & (cov != need_vol)
    if short.any():
        di, ti = (int(x) for x in np.argwhere(short)[0])
        nd = int(S.ndim[ti])
        raise PlanError(
            f"tensor {S.names[ti]!r}: destination rank {di} needs offset={tuple(noff[:nd, di, ti].tolist())} "
            f"shape={tuple(nshp[:nd, di, ti].tolist())} but the sources hold only {int(cov[di, ti])} of its "
            f"{int(need_vol[di, ti])} elements"
        )
    if missing.any():
        ds, tn = np.nonzero(missing)
        items = [f"{N.names[t]!r} (destination rank {d})" for d, t in zip(ds[:5].tolist(), tn[:5].tolist(), strict=True)]
        more = f" and {len(ds) - 5} more" if len(ds) > 5 else ""
        raise PlanError(f"no source rank holds {', '.join(items)}{more}; check names and tied embeddings")
    isz = np.array([itemsize(dt) for dt in S.dtypes], dtype=np.int64)
    mx = bucket_bytes // np.maximum(isz, 1)
    tiny = need & (mx < 1)[None, :]
    if tiny.any():
        ti = int(np.argwhere(tiny)[0][1])
        raise PlanError(f"bucket_bytes={bucket_bytes} is smaller than one element of {S.names[ti]!r} ({S.dtypes[ti]})")

    P = out.used
    ten, off, shp = out.t[:P], out.off[:, :P], out.shp[:, :P]
    del out
    lens_a = np.concatenate(lens) if lens else np.zeros(0, dtype=np.int64)
    sid = np.flatnonzero(lens_a)
    s_len = lens_a[sid].astype(np.int64)

    # Destination groups in tuple order; a stream is (source, group) and streams are in that order.
    groups: set[tuple[int, ...]] = {(d,) for d in range(Dn)}
    b_pieces: tuple[np.ndarray, ...] | None = None
    b_tuples: list[tuple[int, ...]] = []
    if parts_b:
        bs_, bd_, bt_, bo_, bh_ = (np.concatenate(c, axis=-1) for c in zip(*parts_b, strict=True))
        parts_b.clear()
        b_pieces, b_tuples = _merge_broadcast(bs_, bd_, bt_, bo_, bh_, Dn)
    if repl_pieces:  # the group of a replicated tensor's pieces: every destination that needs it
        rs_, rt_, ro_, rh_ = (np.concatenate(c, axis=-1) for c in zip(*repl_pieces, strict=True))
        repl_pieces.clear()
        rts = np.unique(rt_)
        if Dn <= 62:  # destination sets as bit masks: a tuple per distinct set, not per tensor
            bits = (need[:, rts].astype(np.int64) << np.arange(Dn, dtype=np.int64)[:, None]).sum(axis=0)
            umask, inv = np.unique(bits, return_inverse=True)
            sets = [tuple(i for i in range(Dn) if m >> i & 1) for m in umask.tolist()]
        else:
            per_t = [tuple(np.flatnonzero(need[:, t]).tolist()) for t in rts.tolist()]
            sets = sorted(set(per_t))
            inv = np.array([sets.index(s) for s in per_t], dtype=np.int64)
        gidx = {g: i for i, g in enumerate(b_tuples)}
        for g in sorted(set(sets) - set(gidx)):
            gidx[g] = len(b_tuples)
            b_tuples.append(g)
        gid = np.zeros(Ts, dtype=np.int64)
        gid[rts] = np.array([gidx[s] for s in sets], dtype=np.int64)[inv.reshape(-1)]
        rg_ = gid[rt_]
        b_pieces = (rs_, rg_, rt_, ro_, rh_) if b_pieces is None else tuple(
            np.concatenate([x, y], axis=-1) for x, y in zip(b_pieces, (rs_, rg_, rt_, ro_, rh_), strict=True))
    groups.update(b_tuples)
    ordered = sorted(groups)
    grank = {g: i for i, g in enumerate(ordered)}
    ng = len(ordered)
    single = np.array([grank[(d,)] for d in range(Dn)], dtype=np.int64)
    s_src, s_grp = sid // max(Dn, 1), single[sid % max(Dn, 1)] if Dn else sid
    if b_pieces is not None:
        ten, off, shp, s_src, s_grp, s_len = _merge_streams(
            (ten, off, shp), s_src * ng + s_grp, s_len, b_pieces, np.array([grank[g] for g in b_tuples]), ng, Ts)
        P = len(ten)

    # Sizes; pieces bigger than a bucket are split in place.
    numel = shp[0].astype(np.int64)
    for k in range(1, D):
        numel *= shp[k]
    if P and int(numel.max()) > int(mx.min()):
        big = np.flatnonzero(numel > mx[ten])
        if big.size:
            ten, off, shp, counts = _split(ten, off, shp, big, mx[ten[big]])
            s_len = np.add.reduceat(counts, np.cumsum(s_len) - s_len)
            P = len(ten)
            numel = shp[0].astype(np.int64)
            for k in range(1, D):
                numel *= shp[k]
    if P:
        order, s_src, s_grp, s_len = _whole_first(ten, numel, sshp, s_src, s_grp, s_len)
        if order is not None:
            ten, off, shp, numel = ten[order], off[:, order], shp[:, order], numel[order]
    nb = numel
    nb *= int(isz[0]) if len(isz) and (isz == isz[0]).all() else isz[ten]

    if P:
        entry, (bs, bq, blo, bhi, bnb) = bucket_streams(nb, s_len, bucket_bytes, alignment)
        b_data = np.add.reduceat(nb, blo[np.argsort(blo)]) if len(blo) else blo
        b_data = b_data[np.argsort(np.argsort(blo))]
    else:
        entry = np.zeros(0, dtype=np.int64)
        bs = bq = blo = bhi = bnb = b_data = np.zeros(0, dtype=np.int64)
    del nb, numel
    order = np.lexsort((bs, bq))  # round-robin: every stream's first bucket, then every second one, ...
    bs, blo, bhi, bnb, b_data = bs[order], blo[order], bhi[order], bnb[order], b_data[order]
    b_src, b_grp = s_src[bs], s_grp[bs]

    core = _Core(S, ordered, ten, off, shp, entry, b_src, b_grp, blo, bhi, bnb, b_data)
    h = _hash(S0, N0, core, bucket_bytes, alignment, D)
    buckets = tuple(BucketPlan(i, s, ordered[g], _Entries(core, i), n)
                    for i, (s, g, n) in enumerate(zip(b_src.tolist(), b_grp.tolist(), bnb.tolist(), strict=True)))
    return TransferPlan(_Ranks(S0), _Ranks(N0), buckets, bucket_bytes, alignment, h, core)


def _hash(S: ShardTable, N: ShardTable, core: _Core, bucket_bytes: int, alignment: int, D: int) -> str:
    """SHA-256 over everything that decides which byte goes where: both sides' tables, the destination
    groups, the bucket table, and the per-piece columns (tensor, box, offset in the bucket). The piece
    columns (tens of millions of rows) enter through their XXH3-128 digests: this is a consistency check
    between agents computing the same function, not a MAC, and SHA-256 over a gigabyte takes a second."""
    import xxhash

    h = hashlib.sha256(f"weightsync-plan/{PLAN_FORMAT}|{bucket_bytes}|{alignment}|{D}\n".encode())
    h.update(f"{S.digest}|{N.digest}|{json.dumps(core.groups)}\n".encode())
    for a in (core.b_src, core.b_grp, core.b_lo, core.b_hi, core.b_nbytes):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    for a in (core.p_tensor, *core.p_off, *core.p_shp, core.p_entry):  # one contiguous column at a time
        arr = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        h.update(f"|{arr.dtype.str}|{len(arr)}|".encode())
        h.update(xxhash.xxh3_128(arr.data.cast("B") if arr.nbytes else b"").digest())
    return h.hexdigest()
