"""Ask a model every Level 3 question of a build, score it like a probe head, write the run.

One run = one (model, probe, answering mode) on the chosen splits. Its folder
``OUT/<model-slug>/<probe>/<head>/seed<k>/`` (``head`` = ``vqa-loglik``, ``vqa-generate``
or ``vqa-guided``, plus ``-nohint`` without the convention hint and ``-<N>px`` for an
upscaled image) holds ``config.json``, ``answers.jsonl`` (every answer, with its template
version, option order and raw text) and ``metrics.json`` (written last: a finished run).

Asked per probe:

* every original question with its options in each cyclic order (CircularEval; the
  headline is rotation 0, the class order);
* the same prompt without the image (blind);
* mirrored counterfactual questions (labels recomputed by the builder) when the build has
  them, with and without the image.

Every answer goes through the response cache (:mod:`.cache`): reruns resume, rescoring is free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import protocol_versions

from .base import Backend, PartialAnswers, Reply, Request, to_pil
from .cache import ResponseCache
from .parse import parse_answer
from .prompts import Prompt, render, rotations
from .questions import Questions, load_questions, train_targets
from .score import score_run

METRICS_FILE = "metrics.json"
RUN_FILES = frozenset({"config.json", "answers.jsonl", METRICS_FILE, METRICS_FILE + ".tmp"})


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

    def to_dict(self) -> dict[str, Any]:
        return {"splits": list(self.splits), "convention_hint": self.hint,
                "circular": self.circular, "blind": self.blind, "image_size": self.image_size,
                "seed": self.seed, "n_bootstrap": self.n_boot}


@dataclass(frozen=True)
class Item:
    """One request to make: question ``q`` (index), variant, rotation and its prompt."""

    q: int
    variant: str  # "image" | "blind"
    rotation: int
    prompt: Prompt


def head_name(backend: Backend, cfg: AskConfig) -> str:
    kind = {"constrained": "loglik", "generate": "generate"}[backend.mode]
    if backend.decoding.get("guided", "none") != "none":
        kind = "guided"
    return f"vqa-{kind}" + ("" if cfg.hint else "-nohint") + (
        "" if cfg.image_size == 224 else f"-{cfg.image_size}px")


def plan(qs: Questions, cfg: AskConfig) -> list[Item]:
    """Requests per question: every rotation (originals, with CircularEval), rotation 0
    for mirrors, and rotation 0 without the image (blind)."""
    n = qs.spec.n_classes
    orders = rotations(n)
    items = []
    for i in range(len(qs)):
        rots = range(n) if cfg.circular and not qs.is_mirror[i] else range(1)
        args = (qs.probe, int(qs.organ_a[i]), int(qs.organ_b[i]), int(qs.axis[i]))
        ctx = qs.context(i, cfg.image_size)  # scale, band and stated thresholds (protocol 1.2)
        for r in rots:
            items.append(Item(i, "image", r, render(*args, orders[r], cfg.hint, context=ctx)))
        if cfg.blind:
            items.append(Item(i, "blind", 0, render(*args, orders[0], cfg.hint, blind=True, context=ctx)))
    return items


def cache_key(backend: Backend, qs: Questions, it: Item, cfg: AskConfig) -> dict[str, Any]:
    from spar_bench import __version__

    return {
        "model": backend.identity,
        "decoding": backend.decoding,
        "template": it.prompt.version,
        "prompt_sha256": hashlib.sha256(it.prompt.text.encode("utf-8")).hexdigest(),
        "sample": str(qs.key[it.q]),
        "order": list(it.prompt.order),
        "image": None if it.variant == "blind" else {"size": cfg.image_size},
        "tool": __version__,
    }


def _requests(build, qs: Questions, items: list[Item], size: int) -> list[Request]:
    """Requests with their images, each distinct slice read once."""
    images: dict[tuple[str, int], Any] = {}
    need = sorted({(str(qs.split[it.q]), int(qs.row[it.q])) for it in items if it.variant == "image"})
    for split in sorted({s for s, _ in need}):
        rows = np.array([r for s, r in need if s == split], dtype=np.int64)
        for r, arr in zip(rows, build.images(qs.spec.level, split, rows), strict=True):
            images[(split, int(r))] = to_pil(arr, size)
    return [
        Request(str(qs.key[it.q]), it.prompt.text, it.prompt.letters, it.prompt.options,
                images.get((str(qs.split[it.q]), int(qs.row[it.q]))) if it.variant == "image" else None)
        for it in items
    ]


def ask(backend: Backend, cache: ResponseCache, build, qs: Questions, items: list[Item],
        cfg: AskConfig, progress: Callable[[int, int], None] | None = None) -> list[Reply]:
    """Replies of every item: from the cache, else from the backend (stored per batch)."""
    keys = [cache_key(backend, qs, it, cfg) for it in items]
    got: list[Reply | None] = []
    for k in keys:
        d = cache.get(k)
        got.append(Reply.from_dict(d) if d is not None else None)
    todo = [i for i, r in enumerate(got) if r is None]
    step = max(1, int(backend.batch_size))
    for lo in range(0, len(todo), step):
        idx = todo[lo:lo + step]
        try:
            replies = backend.answer(_requests(build, qs, [items[i] for i in idx], cfg.image_size))
        except PartialAnswers as e:  # keep what was answered, then stop
            cache.put_many([(keys[i], r.to_dict()) for i, r in zip(idx, e.replies, strict=True) if r])
            raise
        if len(replies) != len(idx):
            raise ConfigError(f"backend {backend.name} returned {len(replies)} answers for {len(idx)} questions")
        cache.put_many([(keys[i], r.to_dict()) for i, r in zip(idx, replies, strict=True)])
        for i, r in zip(idx, replies, strict=True):
            got[i] = r
        if progress:
            progress(lo + len(idx), len(todo))
    return got  # type: ignore[return-value]


def decide(backend: Backend, it: Item, reply: Reply) -> tuple[int | None, bool]:
    """``(displayed position or None, parsed?)``: the choice, or the strictly parsed text."""
    if backend.mode == "constrained" and reply.choice is not None:
        return int(reply.choice), True
    pos = parse_answer(reply.text, it.prompt.letters, it.prompt.options)
    return pos, pos is not None


def answer_records(qs: Questions, items: list[Item], replies: list[Reply], backend: Backend) -> list[dict]:
    """One JSON record per answer (answers.jsonl), in plan order."""
    names = qs.spec.class_names
    out = []
    for it, rep in zip(items, replies, strict=True):
        pos, ok = decide(backend, it, rep)
        cls = it.prompt.class_of(pos)
        out.append({
            "key": str(qs.key[it.q]), "split": str(qs.split[it.q]), "mirror": bool(qs.is_mirror[it.q]),
            "variant": it.variant, "rotation": it.rotation, "order": list(it.prompt.order),
            "template": it.prompt.version, "text": rep.text, "choice": pos, "parsed": ok,
            "answer": names[cls] if cls >= 0 else None, "class": cls,
            "truth": int(qs.answer[it.q]), "correct": bool(cls == int(qs.answer[it.q])),
            **({"scores": list(rep.scores)} if rep.scores is not None else {}),
        })
    return out


# --------------------------------------------------------------------------- run folder
def owned_vqa_run(rd: Path) -> set[str] | None:
    """The files of an earlier MLLM run in ``rd``, or None when ``rd`` is not one."""
    try:
        config = json.loads((Path(rd) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("track") != "vqa":
        return None
    return set(RUN_FILES)


def write_run(rd: Path, config: dict, records: list[dict], metrics: dict) -> None:
    """config.json, answers.jsonl, then metrics.json last (a finished run)."""
    from spar_bench.outputs import check_target, claim, remove
    from spar_bench.provenance import json_safe

    check_target(rd)
    if claim(rd, overwrite=True, owned=owned_vqa_run, what="MLLM run folder"):
        remove(rd)
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "config.json").write_text(json.dumps(json_safe(config), indent=2) + "\n")
    with open(rd / "answers.jsonl", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
    tmp = rd / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    tmp.replace(rd / METRICS_FILE)


def versions() -> dict[str, str | None]:
    from spar_bench.provenance import VQA_PACKAGES, package_versions

    return package_versions(VQA_PACKAGES)


def run_probe(backend: Backend, build, probe: str, out: str | Path, cfg: AskConfig,
              cache: ResponseCache, progress=None) -> Path | None:
    """Ask, score and write one probe (``level3.<name>``); None when the build has no such question."""
    from ..tasks import get_probe

    spec = get_probe(probe)
    qs = load_questions(build, spec, list(cfg.splits))
    if not (~qs.is_mirror).any():
        return None
    items = plan(qs, cfg)
    replies = ask(backend, cache, build, qs, items, cfg, progress)
    records = answer_records(qs, items, replies, backend)
    head = head_name(backend, cfg)
    metrics = score_run(qs, records, train_targets(build, spec), cfg.seed, cfg.n_boot, head)
    metrics.update({"probe": probe, "head": head, "seed": cfg.seed,
                    "encoder": backend.name, "random_init": backend.random_init,
                    "track": "vqa", "mode": backend.mode, "template_version": items[0].prompt.version,
                    **protocol_versions(build.manifest)})
    config = {"track": "vqa", "probe": probe, "head": head, "seed": cfg.seed,
              "model": backend.name, "model_identity": backend.identity,
              "decoding": backend.decoding, "mode": backend.mode, **cfg.to_dict(),
              "template_version": items[0].prompt.version, "probe_spec": spec.describe(),
              "dataset": Path(build.root).resolve().name,
              "dataset_fingerprint": build.fingerprint, **protocol_versions(build.manifest),
              "versions": versions()}
    rd = Path(out) / backend.name / probe / head / f"seed{cfg.seed}"
    write_run(rd, config, records, metrics)
    return rd
