"""The agent<->agent protocol on top of the authenticated Link (agent/wire/link.py) and sync (agent/transfer/sync.py).

Two kinds of links, told apart by their first frame:

Control link (inference agent -> every trainer agent, one per pair, long-lived):
    i -> t  ws.hello    {pod, replica, session}
    t -> i  ws.welcome  {pod, ranks, latest, generation}
    t -> i  ws.announce {version}                 whenever the trainer pod has a new complete version
    i -> t  ws.meta?    {id, version}             the trainer ranks' shard metadata of a staged version
    t -> i  ws.meta     {id, version, ok, error?} + payload: binary {ranks, aliases, shard table}
    t -> i  ws.error    {id?, message}            a request the trainer could not parse
    i -> t  ws.served   {version}                 this agent committed `version` into its engine (sent after
                                                  every commit, and again after a reconnect); the trainer
                                                  agent answers its trainer's wait_served from these

Transfer link (one per (source rank, destination rank) per version, short-lived):
    i -> t  ws.transfer {version, src, dst, replica, group, plan_hash, proposal, plan_key, inputs_parts}
                        + payload: part 1 of the binary plan inputs (none when inputs_parts is 0)
    i -> t  ws.inputs   {part}  + payload      parts 2..inputs_parts (inputs bigger than one frame)
    t -> i  ws.epoch    {src, epoch, relay_to?, relay_from?}
                                                  once every destination of the source rank joined; with
                                                  spec.transfer.fanOut Relay it may place the replica in a
                                                  chain (agent/transfer/relay.py): relay_to {group, pod} forward this
                                                  source's buckets; relay_from {group, pod} take them from
                                                  that pod instead (the trainer then closes this link)
    then the sync protocol (sync.begin/ready/go/.../ack) through a Mailbox on both ends.

Relay link (fanOut Relay: downstream inference agent -> its upstream's control port, per (src, dst) and version):
    d -> u  ws.relay    {version, src, dst, plan_hash}
    u -> d  ws.epoch    {src, epoch}              once every destination rank of the source joined and the
                                                  upstream's own transfer expects them; then sync as above,
                                                  the upstream playing the source rank

Why the inference side computes the plan and ships its inputs: only it knows the destination layouts,
and only the union of every trainer pod's metadata gives the sources; the trainer rebuilds the plan from
the same inputs, checks its own ranks' shards against what it staged, and sync compares the hashes.

Why plan_key: the inputs of a large model are tens of MB and do not change between versions. A
destination sends them on its first link to each trainer agent (per trainer session and key); its other
links carry only plan_key (SHA-256 of the inputs), and the trainer agent takes the plan from its cache,
or waits for the one another link's inputs are building. Inputs bigger than a frame travel in parts.

Metadata and plan inputs are columnar (agent/plan/__init__.py ShardTable, pack_arrays): decoding them makes no
per-shard objects, and the same bytes decode to the same table object, so a version with the same
layout finds its plan by dictionary lookups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.agent.plan import (
    DEFAULT_ALIGNMENT,
    PlanError,
    PlanInputs,
    RankShards,
    ShardTable,
    TensorShard,
    TransferPlan,
    pack_arrays,
    unpack_arrays,
)
from weightsync.agent.plan.cache import PLANS
from weightsync.agent.wire.link import DEFAULT_MAX_PAYLOAD, Link

HELLO = "ws.hello"
WELCOME = "ws.welcome"
ANNOUNCE = "ws.announce"
META_REQ = "ws.meta?"
META = "ws.meta"
ERROR = "ws.error"
SERVED = "ws.served"
TRANSFER = "ws.transfer"
INPUTS = "ws.inputs"
EPOCH = "ws.epoch"
RELAY = "ws.relay"

INPUTS_WAIT = 60.0            # how long a key-only transfer link waits for a sibling link's inputs to build
MAX_INPUTS_BYTES = 256 << 20  # plan inputs a serving agent accepts (70k tensors x 256 ranks: 29 MB)


#: the trainer's local socket: the answer to a publish that names its tensor index by id (an index the agent
#: holds from the rank's last publish) when the agent does not hold it; the client sends the index itself then
INDEX_UNKNOWN = "tensor index unknown"
#: a Custom engine's local socket: the answer to a bucket that names its layout by id when the app does not hold
#: that layout (InferenceSession keeps a bounded number); the agent sends the layout itself then
LAYOUT_UNKNOWN = "bucket layout unknown"


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


class _Memo:
    """A small thread-safe LRU. Entries hold strong references to whatever their key names by id()."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: Hashable, value: Any) -> Any:
        with self._lock:
            self._d[key] = value
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


