"""``openai:MODEL --base-url URL``: any OpenAI-compatible chat server (vLLM, SGLang,
llama.cpp, Ollama), over the standard library's HTTP client.

* The image goes as a base64 PNG ``image_url`` part (a Level 4 video as one part per
  frame, in order, before the text: the prompt says what they are); the API key is read from the
  environment variable ``--api-key-env`` (default ``OPENAI_API_KEY``; none is sent when
  it is unset) and is never written anywhere.
* Greedy decoding (temperature 0). ``--guided guided_choice`` adds vLLM's
  ``guided_choice`` parameter, ``--guided structured_outputs`` vLLM's newer
  ``structured_outputs: {"choice": [...]}``, listing the option letters; the reply is
  still parsed strictly. A server that refuses the parameter stops the run with its error.
* Bounded everywhere: ``--concurrency`` requests in flight, ``--timeout`` seconds each,
  ``--retries`` more attempts on timeouts, connection errors, 408, 429 and 5xx answers,
  malformed JSON and empty replies (``content`` null or blank, no refusal: never stored as an
  answer); any other 4xx stops the batch at once (no request of it is sent after, nor retried).
  A request that still fails stops the run (the answers so far are cached: a rerun resumes).
* Back-off follows the server: a ``Retry-After`` header (seconds or an HTTP date) sets the
  wait before the next attempt, else it doubles from 1 s; each wait is capped at
  ``min(MAX_BACKOFF_S, --timeout)`` and stretched by up to 25 % jitter (so concurrent
  requests do not return together), and the waits of one question count against
  ``--timeout``: once they would exceed it, the question stops with the server's last answer.
* A reply in the ``refusal`` field (no ``content``) is kept as a refusal: its text is
  stored, and it counts as unparseable with reason ``refusal``.
* The run folder is ``openai-<model>-<sha8 of the server URL>``: one model name on two
  servers makes two runs.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spar_bench.errors import ConfigError, SparError

from .base import Backend, BackendOptions, PartialAnswers, Reply, Request, png_base64

GUIDED = ("none", "guided_choice", "structured_outputs")
MAX_BACKOFF_S = 30.0


class ServerError(SparError):
    """The server failed a request after every retry, or refused it."""


class Refused(ServerError):
    """The server refused a request (HTTP 4xx other than 408 and 429): the batch stops at once."""


class _Retry(Exception):
    """A failure worth another attempt (timeout, 5xx, 408, 429, malformed JSON, an empty reply);
    ``after``: the seconds the server asked to wait (``Retry-After``), when it did."""

    def __init__(self, message: str, after: float | None = None):
        super().__init__(message)
        self.after = after


class _NotSent(Exception):
    """A request not sent: an earlier one of its batch was refused."""


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP date; None
    when absent or unreadable, 0 for a date in the past."""
    if not value or not value.strip():
        return None
    v = value.strip()
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _sleep(seconds: float) -> None:  # one place to wait (tests record the waits instead)
    time.sleep(seconds)


