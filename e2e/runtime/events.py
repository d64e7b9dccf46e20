"""Kubernetes Events for pods (Started, Killing, BackOff, Unhealthy, Failed, FailedMount), like the
kubelet's, so `kubectl describe pod` explains what the process runtime did. Sent from one background
thread; best effort (a full queue or an API error drops the event, never blocks a pod)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from weightsync.e2e.runtime.kube import ApiError, KubeClient

log = logging.getLogger(__name__)
JSON = dict[str, Any]
COMPONENT = "weightsync-process-runtime"


def event_body(pod: JSON, event_type: str, reason: str, message: str, container: str | None) -> JSON:
    meta = pod["metadata"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    involved: JSON = {
        "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
    }
    if container:
        involved["fieldPath"] = f"spec.containers{{{container}}}"
    node = pod.get("spec", {}).get("nodeName", "")
    return {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": involved,
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    def __init__(self, client: KubeClient, max_queued: int = 1000) -> None:
        self._client = client
        self._queue: queue.Queue[JSON | None] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def emit(self, pod: JSON, event_type: str, reason: str, message: str, container: str | None = None) -> None:
        try:
            self._queue.put_nowait(event_body(pod, event_type, reason, message, container))
        except queue.Full:
            log.debug("event dropped reason=%s", reason)

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            namespace = body["metadata"]["namespace"]
            try:
                self._client.post(f"/api/v1/namespaces/{namespace}/events", body)
            except ApiError as exc:
                log.debug("event not recorded reason=%s error=%s", body["reason"], exc)
