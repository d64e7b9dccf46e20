"""The process's NIXL agent: one per agent process (`NixlEndpoint`), shared by its GDR transports; memory
registration (held while any transport sends or receives in place, dropped when a staging segment is
freed), remote agents' metadata, and blocking one-sided READs. Also how that agent is made: UCX's transport
list (`configure_ucx`) and the progress thread's polling delay. agent/transports/gdr.py is the transport
that drives it over the control link."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.staging import segments
from weightsync.agent.transports.base import TransportError

log = logging.getLogger(__name__)

#: UCX transports for a CPU-only machine: tcp carries UCX's active messages (NIXL insists on a transport
#: with peer-failure handling, so shared memory alone is refused), cma does the bulk copies, self loops.
CPU_UCX_TLS = "tcp,cma,self"
#: How long NIXL's progress thread waits for a UCX event before it polls again, in microseconds. NIXL's Python
#: wrapper sets 0, which makes the thread poll without pause: one CPU core per NIXL agent for as long as the
#: agent lives, idle or not (measured here: 0.99 CPU seconds per second per idle agent; 0.03 with 1000 us, 0.006
#: with 10000 us, READs of 64 MiB equally fast). The thread waits on the worker's event file descriptor, so
#: traffic wakes it at once; the delay bounds how late it polls a transport without events.
PROGRESS_DELAY_ENV = "WEIGHTSYNC_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 1000
_MAKE_LOCK = threading.Lock()


def progress_delay_us() -> int:
    """The progress thread's wait (WEIGHTSYNC_NIXL_PROGRESS_DELAY_US, default 1000; 0 = NIXL's busy poll)."""
    raw = os.environ.get(PROGRESS_DELAY_ENV, "")
    try:
        value = int(raw) if raw.strip() else DEFAULT_PROGRESS_DELAY_US
    except ValueError:
        raise TransportError(f"{PROGRESS_DELAY_ENV}={raw!r} is not a whole number of microseconds") from None
    if value < 0:
        raise TransportError(f"{PROGRESS_DELAY_ENV}={raw!r} must be >= 0")
    return value


def make_nixl_agent(name: str, backends: Sequence[str], delay_us: int) -> Any:
    """A NIXL agent whose progress thread waits `delay_us` between polls. The wrapper (`nixl_agent`) takes no
    such setting, so its one call into the bindings that gets the config is wrapped while the agent is made;
    a NIXL release without that call gives the wrapper's own agent (busy progress thread) and a warning."""
    from nixl import _api as nixl_api
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=list(backends))
    bindings: Any = getattr(nixl_api, "nixlBind", None)
    make = getattr(bindings, "nixlAgent", None)
    if make is None or delay_us == 0:
        if delay_us:
            log.warning("gdr.progress_delay_unsupported nixl=%s: the progress thread polls without pause",
                        getattr(nixl_api, "__file__", "?"))
        return nixl_agent(name, config)

    def with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay_us
        return make(agent_name, cfg)

    with _MAKE_LOCK:
        bindings.nixlAgent = with_delay
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = make


def configure_ucx(tls: str | None = None) -> str | None:
    """Set UCX_TLS before the first NIXL agent of the process is created (UCX reads it once).

    An explicit `tls` wins; an existing UCX_TLS is kept; on a machine without CUDA the CPU set is used;
    on a GPU machine UCX is left to choose (rc / cuda_ipc / cuda_copy), which is what GPUDirect needs.
    Returns the value in effect (None: UCX's own choice)."""
    if tls:
        os.environ["UCX_TLS"] = tls
    elif "UCX_TLS" not in os.environ and not torch.cuda.is_available():
        os.environ["UCX_TLS"] = CPU_UCX_TLS
    return os.environ.get("UCX_TLS")


class Backoff:
    """Polling pause for transfer completion: spin briefly (small buckets finish in microseconds),
    then sleep with growing pauses up to 1 ms, so a poller never starves UCX's progress thread or
    the peer process of CPU (a 2-core CI machine has nothing to spare)."""

    def __init__(self, spins: int = 64, first: float = 20e-6, cap: float = 1e-3) -> None:
        self.spins = spins
        self.delay = first
        self.cap = cap

    def __call__(self) -> None:
        if self.spins > 0:
            self.spins -= 1
            return
        time.sleep(self.delay)
        self.delay = min(self.cap, self.delay * 2)


