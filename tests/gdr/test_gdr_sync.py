"""GDR (NIXL over UCX) weight sync between real processes: bit-exact for every layout, late joiners,
verify: Checksum retries and clean failures, delta sync. CPU-only: UCX moves DRAM over tcp/cma."""

from __future__ import annotations

import pytest
from gdr_harness import (
    KB,
    GdrScenario,
    Replica,
    assert_ok,
    llama_metas,
    run_gdr,
    tp_needs,
    tp_sources,
)

from weightsync.agent.layout.rules import TensorMeta
from weightsync.agent.transports.delta import DeltaConfig


@pytest.mark.parametrize(("a", "b"), [(2, 4), (4, 2), (1, 8)])
def test_tp_reshard(a: int, b: int) -> None:
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, a), [Replica(tp_needs(metas, b), [1, 2])])
    res = run_gdr(scn)
    assert_ok(res)
    for d in range(b):
        r = res[("dst0", d)]
        assert r["committed"] == [1, 2] and r["checked"] > 0
        t = r["stats"][-1]["transport"]
        assert t["transport"] == "gdr" and t["wire_bytes"] == t["full_bytes"] > 0


def test_fsdp_shard0_over_4_to_tp2() -> None:
    metas = llama_metas(hidden=12, inter=24, vocab=66)  # uneven torch.chunk sizes on purpose
    sources = tp_sources(metas, 1, fsdp=4)
    assert {s.name: s.box.shape for s in sources[3]}["model.embed_tokens.weight"] == (15, 12)
    res = run_gdr(GdrScenario(sources, [Replica(tp_needs(metas, 2), [1])]))
    assert_ok(res)
    assert all(res[("dst0", d)]["committed"] == [1] for d in range(2))


def test_tied_embeddings() -> None:
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2, tied=True), [Replica(tp_needs(metas, 2, tied=True), [1])])
    assert not any(s.name == "lm_head.weight" for rank in scn.sources for s in rank)
    res = run_gdr(scn)
    assert_ok(res)
    for d in range(2):
        assert res[("dst0", d)]["committed"] == [1]


def test_mixed_dtypes() -> None:
    metas = [TensorMeta("model.embed_tokens.weight", "bfloat16", (64, 16)),
             TensorMeta("model.layers.0.self_attn.q_proj.weight", "float16", (16, 16)),
             TensorMeta("model.layers.0.self_attn.o_proj.weight", "float32", (16, 16)),
             TensorMeta("model.layers.0.mlp.gate_proj.weight", "int8", (32, 16)),
             TensorMeta("model.layers.0.mlp.down_proj.weight", "float64", (16, 32)),
             TensorMeta("model.layers.0.input_layernorm.weight", "float32", (16,)),
             TensorMeta("model.layers.0.scale", "int32", (3,))]
    res = run_gdr(GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 4), [1, 2])]))
    assert_ok(res)
    assert sum(res[("dst0", d)]["checked"] for d in range(4)) == 2 * 4 * len(metas)


def test_tensor_larger_than_a_bucket() -> None:
    metas = [TensorMeta("model.embed_tokens.weight", "bfloat16", (512, 64)),  # 64 KiB vs 4 KiB buckets
             TensorMeta("model.norm.weight", "float32", (64,))]
    scn = GdrScenario(tp_sources(metas, 1), [Replica(tp_needs(metas, 2), [1])], bucket_bytes=4 * KB)
    res = run_gdr(scn)
    assert_ok(res)
    assert res[("src", 0)]["replicas"][0][0]["buckets"] >= 16


def test_late_joiner_pulls_current_version_without_disturbing_others() -> None:
    """Replica 1 starts only after replica 0 committed version 2; it pulls version 2 (the current one),
    then both get version 3. Replica 0 never re-reads anything because of the newcomer."""
    metas = llama_metas()
    scn = GdrScenario(
        tp_sources(metas, 2),
        [Replica(tp_needs(metas, 2), [1, 2, 3]),
         Replica(tp_needs(metas, 4), [2, 3], join_after=(0, 2))],
        hold={0: (3, 1, 2)},  # the trainer publishes version 3 to replica 0 only after replica 1 has 2
    )
    res = run_gdr(scn)
    assert_ok(res)
    for d in range(2):
        r = res[("dst0", d)]
        assert r["committed"] == [1, 2, 3]
        # replica 0's per-version traffic is exactly its plan, before and after the join
        per_version = [s["bytes"] for s in r["stats"]]
        assert per_version[0] == per_version[1] == per_version[2] > 0
        assert all(s["transport"]["refetches"] == 0 for s in r["stats"])
    for d in range(4):
        r = res[("dst1", d)]
        assert r["committed"] == [2, 3] and r["serving_exact"]


