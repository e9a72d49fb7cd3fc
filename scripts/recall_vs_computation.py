"""Recall versus computation, end to end: does the benchmark tell a model that remembers
canonical anatomy from one that reads the image?

    python scripts/recall_vs_computation.py --out runs/rvc            # the docs/RESULTS.md table (~30 min on 2 busy cores)
    python scripts/recall_vs_computation.py --out /tmp/rvc --quick    # a smoke run (minutes)
    # the computation model of issue 26 (docs/RESULTS.md): 600 random layouts on a 96x16 grid, mirrors as training data
    python scripts/recall_vs_computation.py --out runs/rvc26 --train-on random --seeds 0,1 \
        --probes level3.relative_position,level3.orientation --cases 600 --eval-cases 40 \
        --in-plane 96 --slices 16 --l3-stride 2 --train-mirrors

    # issue 26: the three reference models on the eight probes of Levels 1-3 (docs/RESULTS.md, "calibrated")
    python scripts/recall_vs_computation.py --out runs/rvc-cal --calibrate --seeds 0,1 --cases 1000 \
        --eval-cases 40 --in-plane 96 --slices 16 --l3-stride 2 --samples 1 --train-mirrors \
        --epochs 16 --patience 5 --head coordpool --organ-maps 10 --organ-map-dice 1 --threads 2

``--calibrate``: recall (the encoder trained on canonical layouts), computation (trained on
random layouts) and the oracle (answers from the masks), each scored on every probe of
``--score`` on the three layouts' test splits, with the blind rows (the question-only optimum
fitted on canonical and on random layouts), the mirrored counterfactuals of the canonical
test slices and the conflict items (those whose canonical-anatomy answer is wrong). The
encoders train end to end on ``--probes`` (default relative position) with ``--head``; every
other probe is a frozen probe with the same head (``spar-probe fit``) of the trained encoder's
feature caches. ``--organ-maps N``: the computation model's encoder instead learns organ maps
of the random layouts' slices for N epochs (``probes.finetune.organmaps``: which organs each
token covers; no question seen; 128 px input), and answers the geometric Level 3 probes by
reading its maps (each organ's centre and area, then the oracle's rule: nothing fitted to
answers); Levels 1-2 and counting are frozen ``--head`` probes of it. ``--organ-map-dice W``
adds a soft Dice term to its loss (small organs heard as much as large ones) and a BCE share
head for areas: centres from the organ head's maps, areas from the share head's.
Writes ``OUT/calibration.md``, ``.json``, ``.png`` and ``OUT/plots/<probe>.png``.

1. Three phantom datasets (``spar-build phantom --layout canonical|random|mirrored
   --intensities distinct``: every organ its own mean HU, so that an organ can be found by
   its appearance in any layout), each built into shards with Levels 1 and 3 and mirrored
   counterfactuals, 16 Level 3 questions per probe and slice, every 4th slice.
2. The same small encoder (a narrow ResNet-10-T, channels 16-32-64-128, output stride 8,
   64 x 64 input: 8 x 8 tokens) trained FROM SCRATCH with an ``attnpool`` head
   (``spar-probe finetune --init scratch``) on the canonical build and, separately, on the
   random-layout build, for Level 3 relative position and orientation and Level 1.
3. Every run scored in domain and, re-encoding their images with its own encoder
   (``spar-probe eval --run RUN --data BUILD``), on the test split of the other layouts.
   Beside every number: the blind baseline, the best question-only answer fitted on the
   training build (majority answer per question type; Level 1: the mean training centroid)
   and scored on the same test items.

Writes ``OUT/results.md`` (the table), ``OUT/results.json`` and ``OUT/results.png``.
Expected: the canonical-trained model is near its ceiling in domain (as is its blind
baseline: canonical anatomy answers most questions) and falls towards chance, or below, on
mirrored anatomy; the random-trained model, which cannot lean on recall, holds across layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LAYOUTS = ("canonical", "mirrored", "random")
TRAIN_ON = ("canonical", "random")
PROBES = ("level3.relative_position", "level3.orientation", "level1.localisation")
ENCODER = "timm:resnet10t"
MODEL_ARGS = {"channels": [16, 32, 64, 128], "stem_width": 16, "output_stride": 8,
              "pretrained_cfg_overlay": {"input_size": [3, 64, 64]}}
HEAD = "attnpool"
#: The computation model's encoder when it learns organ maps (``--organ-maps N``): the same
#: network at 128 x 128 input with output stride 16 (still 8 x 8 tokens), so that small organs
#: keep their pixels in the stem (at 64 px the smallest are 2-3 pixels wide).
ORGAN_MAP_MODEL_ARGS = {**MODEL_ARGS, "output_stride": 16, "pretrained_cfg_overlay": {"input_size": [3, 128, 128]}}
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
    from spar_bench.builder.build import BuildConfig, build
    from spar_bench.builder.phantom import PhantomOptions, write_phantom_dataset

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


def blind(train_build: Path, eval_build: Path, probe: str) -> float | None:
    """The question-only optimum fitted on the training build, scored on the eval build's test items."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    spec = get_probe(probe)
    bt, be = Build(train_build), Build(eval_build)
    tr = load_targets(bt, spec, "train", BuildKeys(bt).keys(spec.level, "train"))
    te = load_targets(be, spec, "test", BuildKeys(be).keys(spec.level, "test"))
    tr, te = tr.subset(~tr.is_mirror), te.subset(~te.is_mirror)
    return spec.score(te, spec.prior_predict(spec.fit_prior(tr), te), None, 0).get(spec.headline)


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


def runs_root(out: Path, tr: Training) -> Path:
    """``OUT/runs``, or for other encoder model args ``OUT/runs-<hash>`` (run folders do not name them)."""
    if tr.model_args == MODEL_ARGS:
        return out / "runs"
    import hashlib

    return out / f"runs-{hashlib.sha256(json.dumps(tr.model_args, sort_keys=True).encode()).hexdigest()[:10]}"


def train_run(builds: dict[str, Path], out: Path, tr: Training, train_on: str, probe: str,
              n_boot: int = 200) -> Path:
    """The encoder trained from scratch with ``tr.head`` on ``probe`` of the ``train_on`` build (a
    finished run is kept). ``tr.train_mirrors`` adds the mirrored counterfactuals to the training
    data of non-canonical layouts only (canonical slices and their flips would be two layouts)."""
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.runs.session import run as run_finetune

    cfg = FinetuneConfig(encoder_lr=tr.lr, head_lr=tr.lr, batch_size=32, max_epochs=tr.epochs,
                         warmup_epochs=1, patience=tr.patience, device=tr.device, compute="fp32")
    fs = FinetuneSpec(ENCODER, str(builds[train_on]), probe, tr.head, tr.seed, init="scratch",
                      model_kwargs=tr.model_args, cfg=cfg, n_boot=n_boot,
                      train_mirrors=tr.train_mirrors and train_on != "canonical")
    return run_finetune(fs, runs_root(out, tr), resume=True, progress=False)


