"""Helpers of the closed-loop e2e tests (a uniquely named module: importable from the test files)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kubernetes

from weightsync.crds import contract
from weightsync.e2e import demo


def wait(predicate: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    """demo.poll with a test-friendly name."""
    return demo.poll(predicate, timeout, what, interval)


def events_once(kube: Any, namespace: str, name: str, reason: str) -> list[Any]:
    """The job's Events once one with REASON is there: the operator posts them right after the status write
    that carried the condition, so a test that saw the condition may list them a moment too early."""
    def listed() -> list[Any] | None:
        events = kube.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        return events if any(e.reason == reason for e in events) else None

    return list(wait(listed, 30, f"a {reason} Event on {name}"))


def job(kube: Any, namespace: str, name: str) -> dict[str, Any]:
    return demo.get_job(kube.custom, namespace, name)


def inference_pods(kube: Any, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    return {n: p for n, p in demo.job_pods(kube.api, namespace, name).items() if demo.is_inference_pod(p)}


def served(pod: dict[str, Any]) -> int | None:
    raw = demo.annotation(pod, contract.ANN_SERVED_VERSION)
    return int(raw) if raw else None


def pods_show(kube: Any, namespace: str, name: str, key: str, value: str, role: str = "inference",
              timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Wait until every pod of ROLE carries KEY=VALUE: an agent whose report the operator took writes its pod
    up to WEIGHTSYNC_REPORT_WRITE_DELAY_SECONDS x 1.5 (15 s) later; returns the pods."""
    def check() -> dict[str, dict[str, Any]] | None:
        pods = {n: p for n, p in demo.job_pods(kube.api, namespace, name).items()
                if demo.is_inference_pod(p) == (role == "inference")}
        return pods if pods and all(demo.annotation(p, key) == value for p in pods.values()) else None

    result: dict[str, dict[str, Any]] = demo.poll(check, timeout, f"{role} pods of {name}: {key}={value}")
    return result


def target(pod: dict[str, Any]) -> int | None:
    raw = demo.annotation(pod, contract.ANN_TARGET_VERSION)
    return int(raw) if raw else None


def cond(job_body: dict[str, Any], type_: str) -> str | None:
    return demo.condition(job_body, type_).get("status")


def assert_bit_exact(kube: Any, namespace: str, name: str, version: int, engines: int) -> demo.BitExactReport:
    report = demo.verify_bit_exact(demo.job_pods(kube.api, namespace, name), version)
    assert len(report.engines) == engines, report
    assert report.ok, f"engines are not bit-exact with the trainer's version {version}: {report}"
    assert report.tensors >= 7
    return report


@dataclass
class PodEvent:
    t: float
    name: str
    uid: str
    ready: str | None
    served: int | None
    target: int | None
    engine_version: int | None  # the demo engine's version, queried right after the event (None: unreachable)


@dataclass
class PodRecorder:
    """Watches the pods of a namespace and records every change of readiness and versions, each together
    with the version the demo engine serves at that moment (queried right after the event arrived)."""

    api: kubernetes.client.ApiClient
    namespace: str
    query_engine: bool = True
    events: list[PodEvent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PodRecorder:
        self._thread = threading.Thread(target=self._run, name="pod-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        core = kubernetes.client.CoreV1Api(self.api)
        while not self._stop.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(core.list_namespaced_pod, self.namespace, timeout_seconds=5,
                                   _preload_content=True):
                    if self._stop.is_set():
                        break
                    pod = self.api.sanitize_for_serialization(ev["object"])
                    if not demo.is_inference_pod(pod):
                        continue
                    version: int | None = None
                    if self.query_engine:
                        with contextlib.suppress(Exception):
                            version = demo.engine_state(pod).get("version")
                    self.events.append(PodEvent(time.monotonic(), pod["metadata"]["name"], pod["metadata"]["uid"],
                                                demo.pod_condition(pod, "Ready"), served(pod), target(pod), version))
            except Exception:
                time.sleep(0.2)

    def of(self, name: str) -> list[PodEvent]:
        return [e for e in self.events if e.name == name]
