"""Order of engine calls over real HTTP: pause before the first load, resume after the last, resume also
when a load fails (the server answers 500), never a commit after a failure; plus the HTTP client's
retry / backoff / error policy."""

from __future__ import annotations

import socket

import pytest
import torch
from recording_server import RecordingServer
from test_vllm_released import FakeIpc

from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.base import EngineError, load_version
from weightsync.agent.engines.http import EngineHTTPError, HttpClient, backoff_delays


def _buckets(n: int) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(f"w{i}", torch.full((4, 4), float(i)))] for i in range(n)]


def _client(url: str, engine: str, sleeps: list[float] | None = None) -> HttpClient:
    return HttpClient(url, engine, timeout=10, retries=2, backoff=0.01,
                      sleep=(sleeps.append if sleeps is not None else lambda s: None))


def _sglang(server: RecordingServer, sleeps: list[float] | None = None) -> sglang.SGLangAdapter:
    # path "tensor" without devices: the payload stays in this process (the recording server never rebuilds it)
    return sglang.SGLangAdapter(server.url, path="tensor", client=_client(server.url, "SGLang", sleeps))


def test_sglang_pause_session_load_commit_resume(server: RecordingServer) -> None:
    a = _sglang(server)
    assert load_version(a, 4, _buckets(3), pause_generation=True) == 3
    # /server_info once, before the first session: does the server run a draft model of its own?
    assert server.paths() == ["/pause_generation", "/server_info", "/begin_weight_update", "/update_weights_from_tensor",
                              "/update_weights_from_tensor", "/update_weights_from_tensor", "/end_weight_update",
                              "/update_weight_version", "/flush_cache", "/continue_generation"]
    assert server.calls[-3].body == {"new_version": "4", "abort_all_requests": False}
    assert all(c.body["flush_cache"] is False for c in server.calls if c.path == "/update_weights_from_tensor")


def test_sglang_failed_load_closes_the_session_is_never_retried_and_resumes(server: RecordingServer) -> None:
    server.replies["/update_weights_from_tensor"] = [(200, {"success": True}), (500, {"message": "CUDA OOM"})]
    sleeps: list[float] = []
    a = _sglang(server, sleeps)
    with pytest.raises(EngineHTTPError) as ei:
        load_version(a, 5, _buckets(3), pause_generation=True)
    err = ei.value
    assert err.status == 500 and err.engine == "SGLang" and "/update_weights_from_tensor" in err.url
    assert "CUDA OOM" in str(err) and err.attempts == 1  # a load is not idempotent: never retried blindly
    paths = server.paths()
    assert paths[:3] == ["/pause_generation", "/server_info", "/begin_weight_update"]
    assert paths[-1] == "/continue_generation", "resume must come last, also after a failed load"
    assert paths.count("/update_weights_from_tensor") == 2 and paths.count("/end_weight_update") == 1
    assert paths.index("/end_weight_update") < paths.index("/update_weight_version")
    # abort marks the version partial; it is never committed as version 5
    versions = [c.body["new_version"] for c in server.calls if c.path == "/update_weight_version"]
    assert versions == ["partial-5"]
    assert a.served_version() is None and a.needs_restore
    assert sleeps == []


def test_sglang_needs_restore_only_once_a_bucket_was_sent(server: RecordingServer) -> None:
    server.replies["/update_weights_from_tensor"] = [(400, {"success": False, "message": "bad"})]
    a = _sglang(server)
    with pytest.raises(EngineHTTPError):
        load_version(a, 2, _buckets(1), pause_generation=True)
    # the bucket was sent: the engine may hold part of it
    assert a.needs_restore
    b = _sglang(server)
    server.replies["/begin_weight_update"] = [(400, {"success": False, "message": "refused"})]
    with pytest.raises(EngineHTTPError):
        load_version(b, 3, _buckets(1), pause_generation=True)
    assert not b.needs_restore and server.paths()[-1] == "/continue_generation"


