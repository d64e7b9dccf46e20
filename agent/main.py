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
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.agent import atomic
from weightsync.agent.config import AgentConfig, ConfigError, TopologyWatcher
from weightsync.agent.engines import factory
from weightsync.agent.engines.base import EngineAdapter, EngineError, EngineUnsupported
from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter
from weightsync.agent.health import HealthServer
from weightsync.agent.layout.engine import EngineLayout
from weightsync.agent.layout.rules import LayoutError
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.plan import TensorShard, TransferPlan
from weightsync.agent.podstate import Desired, synced_state
from weightsync.agent.podstatus import PodLink
from weightsync.agent.staging.ring import RingStaging, staging_mode_from_env
from weightsync.agent.staging.segments import cleanup_stale, shm_dir
from weightsync.agent.transfer.fetch import FetchError, TrainerPeers, fetch_version
from weightsync.agent.transfer.groups import TransportCache, group_for, proposal_of
from weightsync.agent.transfer.relay import RelayHub, RelayServer
from weightsync.agent.transfer.serve import StagedVersion, StagingError, StagingStore, WeightServer
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.agent.wire import local
from weightsync.crds import contract
from weightsync.crds.topology import InferenceReplicaTopology, PodMember, Topology

log = logging.getLogger("weightsync.agent")


@dataclass
class InferenceSlot:
    replica: InferenceReplicaTopology
    member: PodMember


def trainer_member(topo: Topology, pod: str) -> PodMember | None:
    return next((m for m in topo.trainer.pods if m.name == pod), None)


def inference_slot(topo: Topology, pod: str) -> InferenceSlot | None:
    slots = [InferenceSlot(r, m) for r in topo.inference for m in r.pods if m.name == pod]
    if len(slots) > 1:
        raise ConfigError(f"pod {pod} hosts {len(slots)} inference replicas; one replica per agent is supported")
    return slots[0] if slots else None


def make_adapter(cfg: AgentConfig, registry: AppRegistry, ranks: list[int], tp_size: int = 1) -> EngineAdapter:
    """The engine adapter for cfg.engine_type (agent/engines/factory.py)."""
    if cfg.engine_type == "Custom":
        return factory.make_adapter("Custom", registry=registry, ranks=ranks,
                                    prefix=f"weightsync-{cfg.job}-{cfg.pod_name}", device=cfg.device,
                                    request_timeout=cfg.timeout_seconds)
    options: dict[str, Any] = {"timeout": float(cfg.timeout_seconds)}
    if cfg.engine_type == "SGLang":
        # CUDA agents hand the engine CUDA IPC handles (device named by GPU UUID); an agent without a GPU
        # broadcasts each bucket into the engine's ranks over SGLang's weight-update group (a CPU tensor
        # pickled for another container cannot be rebuilt there).
        options.update(tp_size=tp_size, path="tensor" if cfg.device.startswith("cuda") else "distributed")
        if cfg.device.startswith("cuda"):
            options["devices"] = engine_devices(cfg.device, tp_size)
    elif cfg.engine_type == "VLLM":
        # The backend is the one the server announces (its --weight-transfer-config, GET /server_info):
        # `weightsync` (the plugin: gloo from a CPU agent, NCCL from a GPU one), `nccl` (rank 0 on a GPU of
        # the agent's own) or `ipc` (colocated: CUDA IPC handles keyed by GPU UUID).
        options.update(backend="auto", device=cfg.device)
        if cfg.device.startswith("cuda"):
            options["devices"] = engine_devices(cfg.device, tp_size)
        if cfg.engine_fault:
            from weightsync.agent.engines.vllm import EngineFault

            options["fault"] = EngineFault.parse(cfg.engine_fault)
    if cfg.lora is not None:
        return lora_adapter(cfg, tp_size)
    return factory.make_adapter(cfg.engine_type, url=cfg.engine_url, **options)


def lora_adapter(cfg: AgentConfig, tp_size: int) -> EngineAdapter:
    """A LoRA job: the engine's adapter-loading endpoint, not its weight-update session (which the agent
    then never opens: no update group, no GPU of the agent's own for vLLM)."""
    from weightsync.agent.engines import lora
    from weightsync.agent.engines.http import HttpClient

    assert cfg.lora is not None
    if not cfg.engine_url:
        raise ConfigError(f"{cfg.engine_type} engine needs its URL ({contract.ENV_ENGINE_URL})")
    client = HttpClient(cfg.engine_url, cfg.engine_type, timeout=float(cfg.timeout_seconds))
    loader: lora.LoraLoader
    if cfg.engine_type == "SGLang":
        from weightsync.agent.engines.sglang import SGLangAdapter

        inner: EngineAdapter = SGLangAdapter(cfg.engine_url, tp_size=tp_size, client=client)
        loader = lora.SGLangLoraLoader(client, tp_size)
    elif cfg.engine_type == "VLLM":
        from weightsync.agent.engines.vllm import VLLMAdapter

        inner = VLLMAdapter(cfg.engine_url, client=client, lora=True)
        loader = lora.VLLMLoraLoader(client, shm_dir() / "lora")
    else:
        raise ConfigError(f"{contract.ENV_LORA}: LoRA needs an SGLang or VLLM engine, not {cfg.engine_type}")
    return lora.LoraAdapter(inner=inner, loader=loader, spec=cfg.lora)


def _checked_digest(res: Any) -> str | None:
    """A fetch's content digest when every piece was checked against its sender's hash (agent/transfer/digest.py)."""
    digest = getattr(res, "digest", "")
    return str(digest) if digest and getattr(res, "digest_checked", False) else None


