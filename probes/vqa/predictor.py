"""The MLLM run kind (``mllm``): :class:`MllmSpec` (data: the model named, its backend options,
the build, the probe, how questions are asked) and :class:`MllmJob`, which loads the backend
(:func:`backend_of`, once per model and options in a process) and asks every question with
every control (every cyclic option order for CircularEval, blind, mirrored and flipped
copies) through the response cache, through the one lifecycle of
:func:`spar_bench.probes.runs.session.run`.

The job's answers, once asked, are :class:`Answered`: the predictor that the shared
evaluation (:func:`~..runs.evaluate.evaluate`) scores (a class per item; -1: no answer, which
every metric counts as a miss), with the MLLM's own controls (:meth:`Answered.extra_metrics`:
parse rate, unparsed reasons, CircularEval, letter bias).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from spar_bench.builder.shards import Build
from spar_bench.provenance import VQA_PACKAGES, package_versions, protocol_versions

from ..measured import is_harness_prompt, mark_unmeasured, unmeasured
from ..runs.evaluate import MIN_PATIENTS_CI, evaluate, run_metrics
from ..runs.record import RunRecord
from ..runs.spec import NamedRun, PredictorSpec
from ..runs.store import check_run_dir
from ..tasks import get_probe
from .ask import (
    ANSWERS_FILE,
    MISSING,
    AskConfig,
    answer_records,
    ask,
    asked_splits,
    cache_key,
    head_name,
    image_digests,
    plan,
    probe_is_volume,
    variant_of,
)
from .base import Backend, BackendOptions
from .cache import ResponseCache, default_cache, key_hash
from .prompts import template_version, volume_template_version
from .questions import Questions, load_questions, train_targets
from .score import answer_tables, extra_metrics


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

        return extra_metrics(self.qs, self.records, self.tables, boot, n_boot)


# --------------------------------------------------------------------------- the MLLM run
#: the backends loaded in this process (:func:`backend_of`): (model, options) -> backend
_LOADED: dict[tuple[str, BackendOptions], Backend] = {}


def backend_of(model: str, options: BackendOptions) -> Backend:
    """The backend of ``model`` with ``options``, loaded once per process and kept until
    :func:`close_backends`: keyed by every input, but one whose identity records no seed (an
    ``hf:`` model) serves every seed (``dummy``'s answers depend on it: one per seed)."""
    from . import load_backend

    any_seed = (model, replace(options, seed=None))  # the key of a backend that serves every seed
    for key in ((model, options), any_seed):
        if key in _LOADED:
            return _LOADED[key]
    backend = load_backend(model, options)
    _LOADED[(model, options) if "seed" in backend.identity else any_seed] = backend
    return backend


def close_backends() -> None:
    """Close (release) every backend :func:`backend_of` loaded, and forget them."""
    loaded = list({id(b): b for b in _LOADED.values()}.values())
    _LOADED.clear()
    for backend in loaded:
        backend.close()


@dataclass(frozen=True)
class MllmSpec(NamedRun):
    """One MLLM run (kind ``mllm``), as data: model ``model`` (``hf:PATH``, ``dummy``, ...) with
    backend ``options`` asked ``probe``'s questions of build ``data`` as ``cfg`` says, its answers
    kept in the response cache ``cache`` (default ``OUT/.vqa-cache/<model>.sqlite``). The backend
    is the job's (:func:`backend_of`, its ``seed`` and ``data`` this spec's); its mode and
    decoding name the run (:meth:`head_name`, :meth:`variant`). The run's identity is its
    record's (model identity, decoding, template, build fingerprint and ``cfg``)."""

    kind: ClassVar[str] = "mllm"

    model: str
    data: str
    probe: str
    cfg: AskConfig = AskConfig()
    options: BackendOptions = BackendOptions()
    cache: str | None = None

    @property
    def seed(self) -> int:
        return self.cfg.seed

    def backend(self) -> Backend:
        """The model as it answers this run (loaded once per process, :func:`backend_of`)."""
        return backend_of(self.model, replace(self.options, seed=self.cfg.seed, data=self.data))

    def variant(self) -> str:
        return variant_of(self.backend(), self.cfg)

    def head_name(self) -> str:
        return head_name(self.backend(), self.cfg, probe_is_volume(self.probe))


def mllm_record(spec: MllmSpec, build, volume: bool, template: str):
    """The :class:`~..runs.record.RunRecord` of an MLLM run on ``build`` as known before asking."""

    b, cfg = spec.backend(), spec.cfg
    inputs = {"model_identity": b.identity, "decoding": b.decoding, "template_version": template}
    return RunRecord(kind="mllm", probe=spec.probe, head=spec.head_name(), seed=cfg.seed,
                     variant=spec.variant(), model=b.name, build=Path(build.root).resolve().name,
                     build_fingerprint=build.fingerprint, inputs=inputs, options=cfg.to_dict(volume),
                     versions=package_versions(VQA_PACKAGES), protocol=protocol_versions(build.manifest),
                     extra={"track": "vqa", "mode": b.mode, "probe_spec": get_probe(spec.probe).describe(),
                            "random_init": bool(b.random_init)})  # fmt: skip


def _missing(records: list[dict]) -> dict[str, int]:
    """``{"missing": n}`` when ``n`` answers were missing from an ``--answers`` file, else nothing."""

    n = sum(r["reason"] == MISSING for r in records)
    return {"missing": n} if n else {}


@dataclass
class MllmJob:
    """Kind ``mllm``: every question of the probe asked with every control (CircularEval
    rotations, blind, mirrored and flipped copies) through the response cache, scored by the
    shared evaluation (:func:`~..runs.evaluate.evaluate`) as :class:`Answered`, whose own
    controls it records too; answers in ``answers.jsonl``. The job holds the live parts its
    spec names: the build, the backend (:func:`backend_of`) and the response cache's path;
    ``progress``: the run's options' ``progress`` when it is a factory ``progress(probe)`` of a
    context whose ``(done, total)`` calls report the answers asked."""

    spec: MllmSpec
    qs: Questions
    rd: Path
    record: Any
    build: Any
    cache: Path
    progress: Any = None
    declared: frozenset[str] = frozenset({"answers.jsonl"})

    @property
    def backend(self) -> Backend:
        return self.spec.backend()

    @classmethod
    def open(cls, spec: MllmSpec, out, options) -> MllmJob | None:
        """None when the build has no question of ``spec.probe`` on the asked splits."""

        build = Build(spec.data)
        qs = load_questions(build, get_probe(spec.probe), list(spec.cfg.splits))
        if not qs.original.any():
            return None
        short = spec.probe.split(".", 1)[1]
        volume = qs.volume is not None
        template = volume_template_version(short) if volume else template_version(short)
        name = spec.backend().name
        cache = Path(spec.cache) if spec.cache is not None else default_cache(out, name)
        progress = options.progress if callable(options.progress) else None
        return cls(spec, qs, spec.run_dir(out, name), mllm_record(spec, build, volume, template), build, cache,
                   progress)  # fmt: skip

    def start(self) -> None:
        check_run_dir(self.rd, self.declared, "MLLM run folder")

    def fit(self):
        """Ask every item (nothing is trained): ``(items, replies, keys, digests)``."""

        s, qs, b = self.spec, self.qs, self.backend
        items = plan(qs, s.cfg)
        digests = image_digests(self.build, qs, items)
        keys = [cache_key(b, qs, it, s.cfg, digests.get(it.q)) for it in items]
        with ResponseCache(self.cache) as cache, (self.progress(s.probe) if self.progress else nullcontext()) as bar:
            return items, ask(b, cache, self.build, qs, items, keys, s.cfg, bar), keys, digests

    def score(self, asked):
        s, qs, rec, b = self.spec, self.qs, self.record, self.backend
        items, replies, keys, digests = asked
        records = answer_records(qs, items, replies, b, digests, s.cfg.volume_as)
        train = train_targets(self.build, qs.spec)
        run = PredictorSpec(s.probe, rec.head, s.cfg.seed, n_boot=s.cfg.n_boot, ci_min_patients=MIN_PATIENTS_CI)
        splits = asked_splits(qs, train)
        prior = qs.spec.fit_prior(splits.tr) if len(splits.tr) else None
        scored = evaluate(run, Answered.of(qs, records), splits, prior)
        metrics = run_metrics(run, splits, scored, encoder=b.name,
                              random_init=b.random_init, variant=rec.variant, train=None, training=None,
                              manifest=self.build.manifest, track="vqa")  # fmt: skip
        distinct = len({key_hash(k) for k in keys})
        metrics.update({"splits": sorted({str(x) for x in qs.split}), "mode": b.mode,
                        "template_version": items[0].prompt.version,
                        "requests": {"answers": len(items), "distinct": distinct,
                                     "deduplicated": len(items) - distinct, **_missing(records)}})  # fmt: skip
        if is_harness_prompt(b.identity):  # another harness's prompt asked them (reports say so)
            metrics["prompt"] = "harness"
        mark_unmeasured(metrics, unmeasured(records, getattr(b, "source", b.name),
                                            bool(getattr(b, "accept_missing", False))))
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        return metrics, rec, {ANSWERS_FILE: (lambda p: p.write_text(text, encoding="utf-8"), True)}
