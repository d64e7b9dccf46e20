"""updatePolicy.strategy Atomic through the engines' real session protocols (over real HTTP): a prepare
reaches no engine endpoint at all (the engine keeps serving), and the commit replays the held version
through the very session a direct load uses (SGLang: pause, begin_weight_update ... end_weight_update,
resume; vLLM: pause, start_weight_update ... finish_weight_update, resume)."""

from __future__ import annotations

import torch
from recording_server import RecordingServer
from test_engine_http_order import _buckets, _client
from test_vllm_released import FakeIpc

from weightsync.agent import atomic
from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.base import load_version


def _prepare(version: int) -> atomic.Held:
    hold = atomic.HoldingAdapter(epoch=0)
    load_version(hold, version, _buckets(3), pause_generation=False)
    assert hold.complete is not None
    return hold.complete


def test_sglang_prepare_touches_nothing_and_the_commit_is_the_ordinary_session(server: RecordingServer) -> None:
    held = _prepare(4)
    assert server.paths() == []  # the engine is not paused, not even asked
    a = sglang.SGLangAdapter(server.url, path="tensor", client=_client(server.url, "SGLang"))
    atomic.commit_held(held, a, pause_generation=True)
    direct = server.paths()
    assert direct == ["/pause_generation", "/server_info", "/begin_weight_update", "/update_weights_from_tensor",
                      "/update_weights_from_tensor", "/update_weights_from_tensor", "/end_weight_update",
                      "/update_weight_version", "/flush_cache", "/continue_generation"]
    assert server.calls[-3].body == {"new_version": "4", "abort_all_requests": False}


def test_vllm_commit_of_a_held_version_is_the_ordinary_update(server: RecordingServer) -> None:
    held = _prepare(2)
    assert server.paths() == []
    a = vllm.VLLMAdapter(server.url, backend="ipc", devices=["cuda:0"], client=_client(server.url, "vLLM"),
                         ipc=FakeIpc())
    atomic.commit_held(held, a, pause_generation=True)
    assert server.paths() == ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                              "/update_weights", "/update_weights", "/finish_weight_update",
                              "/reset_prefix_cache", "/resume"]
    assert server.calls[-3].body == {"weight_version": "2"}


def test_held_tensors_are_the_prepared_ones() -> None:
    held = _prepare(1)
    got = [t for b in held.replay() for _, t in b]
    assert all(torch.equal(t, torch.full((4, 4), float(i))) for i, t in enumerate(got))