def train_and_score(builds: dict[str, Path], out: Path, tr: Training, n_boot: int) -> list[dict]:
    from spar_bench.probes.finetune.encoding import run_eval_reencoded
    from spar_bench.probes.tasks import get_probe

    rows = []
    for train_on in tr.train_on:
        for probe in tr.probes:
            t0 = time.perf_counter()
            rd = train_run(builds, out, tr, train_on, probe, n_boot)
            m = json.loads((rd / "metrics.json").read_text())
            key = get_probe(probe).headline
            row = {"probe": probe, "trained_on": train_on, "metric": key, "run": str(rd.relative_to(out)),
                   "epochs": m["train"]["epochs_run"], "img_s": json.loads((rd / "timing.json").read_text())["images_per_s"],
                   "seed": tr.seed, "chance": m["controls"].get("chance"), "cells": {}}
            for layout in LAYOUTS:
                if layout == train_on:
                    r = m
                else:
                    r = json.loads(run_eval_reencoded(rd, builds[layout], n_boot, device=tr.device,
                                                      compute="fp32").read_text())
                row["cells"][layout] = {"model": r["test"].get(key), "ci": (r["test"].get("ci") or {}).get(key),
                                        "mirror_cf": (r.get("mirror") or {}).get(key),
                                        "blind": blind(builds[train_on], builds[layout], probe)}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------------ calibration (issue 26)
#: The reference models: what each one trains on (the oracle trains on nothing: it reads the masks).
MODELS = ("recall", "computation", "oracle")
MODEL_TRAIN_ON = {"recall": "canonical", "computation": "random"}
#: The blind rows: the question-only optimum (the probe's prior) fitted on each training layout.
BLINDS = {"blind (canonical prior)": "canonical", "blind (random prior)": "random"}
#: The metric of each level's table cell (Level 2's exact permutation is ~0 for every trained
#: model at 8+ tiles, so the table shows its per-tile accuracy; the JSON holds every metric).
TABLE_METRIC = {"level1": "med_px", "level2": "tile_acc"}


def table_metric(probe: str) -> str:
    return TABLE_METRIC.get(probe.split(".", 1)[0], "accuracy")


def test_targets(build_root: Path, probe: str, keys: Any = None):
    """The probe's test items (originals and mirrored counterfactuals) of a build, in the order of
    ``keys`` (a cache's; None: the build's own)."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    spec, b = get_probe(probe), Build(build_root)
    return load_targets(b, spec, "test", BuildKeys(b).keys(spec.level, "test") if keys is None else keys)


def prior_of(build_root: Path, probe: str) -> dict:
    """The probe's prior (question-only optimum) fitted on a build's original training items."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    spec, b = get_probe(probe), Build(build_root)
    tr = load_targets(b, spec, "train", BuildKeys(b).keys(spec.level, "train"))
    return spec.fit_prior(tr.subset(~tr.is_mirror))


def finetuned_predict(rd: Path, build_root: Path, device: str = "cpu"):
    """``(test targets, predictions)`` of finetune run ``rd`` on a build, its images re-encoded
    by the run's own encoder (``spar-probe eval --run``, item by item)."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.config import FinetuneConfig
    from spar_bench.probes.finetune.data import remap
    from spar_bench.probes.finetune.encoding import config_view, encoding_of, load_run_encoder
    from spar_bench.probes.finetune.loop import load_saved
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.train import predict

    saved = load_saved(rd / "head.pt", "head")
    c = config_view(RunRecord.from_saved(saved["config"], rd / "head.pt"))
    spec = get_probe(c["probe"])
    head = build_head(c["head"], spec, c["in_dim"], c["n_tokens"], **c["head_config"])
    head.load_state_dict(saved["state_dict"])
    cfg = FinetuneConfig(**{**c["finetune_config"], "device": device, "compute": "fp32"})
    encoding, _ = encoding_of(load_run_encoder(rd, c), Build(build_root), cfg)
    t = test_targets(build_root, spec.name)
    rows = np.unique(t.rows)
    feats = encoding.features(spec.level, "test", rows, head, c["head_input"])
    return t, predict(head, feats, remap(t, rows))


def encoder_caches(rd: Path, builds: dict[str, Path], out: Path, device: str = "cpu") -> dict[str, Path]:
    """Feature caches of run ``rd``'s trained encoder over every layout's build (frozen, fp32)."""
    from spar_bench.probes.cache import CacheOptions, write_cache

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
    then its predictions on every layout's test items: ``{layout: (targets, predictions)}``."""
    from spar_bench.probes.runs.inputs import load_features, open_cache
    from spar_bench.probes.runs.predictors import CachedHead
    from spar_bench.probes.runs.session import run_fit
    from spar_bench.probes.runs.spec import make_run
    from spar_bench.probes.train import predict

    run = make_run(str(caches[train_on]), probe, tr.head, tr.seed, dict(FROZEN_HEAD_OPTIONS), data=str(builds[train_on]),
                   n_boot=n_boot, controls=False)  # the blind rows are the priors
    rd = run_fit(run, out, progress=False)
    spec_run, c, _, model = CachedHead.load(rd)
    got = {}
    for layout, path in caches.items():
        with open_cache(path) as cache:
            level = spec_run.spec.level
            t = test_targets(builds[layout], probe, cache.keys(level, "test"))
            feats = load_features(cache, c["head_input"], level, "test", spec_run.layer, model)
            got[layout] = (t, predict(model, feats, t))
    return got


