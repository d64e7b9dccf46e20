"""Status aggregation: observed pods -> WeightSyncJob status (pure).

Conditions follow metav1.Condition (type, status, reason, message, observedGeneration,
lastTransitionTime, which only moves when the status flips). Counts are per inference replica; per-pod
detail stays on the pods. A `Problem` (invalid template, unplaceable spec) overrides the pod view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from weightsync.crds import contract
from weightsync.crds.models import (
    MAX_REPLICAS_IN_STATUS,
    Condition,
    ConditionStatus,
    InferenceReplicaStatus,
    LastSync,
    ReplicaCounts,
    SyncProgress,
    WeightSyncJobSpec,
    WeightSyncJobStatus,
    set_condition,
)
from weightsync.operator import atomic, podstate
from weightsync.operator.placement import Plan
from weightsync.operator.replicas import (
    ReplicaState,
    VersionKey,
    replica_states,
    trainer_version,
    versions_behind,
)

REASON_INVALID_TEMPLATE = "InvalidTemplate"
REASON_POD_SECURITY = "PodSecurityRefused"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_PERMISSION_DENIED = "PermissionDenied"
REASON_ENGINE_UNREACHABLE = contract.REASON_ENGINE_UNREACHABLE  # the agent's pod condition reason, passed on


@dataclass(frozen=True)
class Problem:
    """Why the job cannot run as written; becomes Ready=False with this reason."""

    reason: str
    message: str


def parse_conditions(raw: Sequence[Mapping[str, Any]] | None) -> list[Condition]:
    out = []
    for c in raw or []:
        try:
            out.append(Condition.model_validate(dict(c)))
        except ValidationError:
            continue
    return out


def _last_sync(plan: Plan, pods: Mapping[str, Mapping[str, Any]], previous: LastSync | None) -> LastSync | None:
    best = previous
    for p in plan.pods:
        pod = pods.get(p.name)
        if not p.is_inference or pod is None:
            continue
        raw = podstate.last_sync(pod)
        if not raw:
            continue
        try:
            ls = LastSync.model_validate(raw)
        except ValidationError:
            continue
        if best is None or ls.version > best.version:
            best = ls
    return best


def aggregate(
    spec: WeightSyncJobSpec,
    generation: int,
    plan: Plan,
    pods: Mapping[str, Mapping[str, Any]],
    previous: Mapping[str, Any] | None = None,
    membership_generation: int | None = None,
    problem: Problem | None = None,
    now: datetime | None = None,
    states: list[ReplicaState] | None = None,
    outdated: Sequence[str] = (),
    atomic_overdue: atomic.OverduePrepare | None = None,
) -> WeightSyncJobStatus:
    """`outdated`: live pods built from an older spec (a mutable field such as bucketSizeMB changed). They
    are not recreated behind the user's back (a trainer restart loses progress); the condition says so."""
    prev = dict(previous or {})
    conds = parse_conditions(prev.get("conditions"))
    prev_last: LastSync | None = None
    if prev.get("lastSync"):
        try:
            prev_last = LastSync.model_validate(prev["lastSync"])
        except ValidationError:
            prev_last = None

    def put(type_: str, status: ConditionStatus, reason: str, message: str) -> None:
        nonlocal conds
        conds = set_condition(conds, type_, status, reason, message, generation, now)

    states = states if states is not None else replica_states(plan, pods)
    # Paused reports what the engines confirmed, not what was asked: True only once every replica's engine
    # said it stopped generating (a replica that cannot answer keeps the job at Pausing).
    confirmed = sum(1 for s in states if s.paused_confirmed)
    if spec.paused and confirmed == len(states):
        put(contract.COND_PAUSED, "True", "Paused", f"generation is paused on all {len(states)} inference replicas")
    elif spec.paused:
        put(contract.COND_PAUSED, "False", "Pausing",
            f"spec.paused is set; {confirmed}/{len(states)} replicas confirmed the pause")
    elif any(podstate.engine_paused(p) for n, p in pods.items() if podstate.is_live(p) and n in plan.names):
        put(contract.COND_PAUSED, "False", "Resuming", "spec.paused was unset; engines are resuming generation")
    else:
        put(contract.COND_PAUSED, "False", "NotPaused", "inference replicas generate normally")

    if problem is not None:
        st = problem_status(generation, problem, {**prev, "conditions": [c.to_dict() for c in conds]}, spec.paused, now)
        st.mode = plan.mode
        st.membership_generation = membership_generation
        st.last_sync = prev_last
        return st

    tv_key = trainer_version(plan, pods, prev.get("trainerVersion"), prev.get("trainerEpoch") or 0)
    tv = tv_key[1] if tv_key else None
    live = {n: p for n, p in pods.items() if podstate.is_live(p)}
    missing = [p.name for p in plan.pods if p.name not in live]
    unscheduled = [n for n in plan.names if n in live and not podstate.is_scheduled(live[n])]
    trainers_ready = [n for n in plan.trainer_pods if n in live and podstate.is_ready(live[n])]
    complete = [s for s in states if s.complete]
    ready = [s for s in states if s.ready]
    synced = [s for s in states if tv_key is not None and s.served_key == tv_key]
    served_ready = [s.served_key for s in ready if s.served_key is not None]
    served_key = min(served_ready) if served_ready else None
    served = served_key[1] if served_key else None

    # Complete: a Separated job's trainer pods all exited successfully (restartPolicy OnFailure / Never); the
    # engines keep serving the last version, and Ready then counts the inference replicas only.
    trainer_live = [live[n] for n in plan.trainer_pods if n in live]
    trained = (plan.placement == "Separated" and bool(plan.trainer_pods) and len(trainer_live) == len(plan.trainer_pods)
               and all(podstate.phase(p) == "Succeeded" for p in trainer_live))
    if trained:
        put(contract.COND_COMPLETE, "True", "TrainerSucceeded",
            f"every trainer pod exited successfully after version {tv}; the engines keep serving it")
        trainers_ready = list(plan.trainer_pods)
    else:
        put(contract.COND_COMPLETE, "False", "TrainerRunning", "the trainer has not finished")

    # Ready: every trainer pod (until the trainer completed) and every inference replica Ready.
    if missing or unscheduled:
        put(
            contract.COND_READY, "False", "PodsPending",
            f"{len(plan.pods) - len(missing) - len(unscheduled)}/{len(plan.pods)} pods created and scheduled",
        )
    elif len(trainers_ready) == len(plan.trainer_pods) and len(ready) == len(states):
        put(contract.COND_READY, "True", "AllReplicasReady",
            f"{len(trainers_ready)} trainer pods and {len(ready)} inference replicas are Ready")
    else:
        put(
            contract.COND_READY, "False", "PodsNotReady",
            f"{len(trainers_ready)}/{len(plan.trainer_pods)} trainer pods and {len(ready)}/{len(states)} "
            "inference replicas are Ready",
        )

    round_ = (atomic.decide(states, pods, tv_key, atomic_overdue, now) if spec.update_policy.strategy == "Atomic"
              else None)
    # Synced: every replica serves the newest published version.
    if round_ is not None and round_.failure is not None:
        put(contract.COND_SYNCED, "False", atomic.REASON_PREPARE_FAILED, round_.failure.message(round_.committed))
    elif tv is None:
        put(contract.COND_SYNCED, "Unknown", "NoVersionPublished", "the trainer has not published a version yet")
    elif len(synced) == len(states):
        put(contract.COND_SYNCED, "True", "AllReplicasSynced", f"all {len(states)} replicas serve version {tv}")
    else:
        put(contract.COND_SYNCED, "False", "ReplicasBehind",
            f"{len(synced)}/{len(states)} replicas serve version {tv}")

    # Progressing: pods starting or a version rolling out.
    loading = [s for s in states if s.loading]
    blocked = [(n, podstate.unschedulable(live[n])) for n in unscheduled if podstate.unschedulable(live[n])]
    if blocked:
        put(contract.COND_PROGRESSING, "True", "PodsUnschedulable",
            f"{len(blocked)} pods cannot be scheduled, e.g. {blocked[0][0]}: {blocked[0][1]}")
    elif missing or unscheduled:
        put(contract.COND_PROGRESSING, "True", "PodsStarting",
            f"waiting for {len(missing)} missing and {len(unscheduled)} unscheduled pods")
    elif round_ is not None and round_.switching and round_.commit is not None:
        put(contract.COND_PROGRESSING, "True", atomic.REASON_SWITCHING,
            f"every replica prepared version {round_.commit[1]}; switching all replicas together")
    elif round_ is not None and round_.preparing is not None and round_.failure is None:
        put(contract.COND_PROGRESSING, "True", atomic.REASON_PREPARING,
            f"{len(round_.commit_set)} replicas prepare version {round_.preparing[1]} (fetch and verify, not served)")
    elif loading:
        put(contract.COND_PROGRESSING, "True", "RollingOut",
            f"{len(loading)} replicas loading a new version")
    elif outdated:
        put(contract.COND_PROGRESSING, "False", "PodsOutdated",
            f"{len(outdated)} pods were built from an older spec (e.g. {sorted(outdated)[0]}); they pick up the "
            "change when recreated: delete them when convenient")
    else:
        put(contract.COND_PROGRESSING, "False", "Stable", "all pods exist and no load is in flight")

    # Degraded: failing pods, failed syncs, replicas beyond maxStaleness.
    failing = [(n, d) for n, p in live.items() if (d := podstate.failure_detail(p, now)) is not None]
    unreachable = [(n, d[1]) for n, p in live.items()
                   if (d := podstate.condition_detail(p, contract.POD_CONDITION_SYNCED)) and d[0] == REASON_ENGINE_UNREACHABLE]
    errors = [n for n, p in live.items() if podstate.sync_error(p)]
    digests = digest_groups(states, pods)
    mismatch = next(((key, got) for key, got in sorted(digests.items()) if len(got) > 1), None)
    limit = spec.update_policy.max_staleness
    stale = [
        s.replica for s in complete
        if tv_key is not None and s.served_key is not None and versions_behind(tv_key, s.served_key) > limit
    ]
    if failing:
        put(contract.COND_DEGRADED, "True", failing[0][1][0],
            f"{len(failing)} pods failing, e.g. {failing[0][1][1]}"[:2000])
    elif unreachable:
        put(contract.COND_DEGRADED, "True", REASON_ENGINE_UNREACHABLE,
            f"{len(unreachable)} pods cannot reach their engine, e.g. {unreachable[0][0]}: {unreachable[0][1]}"[:2000])
    elif mismatch is not None:
        (epoch, version), got = mismatch
        detail = "; ".join(f"replicas {sorted(r)}: {d}" for d, r in sorted(got.items()))
        put(contract.COND_DEGRADED, "True", contract.REASON_DIGEST_MISMATCH,
            (f"replicas serving version {version} (epoch {epoch}) hold different content: {detail}. The trainer's "
             "data-parallel ranks published different bytes, or a replica's engine was changed behind its "
             "agent: check the trainer, then delete the odd replicas' pods")[:2000])
    elif errors:
        put(contract.COND_DEGRADED, "True", "SyncFailed",
            f"{len(errors)} pods report a sync error, e.g. {errors[0]}: {podstate.sync_error(live[errors[0]])}")
    elif stale:
        put(contract.COND_DEGRADED, "True", "ReplicasStale",
            f"replicas {stale} are more than maxStaleness={limit} versions behind version {tv}")
    else:
        put(contract.COND_DEGRADED, "False", "AsExpected", "no failing pods, sync errors or stale replicas")

    return WeightSyncJobStatus(
        observed_generation=generation,
        mode=plan.mode,
        trainer_version=tv,
        trainer_epoch=tv_key[0] if tv_key else prev.get("trainerEpoch"),
        served_version=served,
        served_epoch=served_key[0] if served_key else None,
        trainer_digest=_trainer_digest(tv_key, digests, prev),
        committed_version=round_.committed[1] if round_ is not None and round_.committed else None,
        committed_epoch=round_.committed[0] if round_ is not None and round_.committed else None,
        selector=inference_selector(plan),
        inference_replicas=replica_statuses(states, pods, tv_key),
        replica_versions=replica_versions(states),
        membership_generation=membership_generation,
        replicas=ReplicaCounts(inference=len(complete), synced=len(synced), ready=len(ready)),
        last_sync=_last_sync(plan, pods, prev_last),
        conditions=conds,
    )


