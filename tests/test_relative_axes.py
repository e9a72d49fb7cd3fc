"""Relative position per axis (issue 21, item 3): left/right and anterior/posterior apart.

Mirroring flips left/right answers and leaves anterior/posterior ones, so a pooled number
dilutes the mirror control: metrics, controls and the report give each axis (beside the
pooled number), for heads and MLLMs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.schema import RELATIVE_POSITION_AXES
from spar_bench.probes.cli import cli
from spar_bench.probes.targets import Targets
from spar_bench.probes.tasks import get_probe

from helpers import run_cmd

PROBE = "level3.relative_position"


def _targets(spec, axis, answer) -> Targets:
    n = len(answer)
    y = {"answer": np.asarray(answer), "organ_a": np.zeros(n, int), "organ_b": np.ones(n, int),
         "axis": np.asarray(axis), "probe": np.full(n, spec.index)}
    return Targets(spec, "x", np.arange(n), np.array(["a", "b"] * (n // 2)), np.zeros(n, bool), y)


def test_score_splits_relative_position_by_axis_and_keeps_the_pooled_number():
    spec = get_probe(PROBE)
    assert spec.axes == RELATIVE_POSITION_AXES and spec.describe()["axes"] == list(RELATIVE_POSITION_AXES)
    t = _targets(spec, [0, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 1])
    pred = np.array([1, 0, 0, 1, 1, 1])  # left/right 2 of 4, anterior/posterior 2 of 2
    s = spec.score(t, pred, np.random.default_rng(0), 20)
    assert s["accuracy"] == pytest.approx(4 / 6)
    lr, ap = s["per_axis"]["left_right"], s["per_axis"]["anterior_posterior"]
    assert (lr["accuracy"], lr["n"], ap["accuracy"], ap["n"]) == (0.5, 4, 1.0, 2)
    assert len(lr["ci"]["accuracy"]) == 2
    only_lr = spec.score(t.subset(np.arange(4)), pred[:4], None, 0)
    assert set(only_lr["per_axis"]) == {"left_right"}
    other = get_probe("level3.orientation")
    assert other.axes == () and "per_axis" not in other.score(
        _targets(other, [-1, -1], [0, 3]), np.array([0, 3]), None, 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pipeline) -> Path:
    out = tmp_path_factory.mktemp("axes") / "runs"
    assert run_cmd(cli, ["fit", "--features", pipeline["cache"], "--probe", PROBE, "--head", "linear",
                         "--out", out, "--bootstrap", 20, "--max-epochs", 3]) == 0  # fmt: skip
    assert run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--out", out,
                         "--probe", "relative_position", "--bootstrap", 20, "--no-blind"]) == 0  # fmt: skip
    return out


def _metrics(runs: Path, head: str) -> dict:
    (path,) = [p for p in runs.rglob("metrics.json") if f"/{PROBE}/{head}" in p.as_posix()]
    return json.loads(path.read_text())


def test_mirror_control_moves_left_right_and_leaves_anterior_posterior(runs):
    m = _metrics(runs, "linear")
    for ev in (m["test"], m["mirror"], m["controls"]["prior"], m["controls"]["blind"]):
        per = ev["per_axis"]
        n = per["left_right"]["n"] + per["anterior_posterior"]["n"]
        pooled = (per["left_right"]["accuracy"] * per["left_right"]["n"]
                  + per["anterior_posterior"]["accuracy"] * per["anterior_posterior"]["n"]) / n
        assert n == ev["n"] and pooled == pytest.approx(ev["accuracy"])
    prior, prior_m = m["controls"]["prior"]["per_axis"], m["controls"]["prior_mirror"]["per_axis"]
    # canonical anatomy answers left/right on the originals and fails on the mirrored copies;
    # anterior/posterior answers do not change under mirroring
    assert prior_m["left_right"]["accuracy"] < 0.5 < prior["left_right"]["accuracy"]
    assert prior_m["anterior_posterior"]["accuracy"] == pytest.approx(prior["anterior_posterior"]["accuracy"], abs=0.1)
    assert set(_metrics(runs, "vqa-loglik")["mirror"]["per_axis"]) == set(RELATIVE_POSITION_AXES)


def test_report_has_a_per_axis_table(runs, tmp_path):
    assert run_cmd(cli, ["report", runs, "--out", tmp_path / "r"]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    table = md.split(f"## {PROBE}")[1].split("### Per axis")[1].split("###")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| dummy")]
    assert sorted((r[1], r[2]) for r in rows) == [
        ("linear [max_epochs=3]", "anterior_posterior"), ("linear [max_epochs=3]", "left_right"),
        ("vqa-loglik", "anterior_posterior"), ("vqa-loglik", "left_right")]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    (row,) = [r for r in report["probes"][PROBE] if r["head"] == "linear [max_epochs=3]"]
    m = _metrics(runs, "linear")
    assert row["per_axis"]["left_right"]["mirror"] == pytest.approx(m["mirror"]["per_axis"]["left_right"]["accuracy"])
    assert row["per_axis"]["anterior_posterior"]["prior_mirror"] == pytest.approx(
        m["controls"]["prior_mirror"]["per_axis"]["anterior_posterior"]["accuracy"])
