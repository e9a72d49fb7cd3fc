"""The 2-D calibration: does the benchmark tell a model that remembers canonical anatomy from one
that reads the image? It is the ``calibration`` step of ``spar-bench run`` (its config:
:class:`CalibrationConfig`, an experiment file's ``calibration:``); the preset
``recall-vs-computation`` holds docs/RESULTS.md's run, and ``spar-bench check`` compares a rerun
with the reference (:mod:`.calibration_check`).

    spar-bench run recall-vs-computation --only calibration   # docs/RESULTS.md's table alone (~104 min, 2 cores)
    spar-bench check runs/rvc/calibration/calibration.json    # a rerun against docs/calibration.json

Recall (the encoder trained on canonical layouts), computation (trained on random layouts)
and the oracle (answers from the masks), each scored on every probe of ``score`` on the three
layouts' test splits, with the blind rows (the question-only optimum fitted on canonical and
on random layouts), the mirrored counterfactuals of the canonical test slices and the conflict
items (those whose canonical-anatomy answer is wrong). The encoders train end to end on
``probes`` (default relative position) with ``head``; every other probe is a frozen probe
with the same head (``spar-probe fit``) of the trained encoder's feature caches.
``organ_maps: N``: the computation model's encoder instead learns organ maps of the random
layouts' slices for N epochs (``probes.finetune.organmaps``: which organs each token covers; no
question seen; 128 px input), and answers the geometric Level 3 probes by reading its maps
(:class:`~spar_bench.probes.finetune.readout.OrganMapReadout`: each organ's centre and area,
then the oracle's rule: nothing fitted to answers); Levels 1-2 and counting are frozen ``head``
probes of it. ``organ_map_dice: W`` adds a soft Dice term to its loss (small organs heard as
much as large ones) and a BCE share head for areas: centres from the organ head's maps, areas
from the share head's. Writes ``OUT/calibration.md``, ``.json``, ``.png`` and
``OUT/plots/<probe>.png``; the experiment's report carries the tables as a section.

The phantoms: three datasets (``spar-build phantom --layout canonical|random|mirrored
--intensities distinct``: every organ its own mean HU, so that an organ can be found by its
appearance in any layout), each built into shards with mirrored counterfactuals, ``questions``
Level 3 questions per probe and slice on every ``l3_stride``-th slice. The encoder: a narrow
ResNet-10-T (channels 16-32-64-128, output stride 8, 64 x 64 input: 8 x 8 tokens) trained FROM
SCRATCH (``spar-probe finetune --init scratch``).

The reference models are predictors of the package: the oracle is
:class:`~spar_bench.probes.references.slice_oracle.SliceOracle` (run kind ``slice-oracle``), the
trained encoders :class:`~spar_bench.probes.finetune.predictor.FinetunedEncoder` (re-encoding
each layout's images) or frozen ``spar-probe fit`` heads of them, the organ-map readout
:class:`~spar_bench.probes.finetune.readout.OrganMapReadout`; the tests' tiny reader is
:class:`~spar_bench.probes.references.reader.AppearanceReader` (run kind ``reader``). Tables and
plots: :mod:`.calibration_tables`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from spar_bench.builder.build import BuildConfig, build
from spar_bench.builder.phantom import PhantomOptions, write_phantom_dataset
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.fields import check_fields, limited
from spar_bench.hashing import sha256_json
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
from spar_bench.probes.finetune.organmaps import (
    MAP_ENCODER,
    MAP_MODEL_ARGS,
    OrganMapConfig,
    pretrain_organ_maps,
)
from spar_bench.probes.finetune.predictor import FinetunedEncoder
from spar_bench.probes.finetune.readout import READOUT_PROBES, OrganMapReadout
from spar_bench.probes.hardware import pick_device
from spar_bench.probes.references.slice_oracle import SliceOracle
from spar_bench.probes.runs.evaluate import bootstraps, score
from spar_bench.probes.runs.inputs import BuildKeys, open_cache
from spar_bench.probes.runs.predictors import CachedHead
from spar_bench.probes.runs.session import head_on_cache, run_all
from spar_bench.probes.runs.session import run as run_finetune
from spar_bench.probes.runs.spec import make_run
from spar_bench.probes.targets import load_targets
from spar_bench.probes.tasks import get_probe, probe_names

from .calibration_tables import (
    BLINDS,
    LAYOUTS,
    TRAIN_ON,
    calibration_plots,
    calibration_section,
    table_metric,
)

PROBES = ("level3.relative_position", "level3.orientation", "level1.localisation")
ENCODER = "timm:resnet10t"
MODEL_ARGS = {"channels": [16, 32, 64, 128], "stem_width": 16, "output_stride": 8,
              "pretrained_cfg_overlay": {"input_size": [3, 64, 64]}}
HEAD = "attnpool"
#: The computation model's encoder when it learns organ maps (``--organ-maps N``): run kind
#: ``organmaps``'s (the same network at 128 x 128 input with output stride 16, still 8 x 8 tokens).
ORGAN_MAP_MODEL_ARGS = MAP_MODEL_ARGS
INTENSITIES = "distinct"  # every organ its own mean HU: organs recognisable in any layout
L3_STRIDE = 4  # every 4th slice: more layouts (cases) per image trained on


@dataclass(frozen=True)
class Data:
    """The phantom builds: cases per layout, grid (None: the ``small`` preset), sampling."""

    cases: dict[str, int]
    samples: int = 4
    questions: int = 16
    l3_stride: int = L3_STRIDE
    in_plane: int | None = None
    slices: int | None = None
    levels: tuple[str, ...] = ("level1", "level3")

    def grid_suffix(self) -> str:
        """Folder-name suffix of a non-default grid (phantoms of other grids never mix)."""
        return f"-{self.in_plane or 'p'}x{self.slices or 'p'}" if (self.in_plane or self.slices) else ""

    def suffix(self) -> str:
        """Shards' folder-name suffix: the grid's, a non-default Level 3 stride and questions."""
        return (self.grid_suffix() + (f"-s{self.l3_stride}" if self.l3_stride != L3_STRIDE else "")
                + (f"-q{self.questions}" if self.questions != 16 else ""))


def _phantom_done(ph: Path, n: int, layout: str, seed: int) -> bool:
    """A complete phantom dataset of these settings is already at ``ph`` (written atomically)."""
    try:
        rec = json.loads((ph / "phantom.json").read_text())
    except (OSError, ValueError):
        return False
    return (rec.get("n"), rec.get("layout"), rec.get("seed"), rec.get("intensities")) == (n, layout, seed, INTENSITIES)


def build_all(out: Path, data: Data, seed: int, jobs: int = 1) -> dict[str, Path]:
    """One phantom (distinct organ intensities) + shards per layout (Levels 1 and 3, mirrored
    counterfactuals, ``data.questions`` Level 3 questions per probe and slice), each rendered
    and built by ``jobs`` processes (the bytes do not depend on it)."""
    builds = {}
    for i, layout in enumerate(LAYOUTS):
        if layout not in data.cases:  # a layout left out (the calibration test builds two)
            continue
        ph, shards = out / f"phantom-{layout}{data.grid_suffix()}", out / f"shards-{layout}{data.suffix()}"
        builds[layout] = shards
        if (shards / "manifest.json").is_file():
            continue
        n, grid = data.cases[layout], (data.in_plane, data.slices)
        if not _phantom_done(ph, n, layout, seed + i):
            print(f"$ spar-build phantom --out {ph} --n {n} --layout {layout} --seed {seed + i} "
                  f"--intensities {INTENSITIES} --overwrite  # in-plane, slices: {grid}", flush=True)
            opts = PhantomOptions(layout=layout, seed=seed + i, intensities=INTENSITIES, in_plane=data.in_plane,
                                  n_slices=data.slices)
            write_phantom_dataset(ph, n, opts, overwrite=True, progress=False, workers=jobs)
        sample = {"levels": list(data.levels), "samples_per_case": data.samples, "counterfactual": "mirror",
                  "l3_questions_per_probe": data.questions, "l3_stride": data.l3_stride}
        print(f"$ build {shards} from {ph}: {json.dumps(sample)}", flush=True)
        build(BuildConfig(sources=("phantom",), roots=(str(ph),), out=str(shards), sample=sample, hf=False,
                          overwrite=True, workers=jobs), quiet=True)
    return builds


@dataclass(frozen=True)
class Training:
    """What is trained: the encoder (timm ``model_args``), head, schedule, seed and which runs."""

    model_args: dict[str, Any] = field(default_factory=lambda: dict(MODEL_ARGS))
    head: str = HEAD
    epochs: int = 14
    patience: int = 5
    lr: float = 2e-3
    seed: int = 0
    train_on: tuple[str, ...] = TRAIN_ON
    probes: tuple[str, ...] = PROBES
    train_mirrors: bool = False
    score: tuple[str, ...] = ()  # calibration: every probe scored (``tr.probes``: those trained end to end)
    organ_maps: int = 0  # calibration: >0: the computation encoder learns organ maps for this many epochs
    organ_map_dice: float = 0.0  # ... with this weight of the soft Dice term (organmaps.organ_map_loss)
    device: str = "cpu"  # where encoders train and encode (fp32); heads and the readout stay on the CPU


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration step's settings (``calibration:`` of an experiment file, e.g. the preset
    ``recall-vs-computation``): the phantom builds', the trained models' and the scoring's."""

    out: str = "runs/rvc-cal"
    cases: int = limited(100, lo=1, help="phantom cases of each training layout (canonical, random)")
    eval_cases: int = limited(24, lo=1, help="phantom cases of the mirrored layout")
    in_plane: int | None = limited(None, lo=16, help="phantom in-plane voxels (default: 160, 'small')")
    slices: int | None = limited(None, lo=1, help="phantom slices per case (default: 40-60, 'small')")
    l3_stride: int = limited(L3_STRIDE, lo=1, help="Level 3 on every Nth slice")
    samples: int = limited(4, lo=1, help="Level 1 mosaics per case")
    questions: int = limited(16, lo=1, help="Level 3 questions per probe and slice")
    seed: int = limited(0, help="the phantoms' seed")
    jobs: int = limited(1, lo=1, help="processes that render and build the phantoms (the bytes do not depend on it)")
    probes: tuple[str, ...] = limited(("level3.relative_position",),
                                      help="the probes the encoders train end to end on (the first: every other probe "
                                           "is a frozen probe of its encoder)")
    score: tuple[str, ...] = limited(("all",), help="the probes scored (all: the eight of Levels 1-3)")
    model_args: dict[str, Any] = field(default_factory=dict)  # merged into MODEL_ARGS (the encoder's timm args)
    head: str = limited(HEAD, help="the head of the end-to-end and the frozen probes")
    train_mirrors: bool = limited(False, help="the computation model trains on the mirrored counterfactuals too")
    lr: float = limited(2e-3, lo=0, help="learning rate")
    epochs: int = limited(14, lo=1, help="end-to-end training epochs at most")
    patience: int = limited(5, lo=1, help="early-stopping patience (epochs)")
    seeds: tuple[int, ...] = limited((0,), help="training seeds (the table: mean +- std over them)")
    bootstrap: int = limited(200, lo=0, help="patient-bootstrap resamples of each interval")
    device: str = limited("cpu", help="where the encoders train and encode, in fp32 (heads and readout: the CPU)")
    threads: int = limited(1, lo=1, help="torch threads (1: on a shared 2-core machine more threads only contend)")
    organ_maps: int = limited(0, lo=0, help="the computation encoder learns organ maps for this many epochs "
                                            "(0: it trains end to end like recall)")
    organ_map_dice: float = limited(0.0, lo=0, help="weight of the organ-map loss's soft Dice term")

    def __post_init__(self) -> None:
        for name in ("probes", "score", "seeds"):  # a file's list, a string: a tuple
            v = getattr(self, name)
            object.__setattr__(self, name, tuple(v.split(",")) if isinstance(v, str) else tuple(v))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "model_args", dict(self.model_args or {}))
        for name in ("lr", "organ_map_dice"):  # 1 and 1.0 are one run (the organ maps' identity)
            object.__setattr__(self, name, float(getattr(self, name)))
        check_fields(self)
        if not self.probes or not self.seeds:
            raise ConfigError("calibration: probes and seeds must not be empty")

    def layout_cases(self) -> dict[str, int]:
        """Phantom cases per layout: ``cases`` for the training layouts, ``eval_cases`` for the mirrored."""
        return {lay: self.cases if lay in TRAIN_ON else self.eval_cases for lay in LAYOUTS}


