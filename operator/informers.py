"""Watch-backed caches of the jobs and the objects the operator owns (informers, as client-go has them).

Why: a reconcile used to GET or LIST eight kinds, so every pod event cost eight requests and the API
load grew with pods x kinds. Now each kind is listed once and then watched (one stream per kind and
namespace, filtered by the managed-by label on the server), the reconciler reads from memory, and the
event that changed an object is also what asks for the reconcile, after the cache holds it, so a pass
never sees state older than the event that started it.

Writes stay direct. The server's answer to a create or patch is put into the cache at once (`assume`,
kept only while it is newer than what the watch delivered), so the next pass does not miss an object it
has just created; a create that still meets an existing object gets 409 AlreadyExists and the reconciler
looks at that object with one GET. Cached objects drop `metadata.managedFields` (often half a pod's
size; the operator never reads it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract
from weightsync.operator.kube import Kube, KubeError
from weightsync.operator.metrics import CACHED_OBJECTS, RELISTS

log = logging.getLogger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)

OWNED_SELECTOR = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY}"
# What the reconciler reads (besides the job): pods and the supporting objects it ensures.
OWNED_KINDS = ("Pod", "ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy", "ConfigMap")

OnChange = Callable[[str, str, Obj], None]  # (kind, event type ADDED/MODIFIED/DELETED, object)


def _rv(obj: Mapping[str, Any]) -> int:
    """resourceVersion as a number (etcd revision); 0 when it is not one (never taken as newer)."""
    try:
        return int(str((obj.get("metadata") or {}).get("resourceVersion") or "0"))
    except ValueError:
        return 0


def _slim(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class Store:
    """One kind's objects by (namespace, name), with a per-job index (label weightsync.io/job); thread-safe.

    Callers get the stored dicts themselves: they must not modify them (the reconciler only reads)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._items: dict[Key, Obj] = {}
        self._by_job: dict[Key, set[str]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def _index(self, key: Key, obj: Obj | None) -> None:
        old = self._items.get(key)
        if old is not None:
            job = ((old.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_JOB)
            if job:
                self._by_job.get((key[0], job), set()).discard(key[1])
        if obj is None:
            self._items.pop(key, None)
            return
        self._items[key] = obj
        job = ((obj.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_JOB)
        if job:
            self._by_job.setdefault((key[0], job), set()).add(key[1])

    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self._items.get((namespace, name))

    def of_job(self, namespace: str, job: str) -> list[Obj]:
        with self._lock:
            names = sorted(self._by_job.get((namespace, job), ()))
            return [self._items[(namespace, n)] for n in names if (namespace, n) in self._items]

    def key_list(self) -> list[Key]:
        with self._lock:
            return list(self._items)

    def apply(self, type_: str, obj: Obj) -> bool:
        """A watch event; False when it is older than what is stored (an assumed write) and changes nothing."""
        key = _key(obj)
        with self._lock:
            cur = self._items.get(key)
            if type_ == "DELETED":
                if cur is None:
                    return False
                if (cur.get("metadata") or {}).get("uid") != (obj.get("metadata") or {}).get("uid"):
                    return False  # a deleted namesake: the stored object is a newer one
                self._index(key, None)
                return True
            if cur is not None and _rv(cur) > _rv(obj) and _rv(obj) > 0:
                return False
            self._index(key, _slim(obj))
            return True

    def assume(self, obj: Obj) -> None:
        """Our own write's answer from the server: store it unless the watch already delivered newer."""
        key = _key(obj)
        if not key[1] or _rv(obj) == 0:
            return
        with self._lock:
            cur = self._items.get(key)
            if cur is None or _rv(obj) > _rv(cur):
                self._index(key, _slim(obj))

    def replace(self, objs: Iterable[Obj], namespace: str | None = None) -> list[tuple[str, Obj]]:
        """A fresh LIST of NAMESPACE (None: all; one store serves every namespace's informer): the new
        content, and the events that turn the old content into it."""
        new = {_key(o): _slim(o) for o in objs}
        events: list[tuple[str, Obj]] = []
        with self._lock:
            for key, cur in list(self._items.items()):
                if key not in new and (namespace is None or key[0] == namespace):
                    events.append(("DELETED", cur))
                    self._index(key, None)
            for key, obj in new.items():
                old = self._items.get(key)
                if old is None or _rv(old) != _rv(obj):
                    events.append(("ADDED" if old is None else "MODIFIED", obj))
                self._index(key, obj)
        return events


class Informer:
    """LIST then WATCH one kind in one namespace (None: all), in a daemon thread, into a Store.

    On 410 Gone (the watch's resourceVersion was compacted) or a broken stream it lists again and
    reports the difference as events, so nothing deleted meanwhile stays in the cache."""

    def __init__(self, kube: Kube, kind: str, namespace: str | None, store: Store, on_change: OnChange | None,
                 label_selector: str = "", watch_timeout_s: int = 300) -> None:
        self.kube = kube
        self.kind = kind
        self.namespace = namespace
        self.store = store
        self.on_change = on_change
        self.label_selector = label_selector
        self.watch_timeout_s = watch_timeout_s
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._open: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"informer:{kind}:{namespace or '*'}")

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        raw = self._open
        if raw is not None:
            with contextlib.suppress(Exception):  # best effort at shutdown
                raw.shutdown()  # unblocks the read in the informer's thread (urllib3 >= 2.3)

    def _emit(self, type_: str, obj: Obj) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.kind, type_, obj)
        except Exception:
            log.exception("informer callback failed kind=%s", self.kind)

    def _list(self) -> str:
        items: list[Obj] = []
        cont, rv = "", ""
        while True:
            page = self.kube.list_page(self.kind, self.namespace, self.label_selector, cont=cont)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            cont = str(meta.get("continue") or "")
            if not cont:
                break
        RELISTS.labels(self.kind).inc()
        for type_, obj in self.store.replace(items, self.namespace):
            self._emit(type_, obj)
        CACHED_OBJECTS.labels(self.kind).set(len(self.store))
        self.synced.set()
        log.debug("listed kind=%s namespace=%s count=%d", self.kind, self.namespace or "*", len(items))
        return rv

    def _run(self) -> None:
        rv = ""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if not rv:
                    rv = self._list()
                for ev in self.kube.watch(self.kind, self.namespace, rv, self.label_selector,
                                          self.watch_timeout_s, on_open=self._opened):
                    type_, obj = str(ev.get("type")), ev.get("object") or {}
                    if type_ == "ERROR":
                        code = int(obj.get("code") or 0)
                        log.info("watch ended kind=%s code=%s message=%s", self.kind, code, obj.get("message"))
                        if code == 410:
                            rv = ""  # too old: list again
                        break
                    new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if type_ != "BOOKMARK" and self.store.apply(type_, obj):
                        CACHED_OBJECTS.labels(self.kind).set(len(self.store))
                        self._emit(type_, obj)
                    rv = new_rv
                backoff = 0.5
            except KubeError as err:
                if self._stop.is_set():
                    return
                if err.status == 410:
                    rv = ""
                    continue
                log.warning("watch failed kind=%s status=%s error=%s", self.kind, err.status, err.message)
                self._stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
            except Exception as err:  # a broken stream: resume from the last resourceVersion
                if self._stop.is_set():
                    return
                log.warning("watch interrupted kind=%s error=%r", self.kind, err)
                self._stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
            finally:
                self._open = None

    def _opened(self, raw: Any) -> None:
        self._open = raw


@dataclass
class Informers:
    """The operator's caches: the jobs (all of them in scope) and the owned kinds (label-selected),
    per served namespace, or cluster-wide with `namespaces` None."""

    kube: Kube
    namespaces: list[str] | None
    on_change: OnChange | None = None
    kinds: tuple[str, ...] = OWNED_KINDS

    def __post_init__(self) -> None:
        self.stores: dict[str, Store] = {k: Store(k) for k in (contract.KIND, *self.kinds)}
        self._informers: list[Informer] = []
        scopes: list[str | None] = list(self.namespaces) if self.namespaces else [None]
        for ns in scopes:
            self._informers.append(Informer(self.kube, contract.KIND, ns, self.stores[contract.KIND], self._dispatch))
            for kind in self.kinds:
                self._informers.append(Informer(self.kube, kind, ns, self.stores[kind], self._dispatch,
                                                label_selector=OWNED_SELECTOR))

    def _dispatch(self, kind: str, type_: str, obj: Obj) -> None:
        """Calls whatever `on_change` is now (it may be set after construction)."""
        if self.on_change is not None:
            self.on_change(kind, type_, obj)

    def start(self) -> Informers:
        for inf in self._informers:
            inf.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(inf.synced.wait(max(0.0, deadline - time.monotonic())) for inf in self._informers)

    def stop(self) -> None:
        for inf in self._informers:
            inf.stop()

    def serves(self, kind: str) -> bool:
        return kind in self.stores

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.stores[kind].get(namespace, name)

    def of_job(self, kind: str, namespace: str, job: str) -> list[Obj]:
        return self.stores[kind].of_job(namespace, job)

    def assume(self, obj: Obj) -> None:
        store = self.stores.get(str(obj.get("kind") or ""))
        if store is not None:
            store.assume(obj)

    def jobs(self) -> list[Key]:
        return self.stores[contract.KIND].key_list()
