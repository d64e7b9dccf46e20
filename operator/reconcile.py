"""The reconciler: level-triggered and idempotent.

Each pass reads the job and everything it owns, computes the desired objects with the pure builders,
creates what is missing, patches what drifted (only fields that may change), deletes surplus pods, and
writes the status through the status subresource. Running it twice in a row changes nothing: owned
objects carry a hash of their desired form (`contract.ANN_SPEC_HASH`) and are patched only when it
differs, and the status is written only when it differs.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from pydantic import ValidationError

from weightsync.crds import contract, desired
from weightsync.crds.models import ReplicaCounts, TransferMode, WeightSyncJob, validation_messages
from weightsync.operator import (
    atomic,
    desiredstate,
    dra,
    networkpolicy,
    podstate,
    proofs,
    rbac,
    secret,
    service,
)
from weightsync.operator import metrics as m
from weightsync.operator import topology as topo
from weightsync.operator.common import JobRef, job_selector, stable_hash
from weightsync.operator.config import OperatorConfig
from weightsync.operator.events import EventRecorder
from weightsync.operator.informers import Informers
from weightsync.operator.kube import Kube, KubeError
from weightsync.operator.placement import plan as make_plan
from weightsync.operator.pods import TemplateError, build_pods
from weightsync.operator.replicas import replica_states, trainer_version
from weightsync.operator.reports import ReportBox
from weightsync.operator.rollout import desired_annotations
from weightsync.operator.status import (
    REASON_INVALID_SPEC,
    REASON_INVALID_TEMPLATE,
    REASON_PERMISSION_DENIED,
    REASON_POD_SECURITY,
    Problem,
    aggregate,
    ordered,
    problem_status,
)

log = logging.getLogger(__name__)
Obj = dict[str, Any]
REASON_OBJECT_CONFLICT = "ObjectConflict"
REASON_DESIRED_STATE_TOO_LARGE = "DesiredStateTooLarge"
REASON_UNPROVEN_VERSION = "UnprovenVersion"  # Event: a version on a pod without a valid agent proof
CREATE_CONCURRENCY = 8

# Fields of each owned kind the reconciler may patch in place (everything else is fixed at creation).
PATCHABLE: dict[str, tuple[str, ...]] = {
    "ServiceAccount": (),
    "Role": ("rules",),
    "RoleBinding": ("subjects",),
    "Service": ("spec",),
    "NetworkPolicy": ("spec",),
    "ConfigMap": ("data",),
    "ResourceClaimTemplate": (),
}


@dataclass
class Outcome:
    """What one pass did (for logs, metrics and tests)."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    status_write_s: float = 0.0  # round trip of the status PATCH (0 when nothing was written)
    problem: Problem | None = None
    status: Obj = field(default_factory=dict)
    #: pass again after this many seconds even if nothing changes (an Atomic drain waiting for gates to settle)
    recheck_after: float | None = None

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted or self.status_written)


class Conflict(Exception):
    """An object with an owned name exists but belongs to someone else."""


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _log_change(action: str, kind: str, job: JobRef, name: str) -> None:
    """One line per write, as key=value text and as JSON fields (`--log-format json`)."""
    log.info("%s kind=%s name=%s/%s", action, kind, job.namespace, name,
             extra={"action": action, "kind": kind, "job": f"{job.namespace}/{job.name}", "object_name": name})


