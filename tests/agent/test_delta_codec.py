"""Delta codec: bit-exact with a full transfer for every dtype and bit pattern, compact on the wire."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent.plan.buckets import BucketLayout, pack
from weightsync.agent.transports import delta

SPECIALS = {
    torch.float32: [float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-45],
    torch.bfloat16: [float("nan"), -0.0, 0.0, float("inf"), float("-inf")],
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _mutate(t: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Change `fraction` of the elements by flipping random bits (any bit pattern may appear)."""
    out = t.clone()
    n = t.numel()
    k = max(1, int(n * fraction))
    idx = torch.randperm(n, generator=gen)[:k]
    raw = out.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    flips = torch.randint(1, 1 << min(15, 8 * t.element_size() - 1), (k,), generator=gen).to(raw.dtype)
    raw[idx] = raw[idx] ^ flips
    return out


def _roundtrip(prev: torch.Tensor, cur: torch.Tensor, unit: int | None = None, fraction: float = 0.25):
    out = torch.empty(delta.max_encoded_bytes(cur.numel()), dtype=torch.uint8)
    enc = delta.encode(prev, cur, out, delta.DeltaConfig(max_changed_fraction=fraction), unit=unit)
    base = prev.clone()
    if enc.nbytes is not None:
        delta.apply(base, out[: enc.nbytes])
    else:
        base.copy_(cur)
    return enc, base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
def test_bit_exact_with_full_transfer(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        prev_t = torch.randn(40_000, generator=gen).to(dtype)
    else:
        prev_t = torch.randint(-128, 128, (40_000,), generator=gen, dtype=dtype)
    cur_t = _mutate(prev_t, 0.05, gen)
    for i, v in enumerate(SPECIALS.get(dtype, [])):
        cur_t[100 + i * 7] = v
    prev, cur = _bytes(prev_t), _bytes(cur_t)
    unit = delta.unit_for_dtypes([str(dtype).removeprefix("torch.")])
    enc, got = _roundtrip(prev, cur, unit)
    assert enc.nbytes is not None, "5% changed must be sent as a delta"
    assert torch.equal(got, cur), "delta result differs from the full bytes"
    assert enc.nbytes <= 0.15 * cur.numel(), f"wire fraction {enc.nbytes / cur.numel():.3f} > 0.15"


def test_nan_payload_and_negative_zero_are_changes() -> None:
    """Float equality would miss these: -0.0 == 0.0 and NaN != NaN. Raw words must be compared."""
    prev_t = torch.zeros(1000, dtype=torch.float32)
    prev_t[10] = float("nan")
    cur_t = prev_t.clone()
    cur_t[5] = -0.0  # same value as 0.0, different bits
    cur_t.view(torch.int32)[10] = 0x7FC00001  # another NaN payload
    prev, cur = _bytes(prev_t), _bytes(cur_t)
    enc, got = _roundtrip(prev, cur, 4)
    assert enc.changed_words == 2
    assert torch.equal(got, cur)
    assert got.view(torch.int32)[5].item() == cur_t.view(torch.int32)[5].item()


def test_mixed_dtype_bucket_roundtrip_and_unit() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(300, 7, generator=gen).to(torch.bfloat16), torch.randn(513, generator=gen),
               torch.randint(-5, 5, (77,), dtype=torch.int8, generator=gen)]
    layout = BucketLayout.build(("t" + str(i), t.dtype, t.shape) for i, t in enumerate(tensors))
    prev = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pack(prev, layout, tensors)
    changed = [_mutate(t, 0.05, gen) for t in tensors]
    cur = prev.clone()
    pack(cur, layout, changed)
    unit = delta.unit_for_dtypes(e.dtype for e in layout.entries)
    assert unit == 1
    _enc, got = _roundtrip(prev, cur, unit)
    assert torch.equal(got, cur)


def test_unit_for_dtypes() -> None:
    assert delta.unit_for_dtypes(["bfloat16"]) == 2
    assert delta.unit_for_dtypes(["float32"]) == 4
    assert delta.unit_for_dtypes(["float32", "bfloat16"]) == 2
    assert delta.unit_for_dtypes(["float32", "int8"]) == 1
    assert delta.unit_for_dtypes([]) == 1


def test_many_changes_fall_back_to_full() -> None:
    gen = torch.Generator().manual_seed(3)
    prev = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=gen)
    cur = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=gen)
    enc, got = _roundtrip(prev, cur, 2)
    assert enc.nbytes is None and enc.changed_fraction > 0.9
    assert torch.equal(got, cur)


def test_sparse_changes_use_overflow_gaps() -> None:
    prev = torch.zeros(1 << 20, dtype=torch.uint8)
    cur = prev.clone()
    cur[[0, 1, 5000, 70_000, (1 << 20) - 1]] = 7  # gaps >= 255 go to the overflow list
    enc, got = _roundtrip(prev, cur, 1)
    assert enc.nbytes is not None and enc.nbytes < 128
    assert torch.equal(got, cur)


def test_identical_buckets_encode_to_a_header() -> None:
    prev = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    enc, got = _roundtrip(prev, prev.clone(), 4)
    assert enc.nbytes == delta.HEADER_BYTES and enc.changed_words == 0
    assert torch.equal(got, prev)


def test_apply_rejects_malformed_encodings() -> None:
    prev = torch.zeros(1024, dtype=torch.uint8)
    cur = prev.clone()
    cur[10] = 1
    out = torch.empty(delta.max_encoded_bytes(1024), dtype=torch.uint8)
    enc = delta.encode(prev, cur, out, unit=1)
    assert enc.nbytes is not None
    with pytest.raises(delta.DeltaError, match="truncated"):
        delta.apply(prev.clone(), out[: enc.nbytes - 1])
    with pytest.raises(delta.DeltaError, match="base has"):
        delta.apply(torch.zeros(2048, dtype=torch.uint8), out[: enc.nbytes])
    bad = out[: enc.nbytes].clone()
    bad[:4] = 0
    with pytest.raises(delta.DeltaError, match="not a delta"):
        delta.apply(prev.clone(), bad)


def test_delta_base_bookkeeping() -> None:
    base = delta.DeltaBase()
    buf = base.buffer(3, 100)
    assert base.id_of(3) is None
    base.ids[3] = delta.new_base_id()
    assert base.buffer(3, 100) is buf and base.id_of(3) is not None
    base.buffer(3, 200)  # a different size is a different bucket: the old base is gone
    assert base.id_of(3) is None
    assert delta.wire_fraction(None, 100) == 1.0 and delta.wire_fraction(10, 100) == 0.1
