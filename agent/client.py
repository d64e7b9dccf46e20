"""The client library apps import: `TrainerSession` for trainers, `InferenceSession` for Custom engines.

Both talk to the pod's agent over its Unix socket (agent/wire/local.py); tensor bytes go through staging
segments (agent/staging/segments.py), so a publish is one copy of the trainer's local shards into shared memory and
returns as soon as the trainer may reuse (or keep updating) its own memory. Reading what a rank holds is
agent/layout/shards.py's job; placing it in a staging segment (and an engine's views of a bucket there),
agent/staging/places.py's.

    with TrainerSession() as s:
        s.publish(model, version=step)            # nn.Module, state_dict, or (name, tensor) pairs
        s.wait_served(step - 1, timeout=600)      # bounded staleness: every replica serves >= step - 1

    sess = InferenceSession(on_bucket=load, on_commit=commit)
    sess.start()                                  # background thread; reconnects if the agent restarts

`PlacedShard` (a local tensor with its global placement, for shards held as plain tensors) lives in
agent/layout/shards.py and is part of this library's API: it is imported here and listed in `__all__`, so
`from weightsync.agent.client import PlacedShard` is the import apps use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from weightsync.agent.gcpause import collector_paused
from weightsync.agent.layout.engine import EngineLayout
from weightsync.agent.layout.shards import LocalShard, LocalShardsMemo, PlacedShard, Weights
from weightsync.agent.staging import ring, segments
from weightsync.agent.staging.copies import copy_all
from weightsync.agent.staging.places import (
    BucketViews,
    PiecePlaces,
    ShardsDerived,
    TrainerStaging,
    index_entry,
    oversubscribed_threads,
)
from weightsync.agent.wire import local
from weightsync.agent.wire import protocol as P
from weightsync.crds import contract

__all__ = ["AgentUnavailable", "BucketCallback", "InferenceSession", "PiecesCallback", "PlacedShard",
           "PublishResult", "ServedState", "ServedTimeout", "TrainerSession", "Weights", "default_socket_path"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def default_socket_path() -> Path:
    """The agent's socket: WEIGHTSYNC_AGENT_SOCKET when set, else the agent's name in WEIGHTSYNC_SOCKET_DIR."""
    explicit = os.environ.get(contract.ENV_APP_SOCKET)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR) / contract.AGENT_SOCKET_NAME


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
        self._threads_checked = False
        self._staging = TrainerStaging()  # the segments the agent handed out, the last publish's layout
        self._local_shards = LocalShardsMemo()  # the last publish's shards, while the app passes the same tensors
        self._derived: ShardsDerived | None = None  # their sizes, offsets, device and key, while they are the same

    def _drop_connection(self) -> None:
        """Forget the agent: its connection and the staging segments it handed out."""
        self._staging.close()  # its views map segments of the agent that went away
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

    def publish(self, weights: Weights, version: int) -> PublishResult:
        """Stage this rank's shards of `version` with the agent; returns when `weights` may be reused.
        Raises AgentUnavailable when the agent is gone for longer than `reconnect_timeout`."""
        if version < 1:
            raise ValueError(f"version must be >= 1, got {version}")
        return self._retrying(f"publish({version})", lambda: self._publish_once(weights, version))

    def _publish_once(self, weights: Weights, version: int) -> PublishResult:
        with contextlib.ExitStack() as paused:
            # a few containers per tensor live until the staged publish returns (agent/gcpause.py); not over a
            # ring publish, which may hold the trainer until the fleet serves the version
            paused.enter_context(collector_paused())
            return self._publish_paused(weights, version, paused)

    def _publish_paused(self, weights: Weights, version: int, paused: contextlib.ExitStack) -> PublishResult:
        t0 = time.perf_counter()
        shards, aliases = self._local_shards(weights)
        derived = self._derived
        if derived is None or derived.shards is not shards:  # the memo hands back the very same shards: reuse
            derived = self._derived = ShardsDerived.of(shards)
        sizes, offsets, total, device = derived.sizes, derived.offsets, derived.total, derived.device
        if not self._threads_checked and any(s.tensor.is_cpu for s in shards):
            self._threads_checked = True
            why = oversubscribed_threads()
            if why:
                log.warning("trainer.threads_oversubscribed rank=%s %s", self.rank, why)
        conn = self._connection()
        known = self._staging.layout_id()
        reply = conn.request({"op": "stage", "version": version, "rank": self.rank, "nbytes": total, "device": device,
                              "stream": True, "skip_unsent": True, **({"layout_id": known} if known else {})})
        if "ring" in reply:
            paused.close()
            return self._publish_streamed(conn, version, shards, aliases, sizes, t0)
        seg = self._staging.segment(reply["segment"])
        key = derived.key
        layout = self._staging.layout_of(reply)
        arena = self._staging.arena(shards, layout, seg.size, key)
        if arena is None and seg.size < total:
            # a layout without the shards other ranks send, which does not describe these tensors (the model
            # changed): ask for a segment that holds them all, packed in order
            reply = conn.request({"op": "stage", "version": version, "rank": self.rank, "nbytes": total,
                                  "device": device, "stream": True})
            seg = self._staging.segment(reply["segment"])
            layout = self._staging.layout_of(reply)
            arena = self._staging.arena(shards, layout, seg.size, key)
        places: Sequence[int | PiecePlaces | None] = arena or offsets
        lay = self._staging.prepare(seg, shards, places, sizes, layout=layout if arena else None, key=key)
        lay.layout_id = str(reply.get("layout_id") or "") if arena else ""
        srcs = lay.sources(shards)
        with torch.no_grad():
            copy_all(lay.views[seg.name], srcs, lay.chunks(torch.get_num_threads()))
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
        metas = [index_entry(s, n) for s, n in zip(shards, sizes, strict=True)]
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
        self._layouts = BucketViews()  # the views of the buckets' layouts seen, per segment
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
            with collector_paused():  # a view per tensor of the bucket, alive until it is loaded (agent/gcpause.py)
                pairs = self._layouts.by_id(seg, h) if "layout_id" in h else self._layouts.of(seg, h["layout"])
                places = h.get("places")
                if places is None:
                    self.on_bucket(int(h["version"]), pairs)
                else:
                    self._load_pieces(int(h["version"]), pairs, places)
                del pairs
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
        self._layouts.forget(name)  # their views map it
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
