"""Multi-process weight sync: real processes, real TCP links with HMAC, real gloo, real /dev/shm.

Every destination compares every tensor it received bit for bit with the trainer's full tensor sliced
to its own layout (see wsagent_helpers), and commits a version only after receive_version returned.
"""

from __future__ import annotations

import pytest
from wsagent_helpers import Scenario, run_scenario

from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout

KB = 1024


def llama_metas(layers: int = 2, hidden: int = 16, inter: int = 32, vocab: int = 64, *, dtype: str = "bfloat16",
                tied: bool = False) -> list[TensorMeta]:
    m = [TensorMeta("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        m += [
            TensorMeta(f"{p}.input_layernorm.weight", "float32", (hidden,)),
            TensorMeta(f"{p}.self_attn.q_proj.weight", dtype, (hidden, hidden)),
            TensorMeta(f"{p}.self_attn.q_proj.bias", dtype, (hidden,)),
            TensorMeta(f"{p}.self_attn.k_proj.weight", dtype, (hidden // 2, hidden)),
            TensorMeta(f"{p}.self_attn.v_proj.weight", dtype, (hidden // 2, hidden)),
            TensorMeta(f"{p}.self_attn.o_proj.weight", dtype, (hidden, hidden)),
            TensorMeta(f"{p}.mlp.gate_proj.weight", dtype, (inter, hidden)),
            TensorMeta(f"{p}.mlp.up_proj.weight", dtype, (inter, hidden)),
            TensorMeta(f"{p}.mlp.down_proj.weight", dtype, (hidden, inter)),
        ]
    m.append(TensorMeta("model.norm.weight", "float32", (hidden,)))
    m.append(TensorMeta("lm_head.weight", dtype, (vocab, hidden)))
    return m


def tp_scenario(metas: list[TensorMeta], a: int, b: int, *, fsdp: int = 1, bucket: int = 4 * KB,
                transport: str = "nccl", tied: bool = False, **kw: object) -> Scenario:
    sources = [trainer_layout(metas, tp_size=a, tp_rank=r // fsdp, fsdp_size=fsdp, fsdp_rank=r % fsdp,
                              tie_word_embeddings=tied) for r in range(a * fsdp)]
    needs = [inference_layout(metas, b, r, tie_word_embeddings=tied) for r in range(b)]
    return Scenario(sources, needs, bucket, transport=transport, **kw)  # type: ignore[arg-type]


def assert_all_ok(results: dict, n_dst: int, versions: list[int]) -> None:
    for key, r in sorted(results.items()):
        assert r["ok"], f"{key}: {r.get('error')}\n{r.get('trace', '')}"
    for d in range(n_dst):
        r = results[("dst", d)]
        assert r["mismatches"] == [], r["mismatches"]
        assert r["committed"] == versions
        assert r["checked"] > 0


@pytest.mark.parametrize(("a", "b"), [(2, 4), (4, 2), (1, 8)])
def test_tp_reshard_gloo(a: int, b: int) -> None:
    scn = tp_scenario(llama_metas(), a, b, versions=[1, 2])
    assert_all_ok(run_scenario(scn), b, [1, 2])


@pytest.mark.parametrize(("a", "b"), [(2, 4), (1, 8)])
def test_tp_reshard_ipc(a: int, b: int) -> None:
    scn = tp_scenario(llama_metas(), a, b, transport="ipc", versions=[1, 2])
    assert_all_ok(run_scenario(scn), b, [1, 2])


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_fsdp_shard0_over_4_to_tp2(transport: str) -> None:
    # hidden 12 / vocab 66: chunks of dim 0 over 4 ranks are uneven (torch.chunk sizes) on purpose
    metas = llama_metas(hidden=12, inter=24, vocab=66)
    scn = tp_scenario(metas, 1, 2, fsdp=4, transport=transport)
    shapes = {s.name: s.box.shape for s in scn.sources[3]}
    assert shapes["model.embed_tokens.weight"] == (15, 12)  # ceil(66/4)=17 -> 17,17,17,15
    assert_all_ok(run_scenario(scn), 2, [1])


def test_tied_embeddings_send_no_lm_head() -> None:
    metas = llama_metas()
    scn = tp_scenario(metas, 2, 2, tied=True)
    assert all(s.name != "lm_head.weight" for rank in scn.sources + scn.needs for s in rank)
    assert any(s.name == "model.embed_tokens.weight" for s in scn.needs[0])
    assert_all_ok(run_scenario(scn), 2, [1])


def test_mixed_dtypes_bf16_fp32_int8() -> None:
    metas = [
        TensorMeta("model.layers.0.self_attn.q_proj.weight", "bfloat16", (16, 8)),
        TensorMeta("model.layers.0.self_attn.q_proj.weight_scale", "float32", (16,)),
        TensorMeta("model.layers.0.mlp.down_proj.weight", "int8", (8, 16)),
        TensorMeta("model.layers.0.mlp.down_proj.weight_scale", "float32", (8, 1)),
        TensorMeta("model.layers.0.mlp.up_proj.weight", "int8", (16, 8)),
        TensorMeta("model.extra.odd", "int8", (7, 3)),  # 21 bytes: odd sizes keep later entries aligned
        TensorMeta("model.norm.weight", "float32", (8,)),
        TensorMeta("model.step", "int8", ()),  # a 0-d tensor
    ]
    scn = tp_scenario(metas, 2, 4, bucket=100)  # tiny buckets: many split pieces of every dtype
    assert_all_ok(run_scenario(scn), 4, [1])


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_tensor_larger_than_a_bucket(transport: str) -> None:
    big = TensorMeta("model.embed_tokens.weight", "float32", (64, 48))  # 12 KiB, buckets of 1 KiB
    scn = tp_scenario([big, TensorMeta("model.norm.weight", "float32", (48,))], 2, 1, bucket=1 * KB,
                      transport=transport, versions=[1, 2])
    results = run_scenario(scn)
    assert_all_ok(results, 1, [1, 2])
    assert results[("src", 0)]["versions"][0]["buckets"] >= 6


def test_thousands_of_tiny_tensors() -> None:
    metas = [TensorMeta(f"model.layers.{i}.tiny.weight", "float32" if i % 2 else "bfloat16", (3,))
             for i in range(3000)]
    scn = tp_scenario(metas, 1, 2, bucket=64 * KB, transport="ipc")
    results = run_scenario(scn, deadline=120)
    assert_all_ok(results, 2, [1])
    assert results[("dst", 1)]["checked"] == 3000
    # flattened: thousands of tensors, a handful of buckets (one handle per bucket)
    assert results[("src", 0)]["versions"][0]["buckets"] <= 2


def test_broadcast_to_replicas() -> None:
    metas = llama_metas()
    # two TP-2 inference replicas served by one plan: dst ranks 0,1 (replica A) and 2,3 (replica B)
    needs = [inference_layout(metas, 2, r % 2) for r in range(4)]
    sources = [trainer_layout(metas, tp_size=2, tp_rank=r) for r in range(2)]
    scn = Scenario(sources, needs, 4 * KB)
    from weightsync.agent.plan import build_plan

    plan = build_plan(sources, needs, 4 * KB)
    assert plan.broadcast_groups(), "identical needs must become broadcast buckets"
    assert_all_ok(run_scenario(scn), 4, [1])


# -- failures: each gives a clear error, and no destination commits a version ----------------------


def assert_nothing_committed(results: dict, n_dst: int) -> None:
    for d in range(n_dst):
        r = results[("dst", d)]
        assert not r["ok"], f"dst {d} unexpectedly succeeded"
        assert r["committed"] == []


def test_plan_hash_mismatch_moves_nothing() -> None:
    scn = tp_scenario(llama_metas(), 1, 2, dst_bucket_bytes={1: 2 * KB})
    results = run_scenario(scn)
    assert_nothing_committed(results, 2)
    assert results[("dst", 1)]["error_type"] == "PlanMismatch"
    assert "disagree" in results[("dst", 1)]["error"]
    assert results[("src", 0)]["error_type"] == "PlanMismatch"
    assert all(results[("dst", d)]["buckets_seen"] == 0 for d in range(2))


def test_wrong_token_is_refused() -> None:
    scn = tp_scenario(llama_metas(layers=1), 1, 1, wrong_token={0}, accept_timeout=3.0)
    results = run_scenario(scn)
    assert_nothing_committed(results, 1)
    assert results[("dst", 0)]["error_type"] == "AuthError"
    assert "token" in results[("dst", 0)]["error"]
    assert not results[("src", 0)]["ok"]


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_peer_dies_mid_bucket(transport: str) -> None:
    big = [TensorMeta(f"model.layers.{i}.mlp.up_proj.weight", "float32", (1024, 1024)) for i in range(3)]
    scn = tp_scenario(big, 1, 1, bucket=4096 * KB, transport=transport, die_at_bucket=(0, 1), timeout=20.0)
    results = run_scenario(scn)
    assert results[("src", 0)]["exitcode"] == 17
    assert_nothing_committed(results, 1)
    err = results[("dst", 0)]["error"]
    assert results[("dst", 0)]["error_type"] == "PeerFailed", err
    assert "destination rank 0 failed to receive version 1" in err


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_receive_into_destination_tensors(transport: str) -> None:
    # trainer tensors staged in the plan's arena, receivers writing into arena tensors: nccl moves
    # whole-tensor buckets with no pack and no unpack copy; resharded pieces still arrive right.
    scn = tp_scenario(llama_metas(), 2, 4, transport=transport, into=True, versions=[1, 2])
    results = run_scenario(scn)
    assert_all_ok(results, 4, [1, 2])
    if transport == "nccl":
        assert sum(s["direct_buckets"] for d in range(4) for s in results[("dst", d)]["stats"]) > 0
        assert sum(s["direct_buckets"] for r in range(2) for s in results[("src", r)]["versions"]) > 0


def test_hooks_metadata_travels_with_buckets() -> None:
    scn = tp_scenario(llama_metas(), 1, 2, hooks=True)
    assert_all_ok(run_scenario(scn), 2, [1])


def test_truncated_frame_mid_version_commits_nothing() -> None:
    import threading

    from weightsync.agent.plan import TensorShard, build_plan
    from weightsync.agent.transfer.receive import WeightReceiver
    from weightsync.agent.transfer.sync import PeerFailed
    from weightsync.agent.transports.ipc import IpcTransport
    from weightsync.agent.wire.link import LinkListener, connect

    w = TensorShard.full("w", "float32", (64,))
    plan = build_plan([[w]], [[w]], 1024)
    seen: list[str] = []
    errors: list[BaseException] = []
    with LinkListener("127.0.0.1", 0, "tok") as lst:
        link = connect("127.0.0.1", lst.port, "tok")
        fake_sender = lst.accept(timeout=5)

        def receive() -> None:
            try:
                WeightReceiver(plan, 0, IpcTransport(), {0: link}, timeout=10).receive_version(
                    lambda items: seen.extend(n for n, _ in items))
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=receive)
        t.start()
        fake_sender.send({"kind": "sync.begin", "version": 7, "plan_hash": plan.hash, "buckets": 1, "bytes": 256,
                          "bucket_meta": False})
        assert fake_sender.recv(timeout=5)[0]["kind"] == "sync.ready"
        fake_sender.send({"kind": "sync.go", "version": 7})
        # the bucket handle frame is cut off half-way and the peer vanishes
        import hashlib
        import hmac
        import json
        import struct

        body = json.dumps({"kind": "ipc.bucket", "index": 0, "handle": {}}).encode()
        prefix = struct.pack("!4sBBHIQQ", b"WSL1", 1, 0, 0, len(body), 0, 2)
        mac = hmac.new(fake_sender._send_key, prefix + body, hashlib.sha256).digest()
        fake_sender._sock.sendall((prefix + body + mac)[: len(prefix) + 10])
        fake_sender.close()
        t.join(15)
    assert not t.is_alive()
    assert seen == []
    assert len(errors) == 1 and isinstance(errors[0], PeerFailed)
    assert "truncated frame" in str(errors[0]) and "version 7" in str(errors[0])
