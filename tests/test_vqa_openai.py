"""The ``openai:`` backend against a stub OpenAI-compatible server on 127.0.0.1.

The server is started and stopped by the tests (a daemon thread; it also shuts itself
down after 120 s), answers from a scripted plan (text, 5xx, malformed JSON, a slow reply,
4xx) and records every request body and header it receives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spar_bench.probes.vqa.base import BackendOptions, PartialAnswers, Request, to_pil
from spar_bench.probes.vqa.openai import OpenAIBackend

from helpers import running_stub


@pytest.fixture()
def stub():
    with running_stub() as srv:
        yield srv


def _backend(srv, **over) -> OpenAIBackend:
    kw = dict(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", timeout=0.5, retries=2,
              backoff=0.01, concurrency=1, max_new_tokens=8)
    kw.update(over)
    return OpenAIBackend("tiny-vlm", BackendOptions(**kw))


def _req(i: int = 0, image: bool = True) -> Request:
    img = to_pil(np.full((224, 224), 100, np.uint8), 224) if image else None
    return Request(f"k{i}", "Is it? Options:\nA. no\nB. yes", ("A", "B"), ("no", "yes"), img)


def test_request_shape_image_key_and_guided_choice(stub, monkeypatch):
    monkeypatch.setenv("STUB_KEY", "sekrit")
    be = _backend(stub, api_key_env="STUB_KEY", guided="guided_choice")
    (rep,) = be.answer([_req()])
    assert rep.text == "The correct answer is (B)."
    seen = stub.seen[0]
    assert seen["path"] == "/v1/chat/completions" and seen["auth"] == "Bearer sekrit"
    body = seen["body"]
    assert body["model"] == "tiny-vlm" and body["temperature"] == 0 and body["max_tokens"] == 8
    assert body["guided_choice"] == ["A", "B"]
    parts = body["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert "sekrit" not in json.dumps(be.identity) + json.dumps(be.decoding)
    be2 = _backend(stub, guided="structured_outputs", api_key_env="UNSET_KEY_VAR")
    be2.answer([_req(1, image=False)])
    blind = stub.seen[1]
    assert blind["auth"] is None and blind["body"]["structured_outputs"] == {"choice": ["A", "B"]}
    assert [p["type"] for p in blind["body"]["messages"][0]["content"]] == ["text"]


@pytest.mark.parametrize("failure", ["status:503", "status:429", "malformed", "sleep:1.5"])
def test_transient_failures_are_retried(stub, failure):
    stub.plan = [failure]
    (rep,) = _backend(stub).answer([_req()])
    assert rep.meta["attempts"] == 2 and len(stub.seen) == 2


def test_retries_are_bounded_and_answers_that_came_are_kept(stub):
    stub.default = "status:500"
    with pytest.raises(PartialAnswers, match="failed 3 times"):
        _backend(stub).answer([_req()])
    assert len(stub.seen) == 3  # 1 + 2 retries, never more
    stub.seen.clear()
    stub.plan, stub.default = ["text:A", "status:400", "text:B"], "text:C"
    with pytest.raises(PartialAnswers, match="1 of 3 failed") as e:
        _backend(stub).answer([_req(i, image=False) for i in range(3)])
    assert [r.text if r else None for r in e.value.replies] == ["A", None, "B"]


def test_client_errors_stop_at_once(stub):
    stub.default = "status:400"
    with pytest.raises(PartialAnswers, match="HTTP 400"):
        _backend(stub, guided="guided_choice").answer([_req()])
    assert len(stub.seen) == 1


def test_concurrency_keeps_order(stub):
    stub.default = "text:A"
    be = _backend(stub, concurrency=4)
    reps = be.answer([_req(i, image=False) for i in range(12)])
    assert len(reps) == 12 and len(stub.seen) == 12 and all(r.text == "A" for r in reps)


def test_bad_options_are_one_line_errors():
    from spar_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="--base-url"):
        OpenAIBackend("m", BackendOptions())
    with pytest.raises(ConfigError, match="served model"):
        OpenAIBackend("", BackendOptions(base_url="http://127.0.0.1:1/v1"))