def replica_digest(s: ReplicaState, pods: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The content digest a replica serves: its pods' digests summed (each covers its own ranks' pieces), when
    every live pod serves the replica's version and reports one; else None."""
    if s.served_key is None:
        return None
    live = [pods[n] for n in s.pod_names if podstate.is_live(pods.get(n))]
    total = 0
    for p in live:
        d = podstate.served_digest(p)
        if d is None or (podstate.served_epoch(p), podstate.served_version(p)) != s.served_key:
            return None
        total += int(d, 16)
    return f"{total % (1 << 128):032x}" if live else None


def digest_groups(states: list[ReplicaState], pods: Mapping[str, Mapping[str, Any]]
                  ) -> dict[VersionKey, dict[str, list[int]]]:
    """(epoch, version) -> digest -> the replicas serving that version with that digest."""
    out: dict[VersionKey, dict[str, list[int]]] = {}
    for s in states:
        d = replica_digest(s, pods)
        if d is not None and s.served_key is not None:
            out.setdefault(s.served_key, {}).setdefault(d, []).append(s.replica)
    return out


def _trainer_digest(tv_key: VersionKey | None, digests: Mapping[VersionKey, Mapping[str, list[int]]],
                    prev: Mapping[str, Any]) -> str | None:
    """The digest of the trainer's newest version once replicas that loaded it agree on one; the previous
    status's value while none has loaded it yet (same version), else None."""
    if tv_key is None:
        return None
    got = digests.get(tv_key) or {}
    if len(got) == 1:
        return next(iter(got))
    same = (prev.get("trainerEpoch") or 0, prev.get("trainerVersion")) == tv_key
    return str(prev["trainerDigest"]) if same and not got and prev.get("trainerDigest") else None


