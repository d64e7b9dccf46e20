"""The agent process (console script `weightsync-agent`).

Roles (contract.ENV_ROLE):
* trainer: weight server. The local trainer publishes versions over the Unix socket into staging
  segments; the agent announces them and serves them to inference agents (agent/transfer/serve.py).
* inference: weight client. For the target version (pod annotation when Kubernetes is on, else the
  newest version every trainer agent announced) it fetches its slices, hands buckets to the engine and
  commits only after everything arrived (agent/transfer/fetch.py).
* colocated: both in one process; its inference side connects to its own trainer side, and the IPC
  transport moves the bytes through shared memory.

Everything is configured from env (agent/config.py); `/healthz` and `/metrics` are on the metrics port.
This module only wires the pieces and runs them: the trainer intake (agent/transfer/intake.py), the
engine's state and the inference loop (agent/inference/), the engine adapter (agent/engines/factory.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, NoReturn

from weightsync.agent.config import AgentConfig, ConfigError
from weightsync.agent.engines import factory
from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter
from weightsync.agent.health import HealthServer
from weightsync.agent.inference.engine import EngineState
from weightsync.agent.inference.loop import InferenceLoop
from weightsync.agent.membership import MEMBERSHIP_WAIT, inference_slot, trainer_member, wait_for_membership
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.podstate import Desired
from weightsync.agent.podstatus import PodLink
from weightsync.agent.staging.ring import BucketRing, staging_mode_from_env
from weightsync.agent.staging.segments import cleanup_stale
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.transfer.fetch import TrainerPeers
from weightsync.agent.transfer.groups import TransportCache
from weightsync.agent.transfer.intake import TrainerIntake
from weightsync.agent.transfer.relay import RelayHub, RelayServer
from weightsync.agent.transfer.serve import WeightServer
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.agent.wire import local
from weightsync.crds import contract

log = logging.getLogger("weightsync.agent")


TRANSPORT_TIMEOUT = 120.0  # upper bound for forming a group and for one bucket operation


def delta_config(cfg: AgentConfig, mode: str) -> DeltaConfig | None:
    """spec.transfer.deltaSync for this agent's transport: only GDR sends deltas. With another transport
    (transfer.mode Auto resolved to IPC or NCCL; the API server refuses an explicit IPC or NCCL) the
    request is logged once and full buckets are sent."""
    if not cfg.delta_sync:
        return None
    if mode != "GDR":
        log.warning("deltaSync requested but the transport is %s: full buckets (only GDR sends deltas)", mode)
        return None
    log.info("delta sync on: buckets with at most %.3g of their words changed are sent as deltas",
             cfg.delta_max_changed_fraction)
    return DeltaConfig(max_changed_fraction=cfg.delta_max_changed_fraction)


class Agent:
    """One agent process: wires config, the local socket, the trainer intake and weight server and/or the
    inference loop, health, and the pod link."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.token = cfg.read_token()
        self.watcher = wait_for_membership(cfg, MEMBERSHIP_WAIT)
        self.metrics = AgentMetrics()
        self.session = uuid.uuid4().hex[:12]
        self.prefix = f"weightsync-{cfg.job}-{cfg.pod_name}"
        self.registry = AppRegistry()
        self.desired = Desired()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.pod: PodLink | None = None

        topo = self.watcher.current
        self.mode = topo.mode if cfg.transfer_mode == "Auto" else cfg.transfer_mode
        self.verify = "Checksum" in (cfg.verify, topo.verify)
        self.delta = delta_config(cfg, self.mode)
        # fanOut Relay between pods (NCCL, GDR); a relay forwards full buckets, never a trainer's deltas
        self.fan_out = cfg.fan_out == "Relay" and self.mode in ("NCCL", "GDR") and self.delta is None
        if cfg.fan_out == "Relay" and not self.fan_out:
            log.warning("fanOut Relay ignored: transfer mode %s%s sends to each replica directly", self.mode,
                        " with deltaSync" if self.delta is not None else "")
        # group formation and single bucket operations: a dead peer must not hold a trainer for 10 minutes
        self.cache = TransportCache(mode=self.mode, job=cfg.job, pod_ip=cfg.pod_ip, transport_port=cfg.transport_port,
                                    timeout=min(cfg.timeout_seconds, TRANSPORT_TIMEOUT), delta=self.delta,
                                    token=self.token)
        self.tmember = trainer_member(topo, cfg.pod_name) if cfg.is_trainer else None
        islot = inference_slot(topo, cfg.pod_name) if cfg.is_inference else None
        if cfg.is_trainer and self.tmember is None:
            raise ConfigError(f"pod {cfg.pod_name} is not a trainer pod in {cfg.topology_path}")
        if cfg.is_inference and islot is None:
            raise ConfigError(f"pod {cfg.pod_name} is not an inference pod in {cfg.topology_path}")

        cleanup_stale(self.prefix)
        self.store: StagedVersions | None = None
        self.server: WeightServer | None = None
        self.intake: TrainerIntake | None = None
        if self.tmember is not None:
            self.store = StagedVersions(self.tmember.ranks, self.prefix,
                                        keep=factory.staged_versions_to_keep(cfg.engine_type), ring=self._ring(cfg))
            self.metrics.snapshot_bytes.set_function(self.store.snapshot_bytes)
            ring = self.store.ring
            if ring is not None:
                self.metrics.ring_transfers.set_function(lambda: ring.rings_in_use)
            self.server = WeightServer(
                host=cfg.pod_ip, port=cfg.control_port, token=self.token, pod=cfg.pod_name, store=self.store,
                transport_for=lambda g, p, role: self.cache.get(g, p, role=role), metrics=self.metrics, mode=self.mode,
                generation=lambda: self.watcher.current.generation, verify=self.verify, device=cfg.device,
                timeout=cfg.timeout_seconds, fan_out=self.fan_out,
                replicas=lambda: len(self.watcher.current.inference),
            )
            self.intake = TrainerIntake(self.store, self.server, metrics=self.metrics, engine_type=cfg.engine_type,
                                        topology=lambda: self.watcher.current, stop=self._stop, report=self._report)
            # each complete version is counted, announced and reported by the intake (no publish before start)
            self.store.on_complete = self.intake.on_complete
            if self.mode == "NCCL" and self.tmember.index == 0:
                self.cache.host_store()
        # fanOut Relay (agent/transfer/relay.py): an inference pod's agent forwards what it receives to the next
        # replica of a chain, on the control port a pod that serves no trainer rank leaves free
        self.relay: RelayServer | None = None
        if self.fan_out and islot is not None and self.server is None:
            hub = RelayHub(lambda g, p, role: self.cache.get(g, p, role=role), device=cfg.device,
                           timeout=cfg.timeout_seconds,
                           on_forwarded=lambda n: self.metrics.transfer_bytes.labels("relayed", self.mode).inc(n))
            self.relay = RelayServer(cfg.pod_ip, cfg.control_port, self.token, hub,
                                     on_reject=lambda why: self.metrics.rejected_frames.labels(why).inc())
        self.peers: TrainerPeers | None = None
        self.inference: InferenceLoop | None = None
        if islot is not None:
            adapter = factory.make_adapter(
                cfg.engine_type, url=cfg.engine_url, device=cfg.device, tp_size=islot.replica.tensor,
                timeout=cfg.timeout_seconds, lora=cfg.lora, fault=cfg.engine_fault, registry=self.registry,
                ranks=islot.member.ranks, prefix=self.prefix)
            engine = EngineState(cfg, adapter, self.registry, metrics=self.metrics, stop=self._stop, wake=self._wake,
                                 pod=lambda: self.pod, report=self._report)
            self.peers = TrainerPeers(topo, port=cfg.control_port, token=self.token, pod=cfg.pod_name,
                                      replica=islot.replica.replica, on_announce=self._on_announce)
            self.inference = InferenceLoop(
                cfg, engine, peers=self.peers, slot=islot, cache=self.cache, relay=self.relay, watcher=self.watcher,
                metrics=self.metrics, token=self.token, session=self.session, mode=self.mode, verify=self.verify,
                wake=self._wake, desired=lambda: self.desired, pod=lambda: self.pod, report=self._report)
        self.local = local.LocalServer(cfg.socket_path, self._local)
        self.health = HealthServer(cfg.pod_ip, cfg.metrics_port, self.metrics.registry, self._health)

    def _ring(self, cfg: AgentConfig) -> BucketRing | None:
        """Ring staging (agent/staging/ring.py) when WEIGHTSYNC_STAGING=ring and the transfer can send from it; else
        None (whole-version staging), with the reason logged."""
        try:
            mode, depth = staging_mode_from_env()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if mode != "ring":
            return None
        if self.delta is not None:
            log.warning("WEIGHTSYNC_STAGING=ring ignored: delta sync encodes each bucket against the previous "
                        "version's, which needs send slots of its own; whole versions are staged")
            return None
        log.info("staging: ring of %s bucket slots per transfer on %s", depth, cfg.device)
        return BucketRing(self.prefix, depth, cfg.device)

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> Agent:
        self.local.start()
        self.health.start()
        if self.server is not None:
            self.server.start()
        if self.relay is not None:
            self.relay.start()
        if self.cfg.kube_enabled:
            self.pod = PodLink(self.cfg.namespace, self.cfg.pod_name, self._on_desired, self.metrics,
                               token=self.token,
                               desired_configmap=contract.desired_configmap_name(self.cfg.job),
                               job=self.cfg.job).start()
            self.desired = self.pod.desired
            own = self.pod.own_versions()  # what this pod's agent wrote before a restart (proven)
            if self.intake is not None:
                self.intake.resume(own["published_epoch"] or 0, own["published"])
            if self.inference is not None:
                self.inference.engine.reported_served = (own["served"], own["served_epoch"])
            self._report()
        threading.Thread(target=self._loop, name="agent-loop", daemon=True).start()
        islot = self.inference.islot if self.inference is not None else None
        log.info("agent started role=%s pod=%s mode=%s trainer_ranks=%s inference=%s", self.cfg.role,
                 self.cfg.pod_name, self.mode, self.tmember.ranks if self.tmember else None,
                 (islot.replica.replica, islot.member.ranks) if islot else None)
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for closer in (self.local.close, self.health.close):
            closer()
        if self.server is not None:
            self.server.close()
        if self.relay is not None:
            self.relay.close()
        if self.peers is not None:
            self.peers.close()
        if self.pod is not None:
            self.pod.close()
        if self.inference is not None and isinstance(self.inference.engine.adapter, CustomEngineAdapter):
            self.inference.engine.adapter.close()
        self.cache.close()
        if self.store is not None:
            self.store.close()

    # --- local app connections ------------------------------------------------------------------------
    def _local(self, conn: local.LocalConn) -> None:
        """A local app's connection, routed by its hello: a trainer rank (publishes, to the trainer intake), a
        trainer rank's ring stream, or an engine rank (to the inference side's engine state)."""
        hello, _ = conn.recv()
        if hello.get("op") != "hello":
            conn.reply_error("the first message must be hello")
            return
        kind = hello.get("kind")
        rank = int(hello.get("rank", 0))
        if kind == "trainer":
            if self.intake is None:
                conn.reply_error(f"this agent's role is {self.cfg.role}: it does not accept trainer publishes")
                return
            conn.reply_ok(pod=self.cfg.pod_name, role=self.cfg.role, job=self.cfg.job)
            self.intake.trainer_conn(conn, str(hello.get("session") or ""))
        elif kind == "trainer_stream":  # ring staging: the agent asks this trainer rank to fill ring slots
            if self.intake is None or self.intake.store.ring is None:
                conn.reply_error("this agent does not stream versions (WEIGHTSYNC_STAGING is not ring)")
                return
            conn.reply_ok(pod=self.cfg.pod_name)
            self.intake.stream_conn(conn, rank)
        elif kind == "inference":
            if self.inference is None:
                conn.reply_error(f"this agent's role is {self.cfg.role}: it has no engine side")
                return
            self.inference.engine.attach(conn, hello, rank)
        else:
            conn.reply_error(f"unknown client kind {kind!r}: expected trainer or inference")

    # --- desired state and the pod report -------------------------------------------------------------
    def _on_desired(self, d: Desired) -> None:
        self.desired = d
        log.info("desired state target=%s paused=%s", d.target_version, d.paused)
        self._wake.set()
        self._report()

    def _on_announce(self) -> None:
        """A trainer announced a version. Staleness is re-evaluated here, not only in the loop: the loop may
        be blocked inside a load (a hung engine), and a replica that falls more than maxStaleness behind
        must still go NotReady. PodLink coalesces, so an unchanged report costs no API write."""
        self._wake.set()
        self._report()

    def _report(self) -> None:
        latest = self._latest_known()
        if self.pod is None:
            return
        fields: dict[str, Any] = {"published_version": self.intake.published if self.intake is not None else None,
                                  "published_epoch": self.intake.published_epoch if self.intake is not None else 0}
        if self.inference is not None:
            fields.update(self.inference.pod_fields(latest))
        self.pod.update(**fields)

    def _latest_known(self) -> int | None:
        vs = [v for v in (self.desired.target_version, self.peers.newest_announced() if self.peers else None,
                          self.intake.published if self.intake is not None else None) if v is not None]
        return max(vs) if vs else None

    # --- the agent loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Poll the topology file; on an inference agent, take one step of the inference loop."""
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            try:
                topo = self.watcher.poll()
                if self.inference is not None:
                    if topo is not None:
                        self.inference.on_topology(topo)
                    self.inference.step()
            except Exception:
                log.exception("agent loop step failed")
                time.sleep(0.5)

    # --- health --------------------------------------------------------------------------------------
    def _health(self) -> tuple[bool, dict[str, Any]]:
        detail: dict[str, Any] = {"role": self.cfg.role, "pod": self.cfg.pod_name, "mode": self.mode,
                                  "verify": self.verify, "deltaSync": self.delta is not None,
                                  "generation": self.watcher.current.generation}
        if self.intake is not None:
            detail["published"] = self.intake.published
        if self.inference is not None:
            engine = self.inference.engine
            detail.update(served=engine.served, paused=engine.user_paused, engines=self.registry.connected(),
                          trainers_connected=self.inference.peers.connected(),
                          last_error=self.inference.last_error)
        return True, detail


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="weightsync-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("WEIGHTSYNC_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = AgentConfig.from_env()
        agent = Agent(cfg).start()
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        sys.exit(2)
    done = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: shutting down", signum)
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    agent.close()
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """End the process at once once `Agent.close()` returned. The interpreter's own teardown (its last
    collections over every object torch's import made, then each module's dict) costs about 1 s of CPU, which
    a pod's termination and every test that stops agents waited for. Nothing is lost by skipping it: close()
    released what outlives the process (segments unlinked, the engine resumed, listeners closed), the agent
    registers no atexit handler or finalizer that does more, and the logs are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
