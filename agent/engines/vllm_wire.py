"""The `weightsync` vLLM weight-transfer backend's wire: what the agent and vLLM's workers agree on.

Both ends import this module (the agent's VLLMAdapter with backend "weightsync", and the plugin's engine in
every vLLM worker, agent/engines/vllm_plugin.py), so the field names and the layout rule exist once. It
imports only torch (and weightsync's store and leaves), never vLLM.

The group. The agent is rank 0, vLLM's workers ranks 1..W (worker w of DP rank d is 1 + d * TP*PP + w, as
for vLLM's own nccl backend). The rendezvous goes through the agent's StoreServer behind a secret minted
per group and handed to the workers in `init_info` over the pod-local HTTP call: nothing reaches a key
without it. gloo when the engine has no GPU, NCCL when it has (the agent then needs a GPU of its own).

One bucket. The agent sends the bucket's bytes from where they lie when its tensors are views of one buffer
at offsets aligned to their element sizes (the receive slot: `in_place`), else packs them into one uint8
buffer, each at an offset aligned to ALIGNMENT (a multiple of every element size), broadcasts it, and the
workers:
1. receive it into a buffer nothing else views (vLLM's layer-wise reload holds views of a bucket until their
   layer is whole; buffers are pooled and reused once no view is left);
2. recompute every tensor's digest leaf (agent/hashing.py) and compare it with the one in `update_info`;
3. only if all match, hand the tensors (views of the buffer) to the model's `load_weights`, while the next
   bucket is on the wire: bucket k is received (in a thread) while bucket k-1 is loaded, and a last `flush`
   call loads the held bucket before the agent finishes the update;
4. report the outcome in-band: an all-reduce (MAX) of one int64 status every rank joins.
An update the agent gives up (abort) is marked `abandon`: the workers then finish it without complaint; a
session with a failure that is finished without that mark raises after vLLM's reload was finalized, so vLLM
never labels it with a version.
A worker never raises out of `update_weights`: vLLM would end the session with layers left on the meta device
and the next generation would kill the engine. It records the failure, skips the remaining buckets' loads
and reports it; the agent then never finishes the session with a version.
"""

from __future__ import annotations

import datetime
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weightsync.agent.hashing import WSUM, XXH3_128, fmt, leaf, piece_key

BACKEND_NAME = "weightsync"
#: Byte alignment of every tensor in a packed bucket (a multiple of every dtype's element size).
ALIGNMENT = 64

# Per-bucket status, all-reduced with MAX: the worst outcome on any rank wins.
STATUS_OK = 0
STATUS_DIGEST_MISMATCH = 1
STATUS_LOAD_FAILED = 2
STATUS_SESSION_FAILED = 3  # an earlier bucket of this session failed: nothing more is loaded
STATUS_NAMES = {STATUS_OK: "ok", STATUS_DIGEST_MISMATCH: "digest mismatch", STATUS_LOAD_FAILED: "load failed",
                STATUS_SESSION_FAILED: "an earlier bucket of this session failed"}


@dataclass
class WeightsyncInitInfo:
    """POST /init_weight_transfer_engine `init_info` for the weightsync backend."""

    store_host: str
    store_port: int
    store_secret: str
    group: str
    world_size: int
    worker_host: str
    backend: str = "gloo"  # "gloo" | "nccl"
    rank_offset: int = 1
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weightsync backend: group backend must be gloo or nccl, got {self.backend!r}")
        if self.world_size < 2 or self.rank_offset < 1:
            raise ValueError(f"weightsync backend: bad group size {self.world_size} / rank offset {self.rank_offset}")