def replica_statuses(states: list[ReplicaState], pods: Mapping[str, Mapping[str, Any]],
                     newest: VersionKey | None) -> list[InferenceReplicaStatus]:
    """status.inferenceReplicas: one entry per replica; beyond MAX_REPLICAS_IN_STATUS, the replicas not
    serving the newest version come first (the ones a user looks for)."""
    out = []
    for s in states:
        live = [pods[n] for n in s.pod_names if podstate.is_live(pods.get(n))]
        progress = next((p for p in map(podstate.sync_progress, live) if p is not None), None)
        durations = [float(ls["durationSeconds"]) for ls in map(podstate.last_sync, live)
                     if ls is not None and isinstance(ls.get("durationSeconds"), (int, float))]
        unreachable = [d[1] for d in (podstate.condition_detail(p, contract.POD_CONDITION_SYNCED) for p in live)
                       if d is not None and d[0] == REASON_ENGINE_UNREACHABLE]
        error = next((e for e in map(podstate.sync_error, live) if e), None) or next(iter(unreachable), None)
        relayed = next((str(ls["relayedFrom"])[:253] for ls in map(podstate.last_sync, live)
                        if ls is not None and isinstance(ls.get("relayedFrom"), str) and ls["relayedFrom"]), None)
        out.append(InferenceReplicaStatus(
            index=s.replica, pods=list(s.pod_names), served_version=s.served,
            served_epoch=s.served_key[0] if s.served_key else None, served_digest=replica_digest(s, pods),
            target_version=s.target, ready=s.ready,
            progress=SyncProgress.model_validate(progress) if progress else None,
            last_sync_seconds=max(durations) if durations else None, last_error=error[:1024] if error else None,
            relayed_from=relayed,
        ))
    if len(out) > MAX_REPLICAS_IN_STATUS:
        behind = {s.replica for s in states if newest is None or s.served_key != newest}
        out = sorted(out, key=lambda r: (r.index not in behind, r.index))[:MAX_REPLICAS_IN_STATUS]
        out.sort(key=lambda r: r.index)
    return out


