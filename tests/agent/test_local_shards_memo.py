"""LocalShardsMemo (agent/layout/shards.py): a trainer's shards are reused only while it publishes the very same
tensors, and normalised again whenever anything local_shards reads could have changed."""

from __future__ import annotations

import torch

from weightsync.agent.layout.shards import LocalShardsMemo, PlacedShard, local_shards


def _model() -> dict[str, object]:
    embed = torch.zeros(8, 4)
    return {"embed": embed, "lm_head": embed,  # tied: one shard, one alias
            "w": PlacedShard(torch.ones(2, 4), (4, 4), (2, 0)), "b": torch.arange(4.0)}


def test_the_same_tensors_are_normalised_once_and_read_as_they_are_now() -> None:
    weights = _model()
    memo = LocalShardsMemo()
    first = memo(weights)
    assert first == local_shards(weights)
    assert first[1] == {"lm_head": "embed"}
    weights["b"].add_(1)  # type: ignore[attr-defined]  # a training step: in place, same tensor
    again = memo(weights)
    assert again is first
    assert torch.equal(dict((s.name, s.tensor) for s in again[0])["b"], torch.arange(4.0) + 1)


def test_a_new_value_a_moved_storage_or_a_new_shape_is_normalised_again() -> None:
    weights = _model()
    memo = LocalShardsMemo()
    first = memo(weights)
    weights["b"] = torch.arange(4.0)  # another tensor under the same name
    assert memo(weights) is not first
    second = memo(weights)
    weights["b"].set_(torch.zeros(6).untyped_storage())  # type: ignore[attr-defined]  # same object, other bytes
    third = memo(weights)
    assert third is not second
    assert dict((s.name, s.global_shape) for s in third[0])["b"] == (6,)
    weights["b"].data = weights["b"].view(2, 3)  # type: ignore[attr-defined]  # same bytes, another shape
    fourth = memo(weights)
    assert fourth is not third and dict((s.name, s.global_shape) for s in fourth[0])["b"] == (2, 3)


def test_tied_weights_untied_later_are_two_shards() -> None:
    weights = _model()
    weights["lm_head"] = weights["embed"].view(8, 4)  # type: ignore[attr-defined]  # another object, same bytes
    memo = LocalShardsMemo()
    assert memo(weights)[1] == {"lm_head": "embed"}
    weights["lm_head"].set_(torch.zeros(8, 4).untyped_storage())  # type: ignore[attr-defined]  # untied in place
    shards, aliases = memo(weights)
    assert aliases == {} and [s.name for s in shards] == ["embed", "lm_head", "w", "b"]


def test_parameters_and_detached_aliases_are_never_reused() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    weights = {"p": p, "g": torch.zeros(3, requires_grad=True)}
    memo = LocalShardsMemo()
    first = memo(weights)
    assert memo(weights) is not first  # .data and .detach() are new aliases each time: FSDP may swap them
    p.data = torch.ones(5)
    shards, _ = memo(weights)
    assert torch.equal(shards[0].tensor, torch.ones(5))


def test_pairs_that_are_not_a_mapping_are_normalised_every_time() -> None:
    pairs = [("a", torch.zeros(2))]
    memo = LocalShardsMemo()
    assert memo(pairs) is not memo(pairs)
