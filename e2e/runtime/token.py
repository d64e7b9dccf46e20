"""Service-account tokens for projected volumes through the TokenRequest API, bound to the pod.

Like the kubelet, a token is reused until 80% of its lifetime (or 24 h) has passed, then requested again;
the projected volume refresh writes the new one atomically.
"""

from __future__ import annotations

import calendar
import logging
import threading
import time
from typing import Any

from weightsync.e2e.runtime.kube import ApiError, KubeClient

log = logging.getLogger(__name__)
JSON = dict[str, Any]


def token_request_body(audience: str | None, expiration_s: int, pod_name: str, pod_uid: str) -> JSON:
    """TokenRequest bound to the pod: the token dies with the pod; no audience = the apiserver's own."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [audience] if audience else [],
            "expirationSeconds": expiration_s,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid},
        },
    }


def _parse_time(value: str) -> float:
    return float(calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")))


class PodTokens:
    """Tokens of one pod's service account, cached per (audience, expiration)."""

    def __init__(self, client: KubeClient, namespace: str, service_account: str, pod_name: str, pod_uid: str) -> None:
        self._client = client
        self._namespace = namespace
        self._sa = service_account or "default"
        self._pod_name = pod_name
        self._pod_uid = pod_uid
        self._cache: dict[tuple[str | None, int], tuple[str, float]] = {}  # -> (token, refresh_at)
        self._lock = threading.Lock()

    def __call__(self, audience: str | None, expiration_s: int) -> str:
        key = (audience, expiration_s)
        now = time.time()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now < hit[1]:
                return hit[0]
        path = f"/api/v1/namespaces/{self._namespace}/serviceaccounts/{self._sa}/token"
        try:
            answer = self._client.post(
                path, token_request_body(audience, expiration_s, self._pod_name, self._pod_uid)
            )
        except ApiError:
            if hit is not None:  # keep serving the still-valid token through an apiserver hiccup
                return hit[0]
            raise
        token = str(answer["status"]["token"])
        expires = _parse_time(answer["status"]["expirationTimestamp"])
        refresh_at = now + min(0.8 * max(expires - now, 0.0), 24 * 3600.0)
        with self._lock:
            self._cache[key] = (token, refresh_at)
        log.info(
            "token issued namespace=%s pod=%s serviceaccount=%s audience=%s expires_in_s=%d",
            self._namespace, self._pod_name, self._sa, audience or "<api>", int(expires - now),
        )
        return token