def replica_versions(states: list[ReplicaState]) -> str:
    """status.replicaVersions: skew at a glance (a printer column shows one string, not a list)."""
    served = ["-" if s.served is None else str(s.served) for s in states]
    if len(served) <= 16:
        return ",".join(served)
    counts: dict[str, int] = {}
    for v in served:
        counts[v] = counts.get(v, 0) + 1
    return " ".join(f"{v}x{n}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))[:256]


def inference_selector(plan: Plan) -> str:
    """The label selector of the job's inference pods, as the scale subresource reports it (for HPAs)."""
    roles = sorted({p.role for p in plan.pods if p.is_inference}) or [contract.ROLE_INFERENCE]
    role = f"{contract.LABEL_ROLE}={roles[0]}" if len(roles) == 1 else f"{contract.LABEL_ROLE} in ({','.join(roles)})"
    return f"{contract.LABEL_JOB}={plan.job},{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY},{role}"


def ordered(status: WeightSyncJobStatus) -> dict[str, Any]:
    """The status as the API stores it, conditions in the fixed contract order (stable diffs)."""
    body = status.to_dict()
    order = {t: i for i, t in enumerate(contract.JOB_CONDITION_TYPES)}
    body["conditions"] = sorted(body.get("conditions", []), key=lambda c: order.get(c["type"], 99))
    return body


def problem_status(
    generation: int,
    problem: Problem,
    previous: Mapping[str, Any] | None = None,
    paused: bool = False,
    now: datetime | None = None,
) -> WeightSyncJobStatus:
    """Status for a job whose spec cannot even be parsed or planned: every condition names the problem."""
    prev = dict(previous or {})
    conds = parse_conditions(prev.get("conditions"))
    rows: tuple[tuple[str, ConditionStatus, str, str], ...] = (
        (contract.COND_READY, "False", problem.reason, problem.message),
        (contract.COND_SYNCED, "Unknown", problem.reason, "no pods to sync"),
        (contract.COND_PROGRESSING, "False", problem.reason, "nothing is rolled out until the problem is fixed"),
        (
            contract.COND_PAUSED, "True" if paused else "False", "PausedBySpec" if paused else "NotPaused",
            "spec.paused is set" if paused else "spec.paused is not set",
        ),
        (contract.COND_DEGRADED, "True", problem.reason, problem.message),
        (contract.COND_COMPLETE, "False", problem.reason, "the job cannot run"),
    )
    for type_, st, reason, msg in rows:
        conds = set_condition(conds, type_, st, reason, msg, generation, now)
    return WeightSyncJobStatus(
        observed_generation=generation,
        trainer_version=prev.get("trainerVersion"),
        trainer_epoch=prev.get("trainerEpoch"),
        served_version=prev.get("servedVersion"),
        served_epoch=prev.get("servedEpoch"),
        selector=prev.get("selector"),
        replicas=ReplicaCounts(inference=0, synced=0, ready=0),
        conditions=conds,
    )