_METAS = _Memo(128)    # payload digest -> decoded metadata (one per trainer pod and layout)
_SOURCES = _Memo(4)    # (part tables, ranks, reachable) -> the stacked source table
_NEEDS = _Memo(8)      # (tensor table, world, tp, layout) -> the destination table
_INPUTS = _Memo(4)     # (sources, needs, bucket bytes, alignment) -> PlanInputs (its payload and key)


# --- metadata (ws.meta) -----------------------------------------------------------------------------------

def encode_meta(ranks: Mapping[int, Sequence[TensorShard]], aliases: Mapping[str, str]) -> bytes:
    """A trainer pod's ranks' shards (and tensor aliases) as one binary shard table."""
    rank_ids = sorted(ranks)
    return encode_meta_table(rank_ids, ShardTable.from_lists([ranks[r] for r in rank_ids]), aliases)


def encode_meta_table(rank_ids: Sequence[int], table: ShardTable, aliases: Mapping[str, str]) -> bytes:
    """encode_meta for a pod whose shards are already a table (row i is trainer rank rank_ids[i])."""
    if len(rank_ids) != table.num_ranks:
        raise ValueError(f"{len(rank_ids)} rank ids for a table of {table.num_ranks} ranks")
    meta, arrays = table.sections()
    return pack_arrays({"ranks": [int(r) for r in rank_ids], "aliases": dict(aliases), "table": meta}, arrays)


def decode_meta(payload: bytes | memoryview) -> tuple[dict[int, Sequence[TensorShard]], dict[str, str]]:
    """(rank -> shards, aliases). The shards are views of one table (RankShards); identical payloads
    (the same layout in a later version) give the same objects, so everything derived from them is
    found in the memos instead of being recomputed."""
    import xxhash

    digest = xxhash.xxh3_128(payload).digest()  # ~30 GB/s: only names an identical payload seen before
    got = _METAS.get(digest)
    if got is not None:
        return dict(got[0]), dict(got[1])
    try:
        meta, arrays = unpack_arrays(payload)
        rank_ids = [int(r) for r in meta["ranks"]]
        aliases = {str(k): str(v) for k, v in meta.get("aliases", {}).items()}
        table = ShardTable.from_sections(meta["table"], arrays)
        if len(rank_ids) != table.num_ranks or len(set(rank_ids)) != len(rank_ids):
            raise ValueError(f"{len(rank_ids)} rank ids for a table of {table.num_ranks} ranks")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"bad shard metadata: {exc}") from None
    ranks: dict[int, Sequence[TensorShard]] = {r: RankShards(table, i) for i, r in enumerate(rank_ids)}
    _METAS.put(digest, (ranks, aliases))
    return dict(ranks), dict(aliases)


def sources_table(src_meta: Mapping[int, Sequence[TensorShard]], world: int,
                  reachable: set[int] | None = None) -> ShardTable:
    """The plan's sources: trainer ranks 0..world-1 from their metadata (ranks outside `reachable`, when
    given, hold nothing). Made once per layout: the same metadata objects give the same table."""
    rows: list[tuple[ShardTable, int] | None] = []
    for r in range(world):
        shards = src_meta[r]
        if reachable is not None and r not in reachable:
            rows.append(None)
        elif isinstance(shards, RankShards):
            rows.append((shards.table, shards.rank))
        else:
            rows.append((ShardTable.from_lists([shards]), 0))
    key = (tuple(None if x is None else (id(x[0]), x[1]) for x in rows),
           None if reachable is None else frozenset(reachable))
    got = _SOURCES.get(key)
    if got is not None:
        return got[0]
    keep = [x[0] for x in rows if x is not None]  # keeps the ids in `key` from being reused
    table = ShardTable.stack(rows)
    _SOURCES.put(key, (table, keep))
    return table