def engine_devices(device: str, tp_size: int) -> list[str]:
    """The CUDA device of each engine TP rank as the agent sees it (a pinned cuda:N: all on N)."""
    return [device] * tp_size if ":" in device else [f"cuda:{r}" for r in range(tp_size)]


def staged_versions_to_keep(engine_type: str) -> int:
    """Complete versions a trainer agent keeps staged. SGLang and vLLM load in place and cannot roll back,
    so the version before the newest stays staged: the last good version is reloaded after a load failed
    half-way. A Custom engine applies a version only at commit, so one is enough (and costs one model copy
    of staging less)."""
    return 2 if engine_type in ("SGLang", "VLLM") else 1


def engine_takes_full_tensors(engine_type: str) -> bool:
    """SGLang and vLLM load full (unsharded) HF tensors over HTTP and shard them inside the engine, so the
    agent fetches one full copy per replica instead of per-rank TP slices."""
    return engine_type in ("SGLang", "VLLM")


def full_layout(names: dict[str, TensorShard], world: int, tp: int) -> list[list[TensorShard]]:
    return [[TensorShard.full(n, s.dtype, s.global_shape) for n, s in sorted(names.items())]]


class _UserPauseGuard:
    """Wraps the adapter so a load during spec.paused neither pauses twice nor resumes the engine."""

    def __init__(self, inner: EngineAdapter, agent: Agent) -> None:
        self.inner = inner
        self.agent = agent

    def pause(self) -> None:
        if not self.agent.user_paused:
            self.inner.pause()
            self.agent.stall_started = time.perf_counter()

    def resume(self) -> None:
        if getattr(self.inner, "needs_restore", False) and self.agent.restore_version is not None:
            # The engine holds a mix of two versions: it stays paused until the last good one is reloaded
            # (Agent._restore resumes it, also when that fails).
            self.agent.held_paused = True
            return
        if not self.agent.user_paused:
            self.inner.resume()
            self.agent.stall_ended()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("inner", "agent"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)  # e.g. the destination rank of the next bucket


TRANSPORT_TIMEOUT = 120.0  # upper bound for forming a group and for one bucket operation
MEMBERSHIP_WAIT = 180.0  # a new pod can start before the topology ConfigMap update reaches its volume
# An engine not reachable for this long is reported (pod condition reason EngineUnreachable, the job's
# Degraded reason): long enough for a small engine to start, short enough that a wrong engine.port shows
# within a minute. A large model may take longer to start; the message says so.
PROGRESS_INTERVAL = 1.0  # seconds between two progress writes on the pod (API load)
# A load shows progress on the pod only once it has lasted this long: a load done sooner costs one pod write
# per version (its report), not three (first bucket, last bucket, report), which at hundreds of pods is
# most of the API server's work per version.
PROGRESS_AFTER = float(os.environ.get("WEIGHTSYNC_PROGRESS_AFTER_SECONDS", str(PROGRESS_INTERVAL)))
ENGINE_UNREACHABLE_AFTER = float(os.environ.get("WEIGHTSYNC_ENGINE_UNREACHABLE_SECONDS", "30"))


def wait_for_membership(cfg: AgentConfig, timeout: float) -> TopologyWatcher:
    """The topology, once it lists this pod in its role(s). A scaled-up or recreated pod may see the old
    file for a while (ConfigMap volumes update lazily): wait for it rather than crash-looping."""
    deadline = time.monotonic() + timeout
    watcher: TopologyWatcher | None = None
    while True:
        try:
            watcher = watcher or TopologyWatcher(cfg.topology_path)
            watcher.poll()
            topo = watcher.current
            ok = (not cfg.is_trainer or trainer_member(topo, cfg.pod_name) is not None) and (
                not cfg.is_inference or inference_slot(topo, cfg.pod_name) is not None)
            if ok:
                return watcher
            problem = f"pod {cfg.pod_name} is not listed as {cfg.role} in {cfg.topology_path} (generation {topo.generation})"
        except ConfigError as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise ConfigError(f"{problem}; gave up after {timeout:.0f}s")
        log.info("waiting for the topology: %s", problem)
        time.sleep(2.0)


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


@dataclass
class _WireCount:
    """A transport's byte counters when a version's fetch took it (GDR's `stats`), to account the version."""

    transport: Any
    full_bytes: int
    wire_bytes: int
    delta_buckets: int


def _wire_of(used: dict[int, _WireCount]) -> tuple[int, int]:
    """(bytes saved on the wire, buckets received as deltas) by the transports since they were taken."""
    saved = buckets = 0
    for w in used.values():
        st = w.transport.stats
        saved += (st.full_bytes - w.full_bytes) - (st.wire_bytes - w.wire_bytes)
        buckets += st.delta_buckets - w.delta_buckets
    return saved, buckets


