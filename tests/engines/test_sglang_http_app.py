"""The SGLang adapter against SGLang 0.5.23's own HTTP app (the `engines` tier; issue 30's SGLang part).

The stand-in (e2e/engines/sglang_standin.py) serves `sglang.srt.entrypoints.http_server.app` itself, under
the engine venv's python: request parsing, validation, status codes and /server_info are SGLang's. Each test
here is a way the adapter could disagree with that release:

* a weight-update route declares its body `Annotated[...ReqInput, Body()]`: a POST without a JSON body is
  refused 400 "Field required" (the list of such routes is read from SGLang's app, not typed here);
* /server_info reports the resolved speculative algorithm (NEXTN becomes EAGLE) and the server's TP, DP and
  PP sizes;
* on the tensor path a loader error kills SGLang's scheduler and server (no restore is possible);
* /flush_cache is refused while requests run, and takes a `timeout` to wait for them;
* the supported releases are a range (0.5.23 and its post releases), not one string.

A stand-in takes ~20 s to start (SGLang's imports), so the tests that neither need other flags nor break the
server share one with the default flags (`shared`): each sees only its own events, and starts on a server that
is not paused, has no session open and runs no request, as a fresh one. A test with other flags, or one whose
server fails a load or dies, starts its own (`standin`).
"""

# ruff: noqa: F811
from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.multiprocessing as tmp
from recording_server import RecordingServer

# the shared stand-in's fixtures are test_sglang_released's (each module gets its own stand-in); pytest passes them
# to the tests by name, which ruff reads as redefinitions
from test_sglang_released import Seen, Standin, _buckets, _weights, default_standin, shared  # noqa: F401

from weightsync.agent.demo.model import DemoModel
from weightsync.agent.engines import sglang
from weightsync.agent.engines.base import EngineError, EngineUnsupported, load_version
from weightsync.agent.engines.http import HttpClient
from weightsync.agent.layout.shards import checksums
from weightsync.e2e.engine_venv import engine_python
from weightsync.e2e.engines import sglang_standin

