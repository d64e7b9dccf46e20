"""Which replica of the operator may act, under kopf peering.

kopf pauses its watch streams on every replica but the highest-priority live peer. The periodic resync
runs outside kopf's handlers, so it asks the same question of the peering object before acting. With
`--standalone` (one replica) the answer is always yes.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from weightsync.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)


def _parse_time(raw: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def is_leader(peers: dict[str, Any], identity: str, priority: int, now: datetime | None = None) -> bool:
    """kopf's rule: pause while another live peer has a higher or equal priority."""
    now = now or datetime.now(timezone.utc)
    for peer_id, info in peers.items():
        if peer_id == identity or not isinstance(info, dict):
            continue
        seen = _parse_time(str(info.get("lastseen", "")))
        lifetime = int(info.get("lifetime", 60))
        if seen is None or seen + timedelta(seconds=lifetime) <= now:
            continue
        if int(info.get("priority", 0)) >= priority:
            return False
    return True


class PeeringGuard:
    def __init__(
        self, kube: Kube | None, identity: str, standalone: bool, name: str = "default",
        namespace: str | None = None, priority: int = 0,
    ) -> None:
        self.kube = kube
        self.identity = identity
        self.standalone = standalone
        self.name = name
        self.namespace = namespace
        self.priority = priority

    @property
    def kind(self) -> str:
        return "KopfPeering" if self.namespace else "ClusterKopfPeering"

    def ensure_object(self) -> None:
        """Create the peering object kopf needs (kopf itself only patches an existing one)."""
        if self.standalone or self.kube is None:
            return
        body: dict[str, Any] = {"apiVersion": "kopf.dev/v1", "kind": self.kind, "metadata": {"name": self.name}}
        if self.namespace:
            body["metadata"]["namespace"] = self.namespace
        try:
            self.kube.create(body)
            log.info("created peering object kind=%s name=%s", self.kind, self.name)
        except KubeError as err:
            if not err.conflict:
                raise

    def active(self) -> bool:
        if self.standalone or self.kube is None:
            return True
        try:
            obj = self.kube.get_or_none(self.kind, self.namespace, self.name)
        except KubeError as err:
            log.warning("peering check failed, assuming passive error=%s", err)
            return False
        if obj is None:
            return True
        return is_leader(obj.get("status") or {}, self.identity, self.priority)
