"""A predictor made from a build, run as every run kind is: :class:`BuildJob` (the job
:func:`~.session.execute` carries out) and :class:`OnBuild`, which gives a predictor class with
``on_build(probe_spec, build)`` the ``open(spec, out, options)`` every run kind answers
(:data:`spar_bench.probes.kinds.RUN_KINDS`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spar_bench.provenance import RUN_PACKAGES, package_versions, protocol_versions

from .evaluate import evaluate, run_metrics
from .inputs import Splits, build_splits
from .record import RunRecord
from .store import check_run_dir


def train_record(result, patience: int) -> dict[str, Any]:
    """``metrics.json``'s ``train``: epochs, the best epoch and its validation loss, why it stopped."""
    return {**{k: getattr(result, k) for k in ("epochs_run", "best_epoch", "best_val_loss")},
            "stopped_by": result.stopped_by(patience),
            **getattr(result, "pruned", {})}  # pruned_at: stopped by `sweep --grid-prune`

@dataclass
class BuildJob:
    """A predictor that reads a build, not a feature cache (``prior``, ``oracle``, the
    references, 3-D organ maps): spec :class:`~.spec.PredictorSpec`, folder ``OUT/<slug>/<probe>/<head>/seed<k>``."""

    run: Any
    predictor: Any
    build: Any
    rd: Path
    record: RunRecord
    declared: frozenset[str] = frozenset()
    splits: Splits | None = None

    @classmethod
    def of(cls, run, predictor, build, out: str | Path, slug: str) -> BuildJob:

        record = RunRecord(kind=predictor.kind, probe=run.probe, head=run.head, seed=run.seed, model=slug,
                           build=Path(build.root).resolve().name, build_fingerprint=build.fingerprint,
                           options=run.to_dict(), versions=package_versions(RUN_PACKAGES),
                           protocol=protocol_versions(build.manifest),
                           extra={"probe_spec": run.spec.describe()})  # fmt: skip
        return cls(run, predictor, build, run.run_dir(out, slug), record)

    @classmethod
    def open(cls, predictor_type, run, out, options=None) -> BuildJob:
        """The job of a registered predictor class (its ``on_build(probe_spec, build)``), named by its kind."""
        from spar_bench.builder.shards import Build

        build = Build(run.features)
        return cls.of(run, predictor_type.on_build(run.spec, build), build, out, run.kind)

    def start(self) -> None:
        check_run_dir(self.rd, self.declared)
        self.splits = build_splits(self.build, self.run)

    def fit(self):
        return self.predictor.fit(self.splits.tr, self.splits.va)

    def score(self, fitted):
        s, run = self.splits, self.run
        prior = run.spec.fit_prior(s.tr)
        train = train_record(fitted, run.train.patience) if fitted is not None else None
        metrics = run_metrics(run, s, evaluate(run, self.predictor, s, prior), encoder=self.record.model,
                              train=train, training=None, manifest=self.build.manifest,
                              track=self.predictor.kind)  # fmt: skip
        return metrics, self.record, {}


class OnBuild:
    """A predictor made from a build (``on_build(probe_spec, build)``, with ``fit``, ``predict``
    and ``blind``) answers ``open`` as every run kind does: its job is a :class:`BuildJob`."""

    @classmethod
    def open(cls, run, out, options=None) -> BuildJob:
        return BuildJob.open(cls, run, out, options)
