"""Asking: the requests of a probe's questions (every control), their prompts, cache keys and
replies, and the answer records; the run itself is :class:`.predictor.MllmJob` (kind ``mllm``).

Ask a model every Level 3 (Level 4) question of a build, score it like a probe head, write the run.

One run = one (model, probe, answering mode) on the chosen splits. Its folder
``OUT/<model-slug>/<probe>/<head>[,<key>=<value>...]/seed<k>/`` (``head`` = ``vqa-loglik``,
``vqa-generate`` or ``vqa-guided``, plus ``-nohint`` without the convention hint and
``-<N>px`` for an upscaled image; then, as for ``fit`` runs, the options that change the
answers and differ from their defaults: ``splits``, ``guided``, ``max_new_tokens``,
``dtype``) holds ``config.json``, ``answers.jsonl`` (every answer, with its template
version, option order, image digest and raw text) and ``metrics.json`` (written last: a
finished run). A finished run made with anything else that changes its answers (the
model's identity, decoding, template, build, image size, controls) is refused in one
line, never replaced.

Asked per probe:

* every original question with its options in each cyclic order (CircularEval; the
  headline is rotation 0, the class order);
* the same question without the image (blind: no sentence describes an image);
* mirrored counterfactual questions (labels recomputed by the builder) when the build has
  them, with and without the image; on Level 4 also the superior-inferior flipped ones.

A Level 4 volume is sent as ``AskConfig.volume_as`` (:func:`.volume.show`: a video of axial
frames, a montage or three orthogonal views); that choice names the run folder's head
(``vqa-loglik-video``), is in ``config.json`` and every image answer's record, and in its
cache key beside the sha256 of the stored volume.

Every answer goes through the response cache (:mod:`.cache`): reruns resume, rescoring is free.
An image answer's key holds the sha256 of the stored slice, so another build's pixels are
never answered from the cache; a blind answer's key holds no question key (the model sees
the prompt alone), so byte-identical blind prompts are asked once per run and cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from spar_bench import __version__
from spar_bench.builder.schema import ordered_splits
from spar_bench.errors import ConfigError
from spar_bench.procs import check_stop
from spar_bench.provenance import VQA_PACKAGES, package_versions

from ..measured import MISSING
from ..runs.inputs import Splits
from ..runs.store import variant_text
from ..tasks import get_probe
from .base import Backend, BackendOptions, PartialAnswers, Reply, Request, to_pil
from .cache import ResponseCache, key_hash
from .parse import parse_answer
from .prompts import (
    Prompt,
    render,
    render_volume,
    rotations,
)
from .questions import Questions, is_volume_probe
from .volume import Shown, show

DEFAULT_MAX_NEW_TOKENS = BackendOptions().max_new_tokens
ANSWERS_FILE = "answers.jsonl"


@dataclass(frozen=True)
class AskConfig:
    """How questions are asked (all recorded in ``config.json``)."""

    splits: tuple[str, ...] = ("test",)
    hint: bool = True
    circular: bool = True
    blind: bool = True
    image_size: int = 224
    seed: int = 0
    n_boot: int = 1000
    #: how a Level 4 volume is sent (``video``, ``montage``, ``views``; resolved, never ``auto``)
    volume_as: str = "montage"

    def __post_init__(self) -> None:
        """``splits`` in the one split order (train, val, test, then the others sorted), each once:
        ``test,val`` and ``val,test`` ask the same questions, so they name one run."""

        object.__setattr__(self, "splits", tuple(ordered_splits(self.splits)))

    def to_dict(self, volume: bool = False) -> dict[str, Any]:
        """config.json's fields; ``volume_as`` only for a Level 4 probe (``volume``)."""
        return {"splits": list(self.splits), "convention_hint": self.hint,
                "circular": self.circular, "blind": self.blind, "image_size": self.image_size,
                "seed": self.seed, "n_bootstrap": self.n_boot,
                **({"volume_as": self.volume_as} if volume else {})}


@dataclass(frozen=True)
class Item:
    """One request to make: question ``q`` (index), variant, rotation and its prompt."""

    q: int
    variant: str  # "image" | "blind"
    rotation: int
    prompt: Prompt


