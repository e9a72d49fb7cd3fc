"""bench/same_outputs.py's own logic (fast): the package layout it builds from setup.cfg, and
the comparison that must flag every difference but a measured rate. The pipeline itself takes
minutes and is not run here: ``python bench/same_outputs.py --ref HEAD`` does."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import load_script

REPO = Path(__file__).resolve().parents[1]


def _bench():
    return load_script(REPO / "bench" / "same_outputs.py", "bench_same_outputs")


def test_lay_out_maps_the_folders_as_setup_cfg_does(tmp_path: Path) -> None:
    so = _bench()
    scripts = so.lay_out(REPO, tmp_path)
    assert scripts["spar-probe"].startswith("spar_bench.probes.") and "spar-build" in scripts
    assert (tmp_path / "spar_bench" / "__init__.py").is_file()
    assert (tmp_path / "spar_bench" / "builder" / "__init__.py").is_file()
    assert (tmp_path / "spar_bench" / "probes" / "__init__.py").is_file()
    assert (tmp_path / "spar_bench" / "manifests" / "labels").is_dir()
    assert not list(tmp_path.rglob("__pycache__"))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_compare_flags_every_difference_but_a_measured_rate(tmp_path: Path) -> None:
    so = _bench()
    m = {"test": {"accuracy": 0.5}, "train": {"images_per_s": 10.0, "epochs": 1}}
    slow = {**m, "train": {"images_per_s": 3.0, "epochs": 1}}
    other = {**slow, "train": {"images_per_s": 3.0, "epochs": 2}}
    a = _tree(tmp_path / "a", {"runs/r/metrics.json": json.dumps(m), "runs/s/metrics.json": json.dumps(m),
                               "runs/same.md": "x", "runs/diff.md": "x", "runs/gone.json": "{}",
                               "report/p.png": "png", "cache/c.h5": "1"})
    b = _tree(tmp_path / "b", {"runs/r/metrics.json": json.dumps(slow), "runs/s/metrics.json": json.dumps(other),
                               "runs/same.md": "x", "runs/diff.md": "y", "runs/new.json": "{}",
                               "report/p.png": "png", "cache/c.h5": "2"})
    rows, bad = so.compare(a, b, compare_all=False)
    assert dict(rows) == {
        "runs/r/metrics.json": "same (but train.images_per_s)",
        "runs/s/metrics.json": "DIFFERENT",
        "runs/same.md": "same", "runs/diff.md": "DIFFERENT",
        "runs/gone.json": "only in ref", "runs/new.json": "only in tree",
        "report/p.png": "same",
    }
    assert bad == 4
    rows, bad = so.compare(a, b, compare_all=True)
    assert dict(rows)["cache/c.h5"] == "DIFFERENT" and bad == 5