def oracle_predict(build_root: Path, probe: str):
    """``(test targets, predictions)`` of the oracle that reads the masks. Level 3: every question
    recomputed from the 224 label / lesion masks of its slice (``vqa --model oracle:pixels``'s
    rule; -1, a miss, where an organ asked about is not visible). Levels 1-2: the centroids the
    targets are measured from on the source slice's mask (a mosaic's tiles carry no position, so
    only the mask answers them): exact by construction, the ceiling of the table."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.vqa.questions import load_questions

    level = probe.split(".", 1)[0]
    if level == "level1":
        t = test_targets(build_root, probe)
        return t, np.nan_to_num(t.y["centroid"], nan=0.5)
    if level == "level2":
        t = test_targets(build_root, probe)
        return t, t.y["target_slot"].copy()
    from spar_bench.probes.tasks import get_probe

    b = Build(build_root)
    q = load_questions(b, get_probe(probe), ["test"])
    rows = np.unique(q.row)
    label = dict(zip(rows.tolist(), b.images("level3", "test", rows, field="label"), strict=True))
    lesion = dict(zip(rows.tolist(), b.images("level3", "test", rows, field="lesion"), strict=True))
    pred = np.array([_oracle_answer(q, i, label[int(q.row[i])], lesion[int(q.row[i])]) for i in range(len(q))])
    return q.t, pred.astype(np.int64)


def _oracle_answer(q, i: int, label: np.ndarray, lesion: np.ndarray) -> int:
    from spar_bench.builder.samples.pixels import pixel_class

    cls = pixel_class(q.probe, int(q.axis[i]), label, lesion, (int(q.organ_a[i]), int(q.organ_b[i])),
                      float(q.mm_per_pixel[i]), stated_cuts(q, i), q.min_pixels or 1)
    return -1 if cls is None else cls


def stated_cuts(q, i: int) -> tuple[float, ...]:
    """What question ``i``'s prompt states: its size or distance cuts, or the symmetry band in %."""
    from spar_bench.builder.samples.pixels import stated_band

    return tuple(q.cuts[i]) if q.cuts is not None else ((stated_band(q.band),) if q.band is not None else ())


def score_model(t, pred: np.ndarray, canon_prior: dict, seed: int, n_boot: int) -> dict:
    """The table metric of ``pred`` on the original test items (CI over patients), on the mirrored
    counterfactuals, and on the conflict items: those the canonical prior (canonical anatomy's
    answer) gets wrong (Level 3 only)."""
    from spar_bench.probes.runs.evaluate import bootstraps

    spec, key = t.spec, table_metric(t.spec.name)
    rng = bootstraps(seed, "calibration", spec.name)
    orig, mir = ~t.is_mirror, t.is_mirror
    s = spec.score(t.subset(orig), pred[orig], rng("test"), n_boot)
    out = {"value": s.get(key), "ci": (s.get("ci") or {}).get(key), "all": _plain(s)}
    if mir.any():
        out["mirror_cf"] = spec.score(t.subset(mir), pred[mir], None, 0).get(key)
    c = spec.conflict(canon_prior, t.subset(orig), pred[orig], rng("conflict"), n_boot)
    if c is not None:
        out["conflict"], out["conflict_n"] = c.get(key), c.get("n")
        out["conflict_ci"] = (c.get("ci") or {}).get(key)
    c = spec.conflict(canon_prior, t.subset(mir), pred[mir], None, 0) if mir.any() else None
    if c is not None:
        out["mirror_conflict"], out["mirror_conflict_n"] = c.get(key), c.get("n")
    return out


def _plain(d: dict) -> dict:
    """The scalar metrics of a score (no per-organ / per-axis breakdowns)."""
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) or v is None}


def reference_rows(builds: dict[str, Path], probes: tuple[str, ...], n_boot: int) -> list[dict]:
    """The rows that do not depend on a training seed: the oracle and the blind baselines."""
    rows = []
    for probe in probes:
        canon = prior_of(builds["canonical"], probe)
        cells = {lay: score_model(*oracle_predict(builds[lay], probe), canon, 0, n_boot) for lay in LAYOUTS}
        rows.append({"probe": probe, "model": "oracle", "seed": None, "cells": cells})
        for name, fitted_on in BLINDS.items():
            prior, cells = prior_of(builds[fitted_on], probe), {}
            for lay in LAYOUTS:
                t = test_targets(builds[lay], probe)
                cells[lay] = score_model(t, t.spec.prior_predict(prior, t), canon, 0, n_boot)
            rows.append({"probe": probe, "model": name, "seed": None, "cells": cells})
    return rows


def cached_reference_rows(builds: dict[str, Path], probes: tuple[str, ...], n_boot: int, path: Path) -> list[dict]:
    """:func:`reference_rows`, kept in ``path`` for the same builds (fingerprints), probes and bootstrap."""
    from spar_bench.builder.shards import Build

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
    from spar_bench.probes.targets import ProbeUnavailable
    from spar_bench.probes.tasks import probe_names

    train_on = MODEL_TRAIN_ON[model]
    if model == "computation" and tr.organ_maps:
        runs, enc_run = {}, organ_map_run(builds, out, tr)
    else:
        runs = {p: train_run(builds, out, tr, train_on, p) for p in tr.probes}
        enc_run = runs[tr.probes[0]]
    caches = encoder_caches(enc_run, builds, enc_run / "calibration", tr.device)
    rows = []
    for probe in [p for p in probe_names() if p in tr.score]:
        canon = prior_of(builds["canonical"], probe)
        readout = model == "computation" and tr.organ_maps and probe in READOUT_PROBES
        try:
            if readout:
                got = {lay: organ_map_predict(enc_run, builds[lay], probe, tr.device) for lay in LAYOUTS}
            elif probe in runs:
                got = {lay: finetuned_predict(runs[probe], builds[lay], tr.device) for lay in LAYOUTS}
            else:
                got = frozen_head_predict(caches, builds, train_on, probe, tr,
                                          enc_run / "calibration" / "heads", n_boot)
        except ProbeUnavailable as e:  # e.g. no symmetric pair in a random layout: nothing to train on
            print(f"{model} {probe}: {e}", flush=True)
            got = {}
        cells = {lay: score_model(t, pred, canon, tr.seed, n_boot) for lay, (t, pred) in got.items()}
        cells = {lay: cells.get(lay, {"value": None}) for lay in LAYOUTS}
        rows.append({"probe": probe, "model": model, "seed": tr.seed, "cells": cells,
                     "how": ("organ maps + geometric readout" if readout else
                             "finetuned" if probe in runs else f"frozen encoder + {tr.head} probe")})
        print(json.dumps({k: rows[-1][k] for k in ("probe", "model", "seed")}
                         | {lay: c["value"] for lay, c in cells.items()}), flush=True)
    return rows


# -------------------------------------------------- the tiny reference models (tests/test_calibration.py)
READER_BINS, READER_GRID, READER_L2 = 24, 16, 0.1