def head_name(backend: Backend, cfg: AskConfig, volume: bool = False) -> str:
    """``vqa-<answering>[-nohint][-<N>px]``, then ``-<volume_as>`` for a Level 4 probe."""
    kind = {"constrained": "loglik", "generate": "generate"}[backend.mode]
    if backend.decoding.get("guided", "none") != "none":
        kind = "guided"
    return f"vqa-{kind}" + ("" if cfg.hint else "-nohint") + (
        "" if cfg.image_size == 224 else f"-{cfg.image_size}px") + (f"-{cfg.volume_as}" if volume else "")


def probe_is_volume(probe: str) -> bool:
    """``probe`` (a full name) asks about whole volumes (Level 4)."""

    return is_volume_probe(get_probe(probe))


def variant_of(backend: Backend, cfg: AskConfig) -> str:
    """``k=v,...`` of the options that change the answers, differ from their defaults and are
    named neither by the model slug nor by the head: the folder suffix (``splits=val``)."""
    dec, changed = backend.decoding, {}
    if tuple(cfg.splits) != ("test",):
        changed["splits"] = "+".join(cfg.splits)
    if dec.get("guided", "none") != "none":
        changed["guided"] = dec["guided"]
    tokens = dec.get("max_new_tokens", dec.get("max_tokens"))
    if tokens is not None and tokens != DEFAULT_MAX_NEW_TOKENS:
        changed["max_new_tokens"] = tokens
    if dec.get("dtype", "float32") != "float32":
        changed["dtype"] = dec["dtype"]
    return variant_text(changed)


def plan(qs: Questions, cfg: AskConfig) -> list[Item]:
    """Requests per question: every rotation (originals, with CircularEval), rotation 0
    for mirrors, and rotation 0 without the image (blind)."""
    n = qs.spec.n_classes
    orders = rotations(n)
    items = []
    original = qs.original
    for i in range(len(qs)):
        rots = range(n) if cfg.circular and original[i] else range(1)
        for r in rots:
            items.append(Item(i, "image", r, prompt_of(qs, i, orders[r], cfg)))
        if cfg.blind:
            items.append(Item(i, "blind", 0, prompt_of(qs, i, orders[0], cfg, blind=True)))
    return items


def prompt_of(qs: Questions, i: int, order: tuple[int, ...], cfg: AskConfig, blind: bool = False) -> Prompt:
    """Question ``i``'s prompt with its options in ``order``: a slice's (Level 3: scale, band and
    stated thresholds, protocol 1.2) or a volume's (Level 4: how it is shown, its scale)."""
    if qs.volume is not None:
        organs = (int(qs.organ_a[i]), int(qs.organ_b[i]), int(qs.organ_c[i]))
        ctx = qs.volume_context(i, cfg.volume_as, cfg.image_size)
        return render_volume(qs.probe, organs, int(qs.axis[i]), order, cfg.hint, blind=blind, context=ctx)
    args = (qs.probe, int(qs.organ_a[i]), int(qs.organ_b[i]), int(qs.axis[i]))
    return render(*args, order, cfg.hint, blind=blind, context=qs.context(i, cfg.image_size))


def plain_prompt(qs: Questions, i: int) -> Prompt:
    """Question ``i`` as it is asked with its image under the default :class:`AskConfig`: options
    in class order (rotation 0), the convention hint, the 224 image (the ``llm:N+q`` stage's
    prompt: :mod:`spar_bench.probes.question_rows`)."""
    return prompt_of(qs, i, rotations(qs.spec.n_classes)[0], AskConfig())


def image_digest(image: np.ndarray) -> str:
    """sha256 of a stored slice or volume: dtype, shape and bytes."""
    a = np.ascontiguousarray(image)
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode("ascii") + a.tobytes()).hexdigest()


def image_digests(build, qs: Questions, items: list[Item], chunk: int = 256) -> dict[int, str]:
    """:func:`image_digest` of the slice (volume) of every question asked with its image, by
    question index; each distinct slice read and hashed once (``chunk`` at a time)."""
    need = sorted({it.q for it in items if it.variant == "image"})
    by_row: dict[tuple[str, int], str] = {}
    for split in sorted({str(qs.split[i]) for i in need}):
        rows = sorted({int(qs.row[i]) for i in need if str(qs.split[i]) == split})
        for lo in range(0, len(rows), chunk):
            part = np.array(rows[lo:lo + chunk], dtype=np.int64)
            for r, arr in zip(part.tolist(), build.images(qs.spec.level, split, part), strict=True):
                by_row[(split, r)] = image_digest(arr)
    return {i: by_row[(str(qs.split[i]), int(qs.row[i]))] for i in need}


