"""Check ``spar-bench run --dry-run``'s estimates against real small builds, and measure the
table they come from (``experiments/sizes.json``).

    python bench/estimate.py                 # estimate vs measured: demo, volumes, 20 WORD maps
    python bench/estimate.py --only demo,volumes
    python bench/estimate.py --write         # re-measure experiments/sizes.json, then compare

Comparison (default): for each experiment its build step is planned (the estimate: images,
test-split questions, seconds on 2 CPU cores), then run as ``spar-bench run`` runs it, and
counted from its manifest (the measurement). Printed side by side, per build and per case,
with measured / estimated ratios:

* ``demo``: the shipped demo (12-case canonical phantom, 8 samples a case, mirror);
* ``volumes``: the shipped Level 4 preset (12-case phantom, 16^3 volumes, mirror+flip);
* ``word20``: the 20 WORD label maps of ``../shared/data/word-labels`` (``--images
  synthesize``, thresholds fitted on test: every case is a test case) with the paper
  preset (32 samples a case, ``l12_min_organs`` 8, mirror), as the paper's ``word`` build.

``--write`` first measures each source's row on builds other than those compared (so the
comparison is no identity): a 24-case phantom (seed 1; Levels 1-3, then Level 4 at 16^3),
10 of the WORD maps (paper preset, ``--limit word=10``), the TotalSegmentator sample (paper
preset, WORD's thresholds), and LiTS-layout label maps made here from 6 WORD maps (the liver
as label 1, a 20 mm ball of tumour as label 2 at the liver's centre: LiTS's labels on real
anatomy; no LiTS scan is on this machine). Build seconds are one process's CPU seconds per case
(``jobs`` 1, in this process: on a shared machine, CPU time is what an idle machine's wall time
would be); the comparison also prints the wall time under the load it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
TABLE = REPO / "experiments" / "sizes.json"


def _word_yaml(out: Path, root: Path, extra: str = "") -> str:
    return (f"experiment: word20\nout: {out}\nbuilds:\n  word:\n    sources: [word]\n    roots: [{root}]\n"
            f"    options: {{preset: paper, images: synthesize, fit_thresholds_on: test, hf: false, jobs: 1{extra}}}\n")


def _experiment(name: str, tmp: Path):
    from spar_bench.experiments import preset_path
    from spar_bench.experiments.config import load_experiment

    out = tmp / name
    if name == "word20":
        path = tmp / "word20.yaml"
        path.write_text(_word_yaml(out, SHARED / "word-labels"))
        return load_experiment(path)
    return load_experiment(preset_path(name), {"OUT": str(out), "JOBS": "1"})


def compare(name: str, tmp: Path) -> list[tuple[str, float, float]]:
    """``(what, estimated, measured)`` rows of experiment ``name``'s (first) build."""
    from spar_bench.experiments.estimate import step_seconds
    from spar_bench.experiments.plan import make_plan
    from spar_bench.experiments.runner import execute
    from spar_bench.experiments.step_kinds import estimated_images, estimated_questions

    exp = _experiment(name, tmp)
    plan = make_plan(exp)
    step = next(s for s in plan.steps if s.kind == "build")
    b = step.id.split(":", 1)[1]
    kind = "3d" if "level4" in (exp.builds[b].options.get("levels") or ()) else None
    est = {"cases": dict(step.cost)["cases"], "images": estimated_images(exp, b, kind),
           "questions": estimated_questions(exp, b), "seconds": step_seconds(plan, step)[0]}
    t0, c0 = time.perf_counter(), time.process_time()
    execute(step, exp.out, None)
    seconds, wall = time.process_time() - c0, time.perf_counter() - t0
    manifest = json.loads((exp.out / "builds" / b / "manifest.json").read_text())
    got = {"cases": len(manifest["cases"]), "images": estimated_images(exp, b, kind),
           "questions": estimated_questions(exp, b), "seconds": seconds}
    rows = [(k, float(est[k]), float(got[k])) for k in est]
    rows += [(f"{k} / case", est[k] / max(est["cases"], 1), got[k] / max(got["cases"], 1))
             for k in ("images", "questions", "seconds")]
    return rows + [("wall seconds (load)", est["seconds"], wall)]


