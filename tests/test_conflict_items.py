"""Conflict items (issue 21, item 4): the Level 3 items whose answer in the image differs from
the prior's (canonical anatomy's) answer, scored by ONE function for heads and MLLMs.

``metrics.conflict_metrics`` (through ``ProbeSpec.conflict``) gives accuracy there and how
often the prediction is the prior's answer. A prior-copying predictor scores 0 % with 100 %
agreement; the truth scores 100 % with 0 %. ``fit`` (test, mirror, prior, blind) and
``vqa`` (test, mirror, prior, blind) record it, and the report shows it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.probes.cli import cli
from spar_bench.probes.metrics import conflict_metrics
from spar_bench.probes.targets import Targets
from spar_bench.probes.tasks import get_probe

from helpers import run_cmd


def test_conflict_metrics_of_constructed_predictions():
    y = np.array([1, 0, 1, 1, 0, 2])
    prior = np.array([1, 1, 1, 0, 0, 0])  # conflict items: 1, 3, 5
    copy = conflict_metrics(y, prior, prior)
    assert (copy["n"], copy["n_items"], copy["share"]) == (3, 6, 0.5)
    assert copy["accuracy"] == 0.0 and copy["prior_agreement"] == 1.0
    truth = conflict_metrics(y, y, prior)
    assert truth["accuracy"] == 1.0 and truth["prior_agreement"] == 0.0
    unparsed = conflict_metrics(y, np.full(6, -1), prior)  # an MLLM that answered nothing
    assert unparsed["accuracy"] == 0.0 and unparsed["prior_agreement"] == 0.0
    none = conflict_metrics(y, y, y)
    assert none["n"] == 0 and np.isnan(none["accuracy"])
    groups = np.array(["a", "a", "b", "b", "c", "c"])
    ci = conflict_metrics(y, y, prior, groups, np.random.default_rng(0), 50)["ci"]
    assert ci["accuracy"] == [1.0, 1.0] and ci["prior_agreement"] == [0.0, 0.0]


def _targets(spec, organ_a, organ_b, axis, answer, patient) -> Targets:
    n = len(answer)
    y = {"answer": np.asarray(answer), "organ_a": np.asarray(organ_a), "organ_b": np.asarray(organ_b),
         "axis": np.asarray(axis), "probe": np.full(n, spec.index)}
    return Targets(spec, "x", np.arange(n), np.asarray(patient), np.zeros(n, bool), y)


def test_spec_conflict_uses_the_prior_fitted_on_train_per_axis_too():
    spec = get_probe("level3.relative_position")
    # train: liver (0) left of spleen (1)? mostly no (canonical); anterior? mostly yes
    train = _targets(spec, [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1],
                     [0, 0, 1, 1, 1, 0], ["p"] * 6)
    prior = spec.fit_prior(train)
    test = _targets(spec, [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0], ["a", "a", "b", "b"])
    copy = spec.conflict(prior, test, spec.prior_predict(prior, test), None, 0)
    assert copy["n"] == 2 and copy["accuracy"] == 0.0 and copy["prior_agreement"] == 1.0
    assert {a: v["n"] for a, v in copy["per_axis"].items()} == {"left_right": 1, "anterior_posterior": 1}
    truth = spec.conflict(prior, test, test.y["answer"], None, 0)
    assert truth["accuracy"] == 1.0 and truth["per_axis"]["left_right"]["accuracy"] == 1.0
    assert spec.conflict(None, test, test.y["answer"], None, 0) is None  # no prior, no conflicts
    assert get_probe("level2.arrangement").conflict(prior, test, None, None, 0) is None


PROBE = "level3.relative_position"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pipeline) -> Path:
    """A head trained on the canonical phantom (dummy features) and a dummy MLLM, one folder."""
    out = tmp_path_factory.mktemp("conflict") / "runs"
    assert run_cmd(cli, ["fit", "--features", pipeline["cache"], "--probe", PROBE, "--head", "mlp",
                         "--out", out, "--bootstrap", 20, "--max-epochs", 3]) == 0  # fmt: skip
    assert run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--out", out,
                         "--probe", "relative_position", "--bootstrap", 20]) == 0  # fmt: skip
    return out


def _metrics(runs: Path, head: str) -> dict:
    (path,) = [p for p in runs.rglob("metrics.json") if f"/{PROBE}/{head}" in p.as_posix()]
    return json.loads(path.read_text())


def test_canonical_head_reports_conflict_items_and_the_prior_copies_canonical_answers(runs):
    m = _metrics(runs, "mlp")
    test, mirror, ctrl = m["test"]["conflict"], m["mirror"]["conflict"], m["controls"]
    assert test["n_items"] == m["test"]["n"] and 0 < test["n"] < test["n_items"]
    assert 0.0 <= test["accuracy"] <= 1.0 and len(test["ci"]["accuracy"]) == 2
    # mirroring flips left/right answers: most mirrored left/right items contradict the prior
    lr_test, lr_mirror = test["per_axis"]["left_right"], mirror["per_axis"]["left_right"]
    assert lr_mirror["share"] > 0.5 > lr_test["share"]
    for name in ("prior", "prior_mirror"):  # the prior-copying predictor
        c = ctrl[name]["conflict"]
        assert c["n"] > 0 and c["accuracy"] == 0.0 and c["prior_agreement"] == 1.0
    assert ctrl["blind"]["conflict"]["n"] == test["n"]  # the same items, the blind head's answers


def test_mllm_conflict_items_come_from_the_same_function(runs):
    head, mllm = _metrics(runs, "mlp"), _metrics(runs, "vqa-loglik")
    assert mllm["test"]["conflict"]["n"] == head["test"]["conflict"]["n"]  # same items, same prior
    assert mllm["mirror"]["conflict"]["n"] == head["mirror"]["conflict"]["n"]
    prior = mllm["controls"]["prior"]["conflict"]
    assert prior["accuracy"] == 0.0 and prior["prior_agreement"] == 1.0
    assert mllm["controls"]["blind"]["conflict"]["n"] == mllm["test"]["conflict"]["n"]
    assert set(mllm["test"]["per_axis"]) == {"left_right", "anterior_posterior"}


def test_report_shows_conflict_items_for_heads_and_mllms(runs, tmp_path):
    assert run_cmd(cli, ["report", runs, "--out", tmp_path / "report"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    section = md.split(f"## {PROBE}")[1].split("\n## ")[0]
    table = section.split("### Conflict items")[1].split("###")[0]
    rows = [line for line in table.splitlines() if line.startswith("| dummy")]
    assert {r.split(" | ")[1] for r in rows} == {"mlp [max_epochs=3]", "vqa-loglik"}
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (row,) = [r for r in report["probes"][PROBE] if r["head"] == "mlp [max_epochs=3]"]
    assert row["conflict"]["prior"]["accuracy"] == 0.0 and row["conflict"]["prior"]["prior_agreement"] == 1.0
    assert row["conflict"]["test"]["n"] == _metrics(runs, "mlp")["test"]["conflict"]["n"]


@pytest.mark.slow
def test_mask_oracle_scores_every_conflict_item(pipeline, tmp_path):
    """The mask oracle reads the answer from the stored geometry: 100 % on the conflict items
    of every probe, original and mirrored, and never the prior's answer there."""
    out = tmp_path / "runs"
    assert run_cmd(cli, ["vqa", "--model", "oracle", "--data", pipeline["shards"], "--out", out,
                         "--bootstrap", 10, "--no-blind"]) == 0  # fmt: skip
    seen = 0
    for path in sorted(out.rglob("metrics.json")):
        m = json.loads(path.read_text())
        for ev in (m["test"], m["mirror"]):
            c = ev["conflict"]
            if c["n"]:
                seen += 1
                assert c["accuracy"] == 1.0 and c["prior_agreement"] == 0.0, path
    assert seen >= 6  # relative position, orientation, symmetry, ... have conflict items