def cache_key(backend: Backend, qs: Questions, it: Item, cfg: AskConfig,
              digest: str | None = None) -> dict[str, Any]:
    """The response cache key of ``it``: an image answer's holds the question key and the
    image's ``digest``; a blind answer's holds neither (it depends on the prompt alone)."""

    blind = it.variant == "blind"
    if not blind and digest is None:
        raise ValueError(f"question {qs.key[it.q]}: an image answer's cache key needs the image digest")
    image = None if blind else {"size": cfg.image_size, "sha256": digest}
    if image is not None and qs.volume is not None:  # a volume: shown as video, montage or views
        image["volume_as"] = cfg.volume_as
    return {
        "model": backend.identity,
        "decoding": backend.decoding,
        "template": it.prompt.version,
        "prompt_sha256": hashlib.sha256(it.prompt.text.encode("utf-8")).hexdigest(),
        "sample": None if blind else str(qs.key[it.q]),
        "order": list(it.prompt.order),
        "image": image,
        "tool": __version__,
    }


#: Shown slices / volumes kept between batches (consecutive batches mostly ask about the same ones).
SHOWN_KEPT = 8


def _requests(build, qs: Questions, items: list[Item], cfg: AskConfig,
              kept: dict[tuple[str, int], Shown] | None = None) -> list[Request]:
    """Requests with their images (a volume: its image or video frames, ``cfg.volume_as``),
    each distinct slice or volume read once; ``kept`` (the last :data:`SHOWN_KEPT` shown,
    oldest first) is reused and updated."""
    shown: dict[tuple[str, int], Shown] = {} if kept is None else kept
    need = sorted({(str(qs.split[it.q]), int(qs.row[it.q])) for it in items if it.variant == "image"})
    for split in sorted({s for s, _ in need}):
        rows = np.array([r for s, r in need if s == split and (s, r) not in shown], dtype=np.int64)
        for r, arr in zip(rows, build.images(qs.spec.level, split, rows) if len(rows) else [], strict=True):
            shown[(split, int(r))] = show(arr, cfg.volume_as, cfg.image_size) if qs.volume is not None \
                else Shown(image=to_pil(arr, cfg.image_size))
    for key in need:  # most recently used last
        shown[key] = shown.pop(key)
    out = []
    for it in items:
        s = shown[(str(qs.split[it.q]), int(qs.row[it.q]))] if it.variant == "image" else Shown()
        out.append(Request(str(qs.key[it.q]), it.prompt.text, it.prompt.letters, it.prompt.options, s.image, s.frames))
    while len(shown) > max(SHOWN_KEPT, len(need)):
        shown.pop(next(iter(shown)))
    return out


def shown_requests(build, qs: Questions, items: list[Item], cfg: AskConfig,
                   kept: dict[tuple[str, int], Shown] | None = None) -> list[Request]:
    """The :class:`~.base.Request` of every item, with its image as the model is shown it (the
    export writes these, so a harness sees exactly what ``spar-probe vqa`` sends)."""
    return _requests(build, qs, items, cfg, kept)


def ask(backend: Backend, cache: ResponseCache, build, qs: Questions, items: list[Item],
        keys: list[dict[str, Any]], cfg: AskConfig,
        progress: Callable[[int, int], None] | None = None) -> list[Reply]:
    """Replies of every item (``keys``: their cache keys): from the cache, else from the
    backend (stored per batch); items of one key are asked once."""
    hashes = [key_hash(k) for k in keys]
    first: dict[str, int] = {}
    for i, h in enumerate(hashes):
        first.setdefault(h, i)
    got: dict[str, Reply] = {}
    for h, i in first.items():
        d = cache.get(keys[i])
        if d is not None:
            got[h] = Reply.from_dict(d)
    todo = [i for h, i in first.items() if h not in got]
    step = max(1, int(backend.batch_size))
    kept: dict[tuple[str, int], Shown] = {}
    for lo in range(0, len(todo), step):
        check_stop()
        idx = todo[lo:lo + step]
        try:
            replies = backend.answer(_requests(build, qs, [items[i] for i in idx], cfg, kept))
        except PartialAnswers as e:  # keep what was answered, then stop
            cache.put_many([(keys[i], r.to_dict()) for i, r in zip(idx, e.replies, strict=True) if r])
            raise
        if len(replies) != len(idx):
            raise ConfigError(f"backend {backend.name} returned {len(replies)} answers for {len(idx)} questions")
        cache.put_many([(keys[i], r.to_dict()) for i, r in zip(idx, replies, strict=True)])
        for i, r in zip(idx, replies, strict=True):
            got[hashes[i]] = r
        if progress:
            progress(lo + len(idx), len(todo))
    return [got[h] for h in hashes]