def test_verify_retries_a_corrupted_bucket_then_commits() -> None:
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2], corrupt={1: (2, 1)})],
                      verify=True)
    res = run_gdr(scn)
    assert_ok(res)
    r = res[("dst0", 1)]
    assert r["corrupted"] == 1 and r["committed"] == [1, 2] and r["serving_exact"]
    assert r["stats"][-1]["transport"]["refetches"] == 1


def test_verify_retries_through_the_agents_routing_transport() -> None:
    """The agent process receives through a RoutingTransport (one GDR transport per source rank): a
    checksum mismatch must still be read again from the right source rank, not fail the version."""
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 1), [1, 2], corrupt={0: (2, 1)})],
                      verify=True, routed=True)
    res = run_gdr(scn)
    assert_ok(res)
    r = res[("dst0", 0)]
    assert r["corrupted"] == 1 and r["committed"] == [1, 2] and r["serving_exact"]
    assert r["stats"][-1]["transport"]["refetches"] == 1


def test_verify_fails_the_version_cleanly_when_corruption_persists() -> None:
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2], corrupt={0: (2, 100)})],
                      verify=True)
    res = run_gdr(scn)
    bad = res[("dst0", 0)]
    assert bad["ok"], bad.get("error")
    assert bad["committed"] == [1], "a version with a corrupted bucket must never be committed"
    assert bad["failed"] and bad["failed"][0]["version"] == 2
    assert "checksum" in bad["failed"][0]["error"].lower()
    assert bad["corrupted"] == 3, "first read + 2 retries"
    assert bad["serving"] == 1 and bad["serving_exact"], "the engine keeps serving version 1 bit-exactly"
    # the trainer learns that the version failed (the receiver aborted it)
    assert not res[("src", 0)]["ok"] or not res[("src", 1)]["ok"]


def test_delta_sync_is_bit_exact_and_small() -> None:
    metas = llama_metas(hidden=64, inter=128, vocab=256)
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 2), [1, 2, 3])], bucket_bytes=64 * KB,
                      delta=DeltaConfig(max_changed_fraction=0.25), change=0.05, verify=True)
    res = run_gdr(scn)
    assert_ok(res)
    for d in range(2):
        r = res[("dst0", d)]
        assert r["committed"] == [1, 2, 3]
        first, *later = r["stats"]
        # cumulative transport counters: version 1 is full, versions 2 and 3 are deltas
        assert first["transport"]["delta_buckets"] == 0
        full1, wire1 = first["transport"]["full_bytes"], first["transport"]["wire_bytes"]
        assert wire1 == full1
        last = later[-1]["transport"]
        later_full = last["full_bytes"] - full1
        later_wire = last["wire_bytes"] - wire1
        assert last["delta_buckets"] > 0
        assert later_wire <= 0.15 * later_full, f"wire fraction {later_wire / later_full:.3f}"


def test_delta_late_joiner_reads_full_buckets() -> None:
    metas = llama_metas()
    scn = GdrScenario(
        tp_sources(metas, 1),
        [Replica(tp_needs(metas, 1), [1, 2, 3]), Replica(tp_needs(metas, 2), [2, 3], join_after=(0, 2))],
        delta=DeltaConfig(), change=0.05, hold={0: (3, 1, 2)},
    )
    res = run_gdr(scn)
    assert_ok(res)
    joiner = res[("dst1", 0)]
    assert joiner["committed"] == [2, 3] and joiner["serving_exact"]
    assert joiner["stats"][0]["transport"]["delta_buckets"] == 0  # no base yet: full buckets


def test_zero_copy_from_staging_arena_into_destination() -> None:
    """Trainer tensors in a plan arena are READ in place (registered once, no pack) straight into the
    inference arena (no unpack copy); a corrupted direct read is fetched again by verify."""
    metas = llama_metas()
    scn = GdrScenario(tp_sources(metas, 2), [Replica(tp_needs(metas, 4), [1, 2, 3], corrupt={2: (2, 1)})],
                      arena=True, verify=True)
    res = run_gdr(scn)
    assert_ok(res)
    assert all(res[("src", r)]["direct_buckets"] > 0 for r in range(2))
    for d in range(4):
        r = res[("dst0", d)]
        assert r["committed"] == [1, 2, 3] and r["serving_exact"]
        assert all(s["direct_buckets"] > 0 for s in r["stats"])  # pieces of split tensors still use slots
    assert res[("dst0", 2)]["stats"][-1]["transport"]["refetches"] == 1
