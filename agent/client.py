"""The client library apps import: `TrainerSession` for trainers, `InferenceSession` for Custom engines.

Both talk to the pod's agent over its Unix socket (agent/wire/local.py); tensor bytes go through staging
segments (agent/staging/segments.py), so a publish is one copy of the trainer's local shards into shared memory and
returns as soon as the trainer may reuse (or keep updating) its own memory.

    with TrainerSession() as s:
        s.publish(model, version=step)            # nn.Module, state_dict, or (name, tensor) pairs
        s.wait_served(step - 1, timeout=600)      # bounded staleness: every replica serves >= step - 1

    sess = InferenceSession(on_bucket=load, on_commit=commit)
    sess.start()                                  # background thread; reconnects if the agent restarts
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from weightsync.agent.plan import buckets
from weightsync.agent.staging import ring, segments
from weightsync.agent.wire import local
from weightsync.agent.wire import protocol as P
from weightsync.crds import contract

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class TensorShard:
    """A local shard with explicit global placement, for tensor-parallel shards held as plain tensors."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


Weights = torch.nn.Module | Mapping[str, Any] | Iterable[tuple[str, Any]]


@dataclass(frozen=True)
class LocalShard:
    """What a rank publishes for one tensor: its local bytes and where they sit in the global tensor."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def default_socket_path() -> Path:
    explicit = os.environ.get(contract.ENV_APP_SOCKET)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR) / contract.AGENT_SOCKET_NAME


def _dtensor_shard(name: str, t: Any) -> LocalShard:
    """The local tensor and its box; a placement with no box (a _StridedShard whose rows are not
    contiguous, Partial, unknown types) is refused by name (dtensor_layout.PlacementError)."""
    from torch.distributed.tensor import DTensor

    from weightsync.agent.layout.dtensor import dtensor_local_box

    assert isinstance(t, DTensor)
    offset, _shape = dtensor_local_box(name, t)
    return LocalShard(name, t.to_local().detach(), tuple(t.shape), offset)


def _is_sharded_tensor(t: Any) -> bool:
    return any(c.__name__ == "ShardedTensor" and c.__module__.startswith("torch.distributed._shard")
               for c in type(t).__mro__)


def _sharded_tensor_shard(name: str, t: Any) -> LocalShard | None:
    """An FSDP1 ShardedTensor (SHARDED_STATE_DICT): this rank's one local shard with its global box, or None
    when this rank holds no shard of it (torch.chunk leaves the last ranks empty for a short dim 0)."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

    spec = t.sharding_spec()
    if not isinstance(spec, ChunkShardingSpec | EnumerableShardingSpec):
        raise ValueError(f"{name}: a ShardedTensor with sharding spec {type(spec).__name__} is not supported "
                         "(ChunkShardingSpec and EnumerableShardingSpec are); publish its local shard as a "
                         "TensorShard(tensor, global_shape, global_offset)")
    shards = t.local_shards()
    if not shards:
        return None
    if len(shards) > 1:
        raise ValueError(f"{name}: this rank holds {len(shards)} local shards of the ShardedTensor; one per rank is "
                         "supported (publish each as its own TensorShard under its own name, or reshard)")
    shard = shards[0]
    local_t = shard.tensor.detach()
    global_shape = tuple(int(d) for d in t.metadata().size)
    offset = tuple(int(o) for o in shard.metadata.shard_offsets)
    sizes = tuple(int(d) for d in shard.metadata.shard_sizes)
    if sizes != tuple(local_t.shape):
        raise ValueError(f"{name}: local shard shape {tuple(local_t.shape)} does not match its metadata {sizes}")
    if len(offset) != len(global_shape) or len(sizes) != len(global_shape):
        raise ValueError(f"{name}: shard offsets {offset} do not match the global shape {global_shape}")
    for d, (g, o, n) in enumerate(zip(global_shape, offset, sizes, strict=True)):
        if o < 0 or o + n > g:
            raise ValueError(f"{name}: dim {d} shard [{o}, {o + n}) lies outside global size {g}")
    return LocalShard(name, local_t, global_shape, offset)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """`t` out of autograd: a detached alias when it takes part in it, else itself (a detach per tensor cost
    microseconds each, tens of thousands of times per MoE publish, to change nothing)."""
    return t.detach() if t.requires_grad or t.grad_fn is not None else t


def _is_parameter(value: Any) -> bool:
    """isinstance(value, nn.Parameter) without its Python-level instance check for the common plain tensor."""
    if type(value) is torch.Tensor and not getattr(value, "_is_param", False):
        return False
    return isinstance(value, torch.nn.Parameter)


