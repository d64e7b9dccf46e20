"""Content digests (agent/transfer/digest.py) through real sender and receiver processes over the GDR transport
(the harness of test_gdr_sync.py): every piece's leaf travels with its bucket and is checked on arrival;
a corrupted bucket is a digest mismatch and is never committed; the digest names the content, not how it
travelled (bucket size, replica)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gdr_harness import GdrScenario, Replica, llama_metas, run_gdr, tp_needs, tp_sources

from weightsync.agent.hashing import HashedLeaves, fmt
from weightsync.agent.plan import TensorShard, build_plan
from weightsync.agent.staging.versions import SentLeaves
from weightsync.agent.transfer import digest as D


def replica_digest(res: dict[tuple[str, int], dict[str, Any]], role: str, version: int) -> str:
    """A replica's digest: the distinct pieces its destination ranks received (as the agent's fetch adds
    its ranks' leaves into one Digest)."""
    leaves: dict[str, int] = {}
    for (r, _), out in res.items():
        if r == role:
            assert out["ok"], out.get("error")
            leaves.update(out["digests"][version]["leaves"])
    return D.combine(leaves)


def test_replicas_agree_and_the_digest_follows_the_content() -> None:
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2]), Replica(tp_needs(metas, 2), [1, 2])],
                      digest=True)
    res = run_gdr(scn)
    d1 = {rep: replica_digest(res, rep, 1) for rep in ("dst0", "dst1")}
    d2 = {rep: replica_digest(res, rep, 2) for rep in ("dst0", "dst1")}
    assert d1["dst0"] == d1["dst1"] and d2["dst0"] == d2["dst1"]
    assert d1["dst0"] != d2["dst0"], "new weights, new digest"
    # bucket boundaries do not enter it: the same versions in 4x larger buckets give the same digests
    big = run_gdr(GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2])], digest=True,
                              bucket_bytes=4 * scn.bucket_bytes))
    assert replica_digest(big, "dst0", 1) == d1["dst0"] and replica_digest(big, "dst0", 2) == d2["dst0"]


def test_a_corrupted_bucket_is_a_digest_mismatch_and_is_never_committed() -> None:
    """No `verify: Checksum` (no retry): the piece digests alone catch the flipped byte; version 2 fails
    naming the piece, and the engine keeps serving version 1 bit for bit."""
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2], corrupt={0: (2, 1)})], digest=True)
    res = run_gdr(scn)
    bad = res[("dst0", 0)]
    assert bad["ok"], bad.get("error")
    assert bad["committed"] == [1] and bad["failed"][0]["version"] == 2
    err = bad["failed"][0]["error"]
    assert "piece " in err and "has digest" in err and "the sender computed" in err, err
    assert bad["serving"] == 1 and bad["serving_exact"]


# ---------------- the hooks alone ----------------


def _bucket() -> tuple[Any, torch.Tensor]:
    t = torch.randn(64, 32)
    u = torch.arange(10, dtype=torch.int64)
    plan = build_plan([[TensorShard.full("w", t.dtype, t.shape), TensorShard.full("u", u.dtype, u.shape)]],
                      [[TensorShard.full("w", t.dtype, t.shape), TensorShard.full("u", u.dtype, u.shape)]], 1 << 20)
    (bucket,) = plan.buckets
    data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for e in bucket.entries:
        src = {"w": t, "u": u}[e.piece.name]
        data[e.offset : e.offset + e.piece.nbytes] = src.reshape(-1).view(torch.uint8)
    return bucket, data


def test_hooks_check_every_piece_and_name_the_one_that_differs() -> None:
    bucket, data = _bucket()
    meta = D.DigestHooks().on_send_bucket(1, bucket, data)
    assert meta is not None and len(meta["digest"]["leaves"]) == 2
    got = D.Digest()
    D.DigestHooks(digest=got).on_recv_bucket(1, bucket, data.clone(), meta)
    assert len(got.leaves) == 2 and len(got.hex()) == 32
    corrupt = data.clone()
    w = next(e for e in bucket.entries if e.piece.name == "w")
    corrupt[w.offset + 5] ^= 0x01
    with pytest.raises(D.DigestMismatch, match=r"piece w\|float32\|64,32\|0,0\|64,32"):
        D.DigestHooks(digest=D.Digest()).on_recv_bucket(1, bucket, corrupt, meta)
    # a sender of an earlier release sends no leaves: loaded, and the digest says it was not checked
    old = D.Digest()
    D.DigestHooks(digest=old).on_recv_bucket(1, bucket, data, None)
    assert old.unchecked and old.hex() == got.hex()


