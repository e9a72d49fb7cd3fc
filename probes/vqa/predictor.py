"""A multimodal LLM as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

``fit`` trains nothing (the model is asked as it is); ``predict`` asks each item's question
with its slice, its options in the class order (rotation 0), through the response cache,
and returns the class chosen (-1: no answer, which every metric counts as a miss); its
blind baseline asks the same questions without the image. So an MLLM runs through the
one lifecycle of :func:`spar_bench.probes.runs.session.run_predictor` with every control.

``spar-probe vqa`` (:class:`MllmJob`) asks more of it (every cyclic option order for
CircularEval, answers.jsonl) and scores size and distance against the thresholds its prompts
state; this predictor scores them, like a head's, against the stored answer. The job's answers,
once asked, are :class:`Answered`: the predictor that the shared evaluation
(:func:`~..runs.evaluate.evaluate`) scores, with the MLLM's own controls
(:meth:`Answered.extra_metrics`: parse rate, unparsed reasons, CircularEval, letter bias).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..measured import is_harness_prompt, mark_unmeasured, unmeasured
from ..runs.spec import NamedRun
from .ask import AskConfig, Item, answer_records, ask, cache_key, image_digests, prompt_of
from .base import Backend
from .cache import ResponseCache
from .prompts import rotations
from .questions import Questions, load_questions


def _item_key(t, j: int) -> tuple:
    """Row, organs (C on Level 4), axis and copy flags of item ``j`` of ``t``."""
    flipped = getattr(t, "is_flipped", None)
    return (int(t.rows[j]), *(int(t.y[o][j]) for o in ("organ_a", "organ_b", "organ_c") if o in t.y),
            int(t.y["axis"][j]), bool(t.is_mirror[j]), bool(flipped[j]) if flipped is not None else False)


def question_index(qs: Questions, t) -> np.ndarray:
    """The question of ``qs`` behind each item of ``t`` (both from one split of one build):
    matched on the slice (volume) row, the organs, the axis and the mirror (flip) flags."""
    where: dict[tuple, int] = {}
    for i in range(len(qs)):
        where.setdefault(_item_key(qs.t, i), i)
    return np.array([where[_item_key(t, j)] for j in range(len(t))], dtype=np.int64)


@dataclass
class Mllm:
    """``backend`` asked about ``build``'s Level 3 questions (``cfg``: hint, image size, seed),
    its answers kept in ``cache``; ``with_image=False`` is its blind baseline."""

    backend: Backend
    build: Any
    cache: ResponseCache
    cfg: AskConfig = AskConfig()
    with_image: bool = True
    kind: str = "mllm"

    def fit(self, train, val) -> None:
        return None  # asked as it is: nothing is trained

    def predict(self, t, split: str = "test") -> np.ndarray:
        if len(t) == 0:
            return np.zeros((0,), np.int64)
        qs = load_questions(self.build, t.spec, [split])
        idx = question_index(qs, t)
        items = [self._item(qs, int(i)) for i in idx]
        digests = image_digests(self.build, qs, items)
        keys = [cache_key(self.backend, qs, it, self.cfg, digests.get(it.q)) for it in items]
        replies = ask(self.backend, self.cache, self.build, qs, items, keys, self.cfg)
        records = answer_records(qs, items, replies, self.backend, digests, self.cfg.volume_as)
        return np.array([r["class"] for r in records], dtype=np.int64)

    def _item(self, qs: Questions, i: int) -> Item:
        """Question ``i`` in the class order, with its slice (volume, ``cfg.volume_as``) or (blind) without."""
        prompt = prompt_of(qs, i, rotations(qs.spec.n_classes)[0], self.cfg, blind=not self.with_image)
        return Item(i, "image" if self.with_image else "blind", 0, prompt)

    def blind(self) -> Mllm:
        return Mllm(self.backend, self.build, self.cache, self.cfg, with_image=False)


@dataclass
class Answered:
    """An MLLM's answers, once asked, as the :class:`~..runs.predictors.Predictor` the shared
    evaluation scores: ``predict`` reads each item's class at rotation 0 (or, its ``blind()``,
    without the image) from ``tables`` (:func:`.score.answer_tables`) by the item's question
    index (``y["question"]``, :func:`.ask.answer_targets`); nothing is asked or trained."""

    qs: Questions
    records: list[dict]
    tables: dict[str, np.ndarray]
    with_image: bool = True
    kind: str = "mllm"

    @classmethod
    def of(cls, qs: Questions, records: list[dict]) -> Answered:
        from .score import answer_tables

        return cls(qs, records, answer_tables(qs, records, qs.spec.n_classes))

    def fit(self, train, val) -> None:
        return None

    def predict(self, t, split: str = "test") -> np.ndarray:
        column = self.tables["image"][:, 0] if self.with_image else self.tables["blind"]
        return column[np.asarray(t.y["question"], np.int64)]

    def blind(self) -> Answered | None:
        """The answers without the image, or None when none were asked (``--no-blind``)."""
        if not self.with_image or not (self.tables["blind"] != -2).any():
            return None
        return Answered(self.qs, self.records, self.tables, with_image=False)

    def extra_metrics(self, s, boot, n_boot: int) -> dict:
        """The MLLM's own controls (:func:`.score.extra_metrics`), beside the shared ones."""
        from .score import extra_metrics

        return extra_metrics(self.qs, self.records, self.tables, boot, n_boot)