def _shard_of(name: str, value: Any) -> LocalShard | None:
    if isinstance(value, TensorShard):
        t = _detached(value.tensor)
        shape = t.shape
        if len(value.global_shape) != len(shape) or len(value.global_offset) != len(shape):
            raise ValueError(f"{name}: global shape/offset rank does not match the tensor's {t.dim()} dims")
        if any(o < 0 or o + n > g for g, o, n in zip(value.global_shape, value.global_offset, shape, strict=True)):
            d, g, o, n = next((d, g, o, n) for d, (g, o, n) in enumerate(zip(value.global_shape, value.global_offset,
                                                                             shape, strict=True)) if o < 0 or o + n > g)
            raise ValueError(f"{name}: dim {d} shard [{o}, {o + n}) lies outside global size {g}")
        return LocalShard(name, t, tuple(value.global_shape), tuple(value.global_offset))
    if type(value).__name__ == "DTensor":
        return _dtensor_shard(name, value)
    if _is_sharded_tensor(value):
        return _sharded_tensor_shard(name, value)
    if isinstance(value, torch.Tensor):
        t = _detached(value)
        return LocalShard(name, t, tuple(t.shape), (0,) * t.dim())
    raise TypeError(f"{name}: expected a tensor, DTensor, ShardedTensor or TensorShard, got {type(value).__name__}")


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if type(t).__name__ == "DTensor" or _is_sharded_tensor(t) or t.numel() == 0:
        return None
    # the first byte's address stands for (storage, offset): two views that start at the same address with the
    # same shape, strides and dtype are the same bytes (and it costs no storage object per tensor)
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def local_shards(weights: Weights) -> tuple[list[LocalShard], dict[str, str]]:
    """Normalise what the app passes to publish into local shards, plus tied aliases {dropped: kept}.

    Tied weights (e.g. lm_head.weight sharing embed_tokens.weight) are published once under the first name;
    the alias map tells receivers the other name refers to the same bytes.
    """
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = weights.state_dict(keep_vars=True).items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    shards: list[LocalShard] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    names: set[str] = set()
    for name, value in items:
        if name in names:
            raise ValueError(f"tensor name {name!r} appears twice in one publish")
        names.add(name)
        raw = value.data if not isinstance(value, TensorShard) and _is_parameter(value) else value
        key = _alias_key(raw) if isinstance(raw, torch.Tensor) else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        shard = _shard_of(name, raw)
        if shard is not None:  # None: a ShardedTensor of which this rank holds no shard
            shards.append(shard)
    return shards, aliases


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order: the same digest on both sides means bit-exact."""
    c = t.detach().contiguous().cpu()
    if c.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(c.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in named}


@dataclass(frozen=True)
class PublishResult:
    version: int
    tensors: int
    bytes: int
    seconds: float
    #: ring staging (agent/staging/ring.py): "snapshot" (returned after a snapshot of `snapshot_bytes`), "held" (returned
    #: once the fleet served the version, or after hold_timeout: then `served` is False); "" otherwise
    streamed: str = ""
    snapshot_bytes: int = 0
    served: bool | None = None


@dataclass(frozen=True)
class ServedState:
    """What the inference fleet serves, as this trainer pod's agent knows it (`TrainerSession.served()`).

    The trainer agent learns it from the inference agents themselves: after every version an inference
    agent committed into its engine (every bucket arrived, verified, committed) it reports that version on
    its authenticated control link to every trainer agent, and again after a reconnect. Nothing an app
    container writes (an engine's own claim, a pod annotation) counts. A replica serves a version when every
    pod of it that loads weights reported it (for SGLang and vLLM the pod holding the replica's rank 0 loads
    for the whole replica; for Custom engines every pod); a pod whose agent is not connected to this trainer
    pod's agent, or has not committed a version since it (re)started, serves None.
    """

    replicas: dict[int, int | None]                # inference replica -> version it serves (None: nothing yet)
    pods: dict[int, dict[str, int | None]]         # replica -> its loading pods -> what each agent reported

    @property
    def version(self) -> int | None:
        """The version every replica serves at least (the lowest one); None while a replica serves nothing."""
        return P.lowest_served(self.replicas)

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> ServedState:
        def version(v: Any) -> int | None:
            return None if v is None else int(v)

        replicas: dict[int, int | None] = {}
        pods: dict[int, dict[str, int | None]] = {}
        for r in reply.get("replicas") or []:
            replicas[int(r["replica"])] = version(r.get("served"))
            pods[int(r["replica"])] = {str(p): version(v) for p, v in (r.get("pods") or {}).items()}
        return cls(replicas, pods)

    def describe(self, below: int | None = None) -> str:
        """E.g. 'replica 0 serves 7 (pod job-inference-0-0: 7); replica 1 serves nothing yet (pod
        job-inference-1-0: none)'; with `below`, only the replicas that serve less than it."""
        if not self.replicas:
            return "the job has no inference replica"
        parts = []
        for r, v in sorted(self.replicas.items()):
            if below is not None and v is not None and v >= below:
                continue
            pods = ", ".join(f"pod {p}: {'none' if pv is None else pv}" for p, pv in sorted(self.pods.get(r, {}).items()))
            parts.append(f"replica {r} serves {'nothing yet' if v is None else v}" + (f" ({pods})" if pods else ""))
        return "; ".join(parts)


class ServedTimeout(TimeoutError):
    """`wait_served` gave up: not every inference replica serves the version within the timeout."""

    def __init__(self, version: int, timeout: float, state: ServedState, only_serving: bool = False) -> None:
        self.version = version
        self.timeout = timeout
        self.state = state
        behind = sum(1 for v in state.replicas.values() if v is None or v < version)
        which = "every inference replica that serves something" if only_serving else "every inference replica"
        super().__init__(f"version {version} is not served by {which} after {timeout:g}s: "
                         f"{behind} of {len(state.replicas)} replicas are behind: {state.describe(below=version)}")


class AgentUnavailable(ConnectionError):
    """The agent went away and did not come back within the session's `reconnect_timeout`: the call did not
    happen (a publish is not staged). Training may go on and publish the next version later."""