def test_concurrent_transfers_of_one_staged_version_hash_each_bucket_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas' transfers send the same bucket at the same time (ring staging streams to both at once):
    one hashes it, the other waits for those leaves instead of hashing the same bytes again, and both send
    the same leaves. Hashing is slowed here so that the two really overlap."""
    import threading
    import time

    bucket, data = _bucket()
    calls: list[int] = []
    real = D.bucket_leaves

    def slow_leaves(*args: Any) -> Any:
        calls.append(1)
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(D, "bucket_leaves", slow_leaves)
    shared = SentLeaves()
    hooks = [D.DigestHooks(sent_leaves=shared) for _ in range(2)]
    metas: list[Any] = [None, None]
    go = threading.Barrier(2)

    def send(i: int) -> None:
        go.wait()
        metas[i] = hooks[i].on_send_bucket(1, bucket, data)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1  # before: 2 (each transfer found no leaves yet and hashed)
    assert metas[0] == metas[1] and metas[0] is not None
    metas[0]["digest"]["leaves"][0] = "changed"  # each transfer's metadata is its own: the shared hex stays
    assert metas[1]["digest"]["leaves"][0] != "changed"
    assert hooks[0].on_send_bucket(1, bucket, data) == metas[1]
    assert sum(h.stats.reused_bytes for h in hooks) == bucket.data_nbytes * 2  # hashed once for three sends
    assert sorted([h.stats.bytes for h in hooks]) == [0, bucket.data_nbytes]


def test_a_transfer_that_fails_while_hashing_leaves_the_bucket_to_the_next() -> None:
    shared = SentLeaves()

    def broken() -> Any:
        raise RuntimeError("staging unmapped")

    with pytest.raises(RuntimeError):
        shared.get_or_compute((0, "xxh3_128"), broken)
    one = HashedLeaves.of([("k", 1)])
    assert shared.get_or_compute((0, "xxh3_128"), lambda: one) == (one, False)
    assert shared.get_or_compute((0, "xxh3_128"), broken) == (one, True)
    assert one.hexes == [fmt(1)]


def test_a_region_two_ranks_hold_counts_once_and_must_agree() -> None:
    d = D.Digest()
    d.add("k", 5)
    d.add("k", 5)
    assert d.value() == 5
    with pytest.raises(D.DigestMismatch, match="arrived twice with different bytes"):
        d.add("k", 6)


def test_leaves_depend_on_the_key_and_on_every_byte() -> None:
    x = torch.arange(256, dtype=torch.uint8)
    a = D.leaf("t|uint8|256|0|256", x)
    assert a == D.leaf("t|uint8|256|0|256", x.clone())
    assert a != D.leaf("t|uint8|256|0|128", x)  # same bytes, another region
    y = x.clone()
    y[200] ^= 0x80
    assert a != D.leaf("t|uint8|256|0|256", y)
    assert D.leaf("k", x, D.WSUM) != D.leaf("k", y, D.WSUM)  # the on-device algorithm, computed on CPU here


def test_a_bucket_that_lands_where_its_own_sender_hashed_it_is_not_read_again(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Colocated pod's agent stages the trainer's version and hands its buckets to the engine over IPC: the
    receiver's bucket is its own second mapping of the staging file its sender hashed. It takes those leaves
    instead of reading every byte again, and only for that file region, version, bucket and source, and only
    with the leaves the bucket's metadata carries: anything else is hashed and checked as before."""
    from weightsync.agent.staging import segments
    from weightsync.agent.transports.ipc import _ShmSegment

    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    bucket, data = _bucket()
    n = data.numel()
    seg = segments.create_segment(n + 4096, "wstest")
    assert isinstance(seg, segments.ShmSegment)
    seg.tensor[4096 : 4096 + n].copy_(data)
    sent = seg.tensor[4096 : 4096 + n]
    reader = _ShmSegment(str(seg.path), seg.size, create=False)  # how an IPC reader maps the file
    segments.SHARED.add(segments.MappedFile(str(seg.path), reader))
    try:
        assert reader.tensor is not None
        landed = reader.tensor[4096 : 4096 + n]
        assert landed.data_ptr() != sent.data_ptr()  # another mapping of the same bytes
        assert segments.shm_location(landed) == segments.shm_location(sent) == (seg.name, 4096)
        meta = D.DigestHooks(hashed_here=D.HASHED_HERE).on_send_bucket(7, bucket, sent)  # as over IPC
        assert meta is not None
        full = D.Digest()
        D.DigestHooks(digest=full).on_recv_bucket(7, bucket, data.clone(), meta)  # private memory: hashed

        calls: list[int] = []
        real = D.bucket_leaves
        monkeypatch.setattr(D, "bucket_leaves", lambda *a: calls.append(1) or real(*a))
        got = D.Digest()
        hooks = D.DigestHooks(digest=got)
        hooks.on_recv_bucket(7, bucket, landed, meta)
        assert calls == [] and hooks.stats.reused_bytes == bucket.data_nbytes and hooks.stats.bytes == 0
        assert got.hex() == full.hex() and not got.unchecked

        def hashed(version: int, where: torch.Tensor, m: Any) -> bool:
            h = D.DigestHooks(digest=D.Digest())
            before = len(calls)
            h.on_recv_bucket(version, bucket, where, m)
            return len(calls) == before + 1 and h.stats.reused_bytes == 0

        assert hashed(8, landed, meta)            # another version in the same file region
        # a sender over any other transport records nothing: no receiver in its process reads its buckets
        meta9 = D.DigestHooks().on_send_bucket(9, bucket, sent)
        assert hashed(9, landed, meta9)
        assert hashed(7, data.clone(), meta)      # the same bytes in private memory (a wire's receive slot)
        other = reader.tensor[: n]
        other.copy_(data)
        assert hashed(7, other, meta)             # the same bytes elsewhere in the file
        forged = {**meta, "digest": {**meta["digest"], "leaves": ["0" * 32, *meta["digest"]["leaves"][1:]]}}
        with pytest.raises(D.DigestMismatch, match="the sender computed"):
            D.DigestHooks(digest=D.Digest()).on_recv_bucket(7, bucket, landed, forged)  # hashed, and refused
        del landed, other  # the reader unmaps only once no view is left
        reader.close()
    finally:
        segments.SHARED.forget(seg.name)
        seg.unlink()


