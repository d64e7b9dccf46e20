"""kopf wiring: the process lifecycle around the reconciler, its watch caches and its work queue.

Why the operator's own informers (operator/informers.py) rather than kopf's watch handlers: a reconcile
reads the job and everything it owns from memory instead of GETting eight kinds, and the watch event
that updated the cache is the one that asks for the reconcile, so a pass never sees state older than its
trigger. Every event (of the job or of one of its objects) only means "reconcile job X", which is what a
level-triggered reconciler wants. kopf keeps no progress or diff-base annotations on the user's object
and adds no finalizer, so restarting the operator leaves every resourceVersion untouched and deleting a
job never waits for the operator; owned objects are garbage-collected through their owner references.
kopf still runs the process: startup/cleanup, liveness probes, and peering (active/standby), whose
answer gates the reconciles (operator/leadership.py). A periodic resync covers anything missed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from weightsync.crds import contract
from weightsync.operator import gcpolicy, metrics, proofs
from weightsync.operator.common import JobRef
from weightsync.operator.config import OperatorConfig
from weightsync.operator.events import EventRecorder
from weightsync.operator.informers import OWNED_KINDS, Informers
from weightsync.operator.kube import Kube
from weightsync.operator.leadership import PEERING_LIFETIME_S, REFRESH_SECONDS, PeeringGuard
from weightsync.operator.reconcile import CachedReader, Reconciler
from weightsync.operator.reports import REPORT_BATCH_SECONDS, ReportBox, ReportIntake, ReportServer
from weightsync.operator.workqueue import WorkQueue

log = logging.getLogger(__name__)


@dataclass
class RuntimeOptions:
    """Set by `main` before kopf starts; defaults suit `kopf run -m weightsync.operator.handlers`."""

    config: OperatorConfig | None = None
    identity: str = "weightsync-operator"
    standalone: bool = True
    peering_name: str = "default"
    peering_namespace: str | None = None
    priority: int = 0
    scanning: bool = True
    namespaces: list[str] | None = None  # None: every namespace (cluster-wide)


@dataclass
class OperatorState:
    cfg: OperatorConfig
    kube: Kube
    reconciler: Reconciler
    queue: WorkQueue
    guard: PeeringGuard
    informers: Informers
    loop: asyncio.AbstractEventLoop
    report_server: ReportServer | None = None
    ready: bool = False  # the caches are synced: reconciles may start
    caches_synced: asyncio.Event = field(default_factory=asyncio.Event)  # the same, for whoever waits on it
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def request_all(self) -> None:
        for key in self.informers.jobs():
            self.queue.request(key)

    def on_change(self, kind: str, type_: str, obj: dict[str, Any]) -> None:
        """Informer callback (its thread): hand the owning job's key to the event loop."""
        meta = obj.get("metadata") or {}
        ns = str(meta.get("namespace") or "")
        name = str(meta.get("name") or "") if kind == contract.KIND else owner_job(obj)
        if name:
            self.loop.call_soon_threadsafe(self._changed, kind, type_, (ns, name))

    def _changed(self, kind: str, type_: str, key: tuple[str, str]) -> None:
        if kind == contract.KIND and type_ == "DELETED":
            self.queue.forget(key)
            metrics.forget_job(*key)
            return
        if self.ready and self.guard.is_active:
            self.queue.request(key)


OPTIONS = RuntimeOptions()
STATE: OperatorState | None = None


def _state() -> OperatorState:
    if STATE is None:
        raise RuntimeError("operator state is not initialised: the startup handler has not run")
    return STATE


def tune(settings: kopf.OperatorSettings, opts: RuntimeOptions) -> None:
    """kopf settings: bounded API calls, periodic watch reconnects, warnings posted as Events."""
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300       # the API server closes idle watches; kopf reconnects
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.posting.enabled = True
    settings.posting.level = logging.WARNING     # only problems become Events on the job
    settings.peering.stealth = True              # no keep-alive chatter in the logs
    settings.peering.lifetime = PEERING_LIFETIME_S  # a killed leader's entry expires this fast
    settings.execution.max_workers = 8
    settings.scanning.disabled = not opts.scanning


async def _resync_loop(state: OperatorState) -> None:
    """Every resync_seconds, one pass per job, spread over half the period: with 100 jobs all at once, the
    burst of passes held up the pass a busy job's reports were waiting for by a second."""
    while True:
        await asyncio.sleep(state.cfg.resync_seconds)
        keys = sorted(state.informers.jobs())
        metrics.JOBS.set(len(keys))
        gap = spread_gap(state.cfg.resync_seconds, len(keys))
        for key in keys:
            if not (state.ready and state.guard.is_active):
                break
            state.queue.request(key)
            await asyncio.sleep(gap)


def spread_gap(resync_seconds: float, jobs: int) -> float:
    """Seconds between two jobs' resync passes: all of them within half the period."""
    return 0.0 if jobs <= 1 else resync_seconds / 2.0 / jobs


