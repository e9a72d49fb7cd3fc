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
    stub.plan, stub.default = ["text:A", "status:500", "text:B"], "text:C"  # a 4xx would stop the batch
    with pytest.raises(PartialAnswers, match="1 of 3 failed") as e:
        _backend(stub, retries=0).answer([_req(i, image=False) for i in range(3)])
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


def test_retry_after_header_values():
    from email.utils import formatdate

    from spar_bench.probes.vqa.openai import retry_after

    assert retry_after("5") == 5.0 and retry_after(" 0 ") == 0.0 and retry_after("-3") == 0.0
    assert retry_after(None) is None and retry_after("") is None and retry_after("soon") is None
    now = 1_800_000_000.0
    assert retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30.0)
    assert retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0  # a date already past


@pytest.fixture()
def waits(monkeypatch):
    """The back-off waits asked for (recorded, not slept: no test measures the clock)."""
    from spar_bench.probes.vqa import openai

    got: list[float] = []
    monkeypatch.setattr(openai, "_sleep", got.append)
    return got


def test_429_retry_after_is_honoured_with_jitter_up_to_a_cap(stub, waits):
    from email.utils import formatdate

    stub.plan = ["retry:5", "retry:5"]
    (rep,) = _backend(stub, timeout=60, backoff=1.0).answer([_req()])
    assert rep.text == "The correct answer is (B)." and rep.meta["attempts"] == 3
    assert len(waits) == 2 and all(5.0 <= w <= 5.0 * 1.25 for w in waits)  # not the 1 s / 2 s back-off
    waits.clear()
    import time

    stub.plan = [f"retry:{formatdate(time.time() + 20, usegmt=True)}"]  # an HTTP date
    _backend(stub, timeout=60).answer([_req()])
    assert len(waits) == 1 and 17.0 <= waits[0] <= 20.0 * 1.25
    waits.clear()
    stub.plan = ["retry:100000"]  # capped at MAX_BACKOFF_S, never a day
    from spar_bench.probes.vqa.openai import MAX_BACKOFF_S

    _backend(stub, timeout=600).answer([_req()])
    assert len(waits) == 1 and MAX_BACKOFF_S <= waits[0] <= MAX_BACKOFF_S * 1.25
    waits.clear()
    stub.plan = ["status:503", "status:503"]  # no Retry-After: the doubling back-off from --backoff
    _backend(stub, timeout=60, backoff=1.0).answer([_req()])
    assert 1.0 <= waits[0] <= 1.25 and 2.0 <= waits[1] <= 2.5


def test_waits_count_against_the_timeout(stub, waits):
    stub.default = "retry:8"
    with pytest.raises(PartialAnswers, match=r"Retry-After.*--timeout 10") as e:
        _backend(stub, timeout=10, retries=5).answer([_req()])
    assert len(waits) == 1 and len(stub.seen) == 2  # 8 s waited; 8 more would pass 10 s: stop
    assert "\n" not in str(e.value)


def test_a_refusal_is_stored_as_a_refusal(stub):
    from spar_bench.probes.vqa.ask import Item, decide
    from spar_bench.probes.vqa.prompts import render

    stub.plan = ["refusal:I cannot help with medical images."]
    be = _backend(stub)
    (rep,) = be.answer([_req()])
    assert rep.text == "I cannot help with medical images." and rep.meta["refusal"] is True
    from spar_bench.probes.vqa.base import Reply

    again = Reply.from_dict(rep.to_dict())  # as the response cache gives it back
    it = Item(0, "image", 0, render("relative_position", 1, 2, 0, (0, 1)))
    assert decide(be, it, again) == (None, "refusal")
    stub.plan = ["text:B"]
    (ok,) = be.answer([_req()])
    assert "refusal" not in ok.meta and decide(be, it, ok) == (1, None)
