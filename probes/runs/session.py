"""The runner: one run, or a batch of runs, from spec to finished folder.

:func:`run_fit` is the lifecycle of a head on cached features: the finished-run check of
the store, the inputs (:func:`~.inputs.open_run`, :func:`~.inputs.split_targets`), the
predictor's ``fit``, the one evaluation (:func:`~.evaluate.evaluate`) and the store's
write, ``metrics.json`` last. :func:`run_predictor` is the same lifecycle for any
:class:`~.predictors.Predictor` on a build (a reference predictor, an MLLM): a new run
kind is one predictor class. :func:`run_fit_batch` trains the runs of one batch key as one
vmapped batch (:mod:`spar_bench.probes.ensemble`) and writes each as :func:`run_fit` does.

One run = one :class:`~.spec.RunSpec` (cache, probe, head and its options, train config,
seed). Its directory ``OUT/<encoder>[-random-init]/<probe>/<head>[,<options>]/seed<k>/`` holds:

* ``config.json``  - the run spec (``"run"``), the resolved head and train configs, seeds,
  package versions, cache file name + fingerprint, build folder name + fingerprint
  (never an absolute path), ``random_init``;
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
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import RUN_PACKAGES, package_versions, protocol_versions

from .evaluate import evaluate, run_metrics, transfer
from .inputs import (
    Splits,
    cache_identity,
    check_shards,
    encoder_slug,
    load_features,
    open_cache,
    open_run,
    resolve_build,
    split_targets,
)
from .predictors import CachedHead
from .store import METRICS_FILE, finished_run, kept_eval, run_path, write_eval, write_run


class Prepared(NamedTuple):
    """What a head run trains on: its cache and build, targets and its predictor."""

    cache: Any
    build: Any
    splits: Splits
    head: CachedHead


def prepare_run(run, progress: bool = True) -> Prepared:
    """Open and check the run's cache and build; its targets, seeded head and features."""
    cache, build = open_run(run)
    s = split_targets(build, cache, run)
    head = CachedHead.new(run, cache, s)
    head.progress = progress
    return Prepared(cache, build, s, head)


def run_fit(run, out: str | Path, progress: bool = True, overwrite: bool = False) -> Path:
    """Train and score the head of ``run``; write the run directory; return its path.

    A run finished with the same spec is kept (nothing is trained), one with other options is
    refused (:func:`~.store.finished_run`); ``overwrite`` trains it again and replaces it.
    """
    import click

    if not overwrite:
        with open_cache(run.features) as cache:
            rd = run.run_dir(out, encoder_slug(cache))
            if finished_run(run, rd, cache, replace="pass --overwrite"):
                click.echo(f"{rd}: finished earlier with these options; kept (--overwrite trains it again)", err=True)
                return rd
    p = prepare_run(run, progress)
    result = p.head.fit(p.splits.tr, p.splits.va)
    return finish_run(run, p, result, out)


def train_record(result, patience: int) -> dict[str, Any]:
    """``metrics.json``'s ``train``: epochs, the best epoch and its validation loss, why it stopped."""
    return {**{k: getattr(result, k) for k in ("epochs_run", "best_epoch", "best_val_loss")},
            "stopped_by": result.stopped_by(patience),
            **getattr(result, "pruned", {})}  # pruned_at: stopped by `sweep --grid-prune`


def finish_run(run, p: Prepared, result, out: str | Path, blind=None, batch: dict | None = None) -> Path:
    """Score a trained run (test, mirrored, controls) and write its folder.

    ``blind``: the run's blind baseline, already trained (a batch trains them together);
    None trains it here. ``batch`` records the runs it was trained with.
    """
    spec, cache, s = run.spec, p.cache, p.splits
    prior = spec.fit_prior(s.tr)
    weights = cache.meta.get("weights")
    training = weights.get("training") if isinstance(weights, dict) else None  # a finetune export probed frozen
    metrics = run_metrics(run, s, evaluate(run, p.head, s, prior, blind), encoder=encoder_slug(cache),
                          random_init=bool(cache.random_init), layer=run.layer,
                          train=train_record(result, run.train.patience), training=training,
                          manifest=p.build.manifest)  # fmt: skip
    config = run_config(run, cache, p.build, p.head)
    if batch is not None:
        metrics["batch"] = config["batch"] = batch
    rd = run.run_dir(out, encoder_slug(cache))
    write_run(rd, config, metrics, p.head.model, prior)
    return rd


def run_config(run, cache, build, head: CachedHead) -> dict[str, Any]:
    """What ``config.json`` records: the run spec, then what it resolved to and ran with."""
    from spar_bench.seeding import derive_seed

    from ..encoders.base import published_name, published_weights
    from ..heads import head_input

    model, dims = head.model, head.dims
    return {
        "probe": run.probe,
        "head": run.head,
        "seed": run.seed,
        # paths by name only (no local path in anything publishable; eval needs neither)
        "run": {**run.to_dict(), "features": Path(run.features).name,
                "data": Path(run.data).name if run.data else None},
        "variant": run.variant(),
        "probe_spec": run.spec.describe(),
        "seeds": {"torch": run.seed, "bootstrap": [derive_seed(run.seed, "bootstrap", run.probe, run.head, "test")]},
        # names + fingerprints, never absolute paths (eval and report need neither path)
        "features": Path(run.features).name,
        "cache_fingerprint": cache.fingerprint,
        "cache_identity": cache_identity(cache),
        "dataset_dir": Path(build.root).resolve().name,
        "dataset_fingerprint": build.fingerprint,
        "encoder": published_name(str(cache.meta["encoder"]), cache.meta.get("weights"))
        if cache.meta.get("encoder") else None,
        "weights": published_weights(w) if isinstance(w := cache.meta.get("weights"), dict) else None,  # no path
        "random_init": bool(cache.random_init),
        "head_input": head_input(run.head),
        "head_config": model.cfg if hasattr(model, "cfg") else {},
        "in_dim": dims[0],
        "n_tokens": dims[1],
        "train_config": run.train.to_dict(),
        **protocol_versions(build.manifest),
        "versions": package_versions(RUN_PACKAGES),
    }  # fmt: skip