async def _leadership_loop(state: OperatorState) -> None:
    """Re-read the peering object; on becoming the active replica, reconcile every job at once."""
    while True:
        try:
            active, changed = await asyncio.to_thread(state.guard.refresh)
        except Exception as err:  # the guard answers False itself on API errors; this is anything else
            log.warning("leadership check failed error=%r", err)
        else:
            if changed and active and state.ready:
                state.request_all()
        await asyncio.sleep(REFRESH_SECONDS)


async def _start_caches(state: OperatorState) -> None:
    """List and watch; reconciles start only once every cache holds the whole picture (a job whose pods
    are not listed yet would look as if it had none)."""
    state.informers.start()
    synced = await asyncio.to_thread(state.informers.wait_synced, 300.0)
    if not synced:
        log.warning("watch caches not synced after 300 s; starting anyway (their retries continue)")
    state.ready = True
    state.caches_synced.set()
    metrics.JOBS.set(len(state.informers.jobs()))
    log.info("watch caches synced jobs=%d", len(state.informers.jobs()), extra={"jobs": len(state.informers.jobs())})
    if state.guard.is_active:
        state.request_all()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global STATE
    opts = OPTIONS
    cfg = opts.config or OperatorConfig.from_env()
    tune(settings, opts)
    kube = await asyncio.to_thread(Kube.from_environment, float(settings.networking.request_timeout or 60))
    kinds = (*OWNED_KINDS, "ResourceClaimTemplate") if cfg.dra_device_class_name else OWNED_KINDS
    guard = PeeringGuard(kube, opts.identity, opts.standalone, opts.peering_name, opts.peering_namespace, opts.priority)
    await asyncio.to_thread(guard.ensure_object)
    informers = Informers(kube, opts.namespaces, kinds=kinds)
    reports = ReportBox()
    reconciler = Reconciler(kube, cfg, EventRecorder(kube), reader=CachedReader(kube, informers), reports=reports)
    queue = WorkQueue(reconciler.reconcile, batch_seconds=cfg.batch_seconds)
    STATE = OperatorState(cfg=cfg, kube=kube, reconciler=reconciler, queue=queue, guard=guard, informers=informers,
                          loop=asyncio.get_running_loop())
    informers.on_change = STATE.on_change
    metrics.serve(cfg.metrics_port)
    gcpolicy.time_gc()
    if cfg.report_url is not None:
        STATE.report_server = ReportServer(_intake(STATE, reports).take, host=_listen_host(cfg.report_address),
                                           port=cfg.report_port)
        await STATE.report_server.start()
    else:
        log.info("report listener off (%s): agents write their pods only",
                 "no operator key" if cfg.operator_key is None else
                 "no --report-address / POD_IP" if not cfg.report_address else "--report-port 0")
    loop = asyncio.get_running_loop()
    STATE.tasks.append(loop.create_task(_leadership_loop(STATE), name="leadership"))
    STATE.tasks.append(loop.create_task(_start_caches(STATE), name="caches"))
    STATE.tasks.append(loop.create_task(_resync_loop(STATE), name="resync"))
    STATE.tasks.append(loop.create_task(gcpolicy.run(STATE.caches_synced), name="gc"))
    log.info(
        "operator started report_url=%s agent_image=%s node_gpu_count=%d resync_seconds=%s standalone=%s",
        cfg.report_url, cfg.agent_image, cfg.node_gpu_count, cfg.resync_seconds, opts.standalone,
    )


def _listen_host(address: str) -> str:
    """Listen on the advertised address when it is an IP of this host (the pod IP), else everywhere."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "0.0.0.0"
    return address


def _intake(state: OperatorState, box: ReportBox) -> ReportIntake:
    """Pushed reports checked against the caches and the job's token (derived from the operator key), taken
    only by the active replica once its caches hold the whole picture."""
    def token_for(job: dict[str, Any]) -> str | None:
        ref = JobRef.from_body(job)
        if not state.reconciler.checks_versions(ref, job.get("status") or {}):
            return None  # a token from before this operator's key: the agent's MAC could not match
        return proofs.token_for(state.cfg.operator_key, ref)

    return ReportIntake(box, state.informers.get, token_for,
                        is_active=lambda: state.ready and state.guard.is_active,
                        request=lambda key: state.queue.request(key, REPORT_BATCH_SECONDS))


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    global STATE
    if STATE is None:
        return
    if STATE.report_server is not None:
        await STATE.report_server.stop()
    for t in STATE.tasks:
        t.cancel()
    STATE.informers.stop()
    STATE.queue.cancel_all()
    STATE = None


def owner_job(body: dict[str, Any]) -> str | None:
    """The WeightSyncJob controlling a pod, from its owner reference (the label is only a filter)."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == contract.KIND and ref.get("apiVersion", "").startswith(contract.GROUP + "/"):
            return str(ref.get("name"))
    return None


@kopf.on.probe(id="jobs")
def probe_jobs(**_: Any) -> int:
    return len(STATE.informers.jobs()) if STATE is not None else 0
