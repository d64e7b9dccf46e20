"""Flattened buckets: layout, alignment, pack/unpack as views, validation of untrusted indexes."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent.plan.buckets import BucketError, BucketLayout, entry_view, flatten, pack, unpack


def test_layout_alignment_and_sizes() -> None:
    layout = BucketLayout.build([("a", torch.bfloat16, (3,)), ("b", "float32", (100,)), ("c", "int8", (5,)),
                                 ("d", "float32", (2, 2))])
    # entries of >= 256 bytes start 256-aligned; smaller ones only 16-aligned (tiny tensors stay dense)
    assert [e.offset for e in layout.entries] == [0, 256, 656, 672]
    assert layout.nbytes == 688
    layout.validate()


def test_pack_unpack_roundtrip_bit_exact_mixed_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("w", torch.randint(0, 255, (8, 6), dtype=torch.uint8, generator=g).view(torch.bfloat16)),
        ("s", torch.randn(5, generator=g)),
        ("q", torch.randint(-128, 127, (7, 3), dtype=torch.int8, generator=g)),
        ("z", torch.tensor(3.5, dtype=torch.float64)),
        ("t", torch.randn(4, 4, generator=g).t()),  # non-contiguous source
    ]
    buf, layout = flatten(tensors)
    out = unpack(buf, layout)
    for (n, t), (m, u) in zip(tensors, out, strict=True):
        assert n == m and u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
        assert u.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, not a copy
    d = BucketLayout.from_dict(layout.to_dict())
    assert d == layout


def test_pack_rejects_wrong_tensors() -> None:
    layout = BucketLayout.build([("a", "float32", (2,))])
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(BucketError, match="index says float32"):
        pack(buf, layout, [torch.zeros(3)])
    with pytest.raises(BucketError, match="1 entries"):
        pack(buf, layout, [])
    with pytest.raises(BucketError, match="ends at byte"):
        entry_view(torch.empty(4, dtype=torch.uint8), layout.entries[0])


@pytest.mark.parametrize(
    "doc",
    [
        {"entries": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 0}], "nbytes": 8},
        {"entries": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 2}], "nbytes": 64},
        {"entries": [{"name": "a", "dtype": "float32", "shape": [4], "offset": 0},
                     {"name": "b", "dtype": "int8", "shape": [1], "offset": 8}], "nbytes": 64},
        {"entries": [{"name": "a", "dtype": "complex_thing", "shape": [4], "offset": 0}], "nbytes": 64},
        {"entries": [{"name": "a", "dtype": "int8", "shape": [-1], "offset": 0}], "nbytes": 64},
    ],
)
def test_untrusted_index_is_validated(doc: dict) -> None:
    with pytest.raises(BucketError):
        BucketLayout.from_dict(doc)
