"""The agent<->agent protocol on top of the authenticated Link (agent/link.py) and sync (agent/sync.py).

Two kinds of links, told apart by their first frame:

Control link (inference agent -> every trainer agent, one per pair, long-lived):
    i -> t  ws.hello    {pod, replica, session}
    t -> i  ws.welcome  {pod, ranks, latest, generation}
    t -> i  ws.announce {version}                 whenever the trainer pod has a new complete version
    i -> t  ws.meta?    {id, version}             the trainer ranks' shard metadata of a staged version
    t -> i  ws.meta     {id, version, ok, error?} + payload: JSON {ranks: {rank: [shard]}, aliases}
    t -> i  ws.error    {id?, message}            a request the trainer could not parse
    i -> t  ws.served   {version}                 this agent committed `version` into its engine (sent after
                                                  every commit, and again after a reconnect); the trainer
                                                  agent answers its trainer's wait_served from these

Transfer link (one per (source rank, destination rank) per version, short-lived):
    i -> t  ws.transfer {version, src, dst, replica, group, plan_hash, proposal} + payload: JSON plan inputs
    t -> i  ws.epoch    {src, epoch}              once every destination of the source rank joined
    then the sync protocol (sync.begin/ready/go/.../ack) through a Mailbox on both ends.

Why the inference side computes the plan and ships its inputs: only it knows the destination layouts,
and only the union of every trainer pod's metadata gives the sources; the trainer rebuilds the plan from
the same inputs, checks its own ranks' shards against what it staged, and sync compares the hashes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.agent.plan import DEFAULT_ALIGNMENT, TensorShard, TransferPlan, build_plan
from weightsync.agent.plan_cache import PLANS

HELLO = "ws.hello"
WELCOME = "ws.welcome"
ANNOUNCE = "ws.announce"
META_REQ = "ws.meta?"
META = "ws.meta"
ERROR = "ws.error"
SERVED = "ws.served"
TRANSFER = "ws.transfer"
EPOCH = "ws.epoch"


class ProtocolError(RuntimeError):
    """A peer agent sent a message this agent cannot act on; the message says which and why."""


def lowest_served(replicas: Mapping[int, int | None]) -> int | None:
    """The version every inference replica serves at least, from per-replica `ws.served` reports (the
    lowest one); None while some replica serves nothing or there is none. Shared by the trainer agent's
    fleet view and the client's answer to wait_served."""
    vs = list(replicas.values())
    if not vs or any(v is None for v in vs):
        return None
    return min(v for v in vs if v is not None)


def encode_meta(ranks: Mapping[int, Sequence[TensorShard]], aliases: Mapping[str, str]) -> bytes:
    doc = {"ranks": {str(r): [s.to_dict() for s in shards] for r, shards in ranks.items()}, "aliases": dict(aliases)}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_meta(payload: bytes | memoryview) -> tuple[dict[int, list[TensorShard]], dict[str, str]]:
    try:
        doc = json.loads(bytes(payload))
        ranks = {int(r): [TensorShard.from_dict(d) for d in shards] for r, shards in doc["ranks"].items()}
        aliases = {str(k): str(v) for k, v in doc.get("aliases", {}).items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"bad shard metadata: {exc}") from None
    return ranks, aliases


def encode_plan_inputs(sources: Sequence[Sequence[TensorShard]], needs: Sequence[Sequence[TensorShard]],
                       bucket_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    doc = {"sources": [[s.to_dict() for s in r] for r in sources], "needs": [[s.to_dict() for s in r] for r in needs],
           "bucket_bytes": bucket_bytes, "alignment": alignment}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_plan_inputs(payload: bytes | memoryview) -> tuple[list[list[TensorShard]], list[list[TensorShard]], int, int]:
    try:
        doc = json.loads(bytes(payload))
        sources = [[TensorShard.from_dict(d) for d in r] for r in doc["sources"]]
        needs = [[TensorShard.from_dict(d) for d in r] for r in doc["needs"]]
        return sources, needs, int(doc["bucket_bytes"]), int(doc.get("alignment", DEFAULT_ALIGNMENT))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"bad plan inputs: {exc}") from None


def plan_from_inputs(payload: bytes | memoryview) -> TransferPlan:
    """The plan the destination's inputs give: built once per distinct inputs (agent/plan_cache.py)."""
    def build() -> TransferPlan:
        sources, needs, bucket_bytes, alignment = decode_plan_inputs(payload)
        return build_plan(sources, needs, bucket_bytes, alignment=alignment)

    return PLANS.get_or_build(payload, build)


def require(header: Mapping[str, Any], key: str, typ: type) -> Any:
    """A typed field of a peer's header, or ProtocolError naming it."""
    value = header.get(key)
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
        raise ProtocolError(f"{header.get('kind')!r} frame needs {key!r} of type {typ.__name__}, got {value!r}")
    return value