def _link_lost(exc: BaseException) -> bool:
    """A lost agent connection (worth a reconnect), as opposed to an answer or a deadline."""
    return isinstance(exc, (OSError, local.LocalProtocolError)) and not isinstance(
        exc, (TimeoutError, local.PeerAnswer))


#: where a shard staged in pieces puts each one: (offset in the shard, shape, byte offset in staging)
PiecePlaces = list[tuple[tuple[int, ...], tuple[int, ...], int]]


def arena_offsets(shards: Sequence[LocalShard], layout: Any, size: int) -> list[int | PiecePlaces | None] | None:
    """Where each of `shards` goes in the staging layout the agent asked for (its plan's buckets, so they are
    sent straight from staging): a byte offset for a shard staged whole, or its pieces' places for a shard
    that travels in pieces (`layout["pieces"]`: each is copied to its place in its bucket, so this one copy
    is also the pack), or None for a shard the plan sends from another rank (`layout["unsent"]`: a data-
    parallel replica owns it; it is published by metadata only). None when the layout does not describe
    exactly these tensors (first version, changed model): then they are packed in order and the agent packs
    buckets itself."""
    if not isinstance(layout, dict):
        return None
    try:
        index = {e.name: e for e in buckets.BucketLayout.from_dict(layout).entries}
        pieces: dict[str, PiecePlaces] = {}
        for p in layout.get("pieces") or ():
            pieces.setdefault(str(p["name"]), []).append(
                (tuple(int(x) for x in p["offset"]), tuple(int(x) for x in p["shape"]), int(p["at"])))
        unsent = {str(n) for n in layout.get("unsent") or ()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if set(index) & set(pieces) or unsent & (set(index) | set(pieces)) or \
            set(index) | set(pieces) | unsent != {s.name for s in shards}:
        return None
    out: list[int | PiecePlaces | None] = []
    for s in shards:
        dtype, shape, isz = segments.dtype_name(s.tensor.dtype), tuple(s.tensor.shape), s.tensor.element_size()
        if s.name in unsent:
            out.append(None)
            continue
        if s.name in pieces:
            places = pieces[s.name]
            if any(len(o) != len(shape) or len(n) != len(shape) or at < 0 or at + math.prod(n) * isz > size
                   or any(a < 0 or a + b > d for a, b, d in zip(o, n, shape, strict=True)) for o, n, at in places):
                return None
            if sum(math.prod(n) for _, n, _ in places) != math.prod(shape):
                return None
            out.append(places)
            continue
        e = index[s.name]
        if e.dtype != dtype or e.shape != shape or e.offset + e.nbytes > size:
            return None
        out.append(e.offset)
    return out


def oversubscribed_threads(env: Mapping[str, str] | None = None) -> str | None:
    """Why this rank's copy of CPU tensors into staging may stall, or None. The copy runs on torch's intra-op
    threads (one per core by default); with several ranks on one pod (torchrun's LOCAL_WORLD_SIZE), each
    running one per core, their OpenMP threads spin against each other. Measured with two ranks on two
    cores (bench/agent_pipeline.py --mode ipc --fsdp 2 --inference-tp 2): the copy took up to 2 s instead
    of 0.06 s. torchrun sets OMP_NUM_THREADS=1 per rank unless it is set; this catches the other launchers."""
    env = os.environ if env is None else env
    try:
        local_ranks = int(env.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        return None
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks <= 1 or local_ranks * threads <= cores:
        return None
    return (f"{local_ranks} local ranks x {threads} intra-op threads each > {cores} cores: the copy into staging "
            "runs on those threads and can stall for seconds; launch ranks as torchrun does (OMP_NUM_THREADS=1) "
            f"or set OMP_NUM_THREADS to at most {max(1, cores // local_ranks)}")


ShardKey = tuple[tuple[str, torch.dtype, torch.Size, tuple[int, ...], tuple[int, ...]], ...]


def shard_key(shards: Sequence[LocalShard]) -> ShardKey:
    """What a publish's staging layout depends on in its shards: names, dtypes, shapes and global boxes."""
    return tuple([(s.name, s.tensor.dtype, s.tensor.shape, s.global_shape, s.global_offset) for s in shards])


@dataclass
class StagingLayout:
    """One publish's places and tensor index, kept for the next publish of the same shards into the same layout.

    Why: an MoE version has tens of thousands of tensors, and the places (arena_offsets: a parse of the agent's
    layout), the index sent with the publish, and the staging views to copy into were rebuilt per tensor and per
    version (about 40 us per tensor). They depend only on the shards' metadata, the layout the agent sent and the
    segment, so they are built once per layout and segment; every publish still copies every byte."""

    layout: Any
    size: int
    key: ShardKey
    places: Sequence[int | PiecePlaces | None]
    metas: list[dict[str, Any]]
    #: segment name -> the staging views each copy writes to (shard order; a shard in pieces: one per piece)
    views: dict[str, list[torch.Tensor]]
    layout_id: str = ""  # the agent's name for `layout` (it then replies `layout_same` instead of sending it)
    index_id: str = ""   # the agent's name for `metas` once it accepted them (a publish then sends the name only)

    def matches(self, layout: Any, size: int, key: ShardKey) -> bool:
        return self.size == size and self.key == key and self.layout == layout


def staging_views(seg: segments.Segment, shards: Sequence[LocalShard],
                  places: Sequence[int | PiecePlaces | None]) -> list[torch.Tensor]:
    """The views of `seg` the shards are copied to: one per shard staged whole, one per piece of a shard staged
    in pieces, none for a shard another rank sends. Slices of one typed view of the segment per dtype."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: list[torch.Tensor] = []
    for s, place in zip(shards, places, strict=True):
        if place is None:
            continue
        dt = s.tensor.dtype
        flat = typed.get(dt)
        if flat is None:
            isz = torch.empty((), dtype=dt).element_size()
            flat = typed[dt] = seg.tensor[: seg.size // isz * isz].view(dt)
        isz = flat.element_size()
        for at, shape in ([(place, tuple(s.tensor.shape))] if isinstance(place, int) else
                          [(at, shape) for _, shape, at in place]):
            n = math.prod(shape)
            if at % isz or at + n * isz > seg.size:
                raise ValueError(f"{s.name}: staging place {at} (+{n * isz} B) is unaligned or outside segment "
                                 f"{seg.name} of {seg.size} B")
            out.append(flat[at // isz: at // isz + n].view(shape))
    return out


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Every src into its dst: one foreach call for CPU tensors (a loop of copy_ calls in C++; from Python it cost
    about 5 us per tensor more), else a copy each. Not on CUDA: into a staging segment opened from the agent's CUDA
    IPC handle, `_foreach_copy_` left the engines with other bytes (bench/agent_pipeline.py --device cuda on an
    H200, torch 2.11: bit_exact false; the same copies one by one, and foreach between one process's own views,
    were exact). CUDA copies are asynchronous launches anyway."""
    if not dsts:
        return
    if all(t.device.type == "cpu" for t in dsts) and all(t.device.type == "cpu" for t in srcs):
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, t in zip(dsts, srcs, strict=True):
            d.copy_(t)


class TrainerSession:
    """A trainer rank's connection to its agent. Not thread-safe: one publish at a time per session.

    When the agent restarts (its container is restarted, or upgraded), a call in flight reconnects with
    back-off for up to `reconnect_timeout` seconds and is done again from the start (a publish is staged
    again: the new agent holds nothing of the old one); after that it raises AgentUnavailable. An answer
    from the agent (e.g. a version that does not increase) is raised at once, never retried.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, rank: int | None = None,
                 timeout: float = 120.0, reconnect_timeout: float = 120.0, ring_snapshot: str = "auto",
                 hold_timeout: float = 600.0) -> None:
        """`ring_snapshot` and `hold_timeout` apply when the agent streams versions (ring staging,
        agent/staging/ring.py): `auto` snapshots CUDA tensors on their device and holds CPU tensors (publish returns
        once every inference replica serves the version, at most `hold_timeout` s); `copy` snapshots every
        tensor on its device; `none` holds every tensor."""
        if ring_snapshot not in ring.SNAPSHOT_MODES:
            raise ValueError(f"ring_snapshot must be one of {', '.join(ring.SNAPSHOT_MODES)}, got {ring_snapshot!r}")
        self.ring_snapshot = ring_snapshot
        self.hold_timeout = hold_timeout
        self._streamer: ring.Streamer | None = None
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.rank = int(os.environ.get(contract.ENV_RANK, "0")) if rank is None else rank
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        # One id per trainer process and rank, kept across reconnects: a publish from a new id that does not
        # increase the version is a restarted trainer (a new trainer epoch), not a stale one.
        self.session_id = uuid.uuid4().hex
        self._conn: local.LocalConn | None = None
        self._segments: dict[str, segments.Segment] = {}
        self._threads_checked = False
        self._layout: StagingLayout | None = None  # the last publish's places, index and views (StagingLayout)

    def _drop_connection(self) -> None:
        """Forget the agent: its connection and the staging segments it handed out."""
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._layout = None  # its views map segments of the agent that went away
        if self._streamer is not None:
            self._streamer.close()
            self._streamer = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """CALL, done again after a reconnect whenever the agent connection is lost mid-way."""
        deadline: float | None = None
        delay = 0.1
        while True:
            try:
                return call()
            except BaseException as exc:
                if not _link_lost(exc):
                    raise
                self._drop_connection()
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.reconnect_timeout
                if now >= deadline:
                    raise AgentUnavailable(
                        f"{what}: the weightsync agent at {self.socket_path} went away and did not come back "
                        f"within {self.reconnect_timeout:g}s ({exc}); nothing was done") from exc
                log.warning("agent connection lost during %s, reconnecting: %s", what, exc)
                self.reconnects += 1
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 2.0)

    def _connection(self) -> local.LocalConn:
        if self._conn is None:
            conn = local.connect(self.socket_path, min(self.timeout, self.reconnect_timeout))
            conn.request({"op": "hello", "kind": "trainer", "rank": self.rank, "pid": os.getpid(),
                          "session": self.session_id})
            self._conn = conn
        return self._conn

    #: staging segments kept mapped (the agent rotates 2-3 per rank; one it replaced, e.g. by a smaller one once
    #: the plan sends less from this rank, is unmapped here so that its memory is freed)
    KEEP_SEGMENTS = 4

    def _segment(self, handle: dict[str, Any]) -> segments.Segment:
        name = str(handle["name"])
        seg = self._segments.pop(name, None)
        if seg is None or seg.size != int(handle["size"]):
            if seg is not None:
                self._forget_views(name)
                seg.close()
            seg = segments.attach_segment(handle)
        self._segments[name] = seg  # most recently used last
        while len(self._segments) > self.KEEP_SEGMENTS:
            old = next(iter(self._segments))
            self._forget_views(old)
            self._segments.pop(old).close()
        return seg

    def _forget_views(self, name: str) -> None:
        """Drop the cached views of a segment this process unmaps (they would keep its memory mapped)."""
        if self._layout is not None:
            self._layout.views.pop(name, None)

    def publish(self, weights: Weights, version: int) -> PublishResult:
        """Stage this rank's shards of `version` with the agent; returns when `weights` may be reused.
        Raises AgentUnavailable when the agent is gone for longer than `reconnect_timeout`."""
        if version < 1:
            raise ValueError(f"version must be >= 1, got {version}")
        return self._retrying(f"publish({version})", lambda: self._publish_once(weights, version))

    def _publish_once(self, weights: Weights, version: int) -> PublishResult:
        t0 = time.perf_counter()
        shards, aliases = local_shards(weights)
        sizes = [segments.tensor_nbytes(s.tensor) for s in shards]
        offsets, total = segments.pack_offsets(sizes)
        devices = {s.tensor.device.type for s in shards}
        device = "cpu" if devices <= {"cpu"} else str(next(s.tensor.device for s in shards if s.tensor.is_cuda))
        if "cpu" in devices and not self._threads_checked:
            self._threads_checked = True
            why = oversubscribed_threads()
            if why:
                log.warning("trainer.threads_oversubscribed rank=%s %s", self.rank, why)
        conn = self._connection()
        known = self._layout.layout_id if self._layout is not None and self._layout.layout_id else None
        reply = conn.request({"op": "stage", "version": version, "rank": self.rank, "nbytes": total, "device": device,
                              "stream": True, "skip_unsent": True, **({"layout_id": known} if known else {})})
        if "ring" in reply:
            return self._publish_streamed(conn, version, shards, aliases, sizes, t0)
        seg = self._segment(reply["segment"])
        key = shard_key(shards)
        layout = self._layout_of(reply)
        arena = self._arena(shards, layout, seg.size, key)
        if arena is None and seg.size < total:
            # a layout without the shards other ranks send, which does not describe these tensors (the model
            # changed): ask for a segment that holds them all, packed in order
            reply = conn.request({"op": "stage", "version": version, "rank": self.rank, "nbytes": total,
                                  "device": device, "stream": True})
            seg = self._segment(reply["segment"])
            layout = self._layout_of(reply)
            arena = self._arena(shards, layout, seg.size, key)
        places: Sequence[int | PiecePlaces | None] = arena or offsets
        lay = self._staging_layout(seg, shards, places, sizes, layout=layout if arena else None, key=key)
        lay.layout_id = str(reply.get("layout_id") or "") if arena else ""
        srcs: list[torch.Tensor] = []
        for s, place in zip(shards, places, strict=True):
            if place is None:  # another rank sends it (this one is a data-parallel replica): not copied
                continue
            if isinstance(place, int):
                srcs.append(s.tensor)
            else:  # each piece straight to its place in its bucket: a strided copy, the only one
                srcs.extend(s.tensor[tuple(slice(o, o + k) for o, k in zip(off, shape, strict=True))]
                            for off, shape, _ in place)
        with torch.no_grad():
            copy_all(lay.views[seg.name], srcs)
        metas = lay.metas
        if seg.tensor.is_cuda:
            torch.cuda.synchronize(seg.tensor.device)
        head = {"op": "publish", "version": version, "rank": self.rank, "segment": seg.name, "aliases": aliases}
        done: dict[str, Any] | None = None
        if lay.index_id and reply.get("index") == lay.index_id:  # the agent holds this very index: name it
            try:
                done = conn.request({**head, "index": lay.index_id})
            except local.PeerAnswer as exc:
                if P.INDEX_UNKNOWN not in str(exc):
                    raise
        if done is None:
            done = conn.request({**head, "tensors": metas})
        lay.index_id = str(done.get("index") or "")
        return PublishResult(version, len(metas), sum(sizes), time.perf_counter() - t0)

    def _layout_of(self, reply: Mapping[str, Any]) -> Any:
        """The staging layout of a stage reply: the one this session holds when the agent says it is the same."""
        lay = self._layout
        if reply.get("layout_same") is True and lay is not None and lay.layout_id and \
                reply.get("layout_id") == lay.layout_id:
            return lay.layout
        return reply.get("layout")

    def _arena(self, shards: Sequence[LocalShard], layout: Any, size: int, key: ShardKey
               ) -> list[int | PiecePlaces | None] | None:
        """arena_offsets, or the last publish's places when the layout, segment size and shards are the same."""
        known = self._layout
        if layout is not None and known is not None and known.matches(layout, size, key):
            return list(known.places)
        return arena_offsets(shards, layout, size)

    def _staging_layout(self, seg: segments.Segment, shards: Sequence[LocalShard],
                        places: Sequence[int | PiecePlaces | None], sizes: Sequence[int], *, layout: Any,
                        key: ShardKey) -> StagingLayout:
        """The publish's tensor index and `seg`'s views for these places: the last ones when nothing changed."""
        known = self._layout
        if known is None or not known.matches(layout, seg.size, key) or \
                list(known.places) != list(places):
            metas = []
            for s, place, n in zip(shards, places, sizes, strict=True):
                meta: dict[str, Any] = {
                    "name": s.name, "dtype": segments.dtype_name(s.tensor.dtype), "shape": list(s.tensor.shape),
                    "global_shape": list(s.global_shape), "global_offset": list(s.global_offset), "nbytes": n,
                }
                if place is None:
                    meta["unstaged"] = True
                elif isinstance(place, int):
                    meta["offset"] = place
                else:
                    meta["offset"] = place[0][2]
                    meta["pieces"] = [{"offset": list(o), "shape": list(k), "at": at} for o, k, at in place]
                metas.append(meta)
            for name in list(known.views) if known is not None else ():
                self._forget_views(name)
            known = self._layout = StagingLayout(layout, seg.size, key, list(places), metas, {})
        if seg.name not in known.views:
            known.views[seg.name] = staging_views(seg, shards, places)
        return known

    def _stream(self) -> ring.Streamer:
        if self._streamer is None or not self._streamer.alive:
            if self._streamer is not None:
                self._streamer.close()
            self._streamer = ring.Streamer(self.socket_path, self.rank, self.session_id,
                                           min(self.timeout, self.reconnect_timeout))
        return self._streamer

    def _publish_streamed(self, conn: local.LocalConn, version: int, shards: list[LocalShard],
                          aliases: dict[str, str], sizes: list[int], t0: float) -> PublishResult:
        """Ring staging (agent/staging/ring.py): nothing is copied into staging here. The shards (or a snapshot of
        them) stay in this process and each transfer has the stream thread copy them, bucket by bucket,
        into its ring."""
        streamer = self._stream()
        source, snap, hold = ring.snapshot_of({s.name: s.tensor for s in shards}, self.ring_snapshot)
        streamer.add(version, source)
        metas = [{"name": s.name, "dtype": segments.dtype_name(s.tensor.dtype), "shape": list(s.tensor.shape),
                  "global_shape": list(s.global_shape), "global_offset": list(s.global_offset), "nbytes": n}
                 for s, n in zip(shards, sizes, strict=True)]
        try:
            conn.request({"op": "publish_stream", "version": version, "rank": self.rank, "tensors": metas,
                          "aliases": aliases, "snapshot_bytes": snap, "hold": hold})
        except BaseException:
            streamer.drop(version)
            raise
        served: bool | None = None
        if hold:  # the stream reads our own tensors: held until every replica serves the version
            try:
                reply = conn.request({"op": "wait_served", "version": version, "timeout": self.hold_timeout},
                                     timeout=self.hold_timeout + 30.0)
                served = bool(reply.get("reached"))
            finally:
                streamer.drop(version)
                with contextlib.suppress(OSError, local.LocalProtocolError):
                    conn.request({"op": "release", "version": version, "rank": self.rank})
            if not served:
                log.warning("publish(%s): not every inference replica loaded the version within hold_timeout=%gs "
                            "while the trainer was held (ring staging without a snapshot); it is withdrawn, "
                            "the replicas catch up with a later version", version, self.hold_timeout)
        return PublishResult(version, len(metas), sum(sizes), time.perf_counter() - t0,
                             streamed="held" if hold else "snapshot", snapshot_bytes=snap, served=served)

    def served(self) -> ServedState:
        """What every inference replica serves now (see ServedState for where it comes from)."""
        return self._retrying("served()", lambda: ServedState.from_reply(self._connection().request({"op": "served"})))

    def wait_served(self, version: int, timeout: float = 600.0, *, only_serving: bool = False) -> ServedState:
        """Block until every inference replica serves `version` or newer, i.e. its loading agents committed
        such a version into the engine (ServedState); returns what is served then. Raises ServedTimeout
        (a TimeoutError naming the version, the timeout and what each replica serves) after `timeout` s.

        Bounded staleness for on-policy RL: `publish(model, version=step)`, then
        `wait_served(step - max_staleness, timeout)` before generating rollouts. A version < 1 is reached at
        once (nothing to wait for in the first steps). Scaled-up replicas count once they are in the
        topology; a replica that never loads (its engine down) makes every wait time out, unless
        `only_serving`: then replicas that serve nothing right now (pod deleted or rescheduled, agent
        restarting, engine not up yet) are not waited for, and at least one replica must serve `version`.
        Such a replica is out of the routing Service too (its readiness gate is False until its first
        sync), so rollouts keep coming from the others; tag each rollout with the version that generated
        it (docs/trainer-recipes.md) to enforce the bound per rollout.
        """
        if not timeout >= 0 or timeout == float("inf"):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        if version < 1:
            return self.served()
        end = time.monotonic() + timeout
        asked: list[float] = []

        def ask() -> dict[str, Any]:
            # the whole timeout the first time; after a reconnect, what is left of it
            left = float(timeout) if not asked else max(0.0, end - time.monotonic())
            asked.append(left)
            # the agent answers within `left`; the slack covers a busy agent, not a lost one
            req: dict[str, Any] = {"op": "wait_served", "version": int(version), "timeout": left}
            if only_serving:
                req["only_serving"] = True
            return self._connection().request(req, timeout=left + 30.0)

        try:
            reply = self._retrying(f"wait_served({version})", ask)  # asked again after an agent restart
        except TimeoutError:
            if self._conn is not None:
                self._conn.close()  # a late reply would answer the next request
                self._conn = None
            raise TimeoutError(f"the weightsync agent at {self.socket_path} did not answer wait_served({version}) "
                               f"within {timeout + 30.0:g}s") from None
        state = ServedState.from_reply(reply)
        if not reply.get("reached"):
            raise ServedTimeout(version, timeout, state, only_serving)
        return state

    def close(self) -> None:
        """Disconnect. With ring staging the versions this process streams are withdrawn (it holds their
        bytes): keep the session open while the last version should still be served."""
        self._drop_connection()

    def __enter__(self) -> TrainerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BucketCallback = Callable[[int, list[tuple[str, torch.Tensor]]], None]
#: (version, [(name, index, piece)]): load `piece` into `tensor[index]` of the engine's tensor `name`
PiecesCallback = Callable[[int, list[tuple[str, tuple[slice, ...], torch.Tensor]]], None]


class InferenceSession:
    """A Custom engine's end of the agent: the agent drives, this session calls the engine's callbacks.

    `on_bucket(version, [(name, tensor), ...])` must copy what it keeps: the tensors alias a staging segment
    that the agent reuses for the next bucket. `on_commit(version)` is called once per version, only after
    every bucket arrived; `on_abort(version, reason)` when a partial load is dropped. Pause and resume
    callbacks are optional (the demo engine refuses predictions while paused). `on_pieces(version, [(name, index,
    piece), ...])` (optional): a tensor that arrives in pieces (a resharded layout: trainer FSDP, engine TP) is
    handed over piece by piece, each to be loaded into `tensor[index]` of the engine's own tensor, in place of
    the agent assembling it first (a copy per byte of such tensors); the same rule as `on_bucket` applies (the
    pieces alias reused memory). `layout` (agent/layout/engine.py:
    head counts, experts, expert parallelism) makes the agent send each rank its head-wise boxes instead of the
    default row split; every rank passes the same one.
    """

    def __init__(
        self,
        on_bucket: BucketCallback,
        on_commit: Callable[[int], None],
        *,
        on_begin: Callable[[int], None] | None = None,
        on_abort: Callable[[int, str], None] | None = None,
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        served_version: int | None = None,
        layout: Mapping[str, Any] | None = None,
        on_pieces: PiecesCallback | None = None,
    ) -> None:
        self.on_bucket = on_bucket
        self.on_pieces = on_pieces
        if layout is not None:  # refused here, by field, rather than by the agent at every reconnect
            from weightsync.agent.layout.engine import EngineLayout

            EngineLayout.from_dict(layout)
        self.layout = dict(layout) if layout is not None else None
        self.on_commit = on_commit
        self.on_begin = on_begin
        self.on_abort = on_abort
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.rank = int(os.environ.get(contract.ENV_RANK, "0")) if rank is None else rank
        self.served_version = served_version
        self.paused = False
        self.loading: int | None = None  # version begun and not yet committed or aborted
        self.connected = threading.Event()
        self._segments: dict[str, segments.Segment] = {}
        #: (segment, first offset, entries) -> (segment, layout dict, its views): InferenceSession._pairs
        self._layouts: dict[tuple[Any, ...], tuple[segments.Segment, Any, list[tuple[str, torch.Tensor]]]] = {}
        self._stop = threading.Event()
        self._conn: local.LocalConn | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> InferenceSession:
        self._thread = threading.Thread(target=self.serve_forever, name="weightsync-inference", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve the agent's requests; reconnect when the agent restarts, until close()."""
        while not self._stop.is_set():
            try:
                self._conn = local.connect(self.socket_path, timeout=3600)
                self._conn.request({"op": "hello", "kind": "inference", "rank": self.rank, "pid": os.getpid(),
                                    "served_version": self.served_version, "paused": self.paused,
                                    **({"layout": self.layout} if self.layout is not None else {})})
                self.connected.set()
                self._serve(self._conn)
            except (ConnectionError, OSError, local.LocalProtocolError) as exc:
                if self._stop.is_set():
                    return
                log.warning("agent connection lost, reconnecting: %s", exc)
                self._drop_partial("the agent disconnected in the middle of the load")
                time.sleep(0.2)
            finally:
                self.connected.clear()
                if self._conn is not None:
                    self._conn.close()

    def _serve(self, conn: local.LocalConn) -> None:
        while not self._stop.is_set():
            header, _ = conn.recv()
            try:
                fields = self._handle(header)
            except Exception as exc:
                log.exception("engine callback failed op=%s", header.get("op"))
                conn.reply_error(f"{type(exc).__name__}: {exc}")
            else:
                conn.reply_ok(**fields)

    def _handle(self, h: dict[str, Any]) -> dict[str, Any]:
        op = h["op"]
        if op == "bucket":
            seg = self._segment(h["segment"])
            pairs = self._pairs_by_id(seg, h) if "layout_id" in h else self._pairs(seg, h["layout"])
            places = h.get("places")
            if places is None:
                self.on_bucket(int(h["version"]), pairs)
            else:
                self._load_pieces(int(h["version"]), pairs, places)
            if seg.tensor.is_cuda:
                torch.cuda.synchronize(seg.tensor.device)  # the agent reuses the buffer after our reply
        elif op == "begin":
            if self.on_begin:
                self.on_begin(int(h["version"]))
            self.loading = int(h["version"])
        elif op == "commit":
            self.on_commit(int(h["version"]))
            self.served_version = int(h["version"])
            self.loading = None
        elif op == "abort":
            self.loading = None
            if self.on_abort:
                self.on_abort(int(h["version"]), str(h.get("reason", "")))
        elif op == "pause":
            if self.on_pause:
                self.on_pause()
            self.paused = True
        elif op == "resume":
            if self.on_resume:
                self.on_resume()
            self.paused = False
        elif op == "release":
            self._release(str(h.get("name", "")))
        elif op != "served":
            raise ValueError(f"unknown op {op!r}")
        return {"version": self.served_version, "layout_ids": True,
                **({"pieces": True} if self.on_pieces is not None else {})}

    #: bucket layouts whose views are kept (per agent connection); a version's buckets, a few times over
    KEEP_LAYOUTS = 1024

    def _pairs(self, seg: segments.Segment, layout_dict: Any) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every entry of the bucket the agent placed in `seg`. The agent sends the same layouts
        at the same places every version (its receive slots are kept): a layout equal to one already seen in
        this segment takes the views made then, instead of parsing the index and making a view per tensor again
        (for a bucket of thousands of small tensors that was most of the engine's load time)."""
        entries = layout_dict.get("entries") if isinstance(layout_dict, dict) else None
        first = entries[0].get("offset") if isinstance(entries, list) and entries and isinstance(entries[0], dict) \
            else None
        key = (seg.name, first, len(entries) if isinstance(entries, list) else -1)
        hit = self._layouts.get(key)
        if hit is not None and hit[0] is seg and hit[1] == layout_dict:
            return list(hit[2])
        layout = buckets.BucketLayout.from_dict(layout_dict)
        if layout.nbytes > seg.size:
            raise ValueError(f"bucket of {layout.nbytes} B does not fit segment {seg.name} ({seg.size} B)")
        pairs = buckets.unpack(seg.tensor, layout)
        if len(self._layouts) >= self.KEEP_LAYOUTS:
            self._layouts.clear()
        self._layouts[key] = (seg, layout_dict, pairs)
        return list(pairs)

    def _pairs_by_id(self, seg: segments.Segment, h: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """A bucket whose layout the agent names by id (it sends the layout with the id once, then the id only):
        its views, made when the layout came. An id this session does not hold (evicted, or never sent to it)
        is refused by name (protocol.LAYOUT_UNKNOWN) and the agent sends the layout again."""
        lid = ("id", str(h["layout_id"]))
        if "layout" in h:
            pairs = self._pairs(seg, h["layout"])
            if len(self._layouts) >= self.KEEP_LAYOUTS:
                self._layouts.clear()
            self._layouts[lid] = (seg, None, pairs)
            return pairs
        hit = self._layouts.get(lid)
        if hit is None or hit[0] is not seg:
            raise ValueError(f"{P.LAYOUT_UNKNOWN}: {lid[1]} in segment {seg.name}")
        return list(hit[2])

    def _load_pieces(self, version: int, pairs: list[tuple[str, torch.Tensor]], places: Any) -> None:
        """A bucket with pieces: whole tensors to on_bucket, pieces to on_pieces with their index."""
        if self.on_pieces is None:
            raise ValueError("the agent sent pieces of tensors to an engine that passed no on_pieces")
        if not isinstance(places, list) or len(places) != len(pairs):
            raise ValueError(f"a bucket of {len(pairs)} tensors with {len(places) if isinstance(places, list) else places!r} places")
        whole = []
        parts = []
        for (name, t), place in zip(pairs, places, strict=True):
            if place is None:
                whole.append((name, t))
                continue
            offset, shape = [int(x) for x in place["offset"]], [int(x) for x in place["shape"]]
            if len(offset) != t.dim() or len(shape) != t.dim() or any(
                    o < 0 or o + n > s for o, n, s in zip(offset, t.shape, shape, strict=True)):
                raise ValueError(f"piece of {name!r} {list(t.shape)} at {offset} does not fit its tensor {shape}")
            parts.append((name, tuple(slice(o, o + n) for o, n in zip(offset, t.shape, strict=True)), t))
        if whole:
            self.on_bucket(version, whole)
        if parts:
            self.on_pieces(version, parts)

    def _drop_partial(self, reason: str) -> None:
        """A load the agent began but never finished is aborted here, so the engine never keeps half of it
        (the agent that began it is gone; a new agent starts the version again from its first bucket)."""
        version, self.loading = self.loading, None
        if version is not None and self.on_abort:
            try:
                self.on_abort(version, reason)
            except Exception:
                log.exception("engine abort callback failed")

    def _segment(self, handle: dict[str, Any]) -> segments.Segment:
        name = str(handle["name"])
        seg = self._segments.get(name)
        if seg is None:
            seg = segments.attach_segment(handle)
            self._segments[name] = seg
        return seg

    def _release(self, name: str) -> None:
        seg = self._segments.pop(name, None)
        self._layouts = {k: v for k, v in self._layouts.items() if v[0].name != name}  # their views map it
        if seg is not None:
            seg.close()

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(2)
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._layouts.clear()
