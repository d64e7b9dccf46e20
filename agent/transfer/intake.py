"""The trainer intake: what the local trainer ranks publish over the agent's Unix socket comes in here and is
staged (agent/staging/versions.py); each complete version is announced to the inference agents (the weight
server, agent/transfer/serve.py) and reported on the pod. A trainer also asks here what the inference replicas
serve (`served`, `wait_served`), and in ring mode (agent/staging/ring.py) each rank keeps a stream connection
open for the agent to fill ring slots from. It sits beside the weight server, not in staging/: it drives the
server (announce, the served fleet) and counts metrics, which the staging layer below may not import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from weightsync.agent.engines.factory import engine_takes_full_tensors
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.staging.index import StagingError
from weightsync.agent.staging.versions import StagedVersion, StagedVersions
from weightsync.agent.transfer.serve import WeightServer
from weightsync.agent.wire import local
from weightsync.crds.topology import Topology

log = logging.getLogger("weightsync.agent")


class TrainerIntake:
    """The trainer side of one agent: its trainer connections, and the newest version they completed.

    `on_complete` is the staged versions' completion callback (the agent wires it); `report` writes the
    agent's pod report, which carries `published`."""

    def __init__(self, store: StagedVersions, server: WeightServer, *, metrics: AgentMetrics, engine_type: str,
                 topology: Callable[[], Topology], stop: threading.Event, report: Callable[[], None]) -> None:
        self.store = store
        self.server = server
        self.metrics = metrics
        self.engine_type = engine_type
        self.topology = topology  # the current topology (the agent's watcher)
        self.stop = stop
        self.report = report
        self.published: int | None = None
        self.published_epoch = 0  # trainer epoch of `published`
        self._stage_t0 = 0.0  # when the last stage request came in: publish_seconds is measured from it

    def resume(self, published_epoch: int, published: int | None) -> None:
        """Continue after what this pod's agent wrote before a restart (its proven pod annotations)."""
        self.store.resume(published_epoch, published)
        # A trainer may have published while the pod link came up (its socket opens first): the newer
        # of the two stands, and is reported now (else version 1 of a fresh job went unreported).
        before = (published_epoch, published)
        if self.published is None or (before[1] is not None and before > (self.published_epoch, self.published)):
            self.published, self.published_epoch = published, published_epoch

    def trainer_conn(self, conn: local.LocalConn, session: str = "") -> None:
        """Serve one trainer rank's connection (after its hello) until it closes or the agent stops."""
        while not self.stop.is_set():
            h, _ = conn.recv()
            op = h.get("op")
            try:
                if op == "stage":
                    t0 = time.perf_counter()
                    reply = self.store.stage_request(int(h["rank"]), int(h["version"]), int(h["nbytes"]),
                                                     str(h.get("device", "cpu")), session=session,
                                                     stream=h.get("stream") is True,
                                                     skip_unsent=h.get("skip_unsent") is True,
                                                     known_layout=h.get("layout_id"))
                    self._stage_t0 = t0
                    conn.reply_ok(**reply)
                elif op == "publish_stream":  # ring staging: metadata only, the trainer keeps the bytes
                    snap = int(h.get("snapshot_bytes") or 0)
                    sv = self.store.publish_stream(int(h["rank"]), int(h["version"]), h.get("tensors"),
                                                   dict(h.get("aliases") or {}), snapshot_bytes=snap)
                    self.metrics.copied_bytes.labels("snapshot").inc(snap)
                    self.metrics.publish_seconds.observe(time.perf_counter() - self._stage_t0)
                    conn.reply_ok(version=sv.version, complete=sv.complete)
                elif op == "release":  # a held streamed version: its trainer returned from publish
                    conn.reply_ok(withdrawn=self.store.withdraw(int(h["version"])))
                elif op == "publish":
                    sv = self.store.publish(int(h["rank"]), int(h["version"]), str(h["segment"]), h.get("tensors"),
                                            dict(h.get("aliases") or {}), index_id=h.get("index"))
                    self.metrics.publish_seconds.observe(time.perf_counter() - self._stage_t0)
                    rs = sv.ranks.get(int(h["rank"]))
                    conn.reply_ok(version=sv.version, complete=sv.complete,
                                  **({"index": rs.index.id} if rs is not None and rs.index is not None else {}))
                elif op in ("served", "wait_served"):
                    # what every inference replica serves, from its agents' authenticated ws.served reports
                    version, timeout = (int(h["version"]), float(h["timeout"])) if op == "wait_served" else (0, 0.0)
                    reached, state = self.server.served.wait(
                        version, timeout, self.topology, engine_takes_full_tensors(self.engine_type),
                        cancelled=lambda: self.stop.is_set() or local.peer_closed(conn.sock, 0),
                        trainer_epoch=lambda: self.store.trainer_epoch,
                        only_serving=bool(h.get("only_serving", False)))
                    conn.reply_ok(version=version, reached=reached, **state.to_dict())
                else:
                    conn.reply_error(f"unknown trainer op {op!r}")
            except (StagingError, KeyError, ValueError, TypeError) as exc:
                log.warning("publish rejected op=%s error=%s", op, exc)
                conn.reply_error(str(exc))

    def stream_conn(self, conn: local.LocalConn, rank: int) -> None:
        """Ring staging: hold trainer rank `rank`'s stream connection (the agent asks it to fill ring slots)
        until it closes; its versions can then no longer be streamed and are withdrawn. The hello was answered."""
        ring = self.store.ring
        assert ring is not None
        ring.attach(rank, conn)
        try:
            while not self.stop.is_set() and ring.holds(rank, conn):
                if local.peer_closed(conn.sock, 1.0):
                    log.info("trainer rank %s closed its stream connection", rank)
                    break
        finally:
            ring.detach(rank, conn)
            self.store.withdraw_rank(rank)  # its versions can no longer be streamed: not offered any more

    def on_complete(self, sv: StagedVersion) -> None:
        """Every local rank published `sv`: count it, announce it to the inference agents, report it."""
        self.published = sv.version
        self.published_epoch = self.store.trainer_epoch
        self.metrics.published_version.set(sv.version)
        self.metrics.staged_bytes.inc(sv.staged_nbytes)
        if not sv.streamed:  # a streamed version is copied by each transfer's fills (WeightServer counts them)
            self.metrics.copied_bytes.labels("publish").inc(sv.staged_nbytes)
        log.info("version staged version=%s bytes=%s ranks=%s", sv.version, sv.nbytes, sorted(sv.ranks))
        self.server.announce(sv.version, self.published_epoch)
        self.report()
