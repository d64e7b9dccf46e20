"""kopf wiring: thin handlers that only enqueue work for the reconciler.

Why `on.event` rather than `on.create/update/resume` plus a timer: every event (of the job or of one of
its pods) just means "reconcile job X", which is what a level-triggered reconciler wants; kopf then keeps
no progress or diff-base annotations on the user's object and adds no finalizer (timers and daemons
would), so restarting the operator leaves every resourceVersion untouched and deleting a job never waits
for the operator. Owned objects are garbage-collected through their owner references. A periodic resync
covers missed events and deletions of owned objects other than pods.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
from weightsync.crds import contract
from weightsync.operator import metrics
from weightsync.operator.config import OperatorConfig
from weightsync.operator.events import EventRecorder
from weightsync.operator.kube import Kube
from weightsync.operator.leadership import PeeringGuard
from weightsync.operator.reconcile import Reconciler
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


@dataclass
class OperatorState:
    cfg: OperatorConfig
    kube: Kube
    reconciler: Reconciler
    queue: WorkQueue
    guard: PeeringGuard
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


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
    settings.execution.max_workers = 8
    settings.scanning.disabled = not opts.scanning


async def _resync_loop(state: OperatorState) -> None:
    while True:
        await asyncio.sleep(state.cfg.resync_seconds)
        try:
            active = await asyncio.to_thread(state.guard.active)
        except Exception as err:
            log.warning("resync skipped error=%r", err)
            continue
        metrics.JOBS.set(len(state.queue.known))
        if not active:
            continue
        for key in list(state.queue.known):
            state.queue.request(key)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global STATE
    opts = OPTIONS
    cfg = opts.config or OperatorConfig.from_env()
    tune(settings, opts)
    kube = await asyncio.to_thread(Kube.from_environment, float(settings.networking.request_timeout or 60))
    reconciler = Reconciler(kube, cfg, EventRecorder(kube))
    guard = PeeringGuard(kube, opts.identity, opts.standalone, opts.peering_name, opts.peering_namespace, opts.priority)
    await asyncio.to_thread(guard.ensure_object)
    queue = WorkQueue(reconciler.reconcile)
    STATE = OperatorState(cfg=cfg, kube=kube, reconciler=reconciler, queue=queue, guard=guard)
    metrics.serve(cfg.metrics_port)
    STATE.tasks.append(asyncio.get_running_loop().create_task(_resync_loop(STATE), name="resync"))
    log.info(
        "operator started agent_image=%s node_gpu_count=%d resync_seconds=%s standalone=%s",
        cfg.agent_image, cfg.node_gpu_count, cfg.resync_seconds, opts.standalone,
    )


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    global STATE
    if STATE is None:
        return
    for t in STATE.tasks:
        t.cancel()
    STATE.queue.cancel_all()
    STATE = None


@kopf.on.event(contract.GROUP, contract.VERSION, contract.PLURAL)
async def job_event(event: kopf.RawEvent, name: str, namespace: str | None, **_: Any) -> None:
    key = (namespace or "", name)
    if event.get("type") == "DELETED":
        _state().queue.forget(key)
        metrics.forget_job(*key)
        return
    _state().queue.request(key)


def owner_job(body: dict[str, Any]) -> str | None:
    """The WeightSyncJob controlling a pod, from its owner reference (the label is only a filter)."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == contract.KIND and ref.get("apiVersion", "").startswith(contract.GROUP + "/"):
            return str(ref.get("name"))
    return None


@kopf.on.event("v1", "pods", labels={contract.LABEL_MANAGED_BY: contract.MANAGED_BY, contract.LABEL_JOB: kopf.PRESENT})
async def pod_event(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    job = owner_job(dict(body))
    if job and namespace:
        _state().queue.request((namespace, job))


@kopf.on.probe(id="jobs")
def probe_jobs(**_: Any) -> int:
    return len(STATE.queue.known) if STATE is not None else 0