pytestmark = [pytest.mark.engines, pytest.mark.engine_servers]  # SGLang's own HTTP app answers


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Any]:
    made: list[Standin] = []

    def make(*args: str, port: int | None = None) -> Standin:
        s = Standin(tmp_path, *args, port=port)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def body_routes() -> dict[str, list[str]]:
    """SGLang's own answer: the routes of its app whose JSON body is required (read in the engine venv)."""
    code = ("import json, warnings; warnings.simplefilter('ignore'); "
            "from weightsync.e2e.engines.sglang_standin import body_required_routes as f; "
            "print('ROUTES=' + json.dumps(f()))")
    r = subprocess.run([str(engine_python()), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("ROUTES="))
    return dict(json.loads(line.removeprefix("ROUTES=")))


# ---------------- JSON bodies ----------------


def test_sglangs_app_requires_a_body_on_every_weight_update_route(body_routes: dict[str, list[str]]) -> None:
    """The table is SGLang's (FastAPI's own route dependants); the issue's routes are all in it, and the routes
    whose body is optional or absent are not (a broken read would list nothing, or everything)."""
    for route in ("/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
                  "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
                  "/update_weight_version", "/pause_generation", "/continue_generation",
                  "/release_memory_occupation", "/resume_memory_occupation", "/load_lora_adapter_from_tensors",
                  "/unload_lora_adapter"):
        assert "POST" in body_routes.get(route, []), (route, sorted(body_routes))
    for route in ("/flush_cache", "/weights_checker", "/start_profile", "/health", "/server_info"):
        assert route not in body_routes, route


def _every_adapter_call(server: RecordingServer) -> None:
    """Drive every SGLang route the adapter calls over HTTP outside a rendezvous: a full load, a failed one
    (abort), an agent restarting into an open session (end, then begin again), the group's destruction,
    memory release / resume, checks. (The group's own routes, /init_weights_update_group and
    /update_weights_from_distributed, run against SGLang's app itself in test_sglang_released.py, whose
    validation refuses a missing body.)"""
    client = HttpClient(server.url, "SGLang", timeout=10, retries=0)
    a = sglang.SGLangAdapter(server.url, path="tensor", client=client)
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    server.replies["/update_weights_from_tensor"] = [(400, {"success": False, "message": "partially updated"})]
    with pytest.raises(EngineError):
        load_version(a, 2, _buckets(_weights(2)), pause_generation=True)
    server.replies.pop("/update_weights_from_tensor")
    server.replies["/begin_weight_update"] = [(400, {"success": False, "message": "session already open"}),
                                             (200, {"success": True, "message": "ok"})]
    a.begin_update(3)
    a.abort(3, "test")
    a.release_memory(["kv_cache"])
    a.resume_memory(None)
    a.check_weights()
    a._group = sglang._SenderGroup("127.0.0.1", 2, "g", 1.0)
    a._drop_group()  # POST /destroy_weights_update_group


def test_the_adapter_sends_a_json_body_to_every_route_sglang_requires_it_on(
        body_routes: dict[str, list[str]]) -> None:
    server = RecordingServer()
    try:
        _every_adapter_call(server)
    finally:
        server.close()
    needing = [c for c in server.calls if c.method in body_routes.get(c.path, [])]
    missing = [c.path for c in needing if not isinstance(c.body, dict)]
    assert not missing, f"POSTed without a JSON body, which SGLang refuses with 400: {missing}"
    seen = {c.path for c in needing}
    assert {"/begin_weight_update", "/end_weight_update", "/update_weight_version", "/pause_generation",
            "/continue_generation", "/update_weights_from_tensor", "/destroy_weights_update_group",
            "/release_memory_occupation", "/resume_memory_occupation"} <= seen, seen
    assert server.paths().count("/end_weight_update") >= 3  # commit, abort, the restart recovery
    flush = [c for c in server.calls if c.path == "/flush_cache"]
    assert flush and all(c.query.get("timeout") == [str(sglang.FLUSH_TIMEOUT)] for c in flush), flush


def test_a_body_less_post_is_refused_by_sglangs_app_and_the_adapters_calls_pass(
        shared: Seen, body_routes: dict[str, list[str]]) -> None:
    eng = shared
    for route in ("/end_weight_update", "/begin_weight_update", "/pause_generation", "/continue_generation",
                  "/update_weight_version"):
        assert "POST" in body_routes[route]
        r = requests.post(f"{eng.url}{route}", timeout=10)  # no body at all: what the adapter used to send
        assert r.status_code == 400, (route, r.status_code, r.text)
        assert "Field required" in r.json()["message"] and "'body'" in r.json()["message"], r.text
    assert requests.post(f"{eng.url}/end_weight_update", json={}, timeout=10).status_code == 400  # no session:
    # SGLang's own session rule answered, after its validation accepted `{}`
    assert eng.ops().count("refused") == 5 and eng.ops()[-1] == "end_weight_update"
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    assert a.check_engine_version() == "0.5.23"
    items = _weights(4)
    load_version(a, 4, _buckets(items), pause_generation=True)
    assert eng.get("/standin/checksums")["checksums"] == checksums(items) and a.served_version() == 4
    ops = eng.ops()[6:]
    assert "refused" not in ops and ops[-5:] == ["end_weight_update", "update_weight_version", "weights",
                                                "flush_cache", "continue_generation"], ops
    assert all(e["status"] == 200 for e in eng.events()[6:] if e["op"] != "weights")


# ---------------- /server_info: speculative decoding ----------------


@pytest.mark.parametrize("info, separate", [
    ({"speculative_algorithm": None}, False),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": None, "model_path": "/m"}, False),  # MTP
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/m", "model_path": "/m"}, False),  # MTP
    ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": None, "model_path": "/m"}, False),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d", "model_path": "/m"}, True),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d", "model_path": "/m"}, True),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d", "model_path": "/m"}, True),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": None, "model_path": "/m"}, False),
])
def test_mtp_is_told_from_a_separate_draft_by_the_draft_path(info: dict[str, Any], separate: bool) -> None:
    assert sglang.separate_draft(info) is separate