def print_rows(name: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"\n{name}\n| what | estimated | measured | measured / estimated |\n|---|---|---|---|")
    for what, e, m in rows:
        ratio = f"{m / e:.2f}" if e else "-"
        print(f"| {what} | {e:,.1f} | {m:,.1f} | {ratio} |")


# --------------------------------------------------------------------------- measuring the table
def _timed_build(options: dict) -> tuple[Path, float]:
    """The build and its CPU seconds (one process: on a shared machine, CPU time is what an
    idle machine's wall time would be; wall time grows with the load)."""
    from spar_bench.builder.build import build, config_from_options

    config = config_from_options(options)
    c0 = time.process_time()
    path = build(config, quiet=True)
    return path, time.process_time() - c0


def _row(manifest: dict, seconds: float, source: str, spc: int, note: str) -> dict:
    """A source's row from a one-source build's manifest (counterfactual copies divided out)."""
    cases = [c for c in manifest["cases"] if c["source"] == source]
    n = len(cases)
    cf = manifest["config"]["sample"].get("counterfactual")
    copies = 2 if cf in ("mirror", "mirror+flip") else 1
    rows = {lv: sum(c["rows"].get(lv, 0) for c in cases) / copies / n for lv in ("level1", "level2", "level3")}
    questions = {}
    for level in ("level3",):
        for split in manifest["counts"].get(level, {}).values():
            for probe, counts in split.get("classes", {}).items():
                questions[f"{level}.{probe}"] = questions.get(f"{level}.{probe}", 0) + sum(counts) / copies / n
    return {"from": note, "cases": n, "samples_per_case": spc, "l12_kept": round(rows["level1"] / spc, 4),
            "level3_slices": round(rows["level3"], 2), "questions": {k: round(v, 2) for k, v in sorted(questions.items())},
            "build_seconds": round(seconds / n, 2)}  # fmt: skip


def _level4_questions(manifest: dict) -> dict[str, float]:
    n = len(manifest["cases"])
    copies = {"mirror": 2, "mirror+flip": 3}.get(manifest["config"]["sample"].get("counterfactual"), 1)
    out: dict[str, float] = {}
    for split in manifest["counts"].get("level4", {}).values():
        for probe, counts in split.get("classes", {}).items():
            if probe != "present":  # localisation's organ presence: no question
                out[f"level4.{probe}"] = out.get(f"level4.{probe}", 0) + sum(counts) / copies / n
    return {k: round(v, 2) for k, v in sorted(out.items())}


def _lits_like(word_root: Path, out: Path, n: int) -> Path:
    """LiTS-layout label maps from ``n`` WORD maps: liver -> 1, a 20 mm tumour ball -> 2."""
    import nibabel as nib
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(sorted((word_root / "labelsTs").glob("*.nii.gz"))[:n]):
        img = nib.load(f)
        lab = np.asanyarray(img.dataobj)
        seg = (lab == 1).astype(np.uint8)
        centre = np.argwhere(seg).mean(axis=0)
        zooms = np.array(img.header.get_zooms()[:3])
        grid = np.ogrid[tuple(slice(0, s) for s in seg.shape)]
        dist2 = sum(((g - c) * z) ** 2 for g, c, z in zip(grid, centre, zooms, strict=True))
        seg[(dist2 <= 20.0**2) & (seg == 1)] = 2
        nib.save(nib.Nifti1Image(seg, img.affine), out / f"segmentation-{i}.nii.gz")
    return out