def runs_root(out: Path, tr: Training) -> Path:
    """``OUT/runs``, or for other encoder model args ``OUT/runs-<hash>`` (run folders do not name them)."""
    if tr.model_args == MODEL_ARGS:
        return out / "runs"
    return out / f"runs-{sha256_json(tr.model_args)[:10]}"


def train_run(builds: dict[str, Path], out: Path, tr: Training, train_on: str, probe: str,
              n_boot: int = 200) -> Path:
    """The encoder trained from scratch with ``tr.head`` on ``probe`` of the ``train_on`` build (a
    finished run is kept). ``tr.train_mirrors`` adds the mirrored counterfactuals to the training
    data of non-canonical layouts only (canonical slices and their flips would be two layouts)."""
    cfg = FinetuneConfig(encoder_lr=tr.lr, head_lr=tr.lr, batch_size=32, max_epochs=tr.epochs,
                         warmup_epochs=1, patience=tr.patience, device=tr.device, compute="fp32")
    fs = FinetuneSpec(ENCODER, str(builds[train_on]), probe, tr.head, tr.seed, init="scratch",
                      model_kwargs=tr.model_args, cfg=cfg, n_boot=n_boot,
                      train_mirrors=tr.train_mirrors and train_on != "canonical")
    return run_finetune(fs, runs_root(out, tr), resume=True, progress=False)


