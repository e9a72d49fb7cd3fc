"""What every MLLM backend takes and gives back.

A backend answers :class:`Request` batches with :class:`Reply` objects:

* ``constrained`` backends return the chosen displayed position (and the score of every
  option); nothing is parsed;
* ``generate`` backends return raw text, which :func:`spar_bench.probes.vqa.parse.parse_answer`
  reads strictly.

``identity`` names the model for the response cache (never a path alone: a folder's files
are hashed), ``decoding`` the parameters that change an answer.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spar_bench.errors import SparError

MODES = ("constrained", "generate")


@dataclass(frozen=True)
class Request:
    """One question as shown to the model.

    Attributes:
        key: the question key (``<slice key>/q<j>``).
        text: the user message.
        letters: displayed option letters.
        options: displayed option texts.
        image: an RGB ``PIL.Image`` or None (blind run, or a video).
        frames: a video (Level 4 ``--volume-as video``): RGB ``PIL.Image`` frames in order,
            or None.
    """

    key: str
    text: str
    letters: tuple[str, ...]
    options: tuple[str, ...]
    image: Any = None
    frames: tuple | None = None

    @property
    def blind(self) -> bool:
        """Nothing is shown (neither an image nor a video): the blind control."""
        return self.image is None and self.frames is None


@dataclass(frozen=True)
class Reply:
    """A model's answer: raw ``text`` (generation) or a ``choice`` (constrained)."""

    text: str = ""
    choice: int | None = None
    scores: tuple[float, ...] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "choice": self.choice,
                "scores": list(self.scores) if self.scores is not None else None,
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reply:
        s = d.get("scores")
        return cls(d.get("text", ""), d.get("choice"), tuple(s) if s is not None else None,
                   dict(d.get("meta") or {}))


class PartialAnswers(SparError):
    """Some requests of a batch failed for good; ``replies`` holds the others (None where
    failed), so the runner can cache them before it stops."""

    def __init__(self, message: str, replies: list[Reply | None]):
        super().__init__(message)
        self.replies = replies


class Backend:
    """Base class: subclasses set the attributes and implement :meth:`answer`.

    Attributes:
        name: the model spec as a run-folder slug part (``hf-tiny-1a2b3c4d``, ``openai-qwen``).
        mode: ``"constrained"`` or ``"generate"``.
        identity: JSON-able identity of the model weights (cache key).
        decoding: JSON-able decoding parameters (cache key).
        batch_size: requests per :meth:`answer` call the runner sends.
        random_init: True when answers cannot reflect a trained model (dummy).
        preferred_size: the square image size the model's processor asks for, if known
            (``--image-size auto``).
        takes_video: the model reads a video (``Request.frames``) natively; ``--volume-as
            auto`` then sends Level 4 volumes as videos, else as montages.
    """

    name: str = "backend"
    mode: str = "constrained"
    identity: dict[str, Any] = {}
    decoding: dict[str, Any] = {}
    batch_size: int = 8
    random_init: bool = False
    preferred_size: int | None = None
    takes_video: bool = False

    def answer(self, requests: list[Request]) -> list[Reply]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model (default: nothing)."""


def to_pil(image: np.ndarray, size: int):
    """A stored uint8 slice as an RGB PIL image, resized (bicubic) to ``size`` when it differs."""
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8))  # 2-D uint8: mode L
    if size != img.width or size != img.height:
        img = img.resize((size, size), Image.BICUBIC)
    return img.convert("RGB")


def png_base64(img) -> str:
    """``data:image/png;base64,...`` of a PIL image (deterministic bytes)."""

    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass(frozen=True)
class BackendOptions:
    """Everything a backend factory may read (each reads what applies to it).

    Attributes:
        mode: ``constrained`` (log-likelihood of each option) or ``generate`` (parse text).
        seed: the run's seed (dummy answers).
        revision: hub revision (``hf:ORG/NAME``) or the weights' revision a server says it
            serves (``openai:``; recorded in the identity).
        base_url: OpenAI-compatible server root (``http://127.0.0.1:8000/v1``).
        api_key_env: environment variable holding the API key (never stored).
        device, dtype: where and in which precision ``hf:`` models run.
        batch_size: requests per batch (``hf:``) or per concurrent wave (``openai:``).
        max_new_tokens: generation budget (``generate`` mode).
        guided: ``none``, ``guided_choice`` (vLLM's extra parameter) or
            ``structured_outputs`` (current vLLM: ``{"choice": [...]}``).
        timeout, retries, backoff, concurrency: HTTP bounds (``openai:``).
        data: the build folder the questions come from (``oracle`` reads its masks).
        accept_missing: ``answers:`` reports a variant whose answers are all missing as not
            measured instead of refusing the run.
    """

    mode: str = "constrained"
    seed: int = 0
    revision: str | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 8
    max_new_tokens: int = 64
    guided: str = "none"
    timeout: float = 120.0
    retries: int = 3
    backoff: float = 1.0
    concurrency: int = 4
    data: str | None = None
    accept_missing: bool = False
