"""The session: every run of every kind, from spec to finished folder, by one lifecycle.

:func:`run` is the one way a run happens: :func:`open_job` opens the job of ``spec.kind``
(:data:`spar_bench.probes.kinds.RUN_KINDS`, every kind's ``open``: :class:`HeadJob` for a head on
cached features, a kind's own job class, or :class:`~.build_job.BuildJob` for a predictor made
from a build), and
:func:`execute` keeps a finished run of the same identity, else starts, fits, scores (the one
evaluation, :func:`~.evaluate.evaluate`) and writes the folder whole
(:func:`~.store.write_run`: declared files, the record, ``metrics.json`` last).
:func:`run_all` is the one probe x seed loop of every command and experiment step (an
unavailable probe skipped under ``all``); :func:`run_fit_batch` trains the runs of one batch key
as one vmapped batch (:mod:`spar_bench.probes.ensemble`) and writes each as :func:`run` does;
:func:`evaluate_on` scores a finished run on another target through its kind's ``rescore``.

A head run's directory ``OUT/<encoder>[-random-init]/<probe>/<head>[,<options>]/seed<k>/``
holds (docs/FORMATS.md):

* ``config.json``  - the run record (:class:`~.record.RunRecord`, kind ``head``): the run spec
  as ``options``, the resolved head and train configs, seeds, package versions, cache file
  name + fingerprint, build folder name + fingerprint (never an absolute path);
* ``metrics.json`` - every metric the probe spec declares, on ORIGINAL test samples with
  95 % patient-bootstrap CIs, controls (chance, majority, the prior, the blind baseline),
  the same metrics on the mirrored counterfactual test samples (when the build has them),
  training curve summary;
* ``head.pt``      - the trained head (``state_dict`` + config + the fitted prior).

Heads train on original (non-mirrored) samples by default; validation is the cache's
``val`` split, or, when it has none, a seeded 15 % of training patients (recorded as
``val_source``). The blind baseline is the same head trained on the question alone:
image features replaced by zeros (one zero token for token heads).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import click
import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import protocol_versions

from ..targets import concat, load_targets
from ..train import predict
from .build_job import BuildJob, train_record  # noqa: F401 - BuildJob: the session's, from its module
from .evaluate import evaluate, run_metrics, transfer
from .inputs import (
    ProbeUnavailable,
    Splits,
    check_shards,
    encoder_slug,
    load_features,
    open_cache,
    open_run,
    resolve_build,
    split_targets,
)
from .predictors import CachedHead, blind_targets, head_extra, head_record
from .record import RunRecord
from .store import (
    HEAD_FILE,
    HEAD_FILES,
    METRICS_FILE,
    TransferEval,
    Writer,
    check_run_dir,
    clear_staging,
    finished,
    kept_eval,
    run_path,
    save_head,
    write_eval,
    write_run,
)


class Prepared(NamedTuple):
    """What a head run trains on: its cache and build, targets and its predictor."""

    cache: Any
    build: Any
    splits: Splits
    head: CachedHead


@dataclass(frozen=True)
class RunOptions:
    """How a run is carried out (none of it changes what it computes)."""

    overwrite: bool = False  # replace a finished run of the same spec
    resume: bool = False  # continue an interrupted run from its checkpoint (finetune)
    #: show progress; an MLLM run's job also takes a factory ``progress(probe)`` of a context whose
    #: ``(done, total)`` calls report its answers (``spar-probe vqa``'s bars)
    progress: Any = True


class Job(Protocol):
    """One run of a kind, opened from its spec (``RUN_KINDS[kind].open(spec, out, options)``):
    its folder, its record as known before running (its identity), the files it declares
    beside the record and metrics, and three steps the session calls in order."""

    rd: Path
    record: RunRecord
    declared: frozenset[str]

    def start(self) -> None:
        """Make ``rd`` ready to run into (a fresh folder, or the checkpointed one when resumed)."""

    def fit(self) -> Any:
        """Train (or ask); the training result."""

    def score(self, fitted) -> tuple[dict[str, Any], RunRecord, dict[str, Writer]]:
        """``(metrics, the whole record, the declared files' writers)``; the record has the
        identity of ``record``, with what running resolved (``extra``, the build's name)."""


def run(spec, out: str | Path, *, overwrite: bool = False, resume: bool = False, progress: Any = True) -> Path | None:
    """The one way any run happens: open the kind's job from ``spec`` (``spec.kind`` names it in
    :data:`~spar_bench.probes.kinds.RUN_KINDS`), keep a finished run of the same identity
    (refuse one of another, redo a damaged one), else start, fit, score and write the run folder
    whole (:func:`~.store.write_run`: declared files, the record, ``metrics.json`` last). None:
    the spec asks for nothing on its inputs (an MLLM probe the build has no question of).

    Every kind's class opens its job (``open(spec, out, options)``): a head on a cache, a
    finetune, an MLLM asked every control, or a predictor made from a build
    (``on_build(probe_spec, build)``: the prior, the mask oracle), whose ``open`` is
    :class:`~.build_job.OnBuild`'s: a :class:`~.build_job.BuildJob`."""
    options = RunOptions(overwrite=overwrite, resume=resume, progress=progress)
    job = open_job(spec, out, options)
    return None if job is None else execute(job, options)


def run_all(groups: Iterable[Iterable[Any]], out: str | Path, *, skip_unavailable: bool = False,
            **options: Any) -> Iterator[tuple[Any, Path | None]]:
    """Every spec of ``groups`` (each the specs of one probe: its heads x seeds) through
    :func:`run` (``options``: its keywords), in order, yielding ``(spec, run folder)``: the one
    probe x seed loop of every command and experiment step.

    A probe the build cannot ask (:class:`~.inputs.ProbeUnavailable`: no items of it) stops the
    loop when it was named; asked for under ``all`` (``skip_unavailable``) it is skipped whole,
    in one line on stderr. Whole: being unavailable is the probe's on that build, whatever the
    head or seed, so its other specs are not tried (and not reported once each)."""
    for group in groups:
        for spec in group:
            try:
                rd = run(spec, out, **options)
            except ProbeUnavailable as e:
                if not skip_unavailable:
                    raise
                click.echo(f"{spec.probe}: not available on this build ({e}); skipped", err=True)
                break
            yield spec, rd


def open_job(spec, out: str | Path, options: RunOptions = RunOptions()):
    """The job of ``spec`` (``spec.kind`` in :data:`~spar_bench.probes.kinds.RUN_KINDS`: every
    kind answers ``open``), or None."""
    from ..kinds import run_kind

    return run_kind(spec.kind).open(spec, out, options)


def prepare_run(run, progress: bool = True) -> Prepared:
    """Open and check the run's cache and build; its targets, seeded head and features."""
    cache, build = open_run(run)
    s = split_targets(build, cache, run)
    head = CachedHead.new(run, cache, s)
    head.progress = progress
    return Prepared(cache, build, s, head)


@dataclass
class HeadJob:
    """A head on cached features (kind ``head``, spec :class:`~.spec.RunSpec`)."""

    run: Any
    rd: Path
    record: RunRecord
    progress: bool = True
    declared: frozenset[str] = HEAD_FILES
    prepared: Prepared | None = None

    @classmethod
    def open(cls, run, out, options: RunOptions) -> HeadJob:
        with open_cache(run.features) as cache:
            return cls(run, run.run_dir(out, encoder_slug(cache)), head_record(run, cache), options.progress)

    def start(self) -> None:
        check_run_dir(self.rd, self.declared)
        self.prepared = prepare_run(self.run, self.progress)

    def fit(self):
        p = self.prepared
        return p.head.fit(p.splits.tr, p.splits.va)

    def score(self, fitted, blind=None, batch: dict | None = None):
        return head_outputs(self.run, self.prepared, fitted, self.record, blind, batch)

    @staticmethod
    def rescore(rd: Path, target: EvalTarget) -> Path:
        """The run's head scored on another cache (:func:`run_eval`)."""
        if target.features is None:
            raise ConfigError(NEEDS_FEATURES)
        return run_eval(rd, target.features, target.data, target.n_boot, overwrite=target.overwrite)


def run_fit(spec, out: str | Path, progress: bool = True, overwrite: bool = False) -> Path:
    """Train and score the head of ``spec`` (a :class:`~.spec.RunSpec`, through :func:`run`)."""
    return run(spec, out, overwrite=overwrite, progress=progress)


def head_outputs(run, p: Prepared, result, record: RunRecord, blind=None, batch: dict | None = None):
    """A trained head run scored (test, mirrored, controls): ``(metrics, record, files)``;
    ``record`` is its record as opened (:func:`~.predictors.head_record`), completed here.

    ``blind``: the run's blind baseline, already trained (a batch trains them together);
    None trains it here. ``batch`` records the runs it was trained with."""
    spec, cache, s = run.spec, p.cache, p.splits
    prior = spec.fit_prior(s.tr)
    weights = cache.meta.get("weights")
    training = weights.get("training") if isinstance(weights, dict) else None  # a finetune export probed frozen
    metrics = run_metrics(run, s, evaluate(run, p.head, s, prior, blind), encoder=encoder_slug(cache),
                          random_init=bool(cache.random_init), layer=run.layer,
                          train=train_record(result, run.train.patience), training=training,
                          manifest=p.build.manifest)  # fmt: skip
    extra = head_extra(run, p.head)
    if batch is not None:
        metrics["batch"] = extra["batch"] = batch
    record = record.replace(build=Path(p.build.root).resolve().name, extra=extra,
                            protocol=protocol_versions(p.build.manifest))
    head_pt = (lambda path: save_head(path, p.head.model, record.to_dict(), prior), True)
    return metrics, record, {HEAD_FILE: head_pt}


def finish_run(run, p: Prepared, result, out: str | Path, blind=None, batch: dict | None = None) -> Path:
    """Score a trained head run and write its folder (the batch path of :func:`run_fit_batch`)."""
    rd = run.run_dir(out, encoder_slug(p.cache))
    clear_staging(rd)
    check_run_dir(rd, HEAD_FILES)
    metrics, record, files = head_outputs(run, p, result, head_record(run, p.cache), blind, batch)
    write_run(rd, record, metrics, files)
    return rd


# --------------------------------------------------------------------------- transfer
def _transfer_features(cache, c: dict, spec_run, model, rd: Path, split: str, level: str) -> np.ndarray:
    """The features of ``split`` for run ``rd``'s head, checked against what it was trained on."""
    f = load_features(cache, c["head_input"], level, split, spec_run.layer, model)
    if f.shape[-1] != (model.proj_dim if c["head_input"] == "tokens" else c["in_dim"]):
        raise ConfigError(f"{cache.path}: feature width {f.shape[-1]} does not match run {rd} ({c['in_dim']})")
    if c["head_input"] == "tokens" and f.shape[1] != c.get("n_tokens", f.shape[1]):  # e.g. per-tile vs mosaic
        raise ConfigError(f"{cache.path}: {f.shape[1]} tokens per item (tile encoding "
                          f"{cache.tile_encoding}) but run {rd} was trained on {c['n_tokens']}")  # fmt: skip
    return f


def head_on_cache(rd: Path, loaded, cache, build, split: str = "test") -> tuple[Any, np.ndarray]:
    """``(items, predictions)`` of a finished head run ``rd`` (``loaded``: its
    :meth:`~.predictors.CachedHead.load`) on ``split`` of another cache of ``build``, the
    features checked against what the head was trained on (:func:`run_eval`'s, and the 2-D
    calibration's frozen probes on every layout)."""
    spec_run, rec, _, model = loaded
    spec, level = spec_run.spec, spec_run.spec.level
    t = load_targets(build, spec, split, cache.keys(level, split))
    return t, predict(model, _transfer_features(cache, rec.extra, spec_run, model, rd, split, level), t)


def run_eval(run: str | Path, features: str | Path, data: str | Path | None = None, n_boot: int = 1000,
             overwrite: bool = False) -> Path:
    """Score a trained run on another cache without retraining; write ``eval-<cache>.json``
    (kept when it holds this evaluation, refused when another, unless ``overwrite``)."""

    rd = Path(run)
    loaded = CachedHead.load(rd)
    spec_run, _, prior, _ = loaded
    spec = spec_run.spec
    trained = json.loads((rd / METRICS_FILE).read_text())
    majority = (trained.get("controls") or {}).get("majority_class")
    cache = open_cache(features)
    cache.check_probe(spec.name)
    out = rd / f"eval-{Path(features).stem}.json"
    inputs = {"features": Path(features).name, "cache_fingerprint": cache.fingerprint,
              "encoder": encoder_slug(cache), "n_bootstrap": n_boot}  # fmt: skip
    if kept_eval(out, inputs, overwrite):
        return out
    build = resolve_build(cache, data)
    level = spec.level
    if level not in cache.levels():
        raise ConfigError(f"{features}: cache has no {level}; levels: {', '.join(cache.levels())}")
    check_shards(build, level)
    splits = ["test"] if "test" in cache.splits(level) else cache.splits(level)
    tests, preds = zip(*(head_on_cache(rd, loaded, cache, build, split) for split in splits), strict=True)
    scored = transfer(concat(list(tests)), np.concatenate(preds), spec_run.seed, n_boot, prior, majority)
    evaluation = TransferEval(run=run_path(rd), features=Path(features).name, cache_fingerprint=cache.fingerprint,
                              encoder=encoder_slug(cache), random_init=bool(cache.random_init),
                              training=trained.get("training"), splits=splits, probe=spec.name, head=spec_run.head,
                              variant=spec_run.variant(), seed=spec_run.seed, n_bootstrap=n_boot)  # fmt: skip
    return write_eval(out, evaluation, scored)


@dataclass(frozen=True)
class EvalTarget:
    """What a finished run is scored on without retraining: another feature cache
    (``features``, its build ``data`` when the cache does not record it), or a build whose images
    the run's own trained encoder re-encodes (``data`` alone; ``encoder``: a local model's path
    again, which runs do not record)."""

    features: str | None = None
    data: str | None = None
    n_boot: int = 1000
    overwrite: bool = False
    encoder: str | None = None


#: what scoring a run on a build without its cache needs
NEEDS_FEATURES = ("--features is required (re-encoding with --data alone needs a `spar-probe finetune` run, "
                  "whose trained encoder re-encodes the build)")  # fmt: skip


def _kind_of(rd: Path) -> str:
    """A run folder's kind: its record's; without one (a damaged run), the kind whose marker file
    it holds (:data:`~spar_bench.probes.kinds.RUN_KINDS` metadata: a trained encoder is a
    finetune run's), else a head's, so the loader of its head names what is wrong."""
    if (rd / "config.json").is_file():
        return RunRecord.read(rd).kind
    from ..kinds import RUN_KINDS

    marked = (k for k in RUN_KINDS.names() if (m := RUN_KINDS.meta(k).get("marker")) and (rd / m).is_file())
    return next(marked, "head")


def evaluate_on(rd: str | Path, target: EvalTarget) -> Path:
    """Transfer evaluation of any run kind that can be re-scored (its class's ``rescore``):
    ``eval-<target>.json`` in ``rd`` (kept when it holds this evaluation, refused when another,
    unless ``target.overwrite``)."""
    from ..kinds import RUN_KINDS, run_kind

    rd = Path(rd)
    kind = _kind_of(rd)
    rescore = getattr(run_kind(kind), "rescore", None)
    if rescore is None:
        can = [k for k in RUN_KINDS.names() if hasattr(run_kind(k), "rescore")]
        raise ConfigError(f"{rd}: a run of kind {kind} has no trained head to score on another target; "
                          f"runs of kind {' or '.join(can)} can be")  # fmt: skip
    return rescore(rd, target)


# --------------------------------------------------------------------------- runs trained as one batch
def run_fit_batch(runs: list, out, progress: bool = False, prune_at: int = 0) -> list:
    """:func:`run_fit` for runs of one :func:`~spar_bench.probes.ensemble.batch_key`, trained as one
    batch (and their blind baselines as another); each run writes its own folder, recording the
    batch it was trained in.

    Without a val split every seed holds out its own patients, so only runs of one seed
    (grid points) share a batch then. ``prune_at``: each seed's grid points are pruned to
    one after that epoch (:class:`~spar_bench.probes.ensemble.Prune`).
    """
    from ..ensemble import batch_key

    if len({batch_key(r) for r in runs}) != 1:
        raise ConfigError("runs trained as one batch may differ in seed, lr and weight decay only")
    prepared = [prepare_run(r) for r in runs]
    slug = encoder_slug(prepared[0].cache)
    groups: dict[int, list[int]] = {}
    for i, (r, p) in enumerate(zip(runs, prepared, strict=True)):
        groups.setdefault(r.seed if p.splits.val_split != "val" else 0, []).append(i)
    dirs: dict[int, Any] = {}  # id(run) -> its folder
    for members in groups.values():
        ids = [runs[i].run_dir("", slug).as_posix() for i in members]
        batch = {"runs": ids, "trainer": "spar_bench.probes.ensemble.train_heads",
                 "note": "trained as one vmapped batch: agrees with training alone in distribution, not bit for bit"}  # fmt: skip
        dirs.update(_fit_members([runs[i] for i in members], [prepared[i] for i in members], out, batch, progress,
                                 prune_at))
    return [dirs[id(r)] for r in runs]


def _fit_members(runs: list, prepared: list, out, batch: dict, progress: bool, prune_at: int = 0) -> dict:
    """Train one batch's heads, then their blind baselines, then score and write each run.

    Pruned (``prune_at``): a blind baseline stops where its real head was pruned."""
    from ..ensemble import Prune, train_heads

    s0 = prepared[0].splits
    cfgs, seeds = [r.train for r in runs], [r.seed for r in runs]
    feats = lambda split: [p.head.feats[split] for p in prepared]  # noqa: E731
    prune = Prune(prune_at, tuple(seeds)) if prune_at else None
    results = train_heads([p.head.model for p in prepared], (feats("train"), s0.tr), (feats(s0.val_split), s0.va),
                          cfgs, seeds, progress=progress, prune=prune)  # fmt: skip
    if prune is not None:
        losers = tuple(r.pruned_at is not None for r in results)
        prune = replace(prune, losers=losers)
        batch = {**batch, "grid_prune": {"after_epoch": prune_at, "rule": "per seed, the lowest validation loss so far",
                                         "pruned": [i for i, lose in zip(batch["runs"], losers, strict=True) if lose]}}
    blinds: list = [None] * len(runs)
    if runs[0].controls:
        blinds = [p.head.blind() for p in prepared]
        train_heads([b.model for b in blinds], ([b.zero for b in blinds], blind_targets(s0.tr)),
                    ([b.zero for b in blinds], blind_targets(s0.va)), cfgs, seeds, prune=prune)  # fmt: skip
    return {id(r): finish_run(r, p, res, out, blind=b, batch=batch)
            for r, p, res, b in zip(runs, prepared, results, blinds, strict=True)}  # fmt: skip


def execute(job, options: RunOptions = RunOptions()) -> Path:
    """Carry out an opened job (see :func:`run`)."""
    clear_staging(job.rd)
    if not options.overwrite and finished(job.rd, job.record, job.declared, "pass --overwrite"):
        click.echo(f"{job.rd}: finished earlier with these options; kept (--overwrite runs it again)", err=True)
        return job.rd
    job.start()
    metrics, record, files = job.score(job.fit())
    write_run(job.rd, record, metrics, files)
    return job.rd