# ------------------------------------------------------------------ calibration (issue 26)
#: What each trained reference model trains on (the oracle trains on nothing: it reads the masks).
MODEL_TRAIN_ON = {"recall": "canonical", "computation": "random"}
def split_items(build_root: Path, probe: str, keys: Any = None, split: str = "test"):
    """The probe's items of a split (originals and mirrored counterfactuals; default the test
    split) of a build, in the order of ``keys`` (a cache's; None: the build's own)."""
    spec, b = get_probe(probe), Build(build_root)
    return load_targets(b, spec, split, BuildKeys(b).keys(spec.level, split) if keys is None else keys)


def prior_of(build_root: Path, probe: str) -> dict:
    """The probe's prior (question-only optimum) fitted on a build's original training items."""
    spec, b = get_probe(probe), Build(build_root)
    tr = load_targets(b, spec, "train", BuildKeys(b).keys(spec.level, "train"))
    return spec.fit_prior(tr.subset(~tr.is_mirror))


def encoder_caches(rd: Path, builds: dict[str, Path], out: Path, device: str = "cpu") -> dict[str, Path]:
    """Feature caches of run ``rd``'s trained encoder over every layout's build (frozen, fp32)."""
    caches = {}
    for layout, b in builds.items():
        caches[layout] = out / f"cache-{layout}.h5"
        opts = CacheOptions(weights=str(rd / "encoder.safetensors"), device=device, compute="fp32", dtype="fp32")
        write_cache(ENCODER, b, caches[layout], opts, progress=False)
    return caches