def appearance_tokens(build_root: Path, split: str, rows: np.ndarray, bins: int = READER_BINS,
                      grid: int = READER_GRID) -> np.ndarray:
    """``(N, grid*grid, bins)`` float32: per patch of a ``grid`` x ``grid`` tiling of each Level 3
    slice (224 frame), the share of its pixels in each of ``bins`` grey-level bins. Organs of
    ``distinct`` intensity fall in different bins: a patch's bins say which organs it holds."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.organmaps import organ_shares

    img = Build(build_root).images("level3", split, rows).astype(np.int64) * bins // 256  # (N, 224, 224)
    side = img.shape[1] // grid
    return organ_shares(img[:, : grid * side, : grid * side], grid, bins)  # a grey-level bin per "label"


def _reader_module(n_classes: int, bins: int, grid: int):
    """A reader that can do either: find organs A and B by their grey-level bins (attention over
    patches), compare their centres (``pos``) - computation; or answer from the question alone
    (a learned answer per organ pair and axis, ``recall``) - the prior. Which it learns is up
    to its training layouts."""
    import torch

    from spar_bench.builder.schema import N_ORGANS

    class Reader(torch.nn.Module):
        def __init__(self):
            super().__init__()
            lin = torch.linspace(-1.0, 1.0, grid)
            self.register_buffer("xy", torch.stack([lin.repeat(grid), lin.repeat_interleave(grid)], dim=1))
            self.organ = torch.nn.Parameter(torch.zeros(N_ORGANS, bins))
            self.recall = torch.nn.Parameter(torch.zeros(N_ORGANS + 1, N_ORGANS + 1, 2, n_classes))
            self.compare = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, n_classes))

        def forward(self, tokens, slice_of, a, b, axis):
            """``tokens (S, T, bins)`` of the slices, ``slice_of`` each item's slice; organs, axis."""
            w = torch.softmax(20.0 * torch.einsum("stk,ok->sot", tokens, self.organ), dim=2)
            centre = torch.einsum("sot,tc->soc", w, self.xy)  # every organ's centre on every slice
            d = centre[slice_of, a.clamp(min=0)] - centre[slice_of, b.clamp(min=0)]
            ax = torch.nn.functional.one_hot(axis.clamp(0, 1), 2).float()
            feats = torch.cat([d[:, :, None] * ax[:, None, :], d.abs()[:, :, None] * ax[:, None, :]], 1).flatten(1)
            return self.compare(feats) + self.recall[a + 1, b + 1, axis.clamp(0, 1)]

    return Reader()


def _reader_inputs(build_root: Path, probe: str, split: str):
    """The probe's items of a split (targets) and their slices' appearance tokens, as tensors."""
    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    spec, b = get_probe(probe), Build(build_root)
    t = load_targets(b, spec, split, BuildKeys(b).keys(spec.level, split))
    rows, inv = np.unique(t.rows, return_inverse=True)
    tok = torch.from_numpy(appearance_tokens(build_root, split, rows))
    q = {k: torch.from_numpy(t.y[k].astype(np.int64)) for k in ("organ_a", "organ_b", "axis", "answer")}
    return t, tok, torch.from_numpy(inv.astype(np.int64)), q


def train_reader(build_root: Path, probe: str, seed: int, steps: int = 300, lr: float = 0.05,
                 l2: float = READER_L2):
    """The tiny reader trained (full batch, Adam, ``steps``) on a build's original training items;
    ``l2`` penalises the organ bins' weights (finding organs has to pay for itself)."""
    import torch

    t, tok, inv, q = _reader_inputs(build_root, probe, "train")
    keep = torch.from_numpy(~t.is_mirror)
    torch.manual_seed(seed)
    model = _reader_module(t.spec.n_classes, tok.shape[-1], READER_GRID)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        out = model(tok, inv[keep], q["organ_a"][keep], q["organ_b"][keep], q["axis"][keep])
        loss = torch.nn.functional.cross_entropy(out, q["answer"][keep]) + l2 * model.organ.pow(2).sum()
        loss.backward()
        opt.step()
    return model


def reader_predict(model, build_root: Path, probe: str):
    """``(test targets, predictions)`` of a trained tiny reader on a build."""
    import torch

    t, tok, inv, q = _reader_inputs(build_root, probe, "test")
    with torch.no_grad():
        out = model(tok, inv, q["organ_a"], q["organ_b"], q["axis"])
    return t, out.argmax(1).numpy()


def organ_map_run(builds: dict[str, Path], out: Path, tr: Training) -> Path:
    """The computation model's encoder trained from scratch on the organ maps of the random
    layouts' Level 3 slices (``probes.finetune.organmaps``; no question seen), with
    :data:`ORGAN_MAP_MODEL_ARGS`; :data:`READOUT_PROBES` are then read out of its maps, every
    other probe is a frozen ``tr.head`` probe of it."""
    from spar_bench.probes.finetune.organmaps import OrganMapConfig, pretrain_organ_maps

    cfg = OrganMapConfig(epochs=tr.organ_maps, lr=tr.lr, seed=tr.seed, dice=tr.organ_map_dice)
    dice = f"-dice{tr.organ_map_dice:g}" if tr.organ_map_dice else ""
    rd = out / "organ-maps" / f"{builds['random'].name}-e{tr.organ_maps}{dice}" / f"seed{tr.seed}"
    print(f"computation encoder: organ maps, {tr.organ_maps} epochs -> {rd.relative_to(out)}", flush=True)
    return pretrain_organ_maps(ENCODER, builds["random"], rd, cfg, ORGAN_MAP_MODEL_ARGS, progress=False,
                               device=tr.device)


#: Level 3 probes that the organ-map encoder answers by geometry (:func:`organ_map_predict`);
#: the others (Levels 1-2, counting: lesions are not in the maps) are frozen ``--head`` probes of it.
READOUT_PROBES = ("level3.relative_position", "level3.orientation", "level3.symmetry", "level3.size",
                  "level3.distance")


_MAPS: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}  # (run, build) -> map_geometry of its test slices