class OpenAIBackend(Backend):
    def __init__(self, model: str, options: BackendOptions):
        if not model:
            raise ConfigError("model openai:MODEL needs the served model's name, e.g. openai:Qwen2-VL-7B")
        if not options.base_url or not options.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"model openai:{model}: pass --base-url http://HOST:PORT/v1")
        if options.guided not in GUIDED:
            raise ConfigError(f"--guided {options.guided}: expected one of {', '.join(GUIDED)}")
        self.model = model
        self.url = options.base_url.rstrip("/") + "/chat/completions"
        self.key = os.environ.get(options.api_key_env) or None
        self.timeout, self.retries, self.backoff = options.timeout, options.retries, options.backoff
        self.concurrency = options.concurrency
        self.guided = options.guided
        self.mode = "generate"
        base = options.base_url.rstrip("/")
        # the server names the folder too: one model name on two servers makes two runs
        self.name = ("openai-" + model.replace("/", "-").replace(":", "-") + "-"
                     + hashlib.sha256(base.encode("utf-8")).hexdigest()[:8])
        self.identity = {"kind": "openai", "base_url": base, "model": model, "revision": options.revision}
        self.jitter = random.Random()
        self.decoding = {"mode": "generate", "temperature": 0, "max_tokens": options.max_new_tokens,
                         "guided": self.guided}
        self.batch_size = max(options.batch_size, options.concurrency)

    def body(self, r: Request) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": r.text}]
        shown = list(r.frames) if r.frames is not None else [r.image] if r.image is not None else []
        content[:0] = [{"type": "image_url", "image_url": {"url": png_base64(im)}} for im in shown]
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": content}],
                                "temperature": 0, "max_tokens": self.decoding["max_tokens"]}
        if self.guided == "guided_choice":
            body["guided_choice"] = list(r.letters)
        elif self.guided == "structured_outputs":
            body["structured_outputs"] = {"choice": list(r.letters)}
        return body

    def _post(self, data: bytes) -> Reply:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip().replace("\n", " ")
            if e.code in (408, 429) or e.code >= 500:
                after = retry_after(e.headers.get("Retry-After") if e.headers else None)
                raise _Retry(f"HTTP {e.code}: {detail}", after) from None
            raise Refused(f"{self.url}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        try:
            message = json.loads(raw)["choices"][0]["message"]
            content, refusal = message.get("content"), message.get("refusal")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _Retry(f"malformed reply: {raw[:120]!r}") from None
        if isinstance(content, str) and content.strip():
            return Reply(text=content)
        if isinstance(refusal, str) and refusal.strip():
            return Reply(text=refusal, meta={"refusal": True})
        raise _Retry(f"empty reply (content {content!r})")

    def wait_before(self, attempt: int, after: float | None) -> float:
        """Seconds before attempt ``attempt`` (1 = the first retry): the server's ``after``,
        else the doubling back-off; capped, plus up to 25 % jitter."""
        base = after if after is not None else self.backoff * 2 ** (attempt - 1)
        return min(base, MAX_BACKOFF_S, self.timeout) * (1.0 + 0.25 * self.jitter.random())

    def ask_one(self, r: Request, stop: threading.Event | None = None) -> Reply:
        """One request, at most ``retries + 1`` attempts; the waits between them count
        against ``--timeout``. A refusal (:class:`Refused`) sets ``stop``; once it is set, no
        attempt is made (:class:`_NotSent`)."""
        data = json.dumps(self.body(r)).encode("utf-8")
        waited, last = 0.0, _Retry("")
        for attempt in range(self.retries + 1):
            if stop is not None and stop.is_set():
                raise _NotSent(r.key)
            if attempt:
                wait = self.wait_before(attempt, last.after)
                if waited + wait > self.timeout:
                    why = "Retry-After" if last.after is not None else "back-off"
                    raise ServerError(
                        f"{self.url}: question {r.key}: waiting {wait:.1f} s more ({why}) after {waited:.1f} s "
                        f"would pass --timeout {self.timeout:g} (last: {last}); answers so far are cached, "
                        "rerun later to resume")
                _sleep(wait)
                waited += wait
            try:
                reply = self._post(data)
            except _Retry as e:
                last = e
                continue
            except Refused:
                if stop is not None:
                    stop.set()
                raise
            return Reply(text=reply.text, meta={**reply.meta, "attempts": attempt + 1})
        raise ServerError(
            f"{self.url}: question {r.key} failed {self.retries + 1} times (last: {last}); "
            "answers so far are cached, rerun to resume"
        )

    def answer(self, requests: list[Request]) -> list[Reply]:
        """Replies in request order; when some fail for good, :class:`PartialAnswers`
        carries the others (the runner caches them, then stops with the first error)."""
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = [pool.submit(self.ask_one, r, stop) for r in requests]
        replies: list[Reply | None] = []
        errors, unsent = [], 0
        for f in futures:
            try:
                replies.append(f.result())
            except ServerError as e:
                replies.append(None)
                errors.append(str(e))
            except _NotSent:
                replies.append(None)
                unsent += 1
        if errors:
            tail = f", {unsent} not sent" if unsent else ""
            raise PartialAnswers(f"{errors[0]} ({len(errors)} of {len(requests)} failed{tail})", replies)
        return replies  # type: ignore[return-value]


def load_openai(rest: str, options: BackendOptions) -> OpenAIBackend:
    return OpenAIBackend(rest, options)
