"""An in-memory stand-in for operator.kube.Kube that records every call (unit tests count API writes)."""

from __future__ import annotations

import copy
from typing import Any

from weightsync.operator.kube import KubeError

Obj = dict[str, Any]


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], Obj] = {}
        self.calls: list[tuple[str, str, str]] = []

    def get_or_none(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        self.calls.append(("get", kind, name))
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, obj: Obj, dry_run: bool = False) -> Obj:
        kind, meta = obj["kind"], obj["metadata"]
        self.calls.append(("create", kind, meta["name"]))
        key = (kind, meta.get("namespace"), meta["name"])
        if key in self.objects:
            raise KubeError(409, "AlreadyExists", f"{kind} {meta['name']} already exists")
        if not dry_run:
            self.objects[key] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    def writes(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[0] != "get"]