#: The frozen probes' training (``spar-probe fit`` options): a short budget on a shared CPU.
FROZEN_HEAD_OPTIONS = {"max_epochs": 15, "patience": 4}


def frozen_head_predict(caches: dict[str, Path], builds: dict[str, Path], train_on: str, probe: str,
                        tr: Training, out: Path, n_boot: int) -> dict[str, tuple]:
    """A ``tr.head`` probe (``spar-probe fit``) on the frozen encoder's cache of the training layout,
    then its predictions on every layout's test items (:func:`~spar_bench.probes.runs.session.head_on_cache`,
    as ``spar-probe eval`` reads them): ``{layout: (targets, predictions)}``; ``{}`` when the
    training layout has no items of the probe (the session's loop skips it in one line)."""
    run = make_run(str(caches[train_on]), probe, tr.head, tr.seed, dict(FROZEN_HEAD_OPTIONS), data=str(builds[train_on]),
                   n_boot=n_boot, controls=False)  # the blind rows are the priors
    fitted = [rd for _, rd in run_all([[run]], out, skip_unavailable=True, progress=False)]
    if not fitted:  # no items of the probe on the training layout (skipped in one line): no predictions
        return {}
    loaded, got = CachedHead.load(fitted[0]), {}
    for layout, path in caches.items():
        with open_cache(path) as cache:
            got[layout] = head_on_cache(fitted[0], loaded, cache, Build(builds[layout]))
    return got