def organ_map_predict(rd: Path, build_root: Path, probe: str, device: str = "cpu"):
    """``(test targets, predictions)`` of the organ-map encoder read out by geometry: every
    organ's centre from its organ head's map and its area from its share head's
    (``organmaps.predict_maps``, ``map_geometry``; one map where the run has no Dice term),
    then the oracle's rule for the probe with what each prompt states. Nothing is fitted to
    answers: computation by construction, and what it gets wrong its perception got wrong."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.organmaps import (
        load_organ_map_model,
        map_geometry,
        predict_maps,
    )
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import load_questions

    b = Build(build_root)
    q = load_questions(b, get_probe(probe), ["test"])
    key = (str(rd), str(build_root))
    if key not in _MAPS:  # every test slice once per (run, build): the probes share them
        model = load_organ_map_model(rd, device)
        where, share = predict_maps(model, b.images("level3", "test", np.arange(b.count("level3", "test"))))
        _MAPS.clear()
        _MAPS[key] = (map_geometry(where, model.grid)[0], map_geometry(share, model.grid)[1])
    return q.t, readout_answers(q, probe, *_MAPS[key])


def readout_answers(q, probe: str, centre: np.ndarray, area: np.ndarray) -> np.ndarray:
    """The class of every question ``q`` (``load_questions``) from every slice's label centres
    ``(rows, labels, 2)`` and areas in pixels ``(rows, labels)`` (label = organ id + 1), by the
    oracle's rule with what each prompt states."""
    from spar_bench.builder.samples.pixels import Geometry, decide

    kind, pred = probe.split(".", 1)[1], np.empty(len(q), dtype=np.int64)
    for i in range(len(q)):
        r, a, o = int(q.row[i]), int(q.organ_a[i]) + 1, max(int(q.organ_b[i]), -1) + 1  # -1: no organ B
        mpp = float(q.mm_per_pixel[i])
        g = Geometry(tuple(centre[r, a]), tuple(centre[r, o]), float(area[r, a]) * mpp**2,
                     float(area[r, o]) * mpp**2, 0, mpp)
        pred[i] = decide(kind, int(q.axis[i]), g, stated_cuts(q, i))
    return pred


def calibration_rows(builds: dict[str, Path], out: Path, trainings: list[Training], n_boot: int) -> list[dict]:
    """The oracle and blind rows, then recall and computation for every training seed."""
    rows = cached_reference_rows(builds, trainings[0].score, n_boot, out / "reference-rows.json")
    for tr in trainings:
        for model in ("recall", "computation"):
            rows += model_rows(builds, out, tr, model, n_boot)
    return rows


CAL_COLUMNS = (*(f"test: {lay}" for lay in LAYOUTS), "mirrored counterfactual (canonical test slices)",
               "conflict items: mirrored / random")


def _scale(probe: str) -> float:
    return 1.0 if table_metric(probe) == "med_px" else 100.0


def mean_interval(cis: list) -> tuple[float, float]:
    """The table's interval of a cell over seeds: the mean of the seeds' 95 % intervals."""
    return float(np.mean([c[0] for c in cis])), float(np.mean([c[1] for c in cis]))


def cal_cell(rows: list[dict], layout: str, what: str = "value") -> str:
    """mean +- std over seeds (one seed: its value) and, for the layouts, the mean 95% CI."""
    k = _scale(rows[0]["probe"])
    vals = [r["cells"][layout].get(what) for r in rows]
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    txt = f"{k * np.mean(vals):.1f}" + (f" +- {k * np.std(vals, ddof=1):.1f}" if len(vals) > 1 else "")
    cis = [r["cells"][layout].get("ci" if what == "value" else "conflict_ci") for r in rows]
    cis = [c for c in cis if c]
    if cis and what == "value":
        lo, hi = mean_interval(cis)
        txt += f" [{k * lo:.1f}, {k * hi:.1f}]"
    return txt