def mem_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory kind and device id of a tensor's memory: ("VRAM", gpu) or ("DRAM", 0)."""
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def desc_of(t: torch.Tensor, nbytes: int | None = None) -> tuple[int, int, int]:
    """The (address, length, device) descriptor of a tensor's bytes (the first `nbytes` of them) for NIXL."""
    _mem, dev = mem_of(t)
    return (int(t.data_ptr()), int(t.numel() if nbytes is None else nbytes), dev)


@dataclass
class _Held:
    """Memory registered for zero-copy transfers, kept registered (and alive) while any user holds it."""

    reg: Any
    base: int
    nbytes: int
    storage: Any  # keeps the memory alive while NIXL has it registered
    users: set[int] = field(default_factory=set)


class NixlEndpoint:
    """One NIXL agent with the UCX backend, guarded by a lock (NIXL agents are not thread-safe by
    default). Knows which remote agents it has loaded and re-loads one whose metadata changed.

    One per agent process, shared by all its GDR transports (TransportCache): NIXL's model is one agent
    per process, each agent is a UCX context with its own worker, progress thread and sockets, and a
    transport per (destination rank, source rank) pair would otherwise make S x D of them in one pod and
    register the pod's shared receive slots once per source. Hence:
    * `md_gen` counts registrations: a peer whose copy of the metadata is older must load it again
      before reading memory registered since (the transports tell their peers, see `snapshot`);
    * memory sent or received in place (`hold`) is registered once per endpoint and released when the
      last transport holding it closes (`release`);
    * a remote agent's metadata is swapped only while no READ from it is in flight (`load_remote`)."""

    def __init__(self, name: str | None = None, *, backends: Sequence[str] = ("UCX",)) -> None:
        configure_ucx()
        try:
            import nixl._api  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the image
            raise TransportError(
                "the GDR transport needs NIXL: pip install 'weightsync[gdr]' (PyPI nixl)"
            ) from exc
        if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs INFO lines to stdout; keep stdout for results
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = name or f"ws-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self._lock = threading.RLock()
        self.progress_delay_us = progress_delay_us()
        try:
            self.agent = make_nixl_agent(self.name, backends, self.progress_delay_us)
        except Exception as exc:
            raise TransportError(
                f"cannot create NIXL agent {self.name} with backends {list(backends)}: {exc}; on a CPU-only "
                f"machine UCX needs a TCP-capable transport (UCX_TLS={os.environ.get('UCX_TLS')!r}, try "
                f"{CPU_UCX_TLS!r})"
            ) from exc
        self._remote_md: dict[str, bytes] = {}
        self._remote_gen: dict[str, int] = {}  # remote agent -> the md_gen of the metadata loaded
        self._regs: list[Any] = []
        self._held: dict[int, _Held] = {}  # storage base address -> registration
        self.md_gen = 0
        self._reading: dict[str, int] = {}  # remote agent -> READs in flight
        self._idle = threading.Condition(self._lock)
        forget = weakref.WeakMethod(self.forget_range)

        def on_freed(address: int, nbytes: int) -> None:
            method = forget()
            if method is not None:
                method(address, nbytes)

        self._unhook = segments.on_segment_freed(on_freed)

    def register(self, tensors: Sequence[torch.Tensor]) -> Any:
        if not tensors:
            return None
        mem, _ = mem_of(tensors[0])
        with self._lock:
            reg = self.agent.register_memory([(*desc_of(t), "") for t in tensors], mem)
            self._regs.append(reg)
            self.md_gen += 1
            return reg

    def snapshot(self) -> tuple[int, bytes]:
        """(md_gen, metadata) taken together: the metadata holds every registration up to md_gen."""
        with self._lock:
            return self.md_gen, bytes(self.agent.get_agent_metadata())

    def hold(self, data: torch.Tensor, user: object) -> bool:
        """Make sure the whole storage under `data` is registered, on behalf of `user` (kept until
        `release(user)`). False when NIXL cannot register it (the caller falls back to its slots)."""
        start = int(data.data_ptr())
        end = start + data.numel() * data.element_size()
        with self._lock:
            for h in self._held.values():
                if h.base <= start and end <= h.base + h.nbytes:
                    h.users.add(id(user))
                    return True
            storage = data.untyped_storage()
            base, n = int(storage.data_ptr()), int(storage.nbytes())
            whole = torch.empty(0, dtype=torch.uint8, device=data.device).set_(storage, 0, (n,), (1,))
            try:
                reg = self.register([whole])
            except Exception as exc:
                log.warning("gdr.register_failed bytes=%s error=%s: falling back to staging slots", n, exc)
                return False
            self._held[base] = _Held(reg, base, n, storage, {id(user)})
            log.info("gdr.registered bytes=%s device=%s md_gen=%s", n, data.device, self.md_gen)
            return True

    def forget_range(self, address: int, nbytes: int) -> None:
        """The memory at [address, address + nbytes) is being freed (a staging segment the pool replaced):
        deregister what lies there, whoever held it (nothing reads a free slot)."""
        with self._lock:
            for base, h in list(self._held.items()):
                if address <= h.base < address + nbytes:
                    del self._held[base]
                    self.deregister(h.reg)
                    log.info("gdr.deregistered bytes=%s: its staging segment was freed", h.nbytes)

    def release(self, user: object) -> None:
        """`user` no longer sends or receives in place: deregister what nobody else holds."""
        with self._lock:
            for base, h in list(self._held.items()):
                h.users.discard(id(user))
                if not h.users:
                    del self._held[base]
                    self.deregister(h.reg)

    def held_bytes(self) -> int:
        """Bytes registered for in-place transfers (for logs and tests)."""
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    def deregister(self, reg: Any) -> None:
        if reg is None:
            return
        with self._lock:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
            with contextlib.suppress(ValueError):
                self._regs.remove(reg)

    def metadata(self) -> bytes:
        return self.snapshot()[1]

    def load_remote(self, name: str, md: bytes, md_gen: int = -1, *, timeout: float = 60.0) -> str:
        """Make `name` readable; re-load it when its metadata changed (new registrations). `md_gen`: the
        remote's generation of `md`; metadata older than what is loaded is ignored (several transports of
        this process read from one remote agent and may learn its generations out of order). A reload
        waits until no READ from `name` is in flight, at most `timeout` seconds."""
        with self._lock:
            if self._remote_md.get(name) == md or (0 <= md_gen <= self._remote_gen.get(name, -1)):
                return name
            if name in self._remote_md:
                if not self._idle.wait_for(lambda: not self._reading.get(name), timeout):
                    raise TransportError(f"NIXL metadata of {name} changed while READs from it stayed in flight "
                                         f"for {timeout:.0f}s")
                if self._remote_md.get(name) == md or (0 <= md_gen <= self._remote_gen.get(name, -1)):
                    return name  # another transport loaded it (or a newer one) meanwhile
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(name)
            got = self.agent.add_remote_agent(md)
            got_s = got.decode() if isinstance(got, bytes) else str(got)
            if got_s != name:
                raise TransportError(f"NIXL metadata announced as agent {name!r} belongs to {got_s!r}")
            self._remote_md[name] = md
            self._remote_gen[name] = md_gen
            return name

    def read(
        self,
        local: torch.Tensor,
        remote: tuple[int, int, int],
        remote_mem: str,
        peer: str,
        *,
        timeout: float,
        aborted: threading.Event,
    ) -> None:
        """READ len(local) bytes from the peer's (addr, len, dev) into `local`; blocks until done."""
        nbytes = local.numel()
        if nbytes == 0:
            return
        mem, dev = mem_of(local)
        deadline = time.monotonic() + timeout
        with self._lock:
            ldesc = self.agent.get_xfer_descs([(int(local.data_ptr()), nbytes, dev)], mem)
            rdesc = self.agent.get_xfer_descs([(remote[0], nbytes, remote[2])], remote_mem)
            handle = self.agent.initialize_xfer("READ", ldesc, rdesc, peer)
            self._reading[peer] = self._reading.get(peer, 0) + 1
            try:
                state = self.agent.transfer(handle)
            except BaseException:
                self._done_reading(peer)
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(handle)
                raise
        try:
            pause = Backoff()
            while state == "PROC":
                if aborted.is_set():
                    raise TransportError(f"READ of {nbytes} bytes from {peer} aborted")
                if time.monotonic() > deadline:
                    raise TransportError(f"READ of {nbytes} bytes from {peer} timed out after {timeout:.0f}s")
                pause()
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"NIXL READ of {nbytes} bytes from {peer} failed (state {state})")
        finally:
            with self._lock:
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(handle)
                self._done_reading(peer)

    def _done_reading(self, peer: str) -> None:
        left = self._reading.get(peer, 0) - 1
        if left > 0:
            self._reading[peer] = left
        else:
            self._reading.pop(peer, None)
            self._idle.notify_all()

    def close(self) -> None:
        self._unhook()
        with self._lock:
            self._held.clear()
            for reg in list(self._regs):
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(reg)
            self._regs.clear()
            for name in list(self._remote_md):
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(name)
            self._remote_md.clear()
            self._remote_gen.clear()