def test_an_mtp_server_reported_as_eagle_gets_its_mtp_layers_through_selector_all(standin: Any) -> None:
    """SGLang resolves `--speculative-algorithm NEXTN` to EAGLE before /server_info reports it (its own
    ServerArgs resolution runs in the stand-in). Taken for a separate draft, the target's tensors would go with
    selector "target" and the MTP layers would never reach the draft runner."""
    eng = standin("--speculative-algorithm", "NEXTN")
    info = requests.get(f"{eng.url}/server_info", timeout=10).json()
    assert info["speculative_algorithm"] == "EAGLE" and info["speculative_draft_model_path"] in (None, info["model_path"])
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    assert not a.draft_model()
    for v in (1, 2):
        items = _weights(v)
        torch.manual_seed(200 + v)
        mtp = [(f"{sglang_standin.MTP_PREFIX}{n}", t) for n, t in sorted(DemoModel(64).state_dict().items())]
        load_version(a, v, _buckets(items + mtp), pause_generation=True)
        got = eng.get("/standin/checksums")
        assert got["version"] == v and got["checksums"] == checksums(items + mtp)  # the MTP layers landed
    assert "refused" not in eng.ops()


# ---------------- /server_info: parallelism ----------------


@pytest.mark.parametrize("flags, job_tp, words", [
    (("--tp-size", "2"), 1, ["tp_size=2", "parallelism.tensor is 1"]),
    ((), 2, ["tp_size=1", "parallelism.tensor is 2"]),
    (("--dp-size", "2"), 1, ["dp_size=2"]),
    (("--pp-size", "2"), 1, ["pp_size=2"]),
])
def test_a_server_whose_parallelism_the_agent_cannot_feed_is_refused_before_any_rendezvous(
        standin: Any, request: pytest.FixtureRequest, flags: tuple[str, ...], job_tp: int, words: list[str]) -> None:
    eng = standin(*flags) if flags else request.getfixturevalue("shared")
    a = sglang.SGLangAdapter(eng.url, tp_size=job_tp, timeout=60)
    with pytest.raises(EngineUnsupported) as ei:
        a.check_engine_version()
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert getattr(ei.value, "reason", None) == "EngineConfigUnsupported"
    t0 = time.monotonic()
    with pytest.raises(EngineUnsupported):  # also when the agent never asked: begin refuses before the group
        load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    assert time.monotonic() - t0 < 10, "waited in a rendezvous that cannot complete"
    ops = eng.ops()
    assert "init_weights_update_group" not in ops and "begin_weight_update" not in ops, ops
    assert ops[-1] == "continue_generation" and not eng.get("/standin/state")["paused"]


# ---------------- the tensor path: a loader error kills the engine ----------------