def calibration_table(rows: list[dict], probe: str) -> str:
    """Markdown: one probe, a row per model (seeds pooled), a column per test layout and control."""
    unit = {"med_px": "MED px, lower is better", "tile_acc": "per-tile accuracy %"}.get(table_metric(probe),
                                                                                        "accuracy %")
    lines = [f"**{probe}** ({unit})", "", "| model | seeds | " + " | ".join(CAL_COLUMNS) + " |",
             "|---" * (len(CAL_COLUMNS) + 2) + "|"]
    for model in (*MODELS, *BLINDS):
        rs = [r for r in rows if r["probe"] == probe and r["model"] == model]
        if not rs:
            continue
        cells = [cal_cell(rs, lay) for lay in LAYOUTS] + [cal_cell(rs, "canonical", "mirror_cf")]
        cells.append(" / ".join(cal_cell(rs, lay, "conflict") for lay in ("mirrored", "random")))
        name = f"**{model}**" if model in MODELS else model
        lines.append(f"| {name} | {len([r for r in rs if r['seed'] is not None]) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cal_axis(ax, rows: list[dict], probe: str) -> None:
    k, x = _scale(probe), np.arange(len(LAYOUTS))
    for j, model in enumerate(MODELS):
        rs = [r for r in rows if r["probe"] == probe and r["model"] == model]
        if rs:
            vals = [[k * (r["cells"][lay]["value"] if r["cells"][lay]["value"] is not None else np.nan)
                     for r in rs] for lay in LAYOUTS]
            ax.bar(x + (j - 1) * 0.27, np.nanmean(vals, axis=1), 0.27, label=model,
                   yerr=np.nanstd(vals, axis=1) if len(rs) > 1 else None, capsize=2)
    for name, marker in zip(BLINDS, ("_", "x"), strict=True):
        r = next((r for r in rows if r["probe"] == probe and r["model"] == name), None)
        if r is not None:
            ax.scatter(x, [k * (r["cells"][lay]["value"] or np.nan) for lay in LAYOUTS], marker=marker,
                       s=300 if marker == "_" else 30, color="k", zorder=3, label=name)
    ax.set_xticks(x, [f"test: {lay}" for lay in LAYOUTS], fontsize=7)
    ax.set_title(probe, fontsize=9)
    ax.set_ylabel({"med_px": "MED px (lower better)", "tile_acc": "tile accuracy %"}.get(table_metric(probe),
                                                                                         "accuracy %"), fontsize=8)


def calibration_plots(rows: list[dict], out: Path) -> None:
    """``OUT/plots/<probe>.png`` per probe and ``OUT/calibration.png`` (every probe, 2 x 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = list(dict.fromkeys(r["probe"] for r in rows))
    (out / "plots").mkdir(exist_ok=True)
    for probe in probes:
        fig, ax = plt.subplots(figsize=(4.6, 3.4))
        _cal_axis(ax, rows, probe)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"{probe}.png", dpi=100)
        plt.close(fig)
    ncol = 4
    fig, axes = plt.subplots((len(probes) + ncol - 1) // ncol, ncol, figsize=(4.2 * ncol, 3.2 * ((len(probes) + 3) // 4)),
                             squeeze=False)
    for ax, probe in zip(axes.flat, probes, strict=False):
        _cal_axis(ax, rows, probe)
    for ax in list(axes.flat)[len(probes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=90)
    plt.close(fig)


def fmt(v, level1: bool) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if level1 else f"{100 * v:.1f}"


def fmt_seeds(vals: list, level1: bool) -> str:
    """One value, or mean +- std (sample std) over seeds."""
    import numpy as np

    vals = [v for v in vals if v is not None]
    if len(vals) < 2:
        return fmt(vals[0] if vals else None, level1)
    k = 1.0 if level1 else 100.0
    return f"{k * np.mean(vals):.1f} +- {k * np.std(vals, ddof=1):.1f}"


def table(rows: list[dict]) -> str:
    """Markdown: per probe and training layout, model (blind) on each layout's test split;
    several seeds: mean +- std over them (the blind baseline does not depend on the seed)."""
    lines = ["| probe | trained on | seeds | " + " | ".join(f"test: {lay}" for lay in LAYOUTS)
             + " | mirrored counterfactual (in domain) | chance |", "|---" * (len(LAYOUTS) + 5) + "|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["probe"], r["trained_on"]), []).append(r)
    for (probe, train_on), rs in groups.items():
        l1 = probe.startswith("level1")
        cells = [f"**{fmt_seeds([r['cells'][x]['model'] for r in rs], l1)}** ({fmt(rs[0]['cells'][x]['blind'], l1)})"
                 for x in LAYOUTS]
        cf = fmt_seeds([r["cells"][train_on]["mirror_cf"] for r in rs], l1)
        lines.append(f"| {probe} ({'MED px, lower is better' if l1 else 'accuracy %'}) | {train_on} | {len(rs)} | "
                     + " | ".join(cells) + f" | {cf} | {fmt(rs[0]['chance'], l1)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    probes = list(dict.fromkeys(r["probe"] for r in rows))
    fig, axes = plt.subplots(1, len(probes), figsize=(4.2 * len(probes), 3.4), squeeze=False)
    for ax, probe in zip(axes[0], probes, strict=True):
        l1 = probe.startswith("level1")
        x = np.arange(len(LAYOUTS))
        for k, train_on in enumerate(TRAIN_ON):
            r = next((r for r in rows if r["probe"] == probe and r["trained_on"] == train_on), None)
            if r is None:
                continue
            scale = 1.0 if l1 else 100.0
            vals = [(r["cells"][lay]["model"] or np.nan) * scale for lay in LAYOUTS]
            bl = [(r["cells"][lay]["blind"] or np.nan) * scale for lay in LAYOUTS]
            ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, label=f"trained on {train_on}")
            ax.scatter(x + (k - 0.5) * 0.38, bl, marker="_", s=400, color="k", zorder=3,
                       label="blind" if k == 0 else None)
            if not l1 and r.get("chance"):
                ax.axhline(100 * r["chance"], ls=":", color="gray")
        ax.set_xticks(x, [f"test: {lay}" for lay in LAYOUTS], fontsize=8)
        ax.set_title(probe, fontsize=9)
        ax.set_ylabel("MED (px, lower is better)" if l1 else "accuracy (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/rvc")
    ap.add_argument("--cases", type=int, default=100, help="phantom cases of each training layout")
    ap.add_argument("--eval-cases", type=int, default=24,
                    help="phantom cases of the mirrored layout (and of canonical when no model trains on it)")
    ap.add_argument("--in-plane", type=int, default=None, help="phantom in-plane voxels (default: 160, 'small')")
    ap.add_argument("--slices", type=int, default=None, help="phantom slices per case (default: 40-60, 'small')")
    ap.add_argument("--l3-stride", type=int, default=L3_STRIDE, help="Level 3 on every Nth slice")
    ap.add_argument("--samples", type=int, default=4, help="Level 1 mosaics per case")
    ap.add_argument("--questions", type=int, default=16, help="Level 3 questions per probe and slice")
    ap.add_argument("--train-on", default=",".join(TRAIN_ON), help="comma-separated layouts to train on")
    ap.add_argument("--probes", default=",".join(PROBES), help="comma-separated probes")
    ap.add_argument("--model-args", default=None,
                    help="JSON merged into the encoder's timm model args (e.g. '{\"coord_channels\": true}')")
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--train-mirrors", action="store_true",
                    help="train on the mirrored counterfactuals of the training slices too (augmentation)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds (table: mean +- std)")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--device", default="cpu",
                    help="where the encoders train and encode, in fp32: cpu (default), cuda[:N] or auto; the "
                         "probe heads and the organ-map readout stay on the CPU")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes that render and build the phantoms (the bytes do not depend on it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine more threads only contend)")
    ap.add_argument("--seed", type=int, default=0, help="the phantoms' seed")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 cases, 2 epochs")
    ap.add_argument("--calibrate", action="store_true",
                    help="issue 26: recall (canonical), computation (random) and the oracle on every probe of "
                         "--score; the encoders train end to end on --probes (default: relative position)")
    ap.add_argument("--organ-maps", type=int, default=0, metavar="EPOCHS",
                    help="calibration: the computation model's encoder learns organ maps of the random layouts "
                         "for EPOCHS epochs (128 px input), and every probe is a frozen --head probe of it; "
                         "0: it trains end to end on --probes like the recall model")
    ap.add_argument("--organ-map-dice", type=float, default=0.0, metavar="W",
                    help="calibration: the organ-map loss is the BCE plus W times a soft Dice term, which weighs "
                         "every organ present in a slice alike, small ones too (0: the BCE alone)")
    ap.add_argument("--score", default="all",
                    help="calibration: comma-separated probes scored (all: the eight of Levels 1-3)")
    ap.add_argument("--check", default=None, metavar="CALIBRATION_JSON",
                    help="compare a rerun's calibration.json with --against (the table of docs/RESULTS.md) and exit: "
                         "trained cells within the reference's intervals, the rest the same; status 1 if not")
    ap.add_argument("--against", default=str(REFERENCE), metavar="JSON",
                    help="the reference of --check (default: docs/calibration.json, the table of docs/RESULTS.md)")
    args = ap.parse_args(argv)
    if args.organ_maps < 0 or args.organ_map_dice < 0:
        ap.error("--organ-maps and --organ-map-dice must be >= 0")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    if not args.check:  # a bad or absent device fails here, not after the phantoms are built
        from spar_bench.errors import ConfigError
        from spar_bench.probes.hardware import pick_device

        try:
            pick_device(args.device)
        except ConfigError as e:
            ap.error(str(e))
    if args.calibrate and args.probes == ",".join(PROBES):
        args.probes = "level3.relative_position"
    if args.quick:
        args.cases, args.eval_cases, args.samples, args.epochs, args.bootstrap = 6, 6, 2, 2, 20
    return args


def configs(args: argparse.Namespace) -> tuple[Data, list[Training]]:
    train_on, probes = tuple(args.train_on.split(",")), tuple(args.probes.split(","))
    n = {lay: args.cases if lay in train_on else args.eval_cases for lay in LAYOUTS}
    score: tuple[str, ...] = ()
    if getattr(args, "calibrate", False):
        from spar_bench.probes.tasks import get_probe, probe_names

        score = tuple(p for p in probe_names() if p.split(".")[0] in ("level1", "level2", "level3")) \
            if args.score == "all" else tuple(get_probe(p).name for p in args.score.split(","))
        train_on = TRAIN_ON
    levels = tuple(lv for lv in ("level1", "level2", "level3") if any(p.startswith(lv) for p in probes + score))
    data = Data(n, args.samples, args.questions, args.l3_stride, args.in_plane, args.slices, levels)
    model_args = {**MODEL_ARGS, **json.loads(args.model_args or "{}")}
    trainings = [Training(model_args, args.head, args.epochs, args.patience, args.lr, int(s), train_on, probes,
                          args.train_mirrors, score, getattr(args, "organ_maps", 0), getattr(args, "organ_map_dice", 0.0),
                          getattr(args, "device", "cpu"))
                 for s in args.seeds.split(",")]
    return data, trainings


def write_calibration(out: Path, builds: dict[str, Path], trainings: list[Training], args: argparse.Namespace,
                      t0: float, t_build: float) -> int:
    """Train and score the reference models; write ``calibration.md``/``.json``/``.png`` and ``plots/``."""
    rows = calibration_rows(builds, out, trainings, args.bootstrap)
    tr = trainings[0]
    conditions = {"cases": {lay: n for lay, n in zip(LAYOUTS, [args.cases if lay in TRAIN_ON else args.eval_cases
                                                               for lay in LAYOUTS], strict=True)},
                  "grid (in-plane, slices)": [args.in_plane, args.slices], "intensities": INTENSITIES,
                  "samples_per_case": args.samples, "l3_questions_per_probe": args.questions,
                  "l3_stride": args.l3_stride, "trained_end_to_end_on": list(tr.probes), "head": tr.head,
                  "max_epochs": tr.epochs, "patience": tr.patience, "lr": tr.lr,
                  "train_mirrors (computation only)": tr.train_mirrors, "seeds": [t.seed for t in trainings],
                  "computation encoder": (f"organ maps, {tr.organ_maps} epochs, Dice weight {tr.organ_map_dice:g}, "
                                          f"model_args {ORGAN_MAP_MODEL_ARGS}"
                                          if tr.organ_maps else "end to end, like recall"),
                  "encoder": ENCODER, "model_args": tr.model_args, "device": tr.device, "jobs": args.jobs,
                  "threads": args.threads,
                  "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                  "build_seconds": round(t_build, 1), "wall_seconds": round(time.perf_counter() - t0, 1)}
    (out / "calibration.json").write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")
    md = ["# The benchmark calibrated: recall, computation and the oracle on every probe", "",
          "Each cell: mean +- std over training seeds [mean of the seeds' 95% patient-bootstrap intervals]; "
          "conflict items: those the canonical prior (canonical anatomy's answer) gets wrong.", ""]
    md += [calibration_table(rows, p) for p in dict.fromkeys(r["probe"] for r in rows)]
    md += [f"Conditions: {json.dumps(conditions)}", ""]
    (out / "calibration.md").write_text("\n".join(md))
    calibration_plots(rows, out)
    print("\n".join(md))
    return 0


#: conditions a rerun may change and still be compared with the reference table (the machine's)
MACHINE_CONDITIONS = ("device", "jobs", "threads", "cpu_count", "load_average_at_end", "build_seconds", "wall_seconds")
#: the reference table of docs/RESULTS.md, as written by ``--calibrate`` (``--check`` compares a rerun with it)
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "calibration.json"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _row_name(row: dict) -> str:
    """A row as the check names it: ``level3.size recall seed 0`` (untrained rows: no seed)."""
    return f"{row['probe']} {row['model']}" + ("" if row["seed"] is None else f" seed {row['seed']}")


def _cell_problem(cell: Any) -> str | None:
    """What is wrong with one cell of a row (``{"value": number | null, "ci": [lo, hi] | null, ...}``)."""
    if not isinstance(cell, dict):
        return "is not an object"
    if cell.get("value") is not None and not _is_number(cell["value"]):
        return f"value {json.dumps(cell['value'])[:40]} is not a number or null"
    ci = cell.get("ci")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(map(_is_number, ci))):
        return f"ci {json.dumps(ci)[:40]} is not [low, high]"
    return None


#: The fields of a row of calibration.json: (name, check, what it must be).
ROW_FIELDS = (("probe", lambda v: isinstance(v, str), "a string"),
              ("model", lambda v: isinstance(v, str), "a string"),
              ("seed", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
              ("cells", lambda v: isinstance(v, dict), "an object {layout: cell}"))


def _row_problem(row: Any) -> str | None:
    """What is wrong with one row (``{"probe": str, "model": str, "seed": int | null, "cells": {layout: cell}}``)."""
    if not isinstance(row, dict):
        return f"is {type(row).__name__} {json.dumps(row)[:40]}, not an object {{probe, model, seed, cells}}"
    for key, ok, what in ROW_FIELDS:
        if key not in row:
            return f"has no {key!r} ({what})"
        if not ok(row[key]):
            return f"{key!r} is {json.dumps(row[key])[:40]}, not {what}"
    for lay, cell in row["cells"].items():
        if (problem := _cell_problem(cell)) is not None:
            return f"({_row_name(row)}) cell {lay!r} {problem}"
    return None


def shape_problem(doc: Any) -> str | None:
    """What makes a parsed ``calibration.json`` unusable for ``--check``, in words (None: usable):
    ``{"conditions": {...}, "rows": [row, ...]}`` with every row as :func:`_row_problem` wants."""
    if not isinstance(doc, dict) or not {"conditions", "rows"} <= set(doc):
        return "not a calibration.json (needs 'conditions' and 'rows'): the --calibrate output"
    if not isinstance(doc["conditions"], dict):
        return "conditions is not an object"
    if not isinstance(doc["rows"], list):
        return f"rows is {type(doc['rows']).__name__}, not a list of rows"
    for i, row in enumerate(doc["rows"]):
        if (problem := _row_problem(row)) is not None:
            return f"rows[{i}] {problem}"
    return None


def _rows_by_key(rows: list[dict], name: str) -> tuple[dict[tuple, dict], list[str]]:
    """``({(probe, model, seed): row}, a line per row given twice)``."""
    by_key: dict[tuple, dict] = {}
    twice = []
    for r in rows:
        key = (r["probe"], r["model"], r["seed"])
        if key in by_key:
            twice.append(f"{name} has row {_row_name(r)} twice")
        by_key[key] = r
    return by_key, twice


def _has_value(cells: dict, lay: str) -> bool:
    return isinstance(cells.get(lay), dict) and cells[lay].get("value") is not None


def coverage_problems(reference: dict, rerun: dict) -> list[str]:
    """One line per row or cell that is in one of the two files and not the other (a cell without
    a value counts as absent), or given twice: the rerun must hold every row and cell of the
    reference, and no other, or its seed means are not the reference's."""
    ref, lines = _rows_by_key(reference["rows"], "the reference")
    new, twice = _rows_by_key(rerun["rows"], "the rerun")
    lines += twice
    lines += [f"the rerun has no row {_row_name(r)} (the reference has)" for k, r in ref.items() if k not in new]
    lines += [f"the rerun has an extra row {_row_name(r)} (not in the reference)" for k, r in new.items() if k not in ref]
    for key in (k for k in ref if k in new):
        a, b = ref[key]["cells"], new[key]["cells"]
        lays = list(dict.fromkeys([*a, *b]))
        lines += [f"the rerun's row {_row_name(new[key])} has no cell {lay!r} (the reference has)"
                  for lay in lays if _has_value(a, lay) and not _has_value(b, lay)]
        lines += [f"the rerun's row {_row_name(new[key])} has an extra cell {lay!r} (not in the reference)"
                  for lay in lays if _has_value(b, lay) and not _has_value(a, lay)]
    return lines


def _seed_cells(rows: list[dict], probe: str, model: str, layout: str) -> tuple[list[float], list[list[float]]]:
    """The values and intervals of every seed's row of ``model`` on ``probe`` in ``layout``."""
    rs = [r["cells"].get(layout) or {} for r in rows if r["probe"] == probe and r["model"] == model]
    rs = [c for c in rs if c.get("value") is not None]
    return [c["value"] for c in rs], [c["ci"] for c in rs if c.get("ci")]


def check_rerun(reference: dict, rerun: dict) -> tuple[list[str], list[str]]:
    """``(table lines, misses)``: every trained model's cell of the rerun (mean over its seeds)
    against the reference's interval (the mean of its seeds' 95 % intervals, as docs/RESULTS.md's
    table prints it), and every untrained row (oracle, blind), which must be the same. A miss
    names the cell. The two runs must share every condition but the machine's, and the same rows
    and cells (:func:`coverage_problems`); both must have :func:`shape_problem`'s shape."""
    for name, doc in (("the reference", reference), ("the rerun", rerun)):
        if (problem := shape_problem(doc)) is not None:
            raise SystemExit(f"error: {name}: {problem}")
    had, got = (dict(d["conditions"]) for d in (reference, rerun))
    diff = sorted(k for k in set(had) | set(got) if k not in MACHINE_CONDITIONS and had.get(k) != got.get(k))
    if diff:
        raise SystemExit(f"error: the rerun was made with other conditions than the reference ({', '.join(diff)}); "
                         "rerun with the reference's command (its conditions are in its JSON)")
    problems = coverage_problems(reference, rerun)
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    lines = ["| probe | model | layout | reference [interval] | rerun | within |", "|---|---|---|---|---|---|"]
    misses = []
    for probe in dict.fromkeys(r["probe"] for r in reference["rows"]):
        k = _scale(probe)
        for model in (*MODELS, *BLINDS):
            for lay in LAYOUTS:
                ref, cis = _seed_cells(reference["rows"], probe, model, lay)
                new, _ = _seed_cells(rerun["rows"], probe, model, lay)
                if not ref or not new:
                    continue
                m_ref, m_new = float(np.mean(ref)), float(np.mean(new))
                if model in MODELS and model != "oracle":
                    lo, hi = mean_interval(cis)
                    ok, span = lo - 1e-9 <= m_new <= hi + 1e-9, f"[{k * lo:.1f}, {k * hi:.1f}]"
                else:  # computed, not trained: the same on any machine
                    ok, span = abs(m_new - m_ref) <= 1e-9, "(the same)"
                lines.append(f"| {probe} | {model} | {lay} | {k * m_ref:.1f} {span} | {k * m_new:.1f} | "
                             f"{'yes' if ok else '**no**'} |")
                if not ok:
                    misses.append(f"{probe} {model} {lay}: {k * m_new:.1f} against {k * m_ref:.1f} {span}")
    return lines, misses


def check_command(path: Path, reference: Path) -> int:
    """``--check``: print the comparison of a rerun's ``calibration.json`` with ``reference``;
    exit status 1 when a cell is outside its interval."""
    docs = []
    for f in (reference, path):
        try:
            docs.append(json.loads(Path(f).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {f}: not a readable calibration.json ({e})") from None
        if (problem := shape_problem(docs[-1])) is not None:
            raise SystemExit(f"error: {f}: {problem}")
    lines, misses = check_rerun(*docs)
    print("\n".join(lines))
    n = len(lines) - 2  # the table's header and rule
    print(f"\n{n - len(misses)} of {n} cells as the reference" + ("" if not misses else ":"))
    for m in misses:
        print(f"  outside: {m}")
    return 1 if misses else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return check_command(Path(args.check), Path(args.against))
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data, trainings = configs(args)
    t0 = time.perf_counter()
    builds = build_all(out, data, args.seed, args.jobs)
    t_build = time.perf_counter() - t0
    if args.calibrate:
        return write_calibration(out, builds, trainings, args, t0, t_build)
    rows = [r for tr in trainings for r in train_and_score(builds, out, tr, args.bootstrap)]
    wall = time.perf_counter() - t0
    tr = trainings[0]
    conditions = {"cases": data.cases, "grid (in-plane, slices)": [data.in_plane, data.slices],
                  "intensities": INTENSITIES, "samples_per_case": data.samples,
                  "l3_questions_per_probe": data.questions, "l3_stride": data.l3_stride, "max_epochs": tr.epochs,
                  "patience": tr.patience, "lr": tr.lr, "train_mirrors": tr.train_mirrors, "seeds": [t.seed for t in trainings],
                  "encoder": ENCODER, "model_args": tr.model_args, "head": tr.head, "threads": args.threads,
                  "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                  "build_seconds": round(t_build, 1), "wall_seconds": round(wall, 1)}
    (out / "results.json").write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")
    md = ["# Recall versus computation", "",
          "Each cell: **model** (blind baseline, the question-only optimum fitted on the training build), "
          "test split of the layout named; relative position and orientation in % accuracy, Level 1 in "
          "MED pixels. Encoder trained from scratch; several seeds: mean +- std.", "", table(rows), "",
          f"Conditions: {json.dumps(conditions)}", ""]
    (out / "results.md").write_text("\n".join(md))
    plot(rows, out / "results.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
