"""Capture real `kubectl get wsj -o wide` / `kubectl describe wsj` output for docs/troubleshooting.md.

    python -m weightsync.e2e.troubleshooting > docs/troubleshooting.md      # `make troubleshooting-doc`

Runs on the embedded local cluster with the chart-installed operator (as `make demo` does): one healthy
demo job, and one failing job per condition reason shown (a wrong engine port: EngineUnreachable; an
engine that crashes: CrashLoopBackOff; a trainer that finished: Complete). Each section is the operator's
own words, so the page cannot drift from what users see.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.crds import contract
from weightsync.e2e import chart, demo

NS = "demo"
TIMEOUT = 300.0

INTRO = """# Troubleshooting by condition reason

Start with two commands: `kubectl get wsj -o wide` shows every job's versions, conditions and the
version each inference replica serves (`REPLICA-VERSIONS`); `kubectl describe wsj NAME` shows the
conditions with their reasons and messages, `status.inferenceReplicas` and the job's Events. The
`Degraded` column is the reason to look up: every reason is in the tables of
[operations.md](operations.md#condition-reasons) with what to do.

The outputs below are real: `python -m weightsync.e2e.troubleshooting` (`make troubleshooting-doc`)
ran these jobs on the embedded local cluster with the chart-installed operator and wrote this page.
Pod IPs, ages and timestamps differ on your cluster.
"""


def _job_section(env: Any, title: str, text: str, name: str) -> str:
    wide = env.kubectl("get", "wsj", name, "-o", "wide", "-n", NS).stdout.rstrip()
    described = env.kubectl("describe", "wsj", name, "-n", NS).stdout.rstrip()
    return "\n".join([f"## {title}", "", text, "", "```", f"$ kubectl get wsj {name} -o wide", wide, "```", "",
                      "```", f"$ kubectl describe wsj {name}", described, "```", ""])


def _wait(env: Any, name: str, what: str, done: Callable[[dict[str, Any]], bool]) -> None:
    """Until DONE(job) holds for the job NAME."""
    with env.api_client() as api:
        import kubernetes

        custom = kubernetes.client.CustomObjectsApi(api)
        demo.poll(lambda: done(demo.get_job(custom, NS, name)) or None, TIMEOUT, f"{name}: {what}")


def _wait_condition(env: Any, name: str, type_: str, status: str, reason: str | None = None) -> None:
    def done(job: dict[str, Any]) -> bool:
        c = demo.condition(job, type_)
        return c.get("status") == status and (reason is None or c.get("reason") == reason)

    _wait(env, name, f"{type_}={status} {reason or ''}", done)


def _healthy(env: Any) -> tuple[str, str]:
    body = demo.load_example("separated", name_override="healthy")
    demo.set_trainer_args(body, versions=4, interval=1.0)
    demo.apply(env, body, NS)
    _wait(env, "healthy", "servedVersion 4", lambda j: (j.get("status") or {}).get("servedVersion") == 4)
    _wait_condition(env, "healthy", contract.COND_SYNCED, "True")
    _wait_condition(env, "healthy", contract.COND_READY, "True")
    return "healthy", ("A healthy job: `READY`, `SYNCED` True, `DEGRADED` AsExpected, every replica serves the "
                       "trainer's newest version. A replica loading a version shows `progress` under "
                       "`Inference Replicas` while the load is under way.")


def _wrong_port(env: Any) -> tuple[str, str]:
    body = demo.wrong_port_job("wrong-port")
    demo.apply(env, body, NS)
    _wait_condition(env, "wrong-port", contract.COND_DEGRADED, "True", "EngineUnreachable")
    return "wrong-port", ("`Degraded` reason `EngineUnreachable`: `spec.inference.engine.port` is 8999 but the "
                          "engine listens on 8001. The message names the pod, the URL the agent tried and the "
                          "error; versions never land, so the replica stays NotReady. Fix `engine.port` / `engine.url` "
                          "(both mutable): the inference pods are then reported outdated (`Progressing` reason "
                          "`PodsOutdated`), delete them to pick up the fix; the trainer pods are not affected.")


def _crash_loop(env: Any) -> tuple[str, str]:
    body = demo.crash_loop_job("crash-loop")
    demo.apply(env, body, NS)
    _wait_condition(env, "crash-loop", contract.COND_DEGRADED, "True", "CrashLoopBackOff")
    return "crash-loop", ("`Degraded` reason `CrashLoopBackOff`: the engine container exits with code 3. The "
                          "message names the pod, the container, the restarts and the exit code, and the "
                          "condition holds while the container runs between crashes (no flapping). Read "
                          "`kubectl logs POD -c CONTAINER --previous`.")


def _complete(env: Any) -> tuple[str, str]:
    body = demo.finishing_job("finished", versions=3)
    demo.apply(env, body, NS)
    _wait_condition(env, "finished", contract.COND_COMPLETE, "True")
    _wait_condition(env, "finished", contract.COND_READY, "True")
    return "finished", ("`Complete` reason `TrainerSucceeded`: the trainer (restartPolicy OnFailure) published "
                        "its last version and exited 0. The engine keeps serving that version; `Ready` counts "
                        "the inference replicas only.\n\n"
                        "The trainer pod's agent is the source of its versions and ends with the trainer, so a "
                        "trainer that exits should first wait until the fleet serves its last version: "
                        "`session.wait_served(last_version, timeout)` before closing its `TrainerSession` (the demo "
                        "trainer's `--exit` does, for at most `--exit-wait-served` seconds, 300 by default). A "
                        "replica that had not fetched the last version when the trainer pod ended stays on the "
                        "version before (`SERVED` below `TRAINER`, `Synced=False`).")


SCENARIOS: list[tuple[str, Callable[[Any], tuple[str, str]]]] = [
    ("Healthy", _healthy),
    ("EngineUnreachable: a wrong engine port", _wrong_port),
    ("CrashLoopBackOff: an engine that keeps crashing", _crash_loop),
    ("Complete: the trainer finished", _complete),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync.e2e.troubleshooting", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the page here (default: stdout)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="weightsync-troubleshooting-"))
    sections = [INTRO]
    with demo.demo_environment(work) as env:
        demo.ensure_namespace(env, NS)
        release = chart.install_chart(env, "weightsync-system", "weightsync", watch_namespaces=[NS],
                                      create_namespace=True)
        try:
            for title, scenario in SCENARIOS:
                print(f"[troubleshooting] {title}", file=sys.stderr, flush=True)
                name, text = scenario(env)
                sections.append(_job_section(env, title, text, name))
            overview = env.kubectl("get", "wsj", "-o", "wide", "-n", NS).stdout.rstrip()
            sections.insert(1, "\n".join(["## All jobs at a glance", "", "```", "$ kubectl get wsj -o wide",
                                          overview, "```", ""]))
        finally:
            release.uninstall()
    page = "\n".join(sections)
    if args.out:
        args.out.write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
