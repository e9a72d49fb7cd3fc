"""A ``sweep --grid``: the report's row selected on validation, and ``--grid-prune``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.probes.cli import cli
from spar_bench.probes.runs.report import SELECTED, aggregate, collect

from helpers import run_cmd

PROBE = "level3.relative_position"


def _sweep(pipeline, out: Path, *extra) -> int:
    return run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--heads", "mlp", "--probes", PROBE,
                         "--seeds", "0,1", "--grid", "lr=1e-3,3e-2", "--grid", "wd=0,0.1", "--bootstrap", 10,
                         "--no-controls", "--jobs", 1, "--out", out, *extra])  # fmt: skip


@pytest.fixture(scope="module")
def grid_runs(pipeline, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grid") / "runs"
    assert _sweep(pipeline, out, "--max-epochs", 3) == 0
    return out


@pytest.mark.slow
def test_report_selects_each_seeds_grid_point_on_validation(grid_runs, tmp_path):
    ms = collect(grid_runs)
    assert len(ms) == 8
    expect = {}
    for s in (0, 1):
        mine = sorted((m for m in ms if m["seed"] == s), key=lambda m: (m["train"]["best_val_loss"], m["variant"]))
        expect[s] = mine[0]
    assert run_cmd(cli, ["report", grid_runs, "--out", tmp_path / "rep"]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = rep["probes"][PROBE]
    assert len(rows) == 5  # four grid points, one selected row
    (sel,) = [r for r in rows if r["head"] == f"mlp [{SELECTED}]"]
    assert [(c["seed"], c["variant"]) for c in sel["selection"]] == [(s, expect[s]["variant"]) for s in (0, 1)]
    key = sel["metric"]
    assert sel["mean"] == pytest.approx(np.mean([expect[s]["test"][key] for s in (0, 1)]))
    assert sel["seeds"] == [0, 1] and sel["ci_low"] is not None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "### Grid point selected on validation, per seed" in md
    assert f"| 0 | {expect[0]['variant']} |" in md


@pytest.mark.slow
def test_selection_ignores_pruned_runs_and_breaks_ties_by_variant(grid_runs):
    ms = collect(grid_runs)
    seed0 = sorted((m for m in ms if m["seed"] == 0), key=lambda m: m["variant"])
    for m in seed0:
        m["train"]["best_val_loss"] = 1.0  # a tie: the first variant in sorted order wins
    seed0[0]["train"]["pruned_at"] = 2  # ... unless it was pruned
    (sel,) = [r for r in aggregate(ms)[PROBE] if r.get("selection")]
    assert sel["selection"][0]["variant"] == seed0[1]["variant"]
    assert sel["selection"][0]["pruned"] == 1 and sel["selection"][0]["candidates"] == 3
    pruned_row = [r for r in aggregate(ms)[PROBE] if r["head"] == f"mlp [{seed0[0]['variant']}]"]
    assert pruned_row[0]["seeds"] == [1]  # the pruned run is left out of its point's row


def test_grid_prune_writes_every_run_and_keeps_one_point_per_seed(pipeline, tmp_path):
    """``--grid-prune 1``: after epoch 1 each seed keeps the point with the lowest validation loss;
    the others are written as pruned at 1; the report leaves them out of the rows and selects
    each seed's survivor."""
    out = tmp_path / "runs"
    assert _sweep(pipeline, out, "--max-epochs", 3, "--grid-prune", 1) == 0
    ms = collect(out)
    assert len(ms) == 8
    for s in (0, 1):
        mine = [m for m in ms if m["seed"] == s]
        pruned = [m for m in mine if m["train"].get("pruned_at") is not None]
        (kept,) = [m for m in mine if m["train"].get("pruned_at") is None]
        assert all(m["train"]["stopped_by"] == "grid_prune" for m in pruned)
        assert len(pruned) == 3 and all(m["train"]["pruned_at"] == 1 and m["train"]["epochs_run"] == 1
                                        and "pruned_reason" in m["train"] for m in pruned)  # fmt: skip
        assert kept["train"]["epochs_run"] > 1
        assert all(kept["train"]["best_val_loss"] <= m["train"]["best_val_loss"] for m in pruned)
        cfg = json.loads((Path(kept["_dir"]) / "config.json").read_text())["extra"]
        assert cfg["batch"]["grid_prune"]["after_epoch"] == 1
        assert sorted(cfg["batch"]["grid_prune"]["pruned"]) == sorted(
            Path(m["_dir"]).relative_to(out).as_posix() for m in ms if m["train"].get("pruned_at"))
    rows = aggregate(ms)[PROBE]
    (sel,) = [r for r in rows if r.get("selection")]
    survivors = {m["seed"]: m["variant"] for m in ms if m["train"].get("pruned_at") is None}
    assert {c["seed"]: c["variant"] for c in sel["selection"]} == survivors
    assert sum(len(r["seeds"]) for r in rows if not r.get("selection")) == 2  # the pruned runs left out


def test_a_pruned_grid_resumes_only_as_a_pruned_grid(pipeline, tmp_path, capsys):
    """A pruned run looks finished; a sweep that asks for full runs names it instead of skipping it."""
    out = tmp_path / "runs"
    assert _sweep(pipeline, out, "--max-epochs", 3, "--grid-prune", 1) == 0
    capsys.readouterr()
    assert _sweep(pipeline, out, "--max-epochs", 3, "--grid-prune", 1) == 0
    assert "0 run(s) done" in capsys.readouterr().out  # the same pruned grid: all finished
    for extra in ((), ("--grid-prune", 2)):
        assert _sweep(pipeline, out, "--max-epochs", 3, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "pruned after epoch 1" in err and "rerun with --grid-prune 1" in err


@pytest.mark.parametrize("extra,message", [
    (["--max-epochs", 3, "--grid-prune", -1], "--grid-prune -1: give the epoch"),
    (["--max-epochs", 3, "--grid-prune", 3], "must be below the max epochs"),
    (["--max-epochs", 3, "--grid-prune", 1, "--partition", "0/2"], "cannot be split by --only or --partition"),
])  # fmt: skip
def test_grid_prune_refuses_bad_values_in_one_line(pipeline, tmp_path, capsys, extra, message):
    assert _sweep(pipeline, tmp_path / "runs", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("metrics.json"))


def test_grid_prune_without_an_lr_or_wd_grid_says_why(pipeline, tmp_path, capsys):
    args = ["sweep", "--features", pipeline["cache"], "--heads", "mlp", "--probes", PROBE, "--seeds", "0",
            "--grid", "hidden=16,32", "--max-epochs", 3, "--grid-prune", 1, "--out", tmp_path / "runs"]  # fmt: skip
    assert run_cmd(cli, args) == 2
    assert "no --grid over lr or wd" in capsys.readouterr().err