def measure(tmp: Path) -> dict:
    """Every source's row, measured on builds other than those :func:`compare` makes."""
    from spar_bench.builder.phantom.generate import PhantomOptions, write_phantom_dataset

    base = {"no_hf": True, "jobs": 1}
    c0 = time.process_time()
    write_phantom_dataset(tmp / "ph", 24, PhantomOptions(layout="canonical", seed=1), overwrite=True)
    gen = time.process_time() - c0
    path, s = _timed_build({**base, "source": ("phantom",), "root": (str(tmp / "ph"),), "out": str(tmp / "b-ph"),
                            "samples_per_case": 8, "counterfactual": "mirror"})  # fmt: skip
    phantom = _row(json.loads((path / "manifest.json").read_text()), s + gen, "phantom", 8,
                   "24-case canonical phantom (seed 1), 8 samples a case, mirror; Level 4: the same at 16^3, mirror+flip")
    path, _ = _timed_build({**base, "source": ("phantom",), "root": (str(tmp / "ph"),), "out": str(tmp / "b-ph4"),
                            "levels": "level4", "volume_size": 16, "counterfactual": "mirror+flip"})  # fmt: skip
    phantom["questions"].update(_level4_questions(json.loads((path / "manifest.json").read_text())))
    paper = {**base, "preset": "paper", "images": "synthesize"}
    path, s = _timed_build({**paper, "source": ("word",), "root": (str(SHARED / "word-labels"),),
                            "out": str(tmp / "b-word"), "fit_thresholds_on": "test", "limit": ("word=10",)})  # fmt: skip
    word = _row(json.loads((path / "manifest.json").read_text()), s, "word", 32,
                "10 of the 20 WORD label maps (--limit word=10), --images synthesize, paper preset (mirror)")
    thresholds = str(path / "manifest.json")
    path, s = _timed_build({**paper, "source": ("totalsegmentator",), "root": (str(SHARED / "totalsegmentator-sample"),),
                            "out": str(tmp / "b-ts"), "thresholds_from": thresholds})  # fmt: skip
    ts = _row(json.loads((path / "manifest.json").read_text()), s, "totalsegmentator", 32,
              "the TotalSegmentator sample (1 case, 122x101x30 at 3 mm), paper preset, WORD's thresholds")
    lits_root = _lits_like(SHARED / "word-labels", tmp / "lits", 6)
    path, s = _timed_build({**paper, "source": ("lits",), "root": (str(lits_root),), "out": str(tmp / "b-lits"),
                            "thresholds_from": thresholds})  # fmt: skip
    lits = _row(json.loads((path / "manifest.json").read_text()), s, "lits", 32,
                "6 LiTS-layout label maps made from WORD maps (liver, a 20 mm tumour ball), paper preset")
    return {"phantom": phantom, "word": word, "totalsegmentator": ts, "lits": lits}


def write_table(tmp: Path) -> None:
    from spar_bench import __version__

    sources = measure(tmp)
    record = {
        "about": "per case: Level 1-2 mosaics kept of those drawn (l12_kept), Level 3 slices, questions per "
                 "probe (all splits), one process's build seconds; counterfactual copies divided out. "
                 "Read by spar_bench.experiments.sizes; written by bench/estimate.py --write.",
        "measured": {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": "python bench/estimate.py --write",
                     "spar_bench": __version__, "machine": f"{os.cpu_count()} CPU cores",
                     "load_average": [round(x, 1) for x in os.getloadavg()]},
        "sources": sources,
    }  # fmt: skip
    TABLE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="demo,volumes,word20", help="experiments to compare (comma list)")
    ap.add_argument("--write", action="store_true", help="re-measure experiments/sizes.json first")
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU cores")
    with tempfile.TemporaryDirectory(prefix="spar-estimate-") as t:
        tmp = Path(t)
        if args.write:
            write_table(tmp / "measure")
            from spar_bench.experiments import sizes

            sizes.table.cache_clear()
        for name in [n for n in args.only.split(",") if n]:
            print_rows(name, compare(name, tmp))


if __name__ == "__main__":
    sys.exit(main())
