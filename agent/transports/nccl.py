"""NCCL transport (torch.distributed): NCCL on GPU, gloo on CPU, one code path.

Groups: one process group per distinct (source, destinations) set of the plan, created once per
membership generation and reused for every later version (seed 003: reconnecting per update hangs).
A bucket with one destination moves point-to-point (send/recv on its 2-member group); a bucket every
one of several destinations needs byte-identically is one broadcast rooted at the source.

The groups are built directly from a shared c10d Store (ProcessGroupGloo / ProcessGroupNCCL objects),
not through the process-global default group: only the members of a group take part in creating it,
several transports can live in one process (a colocated agent), and a missing replica never blocks
the others. Every endpoint creates its groups in sorted order, which is deadlock-free.

After a failure (`abort`) the groups of that plan are dropped on every member (the sync layer
propagates the abort to all peers) and recreated under a new incarnation at the next `bind`.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from weightsync.agent.plan import BucketPlan
from weightsync.agent.plan.buckets import allocate
from weightsync.agent.staging.segments import STAGING
from weightsync.agent.transports.base import (
    Endpoint,
    Pending,
    Transport,
    TransportContext,
    TransportError,
    register,
)

log = logging.getLogger(__name__)

GroupKey = tuple[int, tuple[int, ...]]  # (src rank, dst ranks)


def make_store(host: str, port: int, *, is_master: bool, timeout: float = 600.0) -> dist.TCPStore:
    """The rendezvous store of a membership generation: the master (e.g. trainer agent 0) hosts it on
    `port`; everyone else connects. All groups of the generation live under prefixes in it."""
    return dist.TCPStore(host, port, None, is_master, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, use_libuv=True)


class _WorkPending(Pending[Any]):
    def __init__(self, work: Any, what: str, result: Any, transport: NcclTransport) -> None:
        self._work = work
        self._what = what
        self._result = result
        self._transport = transport
        self._done = False

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            try:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=timeout))
            except Exception as exc:
                raise TransportError(f"{self._transport.backend} {self._what} failed: {exc}") from exc
            finally:
                self._transport._inflight.discard(self)
            self._done = True
        return self._result


@register("nccl")
class NcclTransport(Transport):
    """Buckets over torch.distributed process groups (NCCL for CUDA buffers, gloo for CPU buffers)."""

    name = "nccl"

    def __init__(
        self,
        store: dist.Store,
        *,
        generation: int = 0,
        host: str | None = None,
        backend: str | None = None,
        timeout: float = 600.0,
        owned: Any = None,
    ) -> None:
        """`store`: the generation's shared Store (see make_store). `host`: the local address gloo binds
        to (the pod IP; default 127.0.0.1 or $WEIGHTSYNC_POD_IP). `backend`: "gloo" / "nccl" (default
        from the device of the first bind). `owned`: a Python store under `store` (transports/rendezvous.py
        LinkStore) that this transport keeps alive and closes."""
        self.store = store
        self._owned = owned
        self.generation = generation
        self.host = host or os.environ.get("WEIGHTSYNC_POD_IP") or "127.0.0.1"
        self._backend = backend
        self.timeout = timeout
        self._groups: dict[GroupKey, Any] = {}
        self._incarnation: dict[GroupKey, int] = {}
        self._slots: list[torch.Tensor | None] = [None] * self.num_slots
        self._need = 1  # bytes of a slot for the bound plan
        self._ctx: TransportContext | None = None
        self._inflight: set[_WorkPending] = set()

    @property
    def backend(self) -> str:
        return self._backend or "gloo"

    # -- groups --------------------------------------------------------------------------------------
    def _group_rank(self, key: GroupKey, me: Endpoint) -> int:
        _src, dsts = key
        return 0 if me.role == "src" else 1 + dsts.index(me.rank)

    def _new_group(self, key: GroupKey, me: Endpoint) -> Any:
        src, dsts = key
        size = 1 + len(dsts)
        inc = self._incarnation.get(key, 0)
        prefix = f"weightsync/g{self.generation}/i{inc}/src{src}-dst{'.'.join(map(str, dsts))}/"
        store = dist.PrefixStore(prefix, self.store)
        rank = self._group_rank(key, me)
        td = datetime.timedelta(seconds=self.timeout)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            gopts._timeout = td
            pg = dist.ProcessGroupGloo(store, rank, size, gopts)
        log.info("nccl.group_created backend=%s generation=%s group=%s rank=%s size=%s", self.backend,
                 self.generation, prefix, rank, size)
        return pg

    def bind(self, ctx: TransportContext) -> None:
        if self._backend is None:
            self._backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        self._ctx = ctx
        mine = ctx.my_buckets()
        keys = sorted({(b.src, b.dsts) for b in mine})
        for key in keys:  # sorted everywhere: deadlock-free creation order
            if key not in self._groups:
                try:
                    self._groups[key] = self._new_group(key, ctx.me)
                except Exception as exc:
                    raise TransportError(
                        f"could not form the {self.backend} group src{key[0]}->dst{list(key[1])} within "
                        f"{self.timeout:.0f}s: {exc} (is every member agent up and reachable?)"
                    ) from exc
        self._need = max(1, max((b.nbytes for b in mine), default=0))
        for i, buf in enumerate(self._slots):
            if buf is not None and (buf.numel() < self._need or buf.device != ctx.device):
                self._set_slot(i, None)  # made again at first use

    def _buffer(self, slot: int) -> torch.Tensor:
        """Slot buffers are made at first use: a sender that only sends in place needs none, and a receiver
        behind a RoutingTransport receives into its destination's shared slots (start_recv_into)."""
        if self._ctx is None:
            raise TransportError("transport used before bind()")
        buf = self._slots[slot]
        if buf is None:
            buf = allocate(self._need, self._ctx.device)
            self._set_slot(slot, buf)
        return buf

    def _set_slot(self, i: int, buf: torch.Tensor | None) -> None:
        old = self._slots[i]
        if old is not None:
            STAGING.sub(old.numel())
        self._slots[i] = buf
        if buf is not None:
            STAGING.add(buf.numel())

    def _slot(self, slot: int, nbytes: int) -> torch.Tensor:
        return self._buffer(slot)[:nbytes]

    def send_buffer(self, slot: int) -> torch.Tensor:
        return self._buffer(slot)

    def _start(self, bucket: BucketPlan, slot: int, sending: bool, buf: torch.Tensor | None = None) -> _WorkPending:
        assert self._ctx is not None
        key = (bucket.src, bucket.dsts)
        pg = self._groups[key]
        if buf is None:
            buf = self._slot(slot, bucket.nbytes)
        what = f"{'send' if sending else 'recv'} of bucket {bucket.index} (src{bucket.src}->dst{list(bucket.dsts)}, " \
               f"{bucket.nbytes} bytes)"
        try:
            if bucket.broadcast:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                opts.rootTensor = 0
                work = pg.broadcast([buf], opts)
            elif sending:
                work = pg.send([buf], 1, 0)
            else:
                work = pg.recv([buf], 0, 0)
        except Exception as exc:
            raise TransportError(f"{self.backend} {what} could not start: {exc}") from exc
        pending = _WorkPending(work, what, None if sending else buf, self)
        self._inflight.add(pending)
        return pending

    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        return self._start(bucket, slot, sending=True)

    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        return self._start(bucket, slot, sending=False)

    def supports_direct_send(self, data: torch.Tensor) -> bool:
        return self._ctx is not None and data.device == self._ctx.device

    def start_send_from(self, bucket: BucketPlan, data: torch.Tensor) -> Pending[None] | None:
        """Any memory on the group's device can be sent from: no pack."""
        if data.device != (self._ctx.device if self._ctx else data.device):
            return None
        return self._start(bucket, -1, sending=True, buf=data)

    def start_recv_into(self, bucket: BucketPlan, slot: int, out: torch.Tensor) -> Pending[torch.Tensor] | None:
        """Receive straight into the destination tensors' memory: no unpack copy."""
        if out.device != (self._ctx.device if self._ctx else out.device):
            return None
        return self._start(bucket, slot, sending=False, buf=out)

    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        """Nothing to do: the slot buffer is simply reused by the next receive."""

    def abort(self, reason: str) -> None:
        """Drop the groups this endpoint used (they may hold half-finished operations); every member
        does the same when the abort reaches it, and the next bind recreates them."""
        if self._ctx is None:
            return
        keys = sorted({(b.src, b.dsts) for b in self._ctx.my_buckets()})
        for key in keys:
            pg = self._groups.pop(key, None)
            if pg is None:
                continue
            self._incarnation[key] = self._incarnation.get(key, 0) + 1
            try:
                pg.abort()
            except Exception:  # best effort: the group is being discarded
                log.debug("nccl.abort_failed group=%s", key, exc_info=True)
        self._inflight.clear()
        log.warning("nccl.groups_dropped generation=%s groups=%s reason=%s", self.generation, len(keys), reason)

    def close(self) -> None:
        for pg in self._groups.values():
            try:
                pg.shutdown() if hasattr(pg, "shutdown") else None
            except Exception:
                log.debug("nccl.shutdown_failed", exc_info=True)
        self._groups.clear()
        for i in range(self.num_slots):
            self._set_slot(i, None)
        if self._owned is not None and hasattr(self._owned, "close"):
            self._owned.close()

    def describe(self) -> dict[str, object]:
        return {"transport": self.name, "backend": self.backend, "generation": self.generation,
                "groups": len(self._groups), "host": self.host}
