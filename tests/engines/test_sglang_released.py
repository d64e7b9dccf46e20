"""The SGLang adapter against SGLang 0.5.23's own released code (the `engines` tier).

Request bodies are validated by SGLang's request types, routes by its route table, and every load goes
to a stand-in server (e2e/engines/sglang_standin.py): SGLang's own FastAPI app, run by the engine venv's
python (e2e/engine_venv.py), in front of SGLang's own session rules and receive code, in separate mount,
PID and /dev/shm namespaces (`unshare`), as the engine container is.

A stand-in takes ~17 s to start (SGLang's imports), so the tests that neither need other flags nor break the
server share one with the default flags (`shared`): each sees only its own events, and starts on a server that
is not paused, has no session open and runs no request, as a fresh one. A test with other flags starts its own
(`standin`).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from weightsync.agent.demo.model import DemoModel
from weightsync.agent.engines import sglang
from weightsync.agent.engines.base import EngineError, EngineUnsupported, load_version
from weightsync.agent.layout.shards import checksums
from weightsync.e2e.engine_venv import engine_python
from weightsync.e2e.engines import released, sglang_code
from weightsync.e2e.procs import free_port

pytestmark = pytest.mark.engines

UNSHARE = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child"]


#: A private /dev/shm: another pod's view. The GPU tier turns it off: the engine container of a Colocated pod
#: shares the pod's /dev/shm with the agent, and torch's CUDA IPC needs that (see tests/engines/test_sglang_gpu.py).
PRIVATE_DEV_SHM = True


def _in_own_namespaces(cmd: list[str]) -> list[str]:
    """cmd in new mount + PID namespaces (UNSHARE), with a private /dev/shm unless PRIVATE_DEV_SHM is off."""
    inner = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && " if PRIVATE_DEV_SHM else "") + "exec " + " ".join(cmd)
    return [*UNSHARE, "sh", "-c", inner]


#: SGLang's app imports its serving stack and resolves its ServerArgs at start: ~20 s on 2 busy cores.
START_TIMEOUT = 180.0


class Standin:
    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"standin-{self.port}.log"
        cmd = [str(engine_python()), "-m", "weightsync.e2e.engines.sglang_standin", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        argv = _in_own_namespaces(cmd)
        self.forked = "--fork" in argv  # unshare waits for the engine, its child, instead of exec'ing it
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"stand-in exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                requests.get(f"{self.url}/standin/state", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.1)
        # the fixture never got this object: stop the server here, or it outlives the test (it did: an engine
        # left serving for the rest of a run, after a start slowed by a parallel run timed out)
        self.close()
        raise AssertionError(f"stand-in did not start within {START_TIMEOUT:.0f} s: {self.log.read_text()}")

    def get(self, path: str) -> Any:
        return requests.get(f"{self.url}{path}", timeout=10).json()

    def ops(self) -> list[str]:
        return [e["op"] for e in self.get("/standin/events")["events"]]

    def close(self) -> None:
        if self.forked:
            # unshare --fork blocks SIGTERM while it waits for its child (a terminate waited out the 10 s every
            # time): SIGKILL it, and --kill-child takes the engine, the new PID namespace's init, down with it
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, AssertionError):  # Popen's waitpid race with gloo
                self.proc.wait(10)
            return
        self.proc.terminate()  # the engine itself (unshare exec'd it): it shuts down on SIGTERM
        try:
            self.proc.wait(10)
        except (subprocess.TimeoutExpired, AssertionError):  # AssertionError: Popen's waitpid race with gloo
            self.proc.kill()


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Any]:
    made: list[Standin] = []

    def make(*args: str) -> Standin:
        s = Standin(tmp_path, *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


class Seen:
    """The module's default-flag stand-in as one test sees it: the events from the test's start on (the earlier
    tests' are not its own), the flushes counted from there."""

    def __init__(self, server: Standin) -> None:
        self.server, self.url, self.port, self.proc, self.log = server, server.url, server.port, server.proc, server.log
        self.first = len(server.get("/standin/events")["events"])
        self.flushes_before = server.get("/standin/state")["flushes"]

    def get(self, path: str) -> Any:
        return self.server.get(path)

    def events(self) -> list[dict[str, Any]]:
        return list(self.server.get("/standin/events")["events"][self.first:])

    def ops(self) -> list[str]:
        return [e["op"] for e in self.events()]

    def flushes(self) -> int:
        return int(self.server.get("/standin/state")["flushes"]) - int(self.flushes_before)


@pytest.fixture(scope="module")
def default_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    """One default-flag stand-in per module that uses it (a module importing this fixture gets its own)."""
    s = Standin(tmp_path_factory.mktemp("sglang-standin"))
    yield s
    s.close()


@pytest.fixture
def shared(default_standin: Standin) -> Iterator[Seen]:
    """The shared stand-in, in the state a fresh one starts in (alive, not paused, no session, no request
    running); after the test, a session it left open is closed (as a restarting agent closes it) and the requests
    it left running end."""
    assert default_standin.proc.poll() is None, default_standin.log.read_text()[-3000:]
    state = default_standin.get("/standin/state")
    assert not state["paused"] and not state["session_open"] and state["running"] == 0, state
    yield Seen(default_standin)
    if default_standin.proc.poll() is None:
        if default_standin.get("/standin/state")["session_open"]:
            requests.post(f"{default_standin.url}/end_weight_update", json={}, timeout=10)
        requests.post(f"{default_standin.url}/standin/requests", json={"running": 0}, timeout=10)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return sorted(DemoModel(64).state_dict().items())


def _buckets(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    return [items[:3], items[3:5], items[5:]]


# ---------------- the engine's own contract ----------------


def test_sglang_pinned_release_is_installed() -> None:
    assert released.installed_version("sglang") == sglang.SGLANG_VERSION == released.PINNED["sglang"]
    assert sglang.SGLANG_VERSION in sglang.SUPPORTED_VERSIONS


def test_every_route_the_adapter_uses_is_registered_by_sglang() -> None:
    table = sglang_code.routes()
    used = [("POST", r) for r in ("/pause_generation", "/continue_generation", "/begin_weight_update",
                                  "/end_weight_update", "/init_weights_update_group", "/destroy_weights_update_group",
                                  "/update_weights_from_distributed", "/update_weights_from_tensor",
                                  "/update_weight_version", "/flush_cache", "/release_memory_occupation",
                                  "/resume_memory_occupation", "/weights_checker")]
    used += [("GET", "/model_info"), ("GET", "/server_info")]
    assert not [u for u in used if u not in table], sorted(table)
    # the table is read from the wheel, not typed here: a route SGLang does not have is absent
    assert ("POST", "/update_weights") not in table and ("POST", "/start_weight_update") not in table


@pytest.mark.parametrize("route, body", [
    ("/begin_weight_update", sglang.begin_body()),
    ("/pause_generation", sglang.pause_body("retract")),
    ("/continue_generation", sglang.continue_body()),
    ("/update_weight_version", sglang.weight_version_body("7")),
    ("/init_weights_update_group", sglang.init_group_body("10.0.0.1", 4000, 3, group_name="g")),
    ("/release_memory_occupation", sglang.memory_body(["kv_cache"])),
    ("/weights_checker", sglang.check_weights_body()),
])
def test_control_bodies_validate_with_sglang_request_types(route: str, body: dict[str, Any]) -> None:
    req = sglang_code.validate(route, body)
    for k, v in body.items():
        assert getattr(req, k) == v, (k, v)


def test_bucket_bodies_validate_and_a_misspelt_field_is_refused() -> None:
    _, meta = sglang.flatten(_weights(0))
    body = sglang.update_weights_from_distributed_body(meta, group_name="g")
    req = sglang_code.validate("/update_weights_from_distributed", body)
    assert req.load_format == "flattened_bucket" and req.flush_cache is False and req.group_name == "g"
    assert [getattr(torch, d) for d in req.dtypes] == [m.dtype for m in meta]
    tbody = sglang.update_weights_from_tensor_body(["aGVsbG8="])
    assert sglang_code.validate("/update_weights_from_tensor", tbody).serialized_named_tensors == [b"hello"]
    with pytest.raises(ValueError, match="flushcache"):
        sglang_code.validate("/update_weights_from_distributed", {**body, "flushcache": True})


def test_flattened_bucket_follows_sglangs_alignment_rule() -> None:
    tb = sglang_code.tensor_bucket()
    mixed = [("a.int8", torch.arange(3, dtype=torch.int8)), ("b.bf16", torch.randn(5).to(torch.bfloat16)),
             ("c.f32", torch.randn(3)), ("d.i64", torch.arange(2))]
    # SGLang's receive buffer refuses an unpadded layout that puts a wider dtype at an odd offset
    with pytest.raises(ValueError, match="Unaligned"):
        tb.FlattenedTensorBucket.empty([n for n, _ in mixed], [t.dtype for _, t in mixed],
                                       [list(t.shape) for _, t in mixed], "cpu")
    flat, meta = sglang.flatten(mixed)
    bucket = tb.FlattenedTensorBucket.empty([m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta],
                                            [list(m.shape) for m in meta], "cpu")
    bucket.get_flattened_tensor().copy_(flat)
    got = dict(bucket.reconstruct_tensors())
    for name, t in mixed:
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_tensor_payload_globals_are_on_sglangs_unpickler_allowlist() -> None:
    """The tensor path's pickle (rebuilt on the engine by SGLang's SafeUnpickler) names only allowed
    globals; the payload of a CPU tensor rebuilds in the same namespaces, bit for bit."""
    flat, meta = sglang.flatten(_weights(1))
    payload = sglang.serialize({"flattened_tensor": flat, "metadata": meta})
    req = sglang_code.validate("/update_weights_from_tensor", sglang.update_weights_from_tensor_body([payload]))
    # SGLang's SafeUnpickler (not deserialize_own_rank: its torch patch is process-wide, for engine processes)
    got = sglang_code.common().MultiprocessingSerializer.deserialize(req.serialized_named_tensors[0])
    assert torch.equal(got["flattened_tensor"], flat)
    assert [m.name for m in got["metadata"]] == [m.name for m in meta]


def test_cpu_tensor_payload_cannot_cross_into_another_container(tmp_path: Path) -> None:
    """Why the agent never sends CPU tensors to an engine: SGLang's own deserializer, in another mount and
    PID namespace with its own /dev/shm, cannot rebuild them; the adapter refuses that path up front."""
    flat, meta = sglang.flatten(_weights(2))
    blob = tmp_path / "payload.b64"
    blob.write_text(sglang.serialize({"flattened_tensor": flat, "metadata": meta}))
    code = ("import sys; from weightsync.e2e.engines import sglang_code as s; "
            f"s.deserialize_own_rank([open({str(blob)!r}).read()], 0)")
    r = subprocess.run(_in_own_namespaces([sys.executable, "-c", repr(code)]), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0, "a CPU tensor was rebuilt in another container's namespaces"
    with pytest.raises(EngineError, match="CUDA IPC"):
        sglang.SGLangAdapter("http://127.0.0.1:1", path="tensor", devices=["cpu"])


def test_unsupported_release_is_refused_with_the_versions_that_work() -> None:
    assert sglang.check_version("0.5.23") == "0.5.23"
    with pytest.raises(EngineUnsupported, match=r"SGLang 0\.5\.5 is not supported.*0\.5\.23"):
        sglang.check_version("0.5.5")


# ---------------- the adapter against SGLang's own session rules and receive code ----------------


def test_versions_load_bit_exact_through_sglangs_distributed_receive(shared: Seen) -> None:
    eng = shared
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    assert a.check_engine_version() == "0.5.23"
    for v in (1, 2):
        items = _weights(v)
        load_version(a, v, _buckets(items), pause_generation=True)
        got = eng.get("/standin/checksums")
        assert got["version"] == v and got["checksums"] == checksums(items)
        assert a.served_version() == v
    ops = eng.ops()
    assert "refused" not in ops
    # one group for both versions, one session per version, one flush per version, always resumed
    assert ops.count("init_weights_update_group") == 1
    assert ops.count("begin_weight_update") == ops.count("end_weight_update") == 2
    assert ops.count("flush_cache") == 2 and ops.count("update_weights_from_distributed") == 6
    assert ops[-5:] == ["end_weight_update", "update_weight_version", "weights", "flush_cache", "continue_generation"]
    assert eng.get("/standin/state")["paused"] is False


def test_sglang_refuses_loads_outside_a_session_and_a_second_begin(shared: Seen) -> None:
    eng = shared
    _, meta = sglang.flatten(_weights(0))
    r = requests.post(f"{eng.url}/update_weights_from_distributed",
                      json=sglang.update_weights_from_distributed_body(meta), timeout=10)
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    assert requests.post(f"{eng.url}/begin_weight_update", json={}, timeout=10).status_code == 200
    r = requests.post(f"{eng.url}/begin_weight_update", json={}, timeout=10)
    assert r.status_code == 400 and "already open" in r.json()["message"]


def test_an_agent_restarting_into_an_open_session_closes_it_first(shared: Seen) -> None:
    eng = shared
    assert requests.post(f"{eng.url}/begin_weight_update", json={}, timeout=10).status_code == 200  # a dead agent
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    items = _weights(3)
    load_version(a, 3, _buckets(items), pause_generation=True)
    assert eng.get("/standin/checksums")["checksums"] == checksums(items)
    assert eng.get("/standin/state")["session_open"] is False


def test_a_load_failing_at_bucket_k_closes_the_session_and_resumes(standin: Any) -> None:
    eng = standin("--fail-load", "2:2")
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    with pytest.raises(EngineError, match="partially updated"):
        load_version(a, 2, _buckets(_weights(2)), pause_generation=True)
    st = eng.get("/standin/state")
    assert st["session_open"] is False and st["paused"] is False and st["weight_version"] == "partial-2"
    assert a.needs_restore and a.served_version() is None
    ops = eng.ops()
    k = len(ops) - 1 - ops[::-1].index("update_weights_from_distributed")
    assert ops[k + 1 : k + 3] == ["end_weight_update", "update_weight_version"] and ops[-1] == "continue_generation"
    assert ops.count("update_weights_from_distributed") == 5  # bucket 2 was not retried, bucket 3 never sent
    # the last good version loads again: served, bit-exact, flagged clean
    items = _weights(1)
    load_version(a, 1, _buckets(items), pause_generation=True)
    assert eng.get("/standin/checksums")["checksums"] == checksums(items) and not a.needs_restore
    assert a.served_version() == 1


def test_the_rendezvous_store_listens_only_on_the_engine_host() -> None:
    """SGLang's rendezvous has no credentials: the agent's store listens on the engine URL's host only
    (127.0.0.1 in a real pod), never on every interface."""
    a = sglang.SGLangAdapter("http://127.0.0.1:1")
    assert a.group_host == "127.0.0.1"
    g = sglang._SenderGroup(a.group_host, 2, "weightsync-test", 5.0)
    try:
        assert g._sock.getsockname()[0] == "127.0.0.1" and g.port > 0
    finally:
        g.close()


def test_draft_tensors_reach_only_the_draft_model_through_sglangs_selectors(standin: Any) -> None:
    """A server with a draft model of its own (EAGLE3-style; the stand-in runs SGLang's own manager with a
    draft runner): `draft.` tensors load into the draft model only (selector "draft", prefix removed) and the
    target's into the target only (selector "target": a draft loader takes any name it also has, here every
    one, with another shape), bit for bit, in one session per version."""
    eng = standin("--draft-hidden", "32")
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    assert a.draft_model()
    for v in (1, 2):
        items = _weights(v)
        torch.manual_seed(100 + v)
        draft = [(f"draft.{n}", t) for n, t in sorted(DemoModel(32).state_dict().items())]
        buckets = _buckets(items)
        buckets[0] = [draft[0], *buckets[0]]
        buckets[-1] = [*buckets[-1], *draft[1:]]
        load_version(a, v, buckets, pause_generation=True)
        got = eng.get("/standin/checksums")
        assert got["version"] == v and got["checksums"] == checksums(items + draft)
    ops = eng.ops()
    assert "refused" not in ops and ops.count("begin_weight_update") == ops.count("end_weight_update") == 2


def test_draft_tensors_without_a_draft_model_are_refused_before_they_are_dropped(shared: Seen) -> None:
    """SGLang answers success for selector "draft" on a server without a draft runner (nothing loads): the
    adapter refuses instead, naming the tensor and what to do, and the engine is resumed and left whole."""
    eng = shared
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    assert not a.draft_model()
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    with pytest.raises(EngineError, match=r"draft tensors \(draft\.mtp\.w, \.\.\.\) but the server runs no separate"):
        load_version(a, 2, [[("draft.mtp.w", torch.ones(3))]], pause_generation=True)
    assert eng.get("/standin/checksums")["version"] == 1 and a.served_version() == 1
    assert eng.get("/standin/state")["paused"] is False and not eng.get("/standin/state")["session_open"]


def test_update_bodies_with_selectors_validate_with_sglangs_request_types() -> None:
    _flat, meta = sglang.flatten([("w", torch.ones(2))])
    for selector in ("target", "draft", "all"):
        body = sglang.update_weights_from_distributed_body(meta, selector=selector)
        assert sglang_code.validate("/update_weights_from_distributed", body).selector == selector
        body = sglang.update_weights_from_tensor_body(["AA=="], selector=selector)
        assert sglang_code.validate("/update_weights_from_tensor", body).selector == selector
    with pytest.raises(Exception, match="selector"):
        sglang_code.validate("/update_weights_from_distributed",
                             sglang.update_weights_from_distributed_body(meta, selector="drafts"))  # type: ignore[arg-type]