def _desired_hash(desired: Mapping[str, Any]) -> str:
    body = {k: v for k, v in desired.items() if k not in ("metadata", "status")}
    meta = desired.get("metadata") or {}
    body["labels"] = meta.get("labels")
    body["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != contract.ANN_SPEC_HASH}
    return stable_hash(body)


class Reader(Protocol):
    """Where a pass reads the job and what it owns: the API (DirectReader) or the watch caches."""

    def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...
    def pods_of(self, job: JobRef) -> list[Obj]: ...
    def assume(self, obj: Obj) -> None: ...


class DirectReader:
    """GET / LIST per pass (tests with a fake API, and tools without a watch)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.kube.get_or_none(kind, namespace, name)

    def pods_of(self, job: JobRef) -> list[Obj]:
        return self.kube.list("Pod", job.namespace, job_selector(job))

    def assume(self, obj: Obj) -> None:
        return None


class CachedReader:
    """Reads from the informers' caches; kinds they do not hold fall back to a GET."""

    def __init__(self, kube: Kube, informers: Informers) -> None:
        self.kube = kube
        self.informers = informers

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        if self.informers.serves(kind):
            return self.informers.get(kind, namespace, name)
        return self.kube.get_or_none(kind, namespace, name)

    def pods_of(self, job: JobRef) -> list[Obj]:
        return self.informers.of_job("Pod", job.namespace, job.name)

    def assume(self, obj: Obj) -> None:
        self.informers.assume(obj)


class Reconciler:
    def __init__(self, kube: Kube, cfg: OperatorConfig, events: EventRecorder | None = None,
                 clock: Callable[[], float] = time.monotonic, reader: Reader | None = None,
                 reports: ReportBox | None = None) -> None:
        self.kube = kube
        self.reports = reports or ReportBox()  # agents' pushed reports, laid over their pods (operator/reports.py)
        self.reader: Reader = reader or DirectReader(kube)
        self.cfg = cfg
        self.events = events or EventRecorder(kube)
        self.clock = clock
        self._tokens_present: set[tuple[str, str, str]] = set()  # (namespace, job, uid) with a token Secret
        self._denials_posted: dict[tuple[str, str], str] = {}  # last PermissionDenied Event per job (no spam)
        self._tokens_derived: set[tuple[str, str, str]] = set()  # jobs whose token this process derived
        self._unproven_posted: dict[tuple[str, str], list[str]] = {}  # pods last named in an UnprovenVersion Event
        self._unchecked_warned: set[tuple[str, str, str]] = set()
        # per job: what was built from its spec last time, and from what (see _memo)
        self._built: dict[tuple[str, str], dict[str, tuple[Any, Any]]] = {}
        self._prepare_clock = atomic.PrepareClock()  # Atomic rounds: since when each job prepares its version

    # --- entry points ----------------------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Reconcile by key; None when the job is gone or being deleted (garbage collection does the rest)."""
        body = self.reader.get(contract.KIND, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            m.forget_job(namespace, name)
            self._built.pop((namespace, name), None)
            self._prepare_clock.forget((namespace, name))
            self.reports.forget(namespace, name)
            return None
        start = self.clock()
        try:
            out = self.reconcile_body(body)
        except Exception as err:
            m.RECONCILE_ERRORS.inc()
            m.RECONCILES.labels(result="error").inc()
            if isinstance(err, KubeError) and err.forbidden_by_rbac:
                self._report_forbidden(body, err)
            raise
        finally:
            m.RECONCILE_DURATION.observe(self.clock() - start)
        m.RECONCILES.labels(result="changed" if out.changed else "unchanged").inc()
        return out

    def reconcile_body(self, body: Obj) -> Outcome:
        job = JobRef.from_body(body)
        prev_status: Obj = body.get("status") or {}
        out = Outcome()
        try:
            model = WeightSyncJob.from_k8s(body)
        except ValidationError as err:
            problem = Problem(REASON_INVALID_SPEC, "; ".join(validation_messages(err))[:2000])
            self._finish_problem(job, body, prev_status, problem, out, paused=bool((body.get("spec") or {}).get("paused")))
            return out
        spec = model.spec
        plan = make_plan(job.name, spec, self.cfg.node_gpu_count, self.cfg.rdma_available,
                         self.cfg.dra_device_class_name)
        if plan.refusal is not None:
            problem = Problem(plan.refusal.reason, plan.refusal.message)
            self._finish_problem(job, body, prev_status, problem, out, paused=spec.paused, mode=plan.mode)
            return out

        if not prev_status.get("conditions"):
            # Status from the very first pass, before the (possibly many) owned objects are created.
            first = aggregate(spec, job.generation, plan, {}, None, None)
            self._write_status(job, prev_status, ordered(first), out)
            prev_status = out.status
        desired_cm = self._owned(job, contract.desired_configmap_name(job.name))
        pods = self._observed_pods(job, desired_cm)
        try:
            # Supporting objects first: the pods' ServiceAccount must exist before a pod can be admitted.
            self._ensure(job, rbac.build_service_account(job), out)
            self._ensure(job, rbac.build_role(job, plan.names), out)
            self._ensure(job, rbac.build_role_binding(job), out)
            self._ensure(job, service.build_service(job, spec), out)
            self._ensure(job, service.build_routing_service(job, spec, plan), out)
            self._ensure(job, networkpolicy.build_network_policy(job, self.cfg.agent_metrics_allow_from), out)
            self._ensure_secret(job, out)
            pods = self._believe(job, pods, prev_status)
            rct = dra.build_resource_claim_template(job, spec, self.cfg)
            if rct is not None:
                self._ensure(job, rct, out)
            prev_cm = self.reader.get("ConfigMap", job.namespace, contract.topology_configmap_name(job.name))
            if prev_cm is not None and _controller_uid(prev_cm) not in (None, job.uid):
                prev_cm = None  # a namesake job's leftover, about to be garbage-collected
            membership = topo.membership_hash(plan, pods)
            cm = self._memo(job, "topology", (membership, topo.next_generation(prev_cm, membership)),
                            lambda: topo.build_topology_configmap(job, spec, plan, pods, prev_cm))
            self._ensure(job, cm, out, existing=prev_cm)
        except Conflict as err:
            self._finish_problem(job, body, prev_status, Problem(REASON_OBJECT_CONFLICT, str(err)), out,
                                 paused=spec.paused, mode=plan.mode)
            return out
        generation = topo.generation_of(cm)

        states = replica_states(plan, pods)
        tv = trainer_version(plan, pods, prev_status.get("trainerVersion"), prev_status.get("trainerEpoch") or 0)
        overdue = None
        now = datetime.now(timezone.utc)  # one instant for every decision of this pass
        if spec.update_policy.strategy == "Atomic":
            round_ = atomic.decide(states, pods, tv, now=now)
            overdue = self._prepare_clock.overdue(
                (job.namespace, job.name), round_.preparing, self.clock(),
                spec.transfer.timeout_seconds + atomic.PREPARE_GRACE_S)
            out.recheck_after = round_.recheck_after
            if round_.settling:
                log.info("atomic.drain_settling job=%s/%s version=%s pods=%s recheck_after_s=%.2f", job.namespace,
                         job.name, round_.commit[1] if round_.commit else None, ",".join(round_.settling),
                         round_.recheck_after or 0.0, extra={"job": f"{job.namespace}/{job.name}"})
            if round_.awaiting:
                log.info("atomic.awaiting_ready job=%s/%s committed=%s trainer=%s pods=%s", job.namespace, job.name,
                         round_.committed[1] if round_.committed else None, tv[1] if tv else None,
                         ",".join(round_.awaiting), extra={"job": f"{job.namespace}/{job.name}"})
        annotations = desired_annotations(spec, plan, states, tv, generation, pods, overdue, now)
        try:
            desired_pods = self._memo(job, "pods", None, lambda: build_pods(job, spec, plan, self.cfg))
        except TemplateError as err:
            problem = Problem(REASON_INVALID_TEMPLATE, str(err))
            self._finish_problem(job, body, prev_status, problem, out, paused=spec.paused, mode=plan.mode)
            return out
        try:
            # Before any pod is created: a new pod's agent finds its target in it.
            desired_cm = self._ensure_desired(job, annotations, desired_cm, out)
        except (desired.DesiredTooLarge, Conflict) as err:
            reason = REASON_OBJECT_CONFLICT if isinstance(err, Conflict) else REASON_DESIRED_STATE_TOO_LARGE
            problem = Problem(reason, str(err))
            self._finish_problem(job, body, prev_status, problem, out, paused=spec.paused, mode=plan.mode)
            return out

        sync_problem = self._sync_pods(job, desired_pods, pods, out, plan.mode)
        if sync_problem is not None:
            self._finish_problem(job, body, prev_status, sync_problem, out, paused=spec.paused, mode=plan.mode)
            return out
        if out.created or out.deleted:
            pods = self._believe(job, self._observed_pods(job, desired_cm), prev_status, report=False)
            states = replica_states(plan, pods)

        built = {p["metadata"]["name"]: p["metadata"]["annotations"].get(contract.ANN_SPEC_HASH) for p in desired_pods}
        outdated = [
            n for n, p in pods.items()
            if podstate.is_live(p) and n in built and podstate.pod_annotations(p).get(contract.ANN_SPEC_HASH) != built[n]
        ]
        self._patch_outdated_pods(job, outdated, annotations, out)
        status = aggregate(spec, job.generation, plan, pods, prev_status, generation, now=now, states=states,
                           outdated=outdated, atomic_overdue=overdue)
        self._write_status(job, prev_status, ordered(status), out)
        m.record_job_status(job.namespace, job.name, out.status)
        if out.status_written:
            self.events.transitions(job, prev_status, out.status)
        if out.created:
            self.events.normal(job, "Created", f"created {', '.join(sorted(out.created))}"[:1000])
        return out

    # --- owned objects -----------------------------------------------------------------------------------
    def _owned_pods(self, job: JobRef) -> dict[str, Obj]:
        pods = self.reader.pods_of(job)
        return {p["metadata"]["name"]: p for p in pods if _controller_uid(p) == job.uid}

    def _observed_pods(self, job: JobRef, desired_cm: Obj | None) -> dict[str, Obj]:
        """The job's cached pods as the rollout reads them: the desired annotations from the job's ConfigMap,
        the reported ones from a report the pod's agent pushed when its pod has not caught up yet."""
        pods = desiredstate.overlay(self._owned_pods(job), desired_cm)
        return self.reports.overlay(job.namespace, job.name, pods)

    def _memo(self, job: JobRef, what: str, inputs: Any, build: Callable[[], Any]) -> Any:
        """BUILD() for this job's uid and spec generation and INPUTS, reused while they stay the same: a pass
        over a 256-pod job rebuilt every pod manifest and the topology (most of its 0.4-0.6 s) though
        neither changes with a version. Treat the result as read-only."""
        slot = self._built.setdefault((job.namespace, job.name), {})
        key = (job.uid, job.generation, inputs)
        hit = slot.get(what)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = build()
        slot[what] = (key, value)
        return value

    def _owned(self, job: JobRef, name: str, kind: str = "ConfigMap") -> Obj | None:
        """The cached object of this job named NAME (None: absent, or a namesake job's leftover)."""
        obj = self.reader.get(kind, job.namespace, name)
        return obj if obj is not None and _controller_uid(obj) == job.uid else None

    def _ensure_desired(self, job: JobRef, per_pod: Mapping[str, Mapping[str, str]], current: Obj | None,
                        out: Outcome) -> Obj:
        """Write what the pods should do into the job's desired-state ConfigMap: one write per change, however
        many pods it retargets (a merge patch of the changed pods' keys; null for pods that are gone)."""
        want = desiredstate.build_desired_configmap(job, per_pod, self.cfg.report_url)
        name = want["metadata"]["name"]
        if current is None:
            return self._ensure(job, want, out)  # create (or the ownership check of a namesake)
        patch = desired.patch_for(want["data"], current.get("data"))
        if not patch:
            return current
        patched = self.kube.patch("ConfigMap", job.namespace, name, {"data": patch})
        self.reader.assume(patched)
        out.patched.append(f"ConfigMap/{name}")
        return patched

    def _ensure(self, job: JobRef, desired: Obj, out: Outcome, existing: Obj | None = None) -> Obj:
        kind = desired["kind"]
        name = desired["metadata"]["name"]
        h = _desired_hash(desired)
        desired["metadata"].setdefault("annotations", {})[contract.ANN_SPEC_HASH] = h
        current = existing if existing is not None else self.reader.get(kind, job.namespace, name)
        if current is None:
            try:
                created = self.kube.create(desired)
            except KubeError as err:
                if not err.conflict:
                    raise
                # Not in the cache, yet it exists: a namesake without our label, or a create the watch has
                # not delivered yet. One GET tells which (the owner check below).
                current = self.kube.get_or_none(kind, job.namespace, name)
                if current is None:
                    return desired  # deleted meanwhile: the next pass creates it
            else:
                self.reader.assume(created)
                out.created.append(f"{kind}/{name}")
                _log_change("created", kind, job, name)
                return created
        owner = _controller_uid(current)
        if owner != job.uid:
            if owner is None:
                raise Conflict(
                    f"{kind} {job.namespace}/{name} exists and is not owned by this WeightSyncJob: "
                    "delete it or rename the job"
                )
            return current  # a deleted namesake job's object, pending garbage collection
        ann = (current.get("metadata") or {}).get("annotations") or {}
        if ann.get(contract.ANN_SPEC_HASH) == h:
            return current
        patch: Obj = {"metadata": {"annotations": desired["metadata"]["annotations"],
                                   "labels": desired["metadata"]["labels"]}}
        for f in PATCHABLE.get(kind, ()):
            if f in desired:
                patch[f] = desired[f]
        patched = self.kube.patch(kind, job.namespace, name, patch)
        self.reader.assume(patched)
        out.patched.append(f"{kind}/{name}")
        _log_change("patched", kind, job, name)
        return patched

    def _ensure_secret(self, job: JobRef, out: Outcome) -> None:
        """Create-only: the token is generated once and never rotated, logged or read back.

        The operator may not read Secrets (least privilege: the chart grants `create` only), so it
        remembers per job uid that the token exists: one POST per job per operator process (201, or 409
        when an earlier process made it), and no API write on later passes.
        """
        key = (job.namespace, job.name, job.uid)
        if key in self._tokens_present:
            return
        name = contract.token_secret_name(job.name)
        try:
            self.kube.create(secret.build_secret(job, proofs.token_for(self.cfg.operator_key, job)))
        except KubeError as err:
            if not err.conflict:
                raise
        else:
            out.created.append(f"Secret/{name}")
            _log_change("created", "Secret", job, name)
            if self.cfg.operator_key is not None:
                self._tokens_derived.add(key)
        self._tokens_present.add(key)

    def _proof_key(self, job: JobRef, status: Mapping[str, Any]) -> str | None:
        """The operator key id the job's versions are checked under (None: not checked)."""
        key = (job.namespace, job.name, job.uid)
        return proofs.enforced_key(self.cfg.operator_key, status, key in self._tokens_derived)

    def checks_versions(self, job: JobRef, status: Mapping[str, Any]) -> bool:
        """The job's versions are checked under this operator's key (so are the reports its agents push)."""
        return self._proof_key(job, status) is not None

    def _believe(self, job: JobRef, pods: dict[str, Obj], status: Mapping[str, Any], report: bool = True) -> dict[str, Obj]:
        """Drop versions on pods that carry no valid proof (a forged annotation moves nothing) and say so
        once per change with a Warning Event naming the pods."""
        if self._proof_key(job, status) is None:
            key = (job.namespace, job.name, job.uid)
            if self.cfg.operator_key is not None and key not in self._unchecked_warned:
                self._unchecked_warned.add(key)
                log.warning("versions on the pods of job=%s/%s are not checked: its token predates this operator's "
                            "key (re-create the job to have them checked)", job.namespace, job.name)
            return pods
        token = proofs.token_for(self.cfg.operator_key, job)
        assert token is not None
        believed, unproven = proofs.believed(pods, token)
        if report and self.reports.held(job.namespace, job.name):
            # A report pushed by a pod's agent stands over that pod until the pod shows it, and so hides what
            # else is written on the pod meanwhile: the pods as cached say whether someone forged a version.
            unproven = sorted(set(unproven) | set(proofs.believed(self._owned_pods(job), token)[1]))
        jkey = (job.namespace, job.name)
        if report and unproven != self._unproven_posted.get(jkey, []):
            self._unproven_posted[jkey] = unproven
            if unproven:
                log.warning("unproven versions ignored job=%s/%s pods=%s", job.namespace, job.name, unproven,
                            extra={"job": f"{job.namespace}/{job.name}", "reason": REASON_UNPROVEN_VERSION})
                self.events.warning(job, REASON_UNPROVEN_VERSION, (
                    f"ignored versions written on pods {', '.join(unproven)} without a valid "
                    f"{contract.ANN_VERSION_PROOF}: only the pod's agent can write a version; something else "
                    "patched the pod")[:1000])
        return believed

    def _sync_pods(self, job: JobRef, desired: list[Obj], observed: dict[str, Obj], out: Outcome,
                   mode: str) -> Problem | None:
        wanted = {p["metadata"]["name"]: p for p in desired}
        missing = [p for n, p in wanted.items() if n not in observed]
        if missing and self.cfg.dry_run_templates:
            problem = self._dry_run(missing, mode)
            if problem is not None:
                return problem
        problem = self._create_pods(job, [copy.deepcopy(p) for p in missing], out, mode)
        if problem is not None:
            return problem
        for name, pod in observed.items():
            if podstate.is_terminating(pod) or name in wanted:
                continue
            if self.kube.delete("Pod", job.namespace, name, uid=pod["metadata"].get("uid")):
                out.deleted.append(f"Pod/{name}")
                _log_change("deleted surplus", "Pod", job, name)
        return None

    def _patch_outdated_pods(self, job: JobRef, outdated: list[str], per_pod: Mapping[str, Mapping[str, str]],
                             out: Outcome) -> None:
        """Pods built from an older spec (an operator upgrade: their agent may predate `<job>-desired` and read
        only its pod's annotations) also get their desired state as annotations, so an upgrade strands no
        agent. Pods built by this operator never do: for them a version costs no pod write."""
        if not outdated:
            return
        raw = self.reader.pods_of(job)
        have = {p["metadata"]["name"]: podstate.pod_annotations(p) for p in raw}
        patches = [(n, diff) for n in outdated
                   if (diff := {k: v for k, v in (per_pod.get(n) or {}).items() if have.get(n, {}).get(k) != v})]
        if not patches:
            return

        def patch(item: tuple[str, Obj]) -> Obj | KubeError:
            try:
                return self.kube.patch("Pod", job.namespace, item[0], {"metadata": {"annotations": item[1]}})
            except KubeError as err:
                return err

        with ThreadPoolExecutor(max_workers=max(1, min(CREATE_CONCURRENCY, len(patches)))) as pool:
            results = list(pool.map(patch, patches))
        for (name, _), res in zip(patches, results, strict=True):
            if isinstance(res, KubeError):
                if res.not_found:
                    continue  # deleted meanwhile: its deletion event brings us back
                raise res
            self.reader.assume(res)
            out.patched.append(f"Pod/{name}")

    def _create_pods(self, job: JobRef, missing: list[Obj], out: Outcome, mode: str) -> Problem | None:
        """Create pods concurrently (a 64-replica job is 65 POSTs); the first refusal is reported."""

        def create(pod: Obj) -> tuple[str, KubeError | None]:
            try:
                self.reader.assume(self.kube.create(pod))
            except KubeError as err:
                return pod["metadata"]["name"], err
            return pod["metadata"]["name"], None

        if not missing:
            return None
        with ThreadPoolExecutor(max_workers=min(CREATE_CONCURRENCY, len(missing))) as pool:
            results = list(pool.map(create, missing))
        problem: Problem | None = None
        for name, err in results:
            if err is None:
                out.created.append(f"Pod/{name}")
                _log_change("created", "Pod", job, name)
            elif err.conflict:
                continue  # the old pod of that name is still terminating; its deletion event brings us back
            elif err.forbidden_by_rbac:
                raise err  # the operator's own permissions, not the template: reported as PermissionDenied
            elif err.invalid:
                problem = problem or refused_pod_problem(f"pod {name} was refused", err, mode)
            else:
                raise err
        return problem

    def _dry_run(self, missing: list[Obj], mode: str) -> Problem | None:
        """Server-side dry-run of one pod per role: a bad template is refused before any pod is created."""
        seen: set[str] = set()
        for pod in missing:
            role = pod["metadata"]["labels"].get(contract.LABEL_ROLE, "")
            if role in seen:
                continue
            seen.add(role)
            try:
                self.kube.create(pod, dry_run=True)
            except KubeError as err:
                if err.forbidden_by_rbac:
                    raise  # the operator's own permissions, not the template: reported as PermissionDenied
                if err.conflict:
                    continue
                if err.invalid:
                    return refused_pod_problem(
                        f"the {role} template does not make a valid pod (server-side dry-run)", err, mode)
                raise
        return None

    # --- status ------------------------------------------------------------------------------------------
    def _write_status(self, job: JobRef, previous: Obj, status: Obj, out: Outcome) -> None:
        kid = self._proof_key(job, previous)
        if kid is not None:
            status = {**status, "versionProofKey": kid}
        out.status = status
        if previous == status:
            return
        # A merge patch replaces lists and removes absent keys only when told: send explicit nulls for
        # fields that disappeared so the stored status equals the computed one.
        patch = dict(status)
        for key in previous:
            if key not in patch:
                patch[key] = None
        t0 = time.monotonic()
        written = self.kube.patch(contract.KIND, job.namespace, job.name, {"status": patch}, subresource="status")
        took = time.monotonic() - t0
        out.status_write_s += took
        m.STATUS_WRITE_DURATION.observe(took)
        self.reader.assume(written)  # the next pass compares with what is stored now, not a stale copy
        out.status_written = True

    def _report_forbidden(self, body: Obj, err: KubeError) -> None:
        """Fail loudly when the operator lacks a permission (a trimmed Role, a hand-made ClusterRole): an
        error log line, Ready=False / Degraded=True with reason PermissionDenied naming the verb and resource,
        and a Warning Event. The work queue retries with backoff, so granting the permission heals the job."""
        job = JobRef.from_body(body)
        message = permission_message(err)
        log.error("permission denied job=%s/%s reason=%s message=%s", job.namespace, job.name, REASON_PERMISSION_DENIED,
                  message, extra={"job": f"{job.namespace}/{job.name}", "reason": REASON_PERMISSION_DENIED})
        previous: Obj = body.get("status") or {}
        spec: Obj = body.get("spec") or {}
        try:
            self._finish_problem(job, body, previous, Problem(REASON_PERMISSION_DENIED, message), Outcome(),
                                 paused=bool(spec.get("paused")), mode=previous.get("mode"), keep_replicas=True)
        except KubeError as status_err:
            # Even the status write is refused: the Event (and the log above) are all that is left.
            log.error("cannot write the job's status job=%s/%s error=%s", job.namespace, job.name, status_err.message,
                      extra={"job": f"{job.namespace}/{job.name}", "reason": REASON_PERMISSION_DENIED})
            key = (job.namespace, job.name)
            if self._denials_posted.get(key) != message:
                self._denials_posted[key] = message
                self.events.warning(job, REASON_PERMISSION_DENIED, message)

    def _finish_problem(
        self, job: JobRef, body: Obj, previous: Obj, problem: Problem, out: Outcome,
        paused: bool = False, mode: TransferMode | None = None, keep_replicas: bool = False,
    ) -> None:
        out.problem = problem
        st = problem_status(job.generation, problem, previous, paused)
        if keep_replicas and previous.get("replicas"):
            st.replicas = ReplicaCounts.model_validate(previous["replicas"])  # the pods are still there
        if mode is not None:
            st.mode = mode
        if previous.get("membershipGeneration") is not None:
            st.membership_generation = previous["membershipGeneration"]
        status = ordered(st)
        old_ready: Obj = next((c for c in previous.get("conditions") or [] if c.get("type") == contract.COND_READY), {})
        self._write_status(job, previous, status, out)
        m.record_job_status(job.namespace, job.name, status)
        if old_ready.get("reason") != problem.reason or old_ready.get("message") != problem.message:
            self.events.warning(job, problem.reason, problem.message)
        log.warning("job cannot run job=%s/%s reason=%s message=%s", job.namespace, job.name, problem.reason,
                    problem.message, extra={"job": f"{job.namespace}/{job.name}", "reason": problem.reason})


def permission_message(err: KubeError) -> str:
    """What is missing and how to fix it, from the authorizer's 403 (which names user, verb and resource)."""
    return (
        f"the operator may not do what this job needs: {err.message}. Grant that permission to the operator's "
        "ServiceAccount (the chart's RBAC has every permission the operator uses: `helm upgrade` with "
        "rbac.create=true, or add the rule to your Role/ClusterRole); the operator retries on its own."
    )[:1000]


def refused_pod_problem(what: str, err: KubeError, mode: str) -> Problem:
    """A pod the API server refused: PodSecurityRefused (with what to do) when the namespace's Pod Security
    level refused it, else InvalidTemplate with the API server's answer."""
    if "violates PodSecurity" not in err.message:
        return Problem(REASON_INVALID_TEMPLATE, f"{what}: {err.message}")
    if mode == "GDR" and "IPC_LOCK" in err.message:
        hint = ("the GDR agent needs the IPC_LOCK capability to pin memory for RDMA, which Pod Security "
                "'baseline' and 'restricted' refuse: run GDR jobs in a namespace labelled "
                "pod-security.kubernetes.io/enforce=privileged, or use transfer.mode NCCL")
    else:
        hint = ("the injected agent meets 'restricted'; make the template's containers meet the namespace's "
                "level (allowPrivilegeEscalation: false, capabilities drop ALL, runAsNonRoot, "
                "seccompProfile RuntimeDefault)")
    return Problem(REASON_POD_SECURITY, f"{what}: {err.message}; {hint}")
