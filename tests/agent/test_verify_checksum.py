"""verify: Checksum: algorithms, the retry-then-fail policy and the sync hooks (pure, no transport)."""

from __future__ import annotations

import pytest
import torch

from weightsync.agent.plan import TensorShard, build_plan
from weightsync.agent.transfer import verify


@pytest.mark.parametrize("algo", verify.ALGORITHMS)
def test_checksum_detects_single_bit_flips_and_swaps(algo: str) -> None:
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = verify.checksum(data, algo)
    assert verify.checksum(data.clone(), algo) == ref
    for pos in (0, 1, 4095, 40_000, (1 << 16) - 1):
        bad = data.clone()
        bad[pos] ^= 1
        assert verify.checksum(bad, algo) != ref, f"flip at {pos} not detected by {algo}"
    swapped = data.clone()
    swapped[:8], swapped[1 << 15 : (1 << 15) + 8] = data[1 << 15 : (1 << 15) + 8].clone(), data[:8].clone()
    assert verify.checksum(swapped, algo) != ref
    assert verify.checksum(data[:-1], algo) != ref


def test_checksum_rejects_non_byte_tensors() -> None:
    with pytest.raises(ValueError, match="uint8"):
        verify.checksum(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="unknown checksum"):
        verify.checksum(torch.zeros(4, dtype=torch.uint8), "md5")


def test_retry_then_succeed() -> None:
    good = torch.arange(256, dtype=torch.uint8)
    bad = good.clone()
    bad[3] = 0
    expected = verify.checksum(good)
    fetches = iter([bad, good])
    used = verify.check_with_retries(bad, expected, verify.XXH3, lambda: next(fetches), verify.RetryPolicy(2))
    assert used == 2


def test_retry_then_fail() -> None:
    good = torch.arange(256, dtype=torch.uint8)
    bad = good.clone()
    bad[3] = 0
    calls = []

    def refetch() -> torch.Tensor:
        calls.append(1)
        return bad

    with pytest.raises(verify.ChecksumMismatch, match="2 retries"):
        verify.check_with_retries(bad, verify.checksum(good), verify.XXH3, refetch, verify.RetryPolicy(2))
    assert len(calls) == 2
    with pytest.raises(verify.ChecksumMismatch, match="no way to fetch"):
        verify.check_with_retries(bad, verify.checksum(good), verify.XXH3, None, verify.RetryPolicy(2))


def test_hooks_sender_meta_and_receiver_check() -> None:
    t = torch.randn(64, 32)
    plan = build_plan([[TensorShard.full("w", t.dtype, t.shape)]], [[TensorShard.full("w", t.dtype, t.shape)]],
                      1 << 20)
    bucket = plan.buckets[0]
    data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    data[: t.numel() * 4] = t.view(-1).view(torch.uint8)
    sender = verify.ChecksumHooks()
    assert sender.sends_bucket_meta
    meta = sender.on_send_bucket(1, bucket, data)
    assert meta is not None and meta["algorithm"] == verify.XXH3
    receiver = verify.ChecksumHooks()
    receiver.on_recv_bucket(1, bucket, data.clone(), meta)
    assert receiver.stats.buckets == 1 and receiver.stats.retries == 0
    corrupt = data.clone()
    corrupt[17] ^= 0x40
    with pytest.raises(verify.ChecksumMismatch):
        receiver.on_recv_bucket(1, bucket, corrupt, meta)
    assert receiver.stats.failures == 1
    healing = verify.ChecksumHooks(refetch=lambda b: data.clone())
    healing.on_recv_bucket(1, bucket, corrupt, meta)
    assert healing.stats.retries == 1
    with pytest.raises(verify.ChecksumMismatch, match="no checksum"):
        receiver.on_recv_bucket(1, bucket, data, None)


def test_checksum_hooks_use_a_transports_refetch() -> None:
    class WithRefetch:
        def refetch(self, bucket: object) -> torch.Tensor:
            return torch.zeros(1, dtype=torch.uint8)

    assert verify.checksum_hooks(WithRefetch(), retries=1).refetch is not None
    assert verify.checksum_hooks(object()).refetch is None
    assert verify.checksum_hooks(None, retries=0).policy.retries == 0