@pytest.fixture
def file_system_sharing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors cross to another process of the same /dev/shm by file name (the CUDA IPC stand-in here)."""
    import test_sglang_released as t

    monkeypatch.setattr(t, "PRIVATE_DEV_SHM", False)
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


def test_a_tensor_path_load_error_kills_sglang_and_is_reported_unreachable_never_restored(
        standin: Any, file_system_sharing: None) -> None:
    eng = standin("--fail-load", "2:1")
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    a.path = "tensor"  # CPU tensors by name: the same receive code SGLang runs for CUDA IPC handles
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    assert eng.get("/standin/checksums")["checksums"] == checksums(_weights(1))
    with pytest.raises(sglang.EngineUnreachable, match="died during /update_weights_from_tensor of version 2") as ei:
        load_version(a, 2, _buckets(_weights(2)), pause_generation=True)
    assert "Nothing was restored" in str(ei.value) and ei.value.reason == "EngineUnreachable"
    # SGLang's own code let the loader's error out of the scheduler: the server is gone, not answering 400
    assert eng.proc.wait(30) == sglang_standin.SCHEDULER_DIED
    assert "scheduler died in update_weights_from_tensor" in eng.log.read_text()
    assert a.engine_lost and a.needs_restore and a.served_version() is None  # no call to a dead engine
    with pytest.raises(sglang.EngineUnreachable, match="nothing was restored"):
        a.pause()  # what the agent's restore would do first: refused at once, not claimed
    # the container restarts (same address): the next version loads into the new process, whole
    back = standin(port=eng.port)
    items = _weights(3)
    load_version(a, 3, _buckets(items), pause_generation=True)
    assert back.get("/standin/checksums")["checksums"] == checksums(items)
    assert not a.engine_lost and not a.needs_restore and a.served_version() == 3


def test_the_distributed_path_answers_partially_updated_and_the_engine_stays(standin: Any) -> None:
    """The same fault on the distributed path: SGLang catches it and answers 400, the engine lives on."""
    eng = standin("--fail-load", "1:2")
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    with pytest.raises(EngineError, match="partially updated") as ei:
        load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    assert not isinstance(ei.value, sglang.EngineUnreachable) and not a.engine_lost and a.needs_restore
    assert eng.proc.poll() is None and eng.get("/standin/state")["weight_version"] == "partial-1"


# ---------------- /flush_cache ----------------


def test_a_refused_flush_is_logged_and_the_version_still_served(shared: Seen, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sglang, "FLUSH_TIMEOUT", 0.5)
    eng = shared
    requests.post(f"{eng.url}/standin/requests", json={"running": 2}, timeout=10)
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    items = _weights(5)
    with caplog.at_level(logging.WARNING, logger="weightsync.agent.engines.sglang"):
        load_version(a, 5, _buckets(items), pause_generation=False)  # requests keep running
    assert a.served_version() == 5 and not a.needs_restore
    assert eng.get("/standin/checksums")["checksums"] == checksums(items)
    flush = [e for e in eng.events() if e["op"] == "flush_cache"]
    assert [e["status"] for e in flush] == [400] and "Timed out waiting for idle" in flush[0]["message"]
    assert "flush_cache_refused version=5-" in caplog.text or "flush_cache_refused version=5" in caplog.text


def test_the_flush_waits_for_running_requests_with_sglangs_timeout(shared: Seen, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `timeout` SGLang refuses at once while requests run; with it, it flushes once they are done."""
    monkeypatch.setattr(sglang, "FLUSH_TIMEOUT", 30.0)
    eng = shared
    assert requests.post(f"{eng.url}/flush_cache", timeout=10).status_code == 200
    requests.post(f"{eng.url}/standin/requests", json={"running": 1}, timeout=10)
    assert requests.post(f"{eng.url}/flush_cache", timeout=10).status_code == 400  # no timeout: refused
    threading.Timer(1.0, lambda: requests.post(f"{eng.url}/standin/requests", json={"running": 0},
                                               timeout=10)).start()
    a = sglang.SGLangAdapter(eng.url, timeout=60)
    t0 = time.monotonic()
    assert a.flush_cache(7) is True and 0.8 < time.monotonic() - t0 < 20
    assert eng.flushes() == 2


# ---------------- releases ----------------


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23.post12"])
def test_sglang_0_5_23_and_its_post_releases_are_supported(version: str) -> None:
    assert sglang.check_version(version) == version


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.5.2", "0.5.230", "0.5.23rc1", "0.5.23.dev0",
                                     "0.5.23+local", "0.6.0", ""])
def test_other_releases_are_refused_naming_the_supported_range(version: str) -> None:
    with pytest.raises(EngineUnsupported, match=r"speaks the weight-update protocol of SGLang 0\.5\.23 and 0\.5\.23\.postN"):
        sglang.check_version(version)