def test_sglang_no_pause_when_not_asked(server: RecordingServer) -> None:
    a = _sglang(server)
    load_version(a, 1, _buckets(1), pause_generation=False)
    assert "/pause_generation" not in server.paths() and "/continue_generation" not in server.paths()


def _vllm(server: RecordingServer) -> vllm.VLLMAdapter:
    # the ipc backend with CPU stand-ins for its CUDA calls (test_vllm_released.FakeIpc); the HTTP is real
    return vllm.VLLMAdapter(server.url, backend="ipc", devices=["cuda:0"], client=_client(server.url, "vLLM"),
                            ipc=FakeIpc())


def test_vllm_order_and_failed_load(server: RecordingServer) -> None:
    a = _vllm(server)
    load_version(a, 1, _buckets(2), pause_generation=True)
    assert server.paths() == ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                              "/update_weights", "/finish_weight_update", "/reset_prefix_cache", "/resume"]
    assert server.calls[-3].body == {"weight_version": "1"}
    assert server.calls[-2].query == {"reset_running_requests": ["true"]}  # frozen requests recompute
    server.calls.clear()
    server.replies["/update_weights"] = [(500, {"error": "worker died"})]
    with pytest.raises(EngineHTTPError, match="worker died") as ei:
        load_version(a, 2, _buckets(2), pause_generation=True)
    assert ei.value.attempts == 1, "a failed /update_weights is never retried blindly"
    # the update is closed (vLLM is never left inside one) without publishing 2; the version is marked partial
    assert server.paths() == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                              "/update_weight_version", "/resume"]
    assert server.calls[3].body is None and server.calls[4].body == {"new_version": "partial-2"}
    assert a.served_version() is None and a.needs_restore


def test_resume_even_when_begin_fails(server: RecordingServer) -> None:
    server.replies["/start_weight_update"] = [(400, {"error": "no weight transfer engine"})]
    a = _vllm(server)
    with pytest.raises(EngineError):
        load_version(a, 1, _buckets(1), pause_generation=True)
    assert server.paths() == ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/resume"]


def test_client_retries_5xx_then_succeeds(server: RecordingServer) -> None:
    server.replies["/x"] = [(503, {"message": "warming up"}), (502, None), (200, {"ok": 1})]
    sleeps: list[float] = []
    assert _client(server.url, "SGLang", sleeps).post("/x", {"a": 1}) == {"ok": 1}
    assert len(server.calls) == 3 and sleeps == [0.01, 0.02]


def test_client_does_not_retry_4xx(server: RecordingServer) -> None:
    server.replies["/x"] = [(422, {"detail": "field required: new_version"})]
    with pytest.raises(EngineHTTPError, match=r"HTTP 422.*field required") as ei:
        _client(server.url, "SGLang").post("/x", {})
    assert ei.value.attempts == 1 and len(server.calls) == 1


def test_client_success_false_is_an_error(server: RecordingServer) -> None:
    server.replies["/x"] = [(200, {"success": False, "message": "weights partially updated"})]
    with pytest.raises(EngineHTTPError, match="partially updated"):
        _client(server.url, "SGLang").post("/x", {})


def test_client_unreachable_engine_is_named() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}"
    sleeps: list[float] = []
    with pytest.raises(EngineHTTPError, match=rf"vLLM engine: POST {url}/pause failed \(no response\).*Connect") as ei:
        _client(url, "vLLM", sleeps).post("/pause")
    assert ei.value.status is None and ei.value.attempts == 3 and len(sleeps) == 2


def test_client_timeout(server: RecordingServer) -> None:
    import time

    def slow(call: object) -> tuple[int, object]:
        time.sleep(1.0)
        return 200, {}

    server.replies["/slow"] = slow
    c = HttpClient(server.url, "SGLang", timeout=0.2, retries=0)
    with pytest.raises(EngineHTTPError, match=r"no response.*Timeout"):
        c.post("/slow")


def test_backoff_delays_are_capped() -> None:
    assert backoff_delays(5, 1.0, 4.0) == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_delays(0, 1.0, 4.0) == []
    with pytest.raises(ValueError, match="http"):
        HttpClient("localhost:1", "SGLang")