def needs_table(sources: ShardTable, world: int, tensor_parallel: int, layout: Hashable,
                compute: Callable[[], Sequence[Sequence[TensorShard]] | ShardTable]) -> ShardTable:
    """The destination table `compute()` gives (per-rank lists or a table), made once per (tensor table
    of the sources, world, tensor parallelism, `layout`: the layout function, None for the defaults)."""
    key = (sources.tensors_digest, world, tensor_parallel, layout)
    got = _NEEDS.get(key)
    if got is None:
        made = compute()
        got = _NEEDS.put(key, made if isinstance(made, ShardTable) else ShardTable.from_lists(made, "destination"))
    return got


def tp_needs_table(sources: ShardTable, tensor_parallel: int) -> ShardTable:
    """What agent/layout/rules.py inference_layout gives every TP rank for the tensors of `sources` (the default
    rules, no overrides, nothing tied), as one table: the rule is looked up once per tensor and the
    boxes are computed as arrays (70k tensors: ~0.1 s instead of ~1.5 s of objects). Raises the
    LayoutError inference_layout would."""
    from weightsync.agent.layout.rules import TensorMeta, shard_dim, tp_shard

    dims = np.array([-1 if (d := shard_dim(n, nd)) is None else d
                     for n, nd in zip(sources.names, sources.ndim.tolist(), strict=True)], dtype=np.int64)
    if tensor_parallel > 1:
        split = np.flatnonzero(dims >= 0)
        bad = split[sources.gshape[split, dims[split]] % tensor_parallel != 0]
        if bad.size:
            t = int(bad[0])
            tp_shard(TensorMeta(sources.names[t], sources.dtypes[t], sources.global_shape(t)), tensor_parallel, 0)
    else:
        dims[:] = -1
    return ShardTable.split_even(sources, dims, tensor_parallel)


# --- plan inputs (ws.transfer) ---------------------------------------------------------------------------