def predicted(predictor, build_root: Path, probe: str) -> tuple[Any, np.ndarray]:
    """``(test items, predictions)`` of a fitted :class:`~spar_bench.probes.runs.predictors.Predictor`
    on a build's test split."""
    t = split_items(build_root, probe)
    return t, predictor.predict(t, "test")


def oracle_items(build_root: Path, probe: str) -> tuple[Any, np.ndarray]:
    """The slice oracle (:class:`~spar_bench.probes.references.slice_oracle.SliceOracle`) on a build's test items."""
    return predicted(SliceOracle(get_probe(probe), Build(build_root)), build_root, probe)


def model_predictor(how: str, run: Path, build_root: Path, probe: str, device: str, geometry: dict):
    """The trained model's predictor on one build: ``readout`` (organ maps read out by geometry,
    the test slices' geometry kept in ``geometry`` per build for the other probes) or
    ``finetuned`` (the end-to-end run re-encoding the build's images)."""
    if how == "finetuned":
        return FinetunedEncoder.from_run(run, Build(build_root), device, "fp32")
    return OrganMapReadout(get_probe(probe), Build(build_root), run, device, geometry.get(str(build_root)))


def score_model(t, pred: np.ndarray, canon_prior: dict, seed: int, n_boot: int) -> dict:
    """A layout's cell: the table metric of ``pred`` on the original test items (CI over patients),
    on the mirrored counterfactuals, and on the conflict items of each: those the canonical prior
    (canonical anatomy's answer) gets wrong (Level 3 only). Scored by the evaluation of every run
    kind (:func:`~spar_bench.probes.runs.evaluate.score`); the conflict items' interval draws from a
    bootstrap stream of its own (``conflict``), as docs/calibration.json's were."""
    key = table_metric(t.spec.name)
    boot = bootstraps(seed, "calibration", t.spec.name)
    orig, mir = ~t.is_mirror, t.is_mirror
    s = score(t.subset(orig), pred[orig], boot("test"), n_boot)
    out = {"value": s.get(key), "ci": (s.get("ci") or {}).get(key), "all": _plain(s)}
    m = score(t.subset(mir), pred[mir], None, 0, canon_prior) if mir.any() else {}
    if mir.any():
        out["mirror_cf"] = m.get(key)
    c = t.spec.conflict(canon_prior, t.subset(orig), pred[orig], boot("conflict"), n_boot)
    if c is not None:
        out["conflict"], out["conflict_n"] = c.get(key), c.get("n")
        out["conflict_ci"] = (c.get("ci") or {}).get(key)
    if "conflict" in m:
        out["mirror_conflict"], out["mirror_conflict_n"] = m["conflict"].get(key), m["conflict"].get("n")
    return out


def _plain(d: dict) -> dict:
    """The scalar metrics of a score (no per-organ / per-axis breakdowns)."""
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) or v is None}


def reference_rows(builds: dict[str, Path], probes: tuple[str, ...], n_boot: int) -> list[dict]:
    """The rows that do not depend on a training seed: the oracle and the blind baselines."""
    rows = []
    for probe in probes:
        canon = prior_of(builds["canonical"], probe)
        cells = {lay: score_model(*oracle_items(builds[lay], probe), canon, 0, n_boot) for lay in LAYOUTS}
        rows.append({"probe": probe, "model": "oracle", "seed": None, "cells": cells})
        for name, fitted_on in BLINDS.items():
            prior, cells = prior_of(builds[fitted_on], probe), {}
            for lay in LAYOUTS:
                t = split_items(builds[lay], probe)
                cells[lay] = score_model(t, t.spec.prior_predict(prior, t), canon, 0, n_boot)
            rows.append({"probe": probe, "model": name, "seed": None, "cells": cells})
    return rows


def cached_reference_rows(builds: dict[str, Path], probes: tuple[str, ...], n_boot: int, path: Path) -> list[dict]:
    """:func:`reference_rows`, kept in ``path`` for the same builds (fingerprints), probes and bootstrap."""
    key = {"builds": {lay: Build(b).fingerprint for lay, b in builds.items()}, "probes": list(probes), "n_boot": n_boot}
    try:
        kept = json.loads(path.read_text())
        if kept["key"] == key:
            return kept["rows"]
    except (OSError, ValueError, KeyError):
        pass
    rows = reference_rows(builds, probes, n_boot)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "rows": rows}, default=float) + "\n")
    tmp.replace(path)
    return rows