# --------------------------------------------------------------------------- the MLLM run
@dataclass(frozen=True)
class MllmSpec(NamedRun):
    """One MLLM run (kind ``mllm``): ``backend`` asked ``probe``'s questions of ``build`` as
    ``cfg`` says, its answers kept in ``cache``. The backend, build and cache are live objects
    (one backend serves every probe); the run's identity is its record's (model identity,
    decoding, template, build fingerprint and ``cfg``)."""

    kind: ClassVar[str] = "mllm"

    backend: Any
    build: Any
    probe: str
    cfg: AskConfig
    cache: Any
    progress: Any = None  # callback(done, total) over the answers not yet cached

    @property
    def seed(self) -> int:
        return self.cfg.seed

    def variant(self) -> str:
        from .ask import variant_of

        return variant_of(self.backend, self.cfg)

    def head_name(self) -> str:
        from .ask import head_name, probe_is_volume

        return head_name(self.backend, self.cfg, probe_is_volume(self.probe))


def mllm_record(spec: MllmSpec, volume: bool, template: str):
    """The :class:`~..runs.record.RunRecord` of an MLLM run as known before asking."""
    from spar_bench.provenance import VQA_PACKAGES, package_versions, protocol_versions

    from ..runs.record import RunRecord
    from ..tasks import get_probe

    b, build, cfg = spec.backend, spec.build, spec.cfg
    inputs = {"model_identity": b.identity, "decoding": b.decoding, "template_version": template}
    return RunRecord(kind="mllm", probe=spec.probe, head=spec.head_name(), seed=cfg.seed,
                     variant=spec.variant(), model=b.name, build=Path(build.root).resolve().name,
                     build_fingerprint=build.fingerprint, inputs=inputs, options=cfg.to_dict(volume),
                     versions=package_versions(VQA_PACKAGES), protocol=protocol_versions(build.manifest),
                     extra={"track": "vqa", "mode": b.mode, "probe_spec": get_probe(spec.probe).describe(),
                            "random_init": bool(b.random_init)})  # fmt: skip


def _missing(records: list[dict]) -> dict[str, int]:
    """``{"missing": n}`` when ``n`` answers were missing from an ``--answers`` file, else nothing."""
    from .ask import MISSING

    n = sum(r["reason"] == MISSING for r in records)
    return {"missing": n} if n else {}


@dataclass
class MllmJob:
    """Kind ``mllm``: every question of the probe asked with every control (CircularEval
    rotations, blind, mirrored and flipped copies) through the response cache, scored by the
    shared evaluation (:func:`~..runs.evaluate.evaluate`) as :class:`Answered`, whose own
    controls it records too; answers in ``answers.jsonl``."""

    spec: MllmSpec
    qs: Questions
    rd: Path
    record: Any
    declared: frozenset[str] = frozenset({"answers.jsonl"})
    asked: Any = None

    @classmethod
    def open(cls, spec: MllmSpec, out, options) -> MllmJob | None:
        """None when the build has no question of ``spec.probe`` on the asked splits."""
        from ..tasks import get_probe
        from .prompts import template_version, volume_template_version

        probe = get_probe(spec.probe)
        qs = load_questions(spec.build, probe, list(spec.cfg.splits))
        if not qs.original.any():
            return None
        short = spec.probe.split(".", 1)[1]
        volume = qs.volume is not None
        template = volume_template_version(short) if volume else template_version(short)
        return cls(spec, qs, spec.run_dir(out, spec.backend.name), mllm_record(spec, volume, template))

    def start(self) -> None:
        from ..runs.store import check_run_dir

        check_run_dir(self.rd, self.declared, "MLLM run folder")

    def fit(self):
        """Ask every item (nothing is trained): ``(items, replies, keys, digests)``."""
        from .ask import ask, cache_key, plan

        s, qs = self.spec, self.qs
        items = plan(qs, s.cfg)
        digests = image_digests(s.build, qs, items)
        keys = [cache_key(s.backend, qs, it, s.cfg, digests.get(it.q)) for it in items]
        return items, ask(s.backend, s.cache, s.build, qs, items, keys, s.cfg, s.progress), keys, digests

    def score(self, asked):
        from ..runs.evaluate import MIN_PATIENTS_CI, evaluate, run_metrics
        from ..runs.spec import PredictorSpec
        from .ask import ANSWERS_FILE, asked_splits
        from .cache import key_hash
        from .questions import train_targets

        s, qs, rec = self.spec, self.qs, self.record
        items, replies, keys, digests = asked
        records = answer_records(qs, items, replies, s.backend, digests, s.cfg.volume_as)
        train = train_targets(s.build, qs.spec)
        run = PredictorSpec(s.probe, rec.head, s.cfg.seed, n_boot=s.cfg.n_boot, ci_min_patients=MIN_PATIENTS_CI)
        splits = asked_splits(qs, train)
        prior = qs.spec.fit_prior(splits.tr) if len(splits.tr) else None
        scored = evaluate(run, Answered.of(qs, records), splits, prior)
        metrics = run_metrics(run, splits, scored, encoder=s.backend.name,
                              random_init=s.backend.random_init, variant=rec.variant, train=None, training=None,
                              manifest=s.build.manifest, track="vqa")  # fmt: skip
        distinct = len({key_hash(k) for k in keys})
        metrics.update({"splits": sorted({str(x) for x in qs.split}), "mode": s.backend.mode,
                        "template_version": items[0].prompt.version,
                        "requests": {"answers": len(items), "distinct": distinct,
                                     "deduplicated": len(items) - distinct, **_missing(records)}})  # fmt: skip
        if is_harness_prompt(s.backend.identity):  # another harness's prompt asked them (reports say so)
            metrics["prompt"] = "harness"
        mark_unmeasured(metrics, unmeasured(records, getattr(s.backend, "source", s.backend.name),
                                            bool(getattr(s.backend, "accept_missing", False))))
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        return metrics, rec, {ANSWERS_FILE: (lambda p: p.write_text(text, encoding="utf-8"), True)}
