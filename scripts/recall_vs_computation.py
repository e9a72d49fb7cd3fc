"""Recall versus computation, end to end: does the benchmark tell a model that remembers
canonical anatomy from one that reads the image?

    python scripts/recall_vs_computation.py --out runs/rvc            # the README table (~30 min on 2 busy cores)
    python scripts/recall_vs_computation.py --out /tmp/rvc --quick    # a smoke run (minutes)
    # the computation model of issue 26 (README): 600 random layouts on a 96x16 grid, mirrors as training data
    python scripts/recall_vs_computation.py --out runs/rvc26 --train-on random --seeds 0,1 \
        --probes level3.relative_position,level3.orientation --cases 600 --eval-cases 40 \
        --in-plane 96 --slices 16 --l3-stride 2 --train-mirrors

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

LAYOUTS = ("canonical", "mirrored", "random")
TRAIN_ON = ("canonical", "random")
PROBES = ("level3.relative_position", "level3.orientation", "level1.localisation")
ENCODER = "timm:resnet10t"
MODEL_ARGS = {"channels": [16, 32, 64, 128], "stem_width": 16, "output_stride": 8,
              "pretrained_cfg_overlay": {"input_size": [3, 64, 64]}}
HEAD = "attnpool"
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


def build_all(out: Path, data: Data, seed: int) -> dict[str, Path]:
    """One phantom (distinct organ intensities) + shards per layout (Levels 1 and 3, mirrored
    counterfactuals, ``data.questions`` Level 3 questions per probe and slice)."""
    from spar_bench.builder.build import BuildConfig, build
    from spar_bench.builder.phantom import write_phantom_dataset

    builds = {}
    for i, layout in enumerate(LAYOUTS):
        ph, shards = out / f"phantom-{layout}{data.grid_suffix()}", out / f"shards-{layout}{data.suffix()}"
        builds[layout] = shards
        if (shards / "manifest.json").is_file():
            continue
        n, grid = data.cases[layout], (data.in_plane, data.slices)
        if not _phantom_done(ph, n, layout, seed + i):
            print(f"$ spar-build phantom --out {ph} --n {n} --layout {layout} --seed {seed + i} "
                  f"--intensities {INTENSITIES} --overwrite  # in-plane, slices: {grid}", flush=True)
            write_phantom_dataset(ph, n, layout=layout, seed=seed + i, intensities=INTENSITIES, overwrite=True,
                                  in_plane=data.in_plane, n_slices=data.slices, progress=False)
        sample = {"levels": list(data.levels), "samples_per_case": data.samples, "counterfactual": "mirror",
                  "l3_questions_per_probe": data.questions, "l3_stride": data.l3_stride}
        print(f"$ build {shards} from {ph}: {json.dumps(sample)}", flush=True)
        build(BuildConfig(sources=("phantom",), roots=(str(ph),), out=str(shards), sample=sample, hf=False,
                          overwrite=True, workers=1), quiet=True)
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


def runs_root(out: Path, tr: Training) -> Path:
    """``OUT/runs``, or for other encoder model args ``OUT/runs-<hash>`` (run folders do not name them)."""
    if tr.model_args == MODEL_ARGS:
        return out / "runs"
    import hashlib

    return out / f"runs-{hashlib.sha256(json.dumps(tr.model_args, sort_keys=True).encode()).hexdigest()[:10]}"


def train_and_score(builds: dict[str, Path], out: Path, tr: Training, n_boot: int) -> list[dict]:
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.finetune.run import run_eval_reencoded, run_finetune
    from spar_bench.probes.tasks import get_probe

    cfg = FinetuneConfig(encoder_lr=tr.lr, head_lr=tr.lr, batch_size=32, max_epochs=tr.epochs,
                         warmup_epochs=1, patience=tr.patience, device="cpu", compute="fp32")
    rows = []
    for train_on in tr.train_on:
        for probe in tr.probes:
            t0 = time.perf_counter()
            fs = FinetuneSpec(ENCODER, str(builds[train_on]), probe, tr.head, tr.seed, init="scratch",
                              model_kwargs=tr.model_args, cfg=cfg, n_boot=n_boot, train_mirrors=tr.train_mirrors)
            rd = run_finetune(fs, runs_root(out, tr), resume=True)
            m = json.loads((rd / "metrics.json").read_text())
            key = get_probe(probe).headline
            row = {"probe": probe, "trained_on": train_on, "metric": key, "run": str(rd.relative_to(out)),
                   "epochs": m["train"]["epochs_run"], "img_s": json.loads((rd / "timing.json").read_text())["images_per_s"],
                   "seed": tr.seed, "chance": m["controls"].get("chance"), "cells": {}}
            for layout in LAYOUTS:
                if layout == train_on:
                    r = m
                else:
                    r = json.loads(run_eval_reencoded(rd, builds[layout], n_boot, device="cpu",
                                                      compute="fp32").read_text())
                row["cells"][layout] = {"model": r["test"].get(key), "ci": (r["test"].get("ci") or {}).get(key),
                                        "mirror_cf": (r.get("mirror") or {}).get(key),
                                        "blind": blind(builds[train_on], builds[layout], probe)}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


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
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine more threads only contend)")
    ap.add_argument("--seed", type=int, default=0, help="the phantoms' seed")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 cases, 2 epochs")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.eval_cases, args.samples, args.epochs, args.bootstrap = 6, 6, 2, 2, 20
    return args


def configs(args: argparse.Namespace) -> tuple[Data, list[Training]]:
    train_on, probes = tuple(args.train_on.split(",")), tuple(args.probes.split(","))
    n = {lay: args.cases if lay in train_on else args.eval_cases for lay in LAYOUTS}
    levels = tuple(lv for lv in ("level1", "level3") if any(p.startswith(lv) for p in probes))
    data = Data(n, args.samples, args.questions, args.l3_stride, args.in_plane, args.slices, levels)
    model_args = {**MODEL_ARGS, **json.loads(args.model_args or "{}")}
    trainings = [Training(model_args, args.head, args.epochs, args.patience, args.lr, int(s), train_on, probes,
                          args.train_mirrors)
                 for s in args.seeds.split(",")]
    return data, trainings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data, trainings = configs(args)
    t0 = time.perf_counter()
    builds = build_all(out, data, args.seed)
    t_build = time.perf_counter() - t0
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