@dataclass
class WeightsyncUpdateInfo:
    """POST /update_weights `update_info`: one packed bucket."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    leaves: list[str] = field(default_factory=list)  # hex leaf per tensor (agent/hashing.py)
    algorithm: str = XXH3_128
    bucket: int = 0
    #: The agent gives the session up (it will finish it without a version): no bytes, no collective; the
    #: session's failure is acknowledged, so that finish closes it quietly.
    abandon: bool = False
    #: No bytes: load the bucket held from the previous call and report (sent before finish).
    flush: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n) or len(self.leaves) != n:
            raise ValueError("weightsync backend: names, dtype_names, shapes, offsets and leaves differ in length")
        if self.algorithm not in (XXH3_128, WSUM):
            raise ValueError(f"weightsync backend: unknown digest algorithm {self.algorithm!r}")


def new_secret() -> str:
    return secrets.token_hex(32)


def init_info(**kw: Any) -> dict[str, Any]:
    """The JSON `init_info` (validated by constructing the dataclass both ends use)."""
    return asdict(WeightsyncInitInfo(**kw))


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).split(".")[-1]


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weightsync backend: unknown dtype {name!r}")
    return dt


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each tensor, total bytes): back to back, each start aligned to ALIGNMENT."""
    offsets: list[int] = []
    pos = 0
    for n in sizes:
        pos = -(-pos // ALIGNMENT) * ALIGNMENT
        offsets.append(pos)
        pos += n
    return offsets, pos


def tensor_key(name: str, dtype: str, shape: Sequence[int]) -> str:
    """A whole tensor's piece key: the same key the trainer's leaf has when it sends the tensor whole."""
    return piece_key(name, dtype, shape, [0] * len(shape), shape)


def leaf_algorithm(device: torch.device) -> str:
    return XXH3_128 if device.type == "cpu" else WSUM


def tensor_leaves(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                  buf: torch.Tensor, offsets: Sequence[int], algorithm: str) -> list[str]:
    """The hex leaf of every tensor, read where it sits in the packed buffer."""
    out = []
    for name, dt, shape, off in zip(names, dtypes, shapes, offsets, strict=True):
        n = dtype_of(dt).itemsize
        for d in shape:
            n *= int(d)
        out.append(fmt(leaf(tensor_key(name, dt, shape), buf[off : off + n], algorithm)))
    return out


def pack(tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None, device: torch.device
         ) -> tuple[torch.Tensor, WeightsyncUpdateInfo]:
    """Pack a bucket into `out` (reused when large enough) and describe it, leaves included."""
    names = [n for n, _ in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    dtypes = [dtype_name(t.dtype) for _, t in tensors]
    offsets, total = layout([nbytes(t) for _, t in tensors])
    if out is None or out.numel() < total or out.device != device:
        out = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    buf = out[:total]
    for (_, t), off in zip(tensors, offsets, strict=True):
        n = nbytes(t)
        if n:
            buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    algorithm = leaf_algorithm(device)
    info = WeightsyncUpdateInfo(names=names, dtype_names=dtypes, shapes=shapes, offsets=offsets, nbytes=total,
                                leaves=tensor_leaves(names, dtypes, shapes, buf, offsets, algorithm),
                                algorithm=algorithm)
    return out, info


def in_place(tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device, max_slack: float = 0.25
             ) -> tuple[torch.Tensor, WeightsyncUpdateInfo] | None:
    """The bucket as it already lies in memory, when it can go on the wire without a pack: every tensor a
    contiguous view of one storage on `device` (the inference agent's receive slot holds a bucket that way),
    each at an offset from the first that is a multiple of its element size, with at most `max_slack` of
    gaps. Returns (the byte range covering them, its description) or None (pack instead)."""
    if not tensors or any(not t.is_contiguous() or t.device != device for _, t in tensors):
        return None
    sized = [t for _, t in tensors if t.numel()]
    if not sized:
        return None
    storage = sized[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in sized):
        return None
    base = min(t.data_ptr() for t in sized)
    offsets = [t.data_ptr() - base if t.numel() else 0 for _, t in tensors]  # an empty tensor has no address
    sizes = [nbytes(t) for _, t in tensors]
    total = max(o + n for o, n in zip(offsets, sizes, strict=True))
    if any(o % t.element_size() for o, (_, t) in zip(offsets, tensors, strict=True)) or total > (1 + max_slack) * sum(sizes):
        return None
    region = torch.empty(0, dtype=torch.uint8, device=device)
    region.set_(storage, base - storage.data_ptr(), (total,), (1,))
    names = [n for n, _ in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    dtypes = [dtype_name(t.dtype) for _, t in tensors]
    algorithm = leaf_algorithm(device)
    info = WeightsyncUpdateInfo(names=names, dtype_names=dtypes, shapes=shapes, offsets=offsets, nbytes=total,
                                leaves=tensor_leaves(names, dtypes, shapes, region, offsets, algorithm),
                                algorithm=algorithm)
    return region, info


def views(buf: torch.Tensor, info: WeightsyncUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of the received buffer (no copy)."""
    out = []
    for name, dt, shape, off in zip(info.names, info.dtype_names, info.shapes, info.offsets, strict=True):
        dtype = dtype_of(dt)
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        out.append((name, buf[off : off + n].view(dtype).view(list(shape))))
    return out


def make_group(store: dist.Store, group: str, rank: int, world_size: int, backend: str, host: str,
               timeout_s: float) -> Any:
    """A process group of its own (never the process-global default group, which vLLM's workers already
    use), created from the rendezvous store under the group's prefix."""
    prefixed = dist.PrefixStore(group, store)
    td = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    gopts._timeout = td
    return dist.ProcessGroupGloo(prefixed, rank, world_size, gopts)


def broadcast(pg: Any, buf: torch.Tensor) -> None:
    """The bucket from rank 0 to every rank of the group (blocks until done on this rank)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buf], opts).wait()


def status_allreduce(pg: Any, status: int, device: torch.device) -> int:
    """Every rank's bucket outcome, MAX-reduced: the agent learns whether every worker loaded the bucket."""
    t = torch.tensor([status], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([t], opts).wait()
    return int(t.item())


def _use_count(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage (c10's own count)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class WorkerReceiver:
    """The worker side of one group: receive, check, load, report. No vLLM in here (the plugin wraps it),
    so the same code runs in tests against a plain `load_weights`."""

    #: Receive buffers kept for reuse (a fresh buffer per bucket faulted every page in again: 1.7 s per GiB
    #: on the wire against 0.5 s into a reused one, bench/engine_stall.py).
    MAX_POOLED = 4

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg = pg
        self.device = device
        self.pool: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's use count when nothing views it)
        self.failure: str | None = None  # the session's first failure; cleared at the next session
        self.held: tuple[torch.Tensor, WeightsyncUpdateInfo] | None = None  # checked, loaded at the next call
        self.buckets = 0
        self.loaded_tensors = 0

    def _buffer(self, n: int) -> torch.Tensor:
        """A buffer nothing else views. vLLM's layer-wise reload keeps the tensors handed to load_weights
        (views of a bucket's buffer) until every weight of their layer arrived, and a layer may span two
        buckets: a buffer is reused only once its storage has no view left (its use count is back to what it
        was when only the pool held it)."""
        for buf, idle in self.pool:
            if buf.numel() >= n and _use_count(buf) <= idle:
                return buf[:n]
        buf = torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)
        if len(self.pool) < self.MAX_POOLED:
            self.pool.append((buf, _use_count(buf)))
        elif self.pool:  # replace the smallest idle one, if any
            free = [k for k, (b, c) in enumerate(self.pool) if _use_count(b) <= c]
            if free:
                smallest = min(free, key=lambda k: int(self.pool[k][0].numel()))
                self.pool[smallest] = (buf, _use_count(buf))
        return buf[:n]

    def start_session(self) -> None:
        self.failure = None
        self.held = None
        self.buckets = 0
        self.loaded_tensors = 0

    def receive(self, info: WeightsyncUpdateInfo, load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any]
                ) -> int:
        """One bucket; returns the reduced status. Bucket k arrives (in a thread) while bucket k-1, checked
        by the previous call, is loaded here: the wire overlaps vLLM's load. `flush` loads the held bucket
        (the agent sends it before finishing the update). The status covers k's check and k-1's load.
        Raises only when the group itself failed (the agent is gone or broke it; the caller records it)."""
        if info.flush:
            return status_allreduce(self.pg, self._load_held(load_weights), self.device)
        buf = self._buffer(info.nbytes)
        received: list[BaseException | None] = []

        def recv() -> None:
            try:
                broadcast(self.pg, buf)
                received.append(None)
            except BaseException as exc:  # handed to the caller below
                received.append(exc)

        thread = threading.Thread(target=recv, name=f"weightsync-recv-{info.bucket}", daemon=True)
        thread.start()
        status = self._load_held(load_weights)
        thread.join()
        if received and received[0] is not None:
            raise received[0]
        self.buckets += 1
        status = max(status, self._check(buf, info))
        return status_allreduce(self.pg, status, self.device)

    def _check(self, buf: torch.Tensor, info: WeightsyncUpdateInfo) -> int:
        """Every tensor's leaf against the agent's; a bucket that passes is held for the next call's load."""
        if self.failure is not None:
            return STATUS_SESSION_FAILED
        got = tensor_leaves(info.names, info.dtype_names, info.shapes, buf, info.offsets, info.algorithm)
        bad = [i for i, (a, b) in enumerate(zip(got, info.leaves, strict=True)) if a != b]
        if bad:
            i = bad[0]
            self.failure = (f"bucket {info.bucket}: digest mismatch in {len(bad)} tensor(s), first "
                            f"{info.names[i]!r}: received {got[i]}, expected {info.leaves[i]}; not loaded")
            return STATUS_DIGEST_MISMATCH
        self.held = (buf, info)
        return STATUS_OK

    def _load_held(self, load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
        held, self.held = self.held, None
        if self.failure is not None:
            return STATUS_SESSION_FAILED
        if held is None:
            return STATUS_OK
        buf, info = held
        try:
            load_weights(views(buf, info))
            self.loaded_tensors += len(info.names)
        except Exception as exc:  # reported in-band, never raised into vLLM
            self.failure = f"bucket {info.bucket}: load_weights failed: {type(exc).__name__}: {exc}"
            return STATUS_LOAD_FAILED
        return STATUS_OK

    def drop_held(self) -> None:
        """The agent gave the update up: the checked bucket not yet loaded never is."""
        self.held = None