REFUSAL = "refusal"
#: ``Reply.meta`` flag of a question another harness's answers file has no answer for (``--answers``)


def decide(backend: Backend, it: Item, reply: Reply) -> tuple[int | None, str | None]:
    """``(displayed position or None, why none)``: the choice, or the strictly parsed text;
    a model's refusal (the OpenAI ``refusal`` field) is never parsed: reason ``refusal``."""
    if reply.meta.get(REFUSAL):
        return None, REFUSAL
    if reply.meta.get(MISSING):
        return None, MISSING
    if backend.mode == "constrained" and reply.choice is not None:
        return int(reply.choice), None
    got = parse_answer(reply.text, it.prompt.letters, it.prompt.options)
    return got.position, got.reason


def answer_records(qs: Questions, items: list[Item], replies: list[Reply], backend: Backend,
                   digests: dict[int, str], volume_as: str | None = None) -> list[dict]:
    """One JSON record per answer (answers.jsonl), in plan order; a Level 4 record also has
    ``flipped`` and ``volume_as`` (how its volume was shown; None without the image)."""
    names = qs.spec.class_names
    out = []
    for it, rep in zip(items, replies, strict=True):
        pos, reason = decide(backend, it, rep)
        cls = it.prompt.class_of(pos)
        volume = {} if qs.volume is None else {
            "flipped": bool(qs.is_flipped[it.q]), "volume_as": volume_as if it.variant == "image" else None}
        out.append({**volume,
            "key": str(qs.key[it.q]), "split": str(qs.split[it.q]), "mirror": bool(qs.is_mirror[it.q]),
            "variant": it.variant, "rotation": it.rotation, "order": list(it.prompt.order),
            "template": it.prompt.version, "text": rep.text, "choice": pos, "parsed": pos is not None,
            "reason": reason, "image_sha256": digests.get(it.q) if it.variant == "image" else None,
            "answer": names[cls] if cls >= 0 else None, "class": cls,
            "truth": int(qs.answer[it.q]), "correct": bool(cls == int(qs.answer[it.q])),
            **({"scores": list(rep.scores)} if rep.scores is not None else {}),
        })
    return out


def answer_targets(qs: Questions):
    """``qs.t`` as an MLLM is scored on it: the answers its prompts decide (``qs.answer``: size
    and distance by the stated thresholds) and each item's question index (``y["question"]``,
    which :class:`.predictor.Answered` reads its answer by)."""
    y = {**qs.t.y, "answer": np.asarray(qs.answer, np.int64), "question": np.arange(len(qs), dtype=np.int64)}
    return replace(qs.t, y=y)


def asked_splits(qs: Questions, train) -> Splits:
    """The questions asked as a run's :class:`~..runs.inputs.Splits` (:func:`answer_targets`): the
    original questions are ``te``, the mirrored ones ``te_mirror``; ``tr`` the build's training
    questions (the prior and majority controls; empty without a train split); nothing is
    trained, so no validation."""
    t = answer_targets(qs)
    empty = t.subset(np.zeros(len(qs), bool))
    tr = train if train is not None else empty
    flipped = {} if qs.volume is None else {"te_flipped": t.subset(qs.is_flipped)}  # Level 4
    return Splits(tr, empty, t.subset(qs.original), t.subset(qs.is_mirror),
                  "none: nothing is trained", "", **flipped)


def versions() -> dict[str, str | None]:
    return package_versions(VQA_PACKAGES)