# --------------------------------------------------------------------------- transfer
def _transfer_features(cache, c: dict, spec_run, model, rd: Path, features, split: str, level: str) -> np.ndarray:
    """The features of ``split`` for run ``rd``'s head, checked against what it was trained on."""
    f = load_features(cache, c["head_input"], level, split, spec_run.layer, model)
    if f.shape[-1] != (model.proj_dim if c["head_input"] == "tokens" else c["in_dim"]):
        raise ConfigError(f"{features}: feature width {f.shape[-1]} does not match run {rd} ({c['in_dim']})")
    if c["head_input"] == "tokens" and f.shape[1] != c.get("n_tokens", f.shape[1]):  # e.g. per-tile vs mosaic
        raise ConfigError(f"{features}: {f.shape[1]} tokens per item (tile encoding "
                          f"{cache.tile_encoding}) but run {rd} was trained on {c['n_tokens']}")  # fmt: skip
    return f


def run_eval(run: str | Path, features: str | Path, data: str | Path | None = None, n_boot: int = 1000,
             overwrite: bool = False) -> Path:
    """Score a trained run on another cache without retraining; write ``eval-<cache>.json``
    (kept when it holds this evaluation, refused when another, unless ``overwrite``)."""
    from ..targets import concat, load_targets
    from ..train import predict

    rd = Path(run)
    spec_run, c, prior, model = CachedHead.load(rd)
    spec = spec_run.spec
    trained = json.loads((rd / METRICS_FILE).read_text())
    majority = (trained.get("controls") or {}).get("majority_class")
    cache = open_cache(features)
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
    tests, preds = [], []
    for split in splits:
        t = load_targets(build, spec, split, cache.keys(level, split))
        tests.append(t)
        preds.append(predict(model, _transfer_features(cache, c, spec_run, model, rd, features, split, level), t))
    scored = transfer(concat(tests), np.concatenate(preds), spec_run.seed, n_boot, prior, majority)
    result: dict[str, Any] = {
        "run": run_path(rd),  # <encoder>/<probe>/<head>/seed<k>
        "features": Path(features).name, "cache_fingerprint": cache.fingerprint,
        "encoder": encoder_slug(cache), "random_init": bool(cache.random_init), "splits": splits,
        "probe": spec.name, "head": spec_run.head, "variant": spec_run.variant(), "seed": spec_run.seed,
        "n_bootstrap": n_boot, **scored,
    }  # fmt: skip
    return write_eval(out, result)


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
    from dataclasses import replace

    from ..ensemble import Prune, train_heads
    from .predictors import blind_targets

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


# --------------------------------------------------------------------------- any predictor on a build
def run_predictor(run, predictor, build, out: str | Path, slug: str, overwrite: bool = False) -> Path:
    """The one lifecycle for any :class:`~.predictors.Predictor` on a build (``run``: a
    :class:`~.spec.PredictorSpec`): split by patient, ``fit``, the one evaluation with every
    control, then the run folder ``OUT/<slug>/<probe>/<head>/seed<k>`` (config.json, then
    metrics.json last). A finished run of the same spec and build is kept; of another,
    refused unless ``overwrite``.
    """
    import click

    from ..runs.inputs import build_splits
    from .store import differences, fresh_run_dir, owned_run, recorded, write_config, write_metrics

    rd = run.run_dir(out, slug)
    config = {"probe": run.probe, "head": run.head, "seed": run.seed, "predictor": predictor.kind,
              "run": run.to_dict(), "probe_spec": run.spec.describe(), "encoder": slug,
              "dataset_dir": Path(build.root).resolve().name, "dataset_fingerprint": build.fingerprint,
              **protocol_versions(build.manifest), "versions": package_versions(RUN_PACKAGES)}  # fmt: skip
    if (rd / METRICS_FILE).is_file() and not overwrite:
        had = recorded(rd)
        same = ("run", "predictor", "dataset_fingerprint")
        diff = differences({k: had.get(k) for k in same}, {k: config[k] for k in same})
        if diff:
            raise ConfigError(f"{rd}: finished with {', '.join(diff)}; write to a new --out, or pass --overwrite")
        click.echo(f"{rd}: finished earlier with these options; kept", err=True)
        return rd
    s = build_splits(build, run)
    fitted = predictor.fit(s.tr, s.va)
    prior = run.spec.fit_prior(s.tr)
    train = train_record(fitted, run.train.patience) if fitted is not None else None
    metrics = run_metrics(run, s, evaluate(run, predictor, s, prior), encoder=slug, train=train, training=None,
                          manifest=build.manifest, track=predictor.kind)  # fmt: skip
    fresh_run_dir(rd, owned_run, "run folder")
    write_config(rd, config)
    write_metrics(rd, metrics)
    return rd