def model_rows(builds: dict[str, Path], out: Path, tr: Training, model: str, n_boot: int) -> list[dict]:
    """One trained reference model (``recall`` or ``computation``), one seed, on every probe: the
    encoder trained end to end on ``tr.probes[0]`` (its own head scores that probe and every
    other of ``tr.probes``), a frozen probe of that encoder, with the same head, for every other probe."""
    train_on = MODEL_TRAIN_ON[model]
    if model == "computation" and tr.organ_maps:
        runs, enc_run = {}, organ_map_run(builds, out, tr)
    else:
        runs = {p: train_run(builds, out, tr, train_on, p) for p in tr.probes}
        enc_run = runs[tr.probes[0]]
    caches = encoder_caches(enc_run, builds, enc_run / "calibration", tr.device)
    rows, geometry = [], {}
    for probe in [p for p in probe_names() if p in tr.score]:
        readout = bool(model == "computation" and tr.organ_maps and probe in READOUT_PROBES)
        how = "readout" if readout else "finetuned" if probe in runs else "frozen"
        got = model_predictions(how, Trained(runs.get(probe, enc_run), train_on, caches), builds, probe, tr,
                                geometry, n_boot)  # {}: a frozen probe with nothing to train on (a layout without it)
        canon = prior_of(builds["canonical"], probe)
        cells = {lay: score_model(t, pred, canon, tr.seed, n_boot) for lay, (t, pred) in got.items()}
        cells = {lay: cells.get(lay, {"value": None}) for lay in LAYOUTS}
        rows.append({"probe": probe, "model": model, "seed": tr.seed, "cells": cells,
                     "how": {"readout": "organ maps + geometric readout", "finetuned": "finetuned"}.get(
                         how, f"frozen encoder + {tr.head} probe")})
        print(json.dumps({k: rows[-1][k] for k in ("probe", "model", "seed")}
                         | {lay: c["value"] for lay, c in cells.items()}), flush=True)
    return rows


class Trained(NamedTuple):
    """A trained model's run for one probe (its own end-to-end run, or the encoder's), the layout
    it trained on and its encoder's feature caches per layout."""

    run: Path
    train_on: str
    caches: dict[str, Path]


def model_predictions(how: str, model: Trained, builds: dict[str, Path], probe: str, tr: Training,
                      geometry: dict, n_boot: int) -> dict[str, tuple]:
    """``{layout: (test items, predictions)}`` of one trained model on one probe (``how``:
    ``readout``, ``finetuned`` or ``frozen``, see :func:`model_rows`)."""
    run = model.run
    if how == "frozen":
        return frozen_head_predict(model.caches, builds, model.train_on, probe, tr, run / "calibration" / "heads",
                                   n_boot)
    got = {}
    for lay in LAYOUTS:
        p = model_predictor(how, run, builds[lay], probe, tr.device, geometry)
        got[lay] = predicted(p, builds[lay], probe)
        if how == "readout":
            geometry[str(builds[lay])] = p.geometry
    return got


def organ_map_run(builds: dict[str, Path], out: Path, tr: Training) -> Path:
    """The computation model's encoder trained from scratch on the organ maps of the random
    layouts' Level 3 slices (``probes.finetune.organmaps``; no question seen), with
    :data:`ORGAN_MAP_MODEL_ARGS`; :data:`~spar_bench.probes.finetune.readout.READOUT_PROBES` are then read out of its maps, every
    other probe is a frozen ``tr.head`` probe of it."""
    cfg = OrganMapConfig(epochs=tr.organ_maps, lr=tr.lr, seed=tr.seed, dice=tr.organ_map_dice)
    dice = f"-dice{tr.organ_map_dice:g}" if tr.organ_map_dice else ""
    rd = out / "organ-maps" / f"{builds['random'].name}-e{tr.organ_maps}{dice}" / f"seed{tr.seed}"
    print(f"computation encoder: organ maps, {tr.organ_maps} epochs -> {rd.relative_to(out)}", flush=True)
    return pretrain_organ_maps(MAP_ENCODER, builds["random"], rd, cfg, ORGAN_MAP_MODEL_ARGS, progress=False,
                               device=tr.device)