def plan_inputs(sources: Sequence[Sequence[TensorShard]] | ShardTable,
                needs: Sequence[Sequence[TensorShard]] | ShardTable,
                bucket_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> PlanInputs:
    """The inputs of a plan; for tables, the same object (payload and key computed once) per layout."""
    if not isinstance(sources, ShardTable) or not isinstance(needs, ShardTable):
        s = sources if isinstance(sources, ShardTable) else ShardTable.from_lists(sources, "source")
        n = needs if isinstance(needs, ShardTable) else ShardTable.from_lists(needs, "destination")
        return PlanInputs(s, n, bucket_bytes, alignment)
    key = (id(sources), id(needs), int(bucket_bytes), int(alignment))
    got = _INPUTS.get(key)
    if got is None or got.sources is not sources or got.needs is not needs:
        got = _INPUTS.put(key, PlanInputs(sources, needs, bucket_bytes, alignment))
    return got


def encode_plan_inputs(sources: Sequence[Sequence[TensorShard]] | ShardTable,
                       needs: Sequence[Sequence[TensorShard]] | ShardTable,
                       bucket_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    return plan_inputs(sources, needs, bucket_bytes, alignment).payload


def decode_plan_inputs(payload: bytes | memoryview) -> tuple[ShardTable, ShardTable, int, int]:
    """(sources, needs, bucket_bytes, alignment); ProtocolError when the payload is malformed."""
    inputs = _decode_inputs(payload)
    return inputs.sources, inputs.needs, inputs.bucket_bytes, inputs.alignment


def _decode_inputs(payload: bytes | memoryview) -> PlanInputs:
    try:
        return PlanInputs.decode(payload)
    except PlanError as exc:
        raise ProtocolError(f"plan inputs break the plan rules: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"bad plan inputs: {exc}") from None


def plan_from_inputs(payload: bytes | memoryview | PlanInputs, key: str | None = None) -> TransferPlan:
    """The plan the destination's inputs give: built once per distinct inputs (agent/plan/cache.py)."""
    if isinstance(payload, PlanInputs):
        inputs = payload
        return PLANS.get_or_build(inputs, inputs.build)
    return PLANS.get_or_build_key(key or PLANS.key(payload), lambda: _decode_inputs(payload).build())


def send_transfer(link: Link, header: Mapping[str, Any], inputs: PlanInputs, *, with_inputs: bool) -> None:
    """Open a transfer: the ws.transfer frame with `header`, naming the plan by its inputs' key and
    carrying the inputs (in as many frames as the link's payload limit needs) when `with_inputs`."""
    view = memoryview(inputs.payload) if with_inputs else memoryview(b"")
    cap = min(link.max_payload, DEFAULT_MAX_PAYLOAD)
    parts = [view[i:i + cap] for i in range(0, len(view), cap)]
    link.send({**header, "plan_key": inputs.key, "inputs_parts": len(parts)}, parts[0] if parts else b"")
    for i, part in enumerate(parts[1:], 2):
        link.send({"kind": INPUTS, "part": i}, part)


def recv_transfer_inputs(link: Link, header: Mapping[str, Any], payload: memoryview,
                         timeout: float = 60.0) -> bytes | None:
    """On the serving side, right after a ws.transfer: the whole plan inputs it carries (reading the
    ws.inputs frames that follow it), or None when it names the plan by key only. Read these before
    attaching a Mailbox to the link."""
    if "plan_key" not in header:
        return bytes(payload)  # a sender that puts the whole inputs in the one frame
    parts = require(header, "inputs_parts", int)
    require(header, "plan_key", str)
    if parts == 0:
        return None
    if not 1 <= parts <= MAX_INPUTS_BYTES // max(1, len(payload)) + 1:
        raise ProtocolError(f"plan inputs in {parts} parts of {len(payload)} bytes exceed {MAX_INPUTS_BYTES} bytes")
    chunks = [bytes(payload)]
    total = len(payload)
    for i in range(2, parts + 1):
        h, p = link.recv(timeout=timeout)
        if h.get("kind") != INPUTS or h.get("part") != i:
            raise ProtocolError(f"expected part {i} of {parts} of the plan inputs, got {h.get('kind')!r} "
                                f"part {h.get('part')!r}")
        total += len(p)
        if total > MAX_INPUTS_BYTES:
            raise ProtocolError(f"plan inputs exceed {MAX_INPUTS_BYTES} bytes")
        chunks.append(bytes(p))
    return b"".join(chunks)


def transfer_plan(header: Mapping[str, Any], inputs: bytes | None, timeout: float = INPUTS_WAIT) -> TransferPlan:
    """The plan a ws.transfer names: built from (or found by) its inputs, or, when it came with the key
    only, the plan another link's inputs built, waiting up to `timeout` for it. ProtocolError otherwise."""
    key = header.get("plan_key")
    if inputs is not None:
        digest = PLANS.key(inputs)
        if key is not None and key != digest:
            raise ProtocolError(f"plan inputs do not match their key ({digest[:12]} != {str(key)[:12]})")
        try:
            return plan_from_inputs(inputs, digest)
        except PlanError as exc:
            raise ProtocolError(f"cannot plan from the destination's inputs: {exc}") from None
    if not isinstance(key, str):
        raise ProtocolError("a ws.transfer without plan inputs must name them by plan_key")
    try:
        return PLANS.wait_for(key, timeout)
    except KeyError as exc:
        raise ProtocolError(f"plan inputs {key[:12]} are unknown here ({exc.args[0]}); the destination sends them "
                            "again on its next attempt") from None


class _SentInputs:
    """Which trainer agents (host, trainer sessions) were sent which plan inputs by this agent."""

    def __init__(self) -> None:
        self._sent: OrderedDict[tuple[str, tuple[str, ...], str], None] = OrderedDict()
        self._lock = threading.Lock()

    def due(self, host: str, sessions: Sequence[str], key: str) -> bool:
        """True (and remembered) when a link to `host` must carry the inputs of `key`: the first one since
        any trainer agent (re)started."""
        k = (host, tuple(sessions), key)
        with self._lock:
            if k in self._sent:
                return False
            self._sent[k] = None
            while len(self._sent) > 4096:
                self._sent.popitem(last=False)
            return True

    def forget(self, key: str) -> None:
        """A transfer with these inputs failed: send them again next time."""
        with self._lock:
            for k in [k for k in self._sent if k[2] == key]:
                del self._sent[k]


SENT_INPUTS = _SentInputs()


def require(header: Mapping[str, Any], key: str, typ: type) -> Any:
    """A typed field of a peer's header, or ProtocolError naming it."""
    value = header.get(key)
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
        raise ProtocolError(f"{header.get('kind')!r} frame needs {key!r} of type {typ.__name__}, got {value!r}")
    return value
