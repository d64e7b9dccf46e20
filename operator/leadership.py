"""Which replica of the operator may act, under kopf peering.

kopf keeps every replica's entry (priority, last seen, lifetime) in the peering object and pauses all but
the highest-priority live peer. The operator's own watch caches run on every replica (a standby that
takes over starts with warm caches), so the reconciles they trigger, and the periodic resync, are gated
on the same rule read from the same object: `refresh()` reads it every few seconds, `is_active` is the
answer in between. A leader that dies without removing its entry (SIGKILL, a lost node) is seen as dead
once its entry is older than its lifetime (PEERING_LIFETIME_S, set in kopf's settings), so a standby
takes over within about that lifetime plus one refresh period. With `--standalone` (one replica) the
answer is always yes.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from weightsync.operator.kube import Kube, KubeError
from weightsync.operator.metrics import LEADER

log = logging.getLogger(__name__)
PEERING_LIFETIME_S = 20  # a replica's entry counts as live this long after its last keep-alive
REFRESH_SECONDS = 2.0


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
        self.is_active = standalone or kube is None
        self._decided = False

    def refresh(self) -> tuple[bool, bool]:
        """Read the peering object once; returns (active now, changed since the last refresh). Logs the
        first answer and every change (`leadership active=...`)."""
        now = self.active()
        changed = now != self.is_active
        if changed or not self._decided:
            log.info("leadership active=%s identity=%s priority=%d", now, self.identity, self.priority,
                     extra={"active": now, "identity": self.identity, "priority": self.priority})
        self._decided = True
        self.is_active = now
        LEADER.set(1 if now else 0)
        return now, changed

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