def calibration_rows(builds: dict[str, Path], out: Path, trainings: list[Training], n_boot: int) -> list[dict]:
    """The oracle and blind rows, then recall and computation for every training seed."""
    rows = cached_reference_rows(builds, trainings[0].score, n_boot, out / "reference-rows.json")
    for tr in trainings:
        for model in ("recall", "computation"):
            rows += model_rows(builds, out, tr, model, n_boot)
    return rows


def configs(cfg: CalibrationConfig) -> tuple[Data, list[Training]]:
    """The builds' and trainings' settings of a calibration step's config."""
    scored = tuple(p for p in probe_names() if p.split(".")[0] in ("level1", "level2", "level3")) \
        if cfg.score == ("all",) else tuple(get_probe(p).name for p in cfg.score)
    levels = tuple(lv for lv in ("level1", "level2", "level3") if any(p.startswith(lv) for p in cfg.probes + scored))
    data = Data(cfg.layout_cases(), cfg.samples, cfg.questions, cfg.l3_stride, cfg.in_plane, cfg.slices, levels)
    model_args = {**MODEL_ARGS, **cfg.model_args}
    trainings = [Training(model_args, cfg.head, cfg.epochs, cfg.patience, cfg.lr, s, TRAIN_ON, cfg.probes,
                          cfg.train_mirrors, scored, cfg.organ_maps, cfg.organ_map_dice, cfg.device)
                 for s in cfg.seeds]
    return data, trainings


def conditions(cfg: CalibrationConfig, tr: Training, t0: float, t_build: float) -> dict[str, Any]:
    """What the table was made under (``spar-bench check`` compares all but :data:`~.calibration_check.MACHINE_CONDITIONS`)."""
    return {"cases": cfg.layout_cases(), "grid (in-plane, slices)": [cfg.in_plane, cfg.slices],
            "intensities": INTENSITIES, "samples_per_case": cfg.samples, "l3_questions_per_probe": cfg.questions,
            "l3_stride": cfg.l3_stride, "trained_end_to_end_on": list(tr.probes), "head": tr.head,
            "max_epochs": tr.epochs, "patience": tr.patience, "lr": tr.lr,
            "train_mirrors (computation only)": tr.train_mirrors, "seeds": list(cfg.seeds),
            "computation encoder": (f"organ maps, {tr.organ_maps} epochs, Dice weight {tr.organ_map_dice:g}, "
                                    f"model_args {ORGAN_MAP_MODEL_ARGS}" if tr.organ_maps else "end to end, like recall"),
            "encoder": ENCODER, "model_args": tr.model_args, "device": tr.device, "jobs": cfg.jobs,
            "threads": cfg.threads, "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
            "build_seconds": round(t_build, 1), "wall_seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def write_calibration(out: Path, rows: list[dict], conds: dict[str, Any]) -> None:
    """``calibration.json`` (the rows and their conditions), ``calibration.md`` (the tables of
    docs/RESULTS.md), ``calibration.png`` and ``plots/``."""
    (out / "calibration.json").write_text(json.dumps({"conditions": conds, "rows": rows}, indent=1) + "\n")
    md = ["# The benchmark calibrated: recall, computation and the oracle on every probe", "",
          *calibration_section(rows), f"Conditions: {json.dumps(conds)}", ""]
    (out / "calibration.md").write_text("\n".join(md))
    calibration_plots(rows, out)


def run_calibration(cfg: CalibrationConfig) -> Path:
    """The calibration step: build the phantoms, train and score recall, computation, the oracle
    and the blind rows (:func:`calibration_rows`) and write them (:func:`write_calibration`) to
    ``cfg.out``; returns it. A run stopped part way keeps its finished builds and runs."""
    import torch

    pick_device(cfg.device)  # a bad or absent device fails here, not after the phantoms are built
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data, trainings = configs(cfg)
    t0 = time.perf_counter()
    builds = build_all(out, data, cfg.seed, cfg.jobs)
    t_build = time.perf_counter() - t0
    rows = calibration_rows(builds, out, trainings, cfg.bootstrap)
    write_calibration(out, rows, conditions(cfg, trainings[0], t0, t_build))
    return out