class Agent:
    """One agent process: wires config, local socket, server and/or client, health, and the pod link."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.token = cfg.read_token()
        self.watcher = wait_for_membership(cfg, MEMBERSHIP_WAIT)
        self.metrics = AgentMetrics()
        self.session = uuid.uuid4().hex[:12]
        self.prefix = f"weightsync-{cfg.job}-{cfg.pod_name}"
        self.registry = AppRegistry()
        self.user_paused = False
        self.served: int | None = None
        self.served_epoch: int | None = None  # trainer epoch of `served` (None: unknown, e.g. an adopted version)
        self.served_digest: str | None = None  # content digest of `served` (agent/transfer/digest.py; None: unknown)
        self._reported_served: tuple[int | None, int | None] = (None, None)  # (served, epoch) on the pod at start
        self.published: int | None = None
        self.published_epoch = 0  # trainer epoch of `published`
        self.desired = Desired()
        self.last_error: str | None = None
        self.last_sync: dict[str, Any] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._attempt = 0
        self._engine_known = False  # the engine reported its served version (hello or served_version())
        # a Custom engine's layout from its hello (agent/layout/engine.py), and the needs function made of it
        self.layout: EngineLayout | None = None
        self.layout_fn: Callable[[dict[str, TensorShard], int, int], list[list[TensorShard]]] | None = None
        self.restore_version: int | None = None  # the last good version while a load is in flight
        self.held_paused = False  # a failed load left the engine's weights mixed: paused until restored
        self.stall_started: float | None = None  # when a load paused generation (pauseGeneration)
        self.last_stall: float | None = None  # the last load's pause to resume, seconds
        self.engine_refused: str | None = None  # an unsupported engine release: no load is attempted
        self._unreachable_since: float | None = None  # first failed attempt to reach the engine (monotonic)
        self._unreachable_reported = False
        self._unreachable_message: str | None = None
        self._loading = False  # a version is being fetched and loaded (progress is reported)
        self._engine_copied = 0  # the Custom adapter's copied_bytes already counted in the metrics
        self.held: atomic.Held | None = None  # strategy Atomic: the prepared version (agent/atomic.py)
        self._prepare_failed: int | None = None  # the version whose last Atomic prepare failed
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
        self.islot = inference_slot(topo, cfg.pod_name) if cfg.is_inference else None
        if cfg.is_trainer and self.tmember is None:
            raise ConfigError(f"pod {cfg.pod_name} is not a trainer pod in {cfg.topology_path}")
        if cfg.is_inference and self.islot is None:
            raise ConfigError(f"pod {cfg.pod_name} is not an inference pod in {cfg.topology_path}")

        cleanup_stale(self.prefix)
        self.store: StagingStore | None = None
        self.server: WeightServer | None = None
        if self.tmember is not None:
            self.store = StagingStore(self.tmember.ranks, self.prefix, on_complete=self._on_complete,
                                      keep=staged_versions_to_keep(cfg.engine_type), ring=self._ring(cfg))
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
            if self.mode == "NCCL" and self.tmember.index == 0:
                self.cache.host_store()
        self.adapter: EngineAdapter | None = None
        self.peers: TrainerPeers | None = None
        # fanOut Relay (agent/transfer/relay.py): an inference pod's agent forwards what it receives to the next
        # replica of a chain, on the control port a pod that serves no trainer rank leaves free
        self.relay: RelayServer | None = None
        self._relay_next = True  # offer to relay on the next fetch (not right after a failed one: direct then)
        if self.fan_out and self.islot is not None and self.server is None:
            hub = RelayHub(lambda g, p, role: self.cache.get(g, p, role=role), device=cfg.device,
                           timeout=cfg.timeout_seconds,
                           on_forwarded=lambda n: self.metrics.transfer_bytes.labels("relayed", self.mode).inc(n))
            self.relay = RelayServer(cfg.pod_ip, cfg.control_port, self.token, hub,
                                     on_reject=lambda why: self.metrics.rejected_frames.labels(why).inc())
        if self.islot is not None:
            self.adapter = make_adapter(cfg, self.registry, self.islot.member.ranks, self.islot.replica.tensor)
            self.peers = TrainerPeers(topo, port=cfg.control_port, token=self.token, pod=cfg.pod_name,
                                      replica=self.islot.replica.replica, on_announce=self._on_announce)
        self.local = local.LocalServer(cfg.socket_path, self._local)
        self.health = HealthServer(cfg.pod_ip, cfg.metrics_port, self.metrics.registry, self._health)

    def _ring(self, cfg: AgentConfig) -> RingStaging | None:
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
        return RingStaging(self.prefix, depth, cfg.device)

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
            if self.store is not None:
                self.store.resume(own["published_epoch"] or 0, own["published"])
                # A trainer may have published while the pod link came up (its socket opens first): the newer
                # of the two stands, and is reported now (else version 1 of a fresh job went unreported).
                before = (own["published_epoch"] or 0, own["published"])
                if self.published is None or (before[1] is not None and before > (self.published_epoch,
                                                                                    self.published)):
                    self.published, self.published_epoch = own["published"], own["published_epoch"] or 0
            self._reported_served = (own["served"], own["served_epoch"])
            self._report()
        threading.Thread(target=self._loop, name="agent-loop", daemon=True).start()
        log.info("agent started role=%s pod=%s mode=%s trainer_ranks=%s inference=%s", self.cfg.role,
                 self.cfg.pod_name, self.mode, self.tmember.ranks if self.tmember else None,
                 (self.islot.replica.replica, self.islot.member.ranks) if self.islot else None)
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
        if isinstance(self.adapter, CustomEngineAdapter):
            self.adapter.close()
        self.cache.close()
        if self.store is not None:
            self.store.close()

    # --- local app connections ------------------------------------------------------------------------
    def _local(self, conn: local.LocalConn) -> None:
        hello, _ = conn.recv()
        if hello.get("op") != "hello":
            conn.reply_error("the first message must be hello")
            return
        kind = hello.get("kind")
        rank = int(hello.get("rank", 0))
        if kind == "trainer":
            if self.store is None:
                conn.reply_error(f"this agent's role is {self.cfg.role}: it does not accept trainer publishes")
                return
            conn.reply_ok(pod=self.cfg.pod_name, role=self.cfg.role, job=self.cfg.job)
            self._trainer_conn(conn, str(hello.get("session") or ""))
        elif kind == "trainer_stream":  # ring staging: the agent asks this trainer rank to fill ring slots
            ring = self.store.ring if self.store is not None else None
            if ring is None:
                conn.reply_error("this agent does not stream versions (WEIGHTSYNC_STAGING is not ring)")
                return
            conn.reply_ok(pod=self.cfg.pod_name)
            ring.attach(rank, conn)
            try:
                while not self._stop.is_set() and ring.holds(rank, conn):
                    if local.peer_closed(conn.sock, 1.0):
                        log.info("trainer rank %s closed its stream connection", rank)
                        break
            finally:
                ring.detach(rank, conn)
                if self.store is not None:  # its versions can no longer be streamed: not offered any more
                    self.store.withdraw_rank(rank)
        elif kind == "inference":
            if self.islot is None:
                conn.reply_error(f"this agent's role is {self.cfg.role}: it has no engine side")
                return
            served = hello.get("served_version")
            refused = self._engine_layout(hello.get("layout"), rank)
            if refused:
                conn.reply_error(refused)
                return
            conn.reply_ok(pod=self.cfg.pod_name, role=self.cfg.role, job=self.cfg.job)
            # The engine is the truth about what it serves: a restarted agent adopts its version, a restarted
            # engine (None) is loaded again; a new engine process is not paused yet, so pause is re-applied.
            engine_served = served if isinstance(served, int) else None
            if engine_served != self.served:
                log.info("engine reports served=%s (agent had %s)", engine_served, self.served)
            self._adopt_served(engine_served if self.served is None or engine_served is None
                               else min(self.served, engine_served))
            # An engine left paused by a dead agent (killed mid-load) counts as paused; the loop then resumes
            # it unless spec.paused wants it paused.
            self.user_paused = hello.get("paused") is True
            self.registry.add(rank, conn, served if isinstance(served, int) else None)
            log.info("engine connected rank=%s served=%s", rank, served)
            self._wake.set()
            while not self._stop.is_set() and self.registry.holds(rank, conn):
                if local.peer_closed(conn.sock, 1.0):
                    log.warning("engine disconnected rank=%s", rank)
                    self.registry.remove(conn)
                    break
            # the LocalServer closes the connection when this returns
        else:
            conn.reply_error(f"unknown client kind {kind!r}: expected trainer or inference")

    def _engine_layout(self, spec: Any, rank: int) -> str:
        """Take a Custom engine's layout from its hello (agent/layout/engine.py); the reason when refused. While
        ranks are connected, another rank must send the same layout (a replica has one); an engine whose ranks
        all left may come back with another."""
        others = [r for r in self.registry.ranks() if r != rank]
        if spec is None:
            if self.layout is not None and others:
                return (f"engine rank {rank} sends no layout, connected ranks {others} sent {self.layout.to_dict()}: "
                        "every rank of a replica must use the same layout")
            if self.layout is not None:
                log.warning("engine layout %s dropped: the default row split applies", self.layout.to_dict())
            self.layout, self.layout_fn = None, None
            return ""
        try:
            got = EngineLayout.from_dict(spec) if isinstance(spec, dict) else None
        except LayoutError as exc:
            return f"engine rank {rank}: bad layout: {exc}"
        if got is None:
            return f"engine rank {rank}: layout must be an object, got {type(spec).__name__}"
        if self.layout is not None and self.layout != got and others:
            return (f"engine rank {rank} sends layout {got.to_dict()}, connected ranks {others} sent "
                    f"{self.layout.to_dict()}: every rank of a replica must use the same layout")
        if self.layout != got:  # the first rank, or an engine restarted with another layout
            if self.layout is not None:
                log.warning("engine layout changes from %s", self.layout.to_dict())
            self.layout = got
            log.info("engine layout %s", got.to_dict())

            def needs(names: dict[str, TensorShard], world: int, tp: int) -> list[list[TensorShard]]:
                try:
                    return got.needs(names, world, tp)
                except LayoutError as exc:
                    raise FetchError(f"the engine's layout cannot lay out the model: {exc}") from None

            self.layout_fn = needs  # one object per layout: the fetcher caches needs and plans by it
        return ""

    def _adopt_served(self, served: int | None) -> None:
        """Take the version the engine says it serves. Its trainer epoch is known only when it is the version
        this agent (or its predecessor, per its proven pod annotation) loaded; else it stays unknown."""
        if served == self.served and self.served_epoch is not None:
            return
        self.served = served
        before, epoch = self._reported_served
        self.served_epoch = epoch if served is not None and served == before else None
        self.served_digest = None  # not loaded by this agent: its content is not known

    def _trainer_conn(self, conn: local.LocalConn, session: str = "") -> None:
        assert self.store is not None
        while not self._stop.is_set():
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
                    self.metrics.publish_seconds.observe(time.perf_counter() - getattr(self, "_stage_t0", 0.0))
                    conn.reply_ok(version=sv.version, complete=sv.complete)
                elif op == "release":  # a held streamed version: its trainer returned from publish
                    conn.reply_ok(withdrawn=self.store.withdraw(int(h["version"])))
                elif op == "publish":
                    sv = self.store.publish(int(h["rank"]), int(h["version"]), str(h["segment"]), h.get("tensors"),
                                            dict(h.get("aliases") or {}), index_id=h.get("index"))
                    self.metrics.publish_seconds.observe(time.perf_counter() - getattr(self, "_stage_t0", 0.0))
                    rs = sv.ranks.get(int(h["rank"]))
                    conn.reply_ok(version=sv.version, complete=sv.complete,
                                  **({"index": rs.index.id} if rs is not None and rs.index is not None else {}))
                elif op in ("served", "wait_served"):
                    # what every inference replica serves, from its agents' authenticated ws.served reports
                    assert self.server is not None
                    version, timeout = (int(h["version"]), float(h["timeout"])) if op == "wait_served" else (0, 0.0)
                    reached, state = self.server.served.wait(
                        version, timeout, lambda: self.watcher.current, engine_takes_full_tensors(self.cfg.engine_type),
                        cancelled=lambda: self._stop.is_set() or local.peer_closed(conn.sock, 0),
                        trainer_epoch=lambda: self.store.trainer_epoch if self.store is not None else 0,
                        only_serving=bool(h.get("only_serving", False)))
                    conn.reply_ok(version=version, reached=reached, **state.to_dict())
                else:
                    conn.reply_error(f"unknown trainer op {op!r}")
            except (StagingError, KeyError, ValueError, TypeError) as exc:
                log.warning("publish rejected op=%s error=%s", op, exc)
                conn.reply_error(str(exc))

    def _on_complete(self, sv: StagedVersion) -> None:
        self.published = sv.version
        assert self.store is not None
        self.published_epoch = self.store.trainer_epoch
        self.metrics.published_version.set(sv.version)
        self.metrics.staged_bytes.inc(sv.staged_nbytes)
        if not sv.streamed:  # a streamed version is copied by each transfer's fills (WeightServer counts them)
            self.metrics.copied_bytes.labels("publish").inc(sv.staged_nbytes)
        log.info("version staged version=%s bytes=%s ranks=%s", sv.version, sv.nbytes, sorted(sv.ranks))
        if self.server is not None:
            self.server.announce(sv.version, self.published_epoch)
        self._report()

    # --- desired state ---------------------------------------------------------------------------------
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
        fields: dict[str, Any] = {"published_version": self.published, "published_epoch": self.published_epoch}
        # Until the engine said what it serves (a restarted agent knows nothing yet), the pod keeps its last
        # report: reporting "stale" now would flap readiness for an engine that is in fact up to date.
        state = atomic.CommitState(self.desired.commit, self.desired.committed)
        if self.islot is not None and (self._engine_known or state.draining):
            ok, reason, msg = synced_state(latest, self.served, self.cfg.max_staleness)
            if self._unreachable_message is not None:  # held until the engine answers again
                ok, reason, msg = False, contract.REASON_ENGINE_UNREACHABLE, self._unreachable_message
            if state.committed is not None and (state.draining or self._unreachable_message is None):
                # Atomic: Ready only on the committed version; a drain is acknowledged whatever else holds
                ok, reason, msg = atomic.ready(self._served_key(state.committed[0]), state)
            if not self._loading:  # the load under way reports its own progress
                fields["sync_progress"] = None
                self.metrics.sync_progress_buckets.set(0)
                self.metrics.sync_progress_bytes.set(0)
            fields.update(prepared_version=self.held.version if self.held else None,
                          prepared_epoch=self.held.epoch if self.held else None)
            self.metrics.prepared_version.set(self.held.version if self.held else 0)
            self.metrics.prepared_bytes.set(self.held.nbytes if self.held else 0)
            fields.update(served_version=self.served, served_epoch=self.served_epoch, served_digest=self.served_digest,
                          engine_paused=self.user_paused, last_sync=self.last_sync,
                          sync_error=self.last_error, synced=ok, synced_reason=reason, synced_message=msg)
        self.pod.update(**fields)

    def _latest_known(self) -> int | None:
        vs = [v for v in (self.desired.target_version, self.peers.newest_announced() if self.peers else None,
                          self.published) if v is not None]
        return max(vs) if vs else None

    # --- inference loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            try:
                self._poll_topology()
                if self.islot is not None:
                    self._step()
            except Exception:
                log.exception("agent loop step failed")
                time.sleep(0.5)

    def _poll_topology(self) -> None:
        topo = self.watcher.poll()
        if topo is None:
            return
        if self.peers is not None:
            self.peers.update(topo)
        if self.cfg.is_inference:
            slot = inference_slot(topo, self.cfg.pod_name)
            if slot is not None:
                self.islot = slot

    def _apply_pause(self) -> None:
        assert self.adapter is not None
        want = self.desired.paused
        if want == self.user_paused:
            return
        try:
            if want:
                self.adapter.pause()
            else:
                self.adapter.resume()
        except EngineError as exc:
            log.warning("engine %s failed: %s", "pause" if want else "resume", exc)
            return
        self.user_paused = want
        self.metrics.engine_paused.set(1 if want else 0)
        log.info("engine %s by spec.paused", "paused" if want else "resumed")
        self._report()

    def _served_key(self, epoch_if_unknown: int) -> tuple[int, int] | None:
        if self.served is None:
            return None
        return (self.served_epoch if self.served_epoch is not None else epoch_if_unknown, self.served)

    def _target(self) -> tuple[int, int] | None:
        """(trainer epoch, version) to load next, None when nothing newer is wanted or available."""
        assert self.peers is not None
        available = self.peers.latest_available()
        if self.cfg.kube_enabled and self.desired.target_version is not None:
            target = (self.desired.target_epoch, self.desired.target_version)
            served = self._served_key(target[0])
            if served is not None and served >= target:
                return None
            # allowed to load: take the newest staged version at least as new (an older one may be evicted)
            if available is not None and available >= target:
                return available
            return None
        if available is None:
            return None
        served = self._served_key(available[0])
        if served is not None and served >= available:
            return None
        return available

    def _step(self) -> None:
        assert self.adapter is not None and self.peers is not None and self.islot is not None
        if self.cfg.engine_type == "Custom" and not self.registry.connected():
            self._engine_unreachable(f"no engine connected to the agent socket {self.cfg.socket_path} "
                                     "(the engine process opens an InferenceSession)")
            self._report()
            return
        if self.cfg.engine_type == "Custom" and self._unreachable_since is not None:
            self._engine_reached()
        if self.engine_refused is not None:
            return
        if not self._engine_known:
            if self.cfg.engine_type != "Custom":
                try:  # an HTTP engine that outlived a restarted agent already serves some version
                    check = getattr(self.adapter, "check_engine_version", None)
                    if check is not None:
                        release = check()
                        log.info("engine release %s %s is supported", self.cfg.engine_type, release)
                    self._adopt_served(self.adapter.served_version())
                except EngineUnsupported as exc:
                    self._refuse_engine(str(exc), exc.reason)
                    return
                except EngineError as exc:
                    log.info("engine not reachable yet: %s", exc)
                    self._engine_unreachable(str(exc))
                    return
            self._engine_known = True
            self._engine_reached()
        self._apply_pause()
        if self._atomic_step():
            return
        target = self._target()
        self.metrics.target_version.set(target[1] if target else self.served or 0)
        if target is None:
            self._report()
            return
        self._fetch(target[1], target[0])

    def _engine_unreachable(self, error: str) -> None:
        """Report (once) an engine that stayed unreachable for ENGINE_UNREACHABLE_AFTER seconds: the pod's
        synced condition False with reason EngineUnreachable and the error, which the operator passes on."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        waited = now - self._unreachable_since
        if self._unreachable_reported or waited < ENGINE_UNREACHABLE_AFTER:
            return
        self._unreachable_reported = True
        message = (f"the {self.cfg.engine_type} engine has not been reachable for {waited:.0f}s: {error}. "
                   "Check spec.inference.engine.port / url and the engine container's log (a large model can "
                   "take minutes to start)")[:1024]
        self._unreachable_message = message
        log.error("engine unreachable: %s", message)
        if self.pod is not None:  # the condition only: a sync-error annotation would read as SyncFailed first
            self.pod.update(synced=False, synced_reason=contract.REASON_ENGINE_UNREACHABLE, synced_message=message)

    def _engine_died(self, error: str) -> None:
        """The engine process died under the load (SGLang's tensor path: a loader error kills its scheduler):
        nothing is restored into it, nothing is served until a restarted engine loads a whole version. Reported
        at once (reason EngineUnreachable); the engine is checked afresh when it answers again."""
        self.served = None
        self.served_digest = None
        self.held_paused = False
        if self.peers is not None:
            self.peers.report_served(0)
        self._engine_known = False
        self._unreachable_since = time.monotonic() - ENGINE_UNREACHABLE_AFTER
        self._unreachable_reported = False
        self._engine_unreachable(error)

    def _engine_reached(self) -> None:
        if self._unreachable_reported:
            log.info("engine reachable again")
        self._unreachable_since = None
        self._unreachable_reported = False
        self._unreachable_message = None

    def _refuse_engine(self, message: str, reason: str) -> None:
        """An engine this agent cannot drive (an unsupported release, a configuration that cannot work):
        reported once on the pod (Synced=False with `reason`) and in the log; no load is attempted (it
        could not succeed)."""
        self.engine_refused = message
        self.last_error = message
        self._engine_known = True
        log.error("engine refused: %s", message)
        if self.pod is not None:
            self.pod.update(served_version=self.served, sync_error=message, synced=False,
                            synced_reason=reason, synced_message=message)

    def _restore(self, version: int, fetch: Any) -> None:
        """Reload `version` (the last good one) into an engine a failed load left with mixed weights, while
        it is still paused; resume it afterwards whatever happens (never left paused)."""
        assert self.adapter is not None
        try:
            log.warning("restoring version=%s into the engine after a failed load", version)
            res = fetch(version)
            self.served = version
            self.served_digest = _checked_digest(res)
            log.info("restored version=%s", version)
        except (FetchError, EngineError, StagingError) as exc:
            self.served = None  # the engine's weights are mixed: not served until a full version loads
            self.served_digest = None
            if self.peers is not None:
                self.peers.report_served(0)  # wait_served must not count this replica any more
            log.error("restore of version=%s failed: %s; the engine serves no complete version", version, exc)
        finally:
            self.held_paused = False
            if not self.user_paused:
                try:
                    self.adapter.resume()
                except EngineError as exc:
                    log.error("engine resume after restore failed: %s", exc)

    def _atomic_step(self) -> bool:
        """strategy Atomic (agent/atomic.py): prepare, wait or commit; False leaves the step to the ordinary
        path (Rolling, or loading the committed version directly)."""
        d = self.desired
        state = atomic.CommitState(d.commit, d.committed)
        target = (d.target_epoch, d.target_version) if d.target_version is not None else None
        served = self._served_key(d.committed[0] if d.committed else 0)
        if self.held is not None and (state.committed is None or self.held.key not in (target, state.commit,
                                                                                        state.committed)):
            log.info("dropping the prepared version=%s (superseded)", self.held.version)
            self.held = None
        action = atomic.decide(served, self.held.key if self.held else None, target, state)
        if action in (atomic.ROLLING, atomic.LOAD):
            return False
        if action == atomic.PREPARE and target is not None:
            self._fetch(target[1], target[0], hold=atomic.HoldingAdapter(
                target[0], fault=d.inject_fault if d.inject_fault == "prepare" else None,
                timeout=float(self.cfg.timeout_seconds)))
        elif action == atomic.COMMIT_HELD and self.held is not None:
            self._commit_held(self.held)
        else:
            self._report()
        return True

    def _commit_held(self, held: atomic.Held) -> None:
        assert self.adapter is not None and self.peers is not None
        t0 = time.perf_counter()
        try:
            if held.buckets:  # none: the engine takes full tensors from replica rank 0's agent, not this one
                atomic.commit_held(held, _UserPauseGuard(self.adapter, self),
                                   pause_generation=self.cfg.pause_generation)
        except EngineError as exc:
            self.last_error = f"loading the prepared version {held.version}: {exc}"
            self.metrics.versions.labels("failed").inc()
            if getattr(self.adapter, "needs_restore", False):
                self.served = None  # mixed weights; the engine stays out of the Service until it loads the version
                self.served_digest = None
            log.warning("atomic commit failed version=%s error=%s", held.version, exc)
            self._report()
            self._attempt += 1
            time.sleep(min(0.2 * 2 ** min(self._attempt, 5), 5.0))
            self._wake.set()
            return
        took = time.perf_counter() - t0
        self.held = None
        self.served, self.served_epoch, self.served_digest = held.version, held.epoch, held.digest
        self.last_error = None
        self.last_sync = {"version": held.version, "durationSeconds": round(took, 4), "bytes": held.nbytes,
                          "mode": self.mode, **({"relayedFrom": held.relayed_from[0]} if held.relayed_from else {})}
        self.metrics.served_version.set(held.version)
        self.metrics.versions.labels("committed").inc()
        log.info("version committed (atomic) version=%s bytes=%s seconds=%.3f", held.version, held.nbytes, took)
        self._report()
        self.peers.report_served(held.version, held.epoch)
        self._wake.set()

    def _fetch(self, version: int, trainer_epoch: int = 0, hold: atomic.HoldingAdapter | None = None) -> None:
        """Fetch `version` and load it into the engine; with `hold` (Atomic prepare) into host memory only."""
        assert self.adapter is not None and self.peers is not None and self.islot is not None
        topo = self.watcher.current
        rep = self.islot.replica
        g = group_for(topo, rep.replica, self.cfg.pod_name)
        store_host = next((p.ip for p in topo.trainer.pods if p.name == g.members[0]), None)
        group = {"name": g.name, "generation": topo.generation,
                 "store": [store_host or self.cfg.pod_ip, self.cfg.transport_port]}

        used: dict[int, _WireCount] = {}

        def transport_for(gr: dict[str, Any], plan: TransferPlan, role: str) -> Any:
            got = self.cache.get(gr, plan, role=role)
            st = getattr(got[0], "stats", None)
            if id(got[0]) not in used and all(hasattr(st, k) for k in ("full_bytes", "wire_bytes", "delta_buckets")):
                assert st is not None
                used[id(got[0])] = _WireCount(got[0], st.full_bytes, st.wire_bytes, st.delta_buckets)
            return got

        full = engine_takes_full_tensors(self.cfg.engine_type)
        my_ranks = ([0] if 0 in self.islot.member.ranks else []) if full else self.islot.member.ranks
        if not my_ranks:
            if hold is not None:  # nothing to hold: replica rank 0's agent holds the full tensors
                self.held = atomic.Held(version, trainer_epoch)
                self._report()
            return  # the engine's HTTP endpoint (replica rank 0's pod) loads the full tensors for all ranks
        t0 = time.perf_counter()

        def fetch(v: int, pause: bool) -> Any:
            return fetch_version(
                v, peers=self.peers, topo=topo, replica=rep.replica, my_ranks=my_ranks,
                layout_fn=full_layout if full else self.layout_fn,
                adapter=_UserPauseGuard(self.adapter, self) if hold is None else hold,
                transport_for=transport_for, group=group, bucket_bytes=self.cfg.bucket_size_mb << 20,
                proposal=proposal_of(self.session, self._attempt, self.peers_sessions(), self.cache.relay_evictions),
                pause_generation=pause, port=self.cfg.control_port, token=self.token,
                expand_aliases=self.cfg.engine_type == "Custom", verify=self.verify, device=self.cfg.device,
                timeout=self.cfg.timeout_seconds, progress=self._progress_reporter(v),
                relay=self.relay.hub if self.relay is not None and self._relay_next else None, pod=self.cfg.pod_name,
            )

        if hold is not None:
            self._hold(version, lambda v: fetch(v, False), hold)
            self._relay_next = self._prepare_failed is None  # after a failed prepare: directly from the trainer
            return
        prev, prev_epoch = self.served, self.served_epoch
        self.restore_version = prev
        self._loading = True
        try:
            res = fetch(version, self.cfg.pause_generation)
        except (FetchError, EngineError, StagingError) as exc:
            self._relay_next = False  # the next attempt asks the trainer agents directly
            self._loading = False
            self.restore_version = None
            if getattr(exc, "reason", None) == contract.REASON_ENGINE_UNREACHABLE:
                self._engine_died(str(exc))
            elif getattr(self.adapter, "needs_restore", False):
                self.served = None  # mixed weights: not served until a complete version is loaded
                self.served_digest = None
                if prev is None and self.peers is not None:
                    self.peers.report_served(0)
                if self.held_paused and prev is not None:
                    self._attempt += 1  # a new proposal: the failed version's plan agreement is spent
                    self.cache.drop(g.name, role_prefix="dst")
                    self._restore(prev, lambda v: fetch(v, False))
                    if self.served is not None:
                        self.served_epoch = prev_epoch
            self._attempt += 1
            self.cache.drop(g.name, role_prefix="dst")
            self.last_error = str(exc)
            self.metrics.versions.labels("failed").inc()
            log.warning("sync failed version=%s attempt=%s error=%s", version, self._attempt, exc)
            self._report()
            time.sleep(min(0.2 * 2 ** min(self._attempt, 5), 5.0))
            self._wake.set()
            return
        self._loading = False
        self._relay_next = True
        took = time.perf_counter() - t0
        self.served = version
        self.served_epoch = trainer_epoch
        self.served_digest = _checked_digest(res)
        self.last_error = None
        self.last_sync = {"version": version, "durationSeconds": round(took, 4), "bytes": res.bytes, "mode": self.mode,
                          **({"relayedFrom": res.relayed_from[0]} if res.relayed_from else {})}
        self.metrics.served_version.set(version)
        self.metrics.versions.labels("committed").inc()
        self.metrics.transfer_bytes.labels("received", self.mode).inc(res.bytes)
        self.metrics.digest_bytes.labels("received", "hashed").inc(res.digest_bytes)
        self.metrics.digest_bytes.labels("received", "reused").inc(res.digest_reused_bytes)
        saved, delta_buckets = _wire_of(used)
        wire = max(0, res.bytes - saved)
        self.metrics.wire_bytes.labels(self.mode).inc(wire)
        self.metrics.delta_buckets.inc(delta_buckets)
        self.metrics.received_buckets.inc(sum(x.buckets for x in res.stats))
        self.metrics.verified_bytes.inc(res.verified_bytes)
        self.metrics.sync_seconds.labels(self.mode).observe(took)
        st = res.stats
        self.metrics.copied_bytes.labels("unpack").inc(sum(x.copied_bytes for x in st))
        engine_copied = getattr(self.adapter, "copied_bytes", None)
        if isinstance(engine_copied, int):
            self.metrics.copied_bytes.labels("engine_pack").inc(max(0, engine_copied - self._engine_copied))
            self._engine_copied = engine_copied
        stall = f" stall={self.last_stall:.3f}" if self.cfg.pause_generation and self.last_stall is not None else ""
        self.last_stall = None
        log.info("version committed version=%s bytes=%s wire_bytes=%s delta_buckets=%s seconds=%.3f handshake=%.3f "
                 "wait=%.3f engine_load=%.3f%s", version, res.bytes, wire, delta_buckets, took,
                 sum(x.handshake_seconds for x in st), sum(x.wait_seconds for x in st), sum(x.load_seconds for x in st),
                 stall)
        self._report()
        self.peers.report_served(version, trainer_epoch)  # trainer agents answer wait_served from these reports
        self._wake.set()

    def stall_ended(self) -> None:
        """Generation resumed after a load: how long it was paused (what a user's rollouts waited)."""
        if self.stall_started is not None:
            self.last_stall = time.perf_counter() - self.stall_started
            self.stall_started = None
            self.metrics.engine_stall_seconds.observe(self.last_stall)

    def _hold(self, version: int, fetch: Callable[[int], Any], hold: atomic.HoldingAdapter) -> None:
        """Atomic prepare: fetch and verify `version` into host memory; the engine is not touched."""
        assert self.peers is not None
        if self._prepare_failed is not None and self._prepare_failed != version:
            self.last_error = None  # a new round: the last one's error is not this one's
        self._loading = True
        try:
            res = fetch(version)
            if res is not None:  # what came over the wire, as for a load (the commit later moves nothing)
                self.metrics.transfer_bytes.labels("received", self.mode).inc(res.bytes)
            if hold.complete is None:
                raise FetchError(f"version {version} was not complete")
        except (FetchError, EngineError, StagingError) as exc:
            self._loading = False
            self._prepare_failed = version
            self._attempt += 1
            if self.islot is not None:
                g = group_for(self.watcher.current, self.islot.replica.replica, self.cfg.pod_name)
                self.cache.drop(g.name, role_prefix="dst")
            self.last_error = f"atomic prepare: {exc.__cause__ or exc}"  # not "was not committed"
            self.metrics.versions.labels("failed").inc()
            log.warning("atomic prepare failed version=%s attempt=%s error=%s", version, self._attempt, exc)
            self._report()
            time.sleep(min(0.2 * 2 ** min(self._attempt, 5), 5.0))
            self._wake.set()
            return
        self._loading = False
        self._prepare_failed = None
        self.held = hold.complete
        if res is not None:
            self.held.relayed_from = list(res.relayed_from)
        self.last_error = None
        log.info("version prepared (held, not served) version=%s bytes=%s", version, self.held.nbytes)
        self._report()
        self._wake.set()

    def _progress_reporter(self, version: int) -> Callable[[int, int, int, int], None]:
        """Report a load's progress on the pod (annotation weightsync.io/sync-progress, then
        status.inferenceReplicas[].progress) once it has lasted PROGRESS_AFTER, then at most once a second
        (the version's report follows the last bucket at once), and count it in the metrics."""
        start = time.monotonic()
        last = [start - PROGRESS_INTERVAL]

        def report(bucket: int, buckets: int, nbytes: int, total: int) -> None:
            self.metrics.sync_progress_buckets.set(bucket)
            self.metrics.sync_progress_bytes.set(nbytes)
            now = time.monotonic()
            if self.pod is None or bucket >= buckets or now - start < PROGRESS_AFTER or now - last[0] < PROGRESS_INTERVAL:
                return
            last[0] = now
            self.pod.update(sync_progress={"version": version, "bucket": bucket, "buckets": buckets,
                                           "bytes": nbytes, "totalBytes": total})

        return report

    def peers_sessions(self) -> list[str]:
        assert self.peers is not None
        return self.peers.trainer_sessions()

    # --- health --------------------------------------------------------------------------------------
    def _health(self) -> tuple[bool, dict[str, Any]]:
        detail: dict[str, Any] = {"role": self.cfg.role, "pod": self.cfg.pod_name, "mode": self.mode,
                                  "verify": self.verify, "deltaSync": self.delta is not None,
                                  "generation": self.watcher.current.generation}
        if self.store is not None:
            detail["published"] = self.published
        if self.islot is not None:
            detail.update(served=self.served, paused=self.user_paused, engines=self.registry.connected(),
                          trainers_connected=self.peers.connected() if self.peers else False,
                          last_error=self.last_error)
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


if __name__ == "__main__":
    main()
