"""Status aggregation and rollout targets from what agents report on their pods."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from weightsync.crds import contract
from weightsync.operator.placement import plan
from weightsync.operator.replicas import replica_states, trainer_version
from weightsync.operator.rollout import desired_annotations, replica_targets
from weightsync.operator.status import Problem, aggregate, ordered, problem_status

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def pod(name, node="n1", ready=True, synced=None, served=None, published=None, target=None, **ann):
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if synced is not None:
        conds.append({"type": contract.POD_CONDITION_SYNCED, "status": "True" if synced else "False"})
    a = dict(ann)
    if served is not None:
        a[contract.ANN_SERVED_VERSION] = str(served)
    if published is not None:
        a[contract.ANN_PUBLISHED_VERSION] = str(published)
    if target is not None:
        a[contract.ANN_TARGET_VERSION] = str(target)
    return {"metadata": {"name": name, "uid": name, "annotations": a}, "spec": {"nodeName": node},
            "status": {"phase": "Running", "conditions": conds, "podIP": "10.0.0.1"}}


def cond(status, type_):
    return next(c for c in status.conditions if c.type == type_)


def test_first_reconcile_with_no_pods(separated):
    spec = separated()
    p = plan("demo", spec)
    st = aggregate(spec, 3, p, {}, None, 1, now=T0)
    assert st.observed_generation == 3 and st.mode == "NCCL" and st.membership_generation == 1
    assert [c.type for c in ordered_conditions(st)] == list(contract.JOB_CONDITION_TYPES)
    assert all(c.observed_generation == 3 for c in st.conditions)
    assert cond(st, "Ready").status == "False" and cond(st, "Ready").reason == "PodsPending"
    assert cond(st, "Progressing").status == "True"
    assert cond(st, "Synced").status == "Unknown"
    assert cond(st, "Paused").status == "False" and cond(st, "Degraded").status == "False"
    assert st.replicas is not None and st.replicas.inference == 0


def ordered_conditions(st):
    order = {t: i for i, t in enumerate(contract.JOB_CONDITION_TYPES)}
    return sorted(st.conditions, key=lambda c: order[c.type])


def test_all_synced_and_ready(separated):
    spec = separated()
    p = plan("demo", spec)
    pods = {
        "demo-trainer-0": pod("demo-trainer-0", published=5),
        "demo-trainer-1": pod("demo-trainer-1", published=5),
        "demo-inference-0-0": pod("demo-inference-0-0", synced=True, served=5),
        "demo-inference-1-0": pod("demo-inference-1-0", synced=True, served=5,
                                  **{contract.ANN_LAST_SYNC: json.dumps({"version": 5, "durationSeconds": 1.5, "bytes": 10, "mode": "NCCL"})}),
    }
    st = aggregate(spec, 1, p, pods, None, 2, now=T0)
    assert st.trainer_version == 5 and st.served_version == 5
    assert st.replicas is not None and (st.replicas.inference, st.replicas.synced, st.replicas.ready) == (2, 2, 2)
    assert cond(st, "Ready").status == "True" and cond(st, "Synced").status == "True"
    assert cond(st, "Progressing").status == "False" and cond(st, "Degraded").status == "False"
    assert st.last_sync is not None and st.last_sync.version == 5 and st.last_sync.mode == "NCCL"


def test_trainer_version_needs_every_trainer_pod_and_never_goes_back(separated):
    p = plan("demo", separated())
    pods = {"demo-trainer-0": pod("demo-trainer-0", published=7), "demo-trainer-1": pod("demo-trainer-1", published=6)}
    assert trainer_version(p, pods) == (0, 6)
    del pods["demo-trainer-1"]
    assert trainer_version(p, pods) is None
    assert trainer_version(p, pods, previous=6) == (0, 6)


def test_behind_stale_and_degraded(separated):
    spec = separated(updatePolicy={"maxStaleness": 1})
    p = plan("demo", spec)
    pods = {
        "demo-trainer-0": pod("demo-trainer-0", published=9),
        "demo-trainer-1": pod("demo-trainer-1", published=9),
        "demo-inference-0-0": pod("demo-inference-0-0", synced=True, served=9),
        "demo-inference-1-0": pod("demo-inference-1-0", ready=False, synced=False, served=7),
    }
    st = aggregate(spec, 1, p, pods, None, 1, now=T0)
    assert st.served_version == 9  # lowest over Ready replicas only
    assert st.replicas is not None and (st.replicas.synced, st.replicas.ready) == (1, 1)
    assert cond(st, "Synced").status == "False" and "1/2" in cond(st, "Synced").message
    assert cond(st, "Ready").reason == "PodsNotReady"
    assert cond(st, "Degraded").status == "True" and cond(st, "Degraded").reason == "ReplicasStale"
    pods["demo-inference-1-0"]["metadata"]["annotations"][contract.ANN_SYNC_ERROR] = "checksum mismatch"
    st = aggregate(spec, 1, p, pods, None, 1, now=T0)
    assert cond(st, "Degraded").reason == "SyncFailed" and "checksum mismatch" in cond(st, "Degraded").message
    pods["demo-trainer-0"]["status"]["phase"] = "Failed"
    assert cond(aggregate(spec, 1, p, pods, None, 1, now=T0), "Degraded").reason == "PodFailed"


def test_paused_only_once_every_engine_confirmed(separated):
    spec = separated(paused=True)
    p = plan("demo", spec)
    pods = {n: pod(n, **{contract.ANN_ENGINE_PAUSED: "true"}) for n in p.names}
    pods["demo-inference-1-0"]["metadata"]["annotations"].pop(contract.ANN_ENGINE_PAUSED)
    c = cond(aggregate(spec, 1, p, pods, None, 1, now=T0), "Paused")
    assert c.status == "False" and c.reason == "Pausing" and "1/2" in c.message
    pods["demo-inference-1-0"]["metadata"]["annotations"][contract.ANN_ENGINE_PAUSED] = "true"
    c = cond(aggregate(spec, 1, p, pods, None, 1, now=T0), "Paused")
    assert c.status == "True" and c.reason == "Paused"
    # Unpaused in the spec while engines still report paused: Resuming, then NotPaused.
    unpaused = separated(paused=False)
    assert cond(aggregate(unpaused, 2, p, pods, None, 1, now=T0), "Paused").reason == "Resuming"
    clean = {n: pod(n) for n in p.names}
    assert cond(aggregate(unpaused, 2, p, clean, None, 1, now=T0), "Paused").reason == "NotPaused"


def test_last_transition_time_moves_only_on_flips(separated):
    spec = separated()
    p = plan("demo", spec)
    first = ordered(aggregate(spec, 1, p, {}, None, 1, now=T0))
    again = ordered(aggregate(spec, 2, p, {}, first, 1, now=T1))
    assert again["conditions"] == [{**c, "observedGeneration": 2} for c in first["conditions"]]
    pods = {n: pod(n, synced=True, served=1, published=1) for n in p.names}
    flipped = aggregate(spec, 2, p, pods, first, 1, now=T1)
    assert cond(flipped, "Ready").last_transition_time == T1
    assert cond(flipped, "Paused").last_transition_time == T0


def test_problem_status_names_the_reason(separated):
    st = ordered(problem_status(4, Problem("InvalidTemplate", "bad image"), None, False, now=T0))
    by = {c["type"]: c for c in st["conditions"]}
    assert by["Ready"]["status"] == "False" and by["Ready"]["reason"] == "InvalidTemplate"
    assert by["Ready"]["message"] == "bad image" and by["Ready"]["observedGeneration"] == 4
    assert by["Degraded"]["status"] == "True" and st["observedGeneration"] == 4


def test_rollout_respects_max_unavailable(separated):
    spec = separated(inference={"replicas": 4, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
                     updatePolicy={"maxUnavailable": "50%"})
    p = plan("demo", spec)
    pods = {n: pod(n, published=2) for n in p.trainer_pods}
    for r in range(4):
        pods[f"demo-inference-{r}-0"] = pod(f"demo-inference-{r}-0", synced=True, served=1, target=1)
    states = replica_states(p, pods)
    targets = replica_targets(spec, states, (0, 2))
    assert targets == {0: (0, 2), 1: (0, 2), 2: (0, 1), 3: (0, 1)}  # 50% of 4: two replicas load at once
    # Replica 0 finished; replica 1 still loading: one more may start.
    pods["demo-inference-0-0"] = pod("demo-inference-0-0", synced=True, served=2, target=2)
    pods["demo-inference-1-0"] = pod("demo-inference-1-0", synced=True, served=1, target=2)
    assert replica_targets(spec, replica_states(p, pods), (0, 2)) == {0: (0, 2), 1: (0, 2), 2: (0, 2), 3: (0, 1)}


def test_new_replicas_catch_up_at_once_and_annotations(separated):
    spec = separated(inference={"replicas": 3, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
                     updatePolicy={"maxUnavailable": 1}, paused=True)
    p = plan("demo", spec)
    pods = {n: pod(n, published=4) for n in p.trainer_pods}
    pods["demo-inference-0-0"] = pod("demo-inference-0-0", synced=True, served=3, target=3)
    pods["demo-inference-1-0"] = pod("demo-inference-1-0", synced=True, served=3, target=3)
    # replica 2 is new: no pod yet -> it takes the newest version without using the budget
    states = replica_states(p, pods)
    ann = desired_annotations(spec, p, states, (0, 4), 6)
    assert ann["demo-inference-2-0"][contract.ANN_TARGET_VERSION] == "4"
    assert [ann[f"demo-inference-{r}-0"][contract.ANN_TARGET_VERSION] for r in (0, 1)] == ["4", "3"]
    assert ann["demo-inference-0-0"][contract.ANN_PAUSED] == "true"
    assert ann["demo-trainer-0"] == {contract.ANN_MEMBERSHIP_GENERATION: "6"}
    # Nothing published yet: no target at all.
    assert contract.ANN_TARGET_VERSION not in desired_annotations(spec, p, replica_states(p, {}), None, 1)["demo-inference-0-0"]


def test_unschedulable_pods_surface_the_schedulers_message(separated):
    spec = separated()
    p = plan("demo", spec)
    pods = {n: pod(n) for n in p.names}
    pods["demo-trainer-0"]["spec"]["nodeName"] = None
    pods["demo-trainer-0"]["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient rdma/hca_shared_devices_a."})
    c = cond(aggregate(spec, 1, p, pods, None, 1, now=T0), "Progressing")
    assert c.status == "True" and c.reason == "PodsUnschedulable" and "Insufficient rdma" in c.message


def test_outdated_pods_are_reported_not_recreated(separated):
    spec = separated()
    p = plan("demo", spec)
    pods = {n: pod(n) for n in p.names}
    c = cond(aggregate(spec, 2, p, pods, None, 1, now=T0, outdated=["demo-trainer-1"]), "Progressing")
    assert c.status == "False" and c.reason == "PodsOutdated" and "demo-trainer-1" in c.message
    assert cond(aggregate(spec, 2, p, pods, None, 1, now=T0), "Progressing").reason == "Stable"


def test_a_restarted_trainer_starts_a_new_epoch_not_a_stale_one(separated):
    """Issue 15 (F4): a restarted trainer publishes 1 again. Its agent marks that as epoch 1; the operator
    orders versions by (epoch, version), so version 1 of epoch 1 is newer than version 9 of epoch 0 and every
    replica is asked to load it (before: trainerVersion stayed at 9 until the new run passed it)."""
    spec = separated(inference={"replicas": 2, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
                     updatePolicy={"maxUnavailable": 1, "maxStaleness": 1})
    p = plan("demo", spec)
    epoch = {contract.ANN_PUBLISHED_EPOCH: "1"}
    pods = {n: pod(n, published=1, **epoch) for n in p.trainer_pods}
    for r in range(2):
        pods[f"demo-inference-{r}-0"] = pod(f"demo-inference-{r}-0", synced=True, served=9, target=9)
    assert trainer_version(p, pods, previous=9) == (1, 1)
    states = replica_states(p, pods)
    ann = desired_annotations(spec, p, states, (1, 1), 3, pods)
    targets = [(ann[f"demo-inference-{r}-0"].get(contract.ANN_TARGET_EPOCH),
                ann[f"demo-inference-{r}-0"].get(contract.ANN_TARGET_VERSION)) for r in range(2)]
    assert sorted(targets) == [("0", "9"), ("1", "1")], "one replica at a time (maxUnavailable 1) loads epoch 1"
    st = aggregate(spec, 1, p, pods, {"trainerVersion": 9, "trainerEpoch": 0}, 3, now=T0)
    assert (st.trainer_version, st.trainer_epoch) == (1, 1)
    assert cond(st, "Synced").status == "False", "serving version 9 of the old epoch is not serving version 1"
    assert cond(st, "Degraded").status == "False", "the old epoch counts as one version behind (maxStaleness 1)"
    # Once loaded (served-epoch 1), the replicas are synced.
    for r in range(2):
        pods[f"demo-inference-{r}-0"] = pod(f"demo-inference-{r}-0", synced=True, served=1, target=1,
                                            **{contract.ANN_SERVED_EPOCH: "1", contract.ANN_TARGET_EPOCH: "1"})
    st = aggregate(spec, 1, p, pods, {"trainerVersion": 1, "trainerEpoch": 1}, 3, now=T0)
    assert cond(st, "Synced").status == "True" and st.served_version == 1


def test_a_trainer_pod_still_in_the_old_epoch_holds_the_new_one_back(separated):
    p = plan("demo", separated())
    new = {contract.ANN_PUBLISHED_EPOCH: "1"}
    pods = {"demo-trainer-0": pod("demo-trainer-0", published=2, **new),
            "demo-trainer-1": pod("demo-trainer-1", published=40)}
    assert trainer_version(p, pods, previous=40) == (0, 40), "epoch 1 is complete only when every pod is in it"
    pods["demo-trainer-1"] = pod("demo-trainer-1", published=1, **new)
    assert trainer_version(p, pods, previous=40) == (1, 1)
    # an older epoch never wins over the one recorded in the status
    assert trainer_version(p, {n: pod(n, published=50) for n in p.trainer_pods}, 3, previous_epoch=1) == (1, 3)


def test_status_selector_selects_the_inference_pods_for_the_scale_subresource(separated):
    from weightsync.operator.status import inference_selector

    p = plan("demo", separated())
    st = aggregate(separated(), 1, p, {}, None, 1, now=T0)
    assert st.selector == inference_selector(p) == (
        "weightsync.io/job=demo,app.kubernetes.io/managed-by=weightsync-operator,weightsync.io/role=inference")


def test_inference_replicas_status_shows_each_replica(separated):
    import json

    spec = separated(inference={"replicas": 3, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("demo", spec)
    pods = {n: pod(n, published=5) for n in p.trainer_pods}
    progress = {"version": 5, "bucket": 3, "buckets": 8, "bytes": 3 << 20, "totalBytes": 8 << 20}
    pods["demo-inference-0-0"] = pod("demo-inference-0-0", synced=True, served=5, target=5, **{
        contract.ANN_LAST_SYNC: json.dumps({"version": 5, "durationSeconds": 1.25, "bytes": 10, "mode": "NCCL"})})
    pods["demo-inference-1-0"] = pod("demo-inference-1-0", synced=True, served=4, target=5, **{
        contract.ANN_SYNC_PROGRESS: json.dumps(progress)})
    pods["demo-inference-2-0"] = pod("demo-inference-2-0", ready=False, synced=False, served=3, target=5, **{
        contract.ANN_SYNC_ERROR: "engine /update_weights timed out",
        contract.ANN_LAST_SYNC: json.dumps({"version": 3, "durationSeconds": 0.5, "bytes": 10, "mode": "NCCL",
                                            "relayedFrom": "demo-inference-1-0"})})
    st = aggregate(spec, 1, p, pods, None, 1, now=T0)
    reps = {r.index: r for r in st.inference_replicas or []}
    assert sorted(reps) == [0, 1, 2]
    # fanOut Relay: the replica before this one in the chain, absent where the trainer sent the load
    assert (reps[0].relayed_from, reps[2].relayed_from) == (None, "demo-inference-1-0")
    assert st.last_sync is not None and st.last_sync.version == 5 and st.last_sync.relayed_from is None
    assert (reps[0].served_version, reps[0].ready, reps[0].last_sync_seconds, reps[0].progress) == (5, True, 1.25, None)
    assert reps[1].progress is not None and reps[1].progress.to_dict() == progress
    assert (reps[1].served_version, reps[1].target_version) == (4, 5)
    assert (reps[2].ready, reps[2].last_error) == (False, "engine /update_weights timed out")
    assert reps[0].pods == ["demo-inference-0-0"]
    assert st.replica_versions == "5,4,3"


def test_inference_replicas_status_is_bounded_and_keeps_the_replicas_behind(separated):
    from weightsync.crds.models import MAX_REPLICAS_IN_STATUS
    from weightsync.operator.status import replica_statuses

    n = MAX_REPLICAS_IN_STATUS + 20
    spec = separated(inference={"replicas": n, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("demo", spec)
    pods = {f"demo-inference-{r}-0": pod(f"demo-inference-{r}-0", served=5 if r != n - 1 else 4) for r in range(n)}
    out = replica_statuses(replica_states(p, pods), pods, (0, 5))
    assert len(out) == MAX_REPLICAS_IN_STATUS
    assert out[-1].index == n - 1, "the replica behind is listed even beyond the bound"
    assert [r.index for r in out] == sorted(r.index for r in out)
    from weightsync.operator.status import replica_versions

    assert replica_versions(replica_states(p, pods)) == f"5x{n - 1} 4x1"


def test_complete_when_every_trainer_pod_succeeded(separated):
    from weightsync.operator.events import version_events

    spec = separated(inference={"replicas": 1, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("demo", spec)
    pods = {n: pod(n, published=8) for n in p.trainer_pods}
    pods["demo-inference-0-0"] = pod("demo-inference-0-0", synced=True, served=8, target=8)
    running = aggregate(spec, 1, p, pods, None, 1, now=T0)
    assert (cond(running, "Complete").status, cond(running, "Complete").reason) == ("False", "TrainerRunning")
    first = p.trainer_pods[0]
    pods[first] = {**pods[first], "status": {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}]}}
    half = aggregate(spec, 1, p, pods, None, 1, now=T0)
    assert cond(half, "Complete").status == "False", "complete only when every trainer pod succeeded"
    for n in p.trainer_pods:
        pods[n] = {**pods[n], "status": {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}]}}
    done = aggregate(spec, 1, p, pods, None, 1, now=T0)
    assert (cond(done, "Complete").status, cond(done, "Complete").reason) == ("True", "TrainerSucceeded")
    assert cond(done, "Ready").status == "True", "after training, Ready counts the serving replicas only"
    assert cond(done, "Degraded").status == "False" and done.trainer_version == 8 and done.served_version == 8
    events = version_events(ordered(running), ordered(done))
    assert ("Normal", "TrainerSucceeded") in [(t, r) for t, r, _ in events]


def test_content_digests_in_status_and_replicas_that_disagree_degrade_the_job(separated):
    """status.trainerDigest is the digest the replicas serving trainerVersion agree on; each replica shows its
    own (servedDigest); replicas at the same version with different digests make the job Degraded with reason
    DigestMismatch, naming them; a malformed digest annotation counts as none."""
    d1, d2 = "a" * 32, "b" * 32
    spec = separated(inference={"replicas": 3, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("demo", spec)

    def pods_with(*digests):
        out = {n: pod(n, published=5) for n in p.trainer_pods}
        for r, d in enumerate(digests):
            name = f"demo-inference-{r}-0"
            out[name] = pod(name, synced=True, served=5, **({contract.ANN_SERVED_DIGEST: d} if d else {}))
        return out

    st = aggregate(spec, 1, p, pods_with(d1, d1, None), None, 1, now=T0)
    assert st.trainer_digest == d1 and cond(st, "Degraded").status == "False"
    assert [r.served_digest for r in st.inference_replicas or []] == [d1, d1, None]
    bad = aggregate(spec, 1, p, pods_with(d1, d2, "not-hex"), None, 1, now=T0)
    deg = cond(bad, "Degraded")
    assert (deg.status, deg.reason) == ("True", contract.REASON_DIGEST_MISMATCH)
    assert "version 5" in deg.message and "[0]" in deg.message and "[1]" in deg.message and d2 in deg.message
    assert bad.trainer_digest is None and (bad.inference_replicas or [])[2].served_digest is None
    # no replica has loaded the trainer's version yet: the digest of that same version is kept
    prev = {"trainerVersion": 5, "trainerEpoch": 0, "trainerDigest": d1}
    assert aggregate(spec, 1, p, pods_with(None, None, None), prev, 1, now=T0).trainer_digest == d1


def test_a_multi_pod_replica_digest_is_the_sum_of_its_pods(separated):
    from weightsync.operator.status import replica_digest

    spec = separated(inference={"replicas": 1, "gpusPerReplica": 2, "podsPerReplica": 2, "parallelism": {"tensor": 2}})
    p = plan("demo", spec)
    pods = {n: pod(n, published=5) for n in p.trainer_pods}
    names = [n for n in p.names if "inference" in n]
    assert len(names) == 2
    pods[names[0]] = pod(names[0], synced=True, served=5, **{contract.ANN_SERVED_DIGEST: f"{1:032x}"})
    pods[names[1]] = pod(names[1], synced=True, served=5, **{contract.ANN_SERVED_DIGEST: f"{(1 << 128) - 1:032x}"})
    (state,) = replica_states(p, pods)
    assert replica_digest(state, pods) == f"{0:032x}"  # modulo 2^128
    pods[names[1]] = pod(names[1], synced=True, served=4, **{contract.ANN_SERVED_DIGEST: f"{2:032x}"})
    (state,) = replica_states(p, pods)
    assert replica_digest(state, pods) is None  # its pods serve different versions