def _wsum_reference(b: bytes) -> int:
    """agent/transfer/verify.py's wsum64 written out: sum over blocks of (2 block + 1) x (sum of the block's int64 words), plus
    the tail bytes weighted 1, 2, ..., all mod 2^64."""
    from weightsync.agent.hashing import WSUM_BLOCK as _WSUM_BLOCK

    words = [int.from_bytes(b[i:i + 8], "little", signed=True) for i in range(0, len(b) // 8 * 8, 8)]
    total = sum((2 * (i // _WSUM_BLOCK) + 1) * w for i, w in enumerate(words))
    total += sum((j + 1) * x for j, x in enumerate(b[len(b) // 8 * 8:]))
    return total & 0xFFFFFFFFFFFFFFFF


def test_a_gpu_buckets_leaves_are_read_back_once_and_keep_their_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSUM (the on-device algorithm, on CPU here up to the device): every piece's sum is queued and the bucket's
    are read back with one `.tolist()`, never one `.item()` per piece (a device sync each), and each leaf is
    still the one an agent of the earlier release computes per piece (mixed releases must agree)."""
    import xxhash

    from weightsync.agent.hashing import WSUM_BLOCK as _WSUM_BLOCK

    g = torch.Generator().manual_seed(3)
    odd = torch.randint(-128, 127, (_WSUM_BLOCK * 8 * 2 + 13,), dtype=torch.int8, generator=g)  # 2 blocks + a tail
    shards = {"w": torch.randn(64, 33, generator=g), "odd": odd, "u": torch.arange(5, dtype=torch.int16)}
    spec = [TensorShard.full(n, t.dtype, t.shape) for n, t in shards.items()]
    (bucket,) = build_plan([spec], [spec], 1 << 22).buckets
    data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for e in bucket.entries:
        data[e.offset : e.offset + e.piece.nbytes] = shards[e.piece.name].reshape(-1).view(torch.uint8)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", lambda self: pytest.fail("a per-piece read-back"))
        leaves = D.bucket_leaves(bucket, data, D.WSUM)
    assert [k for k, _ in leaves] == [D.piece_key(e.piece.name, e.piece.dtype, e.piece.global_shape,
                                                  e.piece.box.offset, e.piece.box.shape) for e in bucket.entries]
    for (key, value), e in zip(leaves, bucket.entries, strict=True):
        piece = data[e.offset : e.offset + e.piece.nbytes]
        inner = _wsum_reference(piece.numpy().tobytes())
        assert value == xxhash.xxh3_128_intdigest(f"{key}|{inner:016x}|{piece.numel()}".encode())
        assert value == D.leaf(key, piece, D.WSUM)
    # and a changed byte in any piece is caught by the hooks with that algorithm
    meta = D.DigestHooks(algorithm=D.WSUM).on_send_bucket(1, bucket, data)
    corrupt = data.clone()
    odd_entry = next(e for e in bucket.entries if e.piece.name == "odd")
    corrupt[odd_entry.offset + odd_entry.piece.nbytes - 1] ^= 0x10  # in the tail
    with pytest.raises(D.DigestMismatch, match=r"piece odd\|int8"):
        D.DigestHooks(digest=D.Digest()).on_recv_bucket(1, bucket, corrupt, meta)
