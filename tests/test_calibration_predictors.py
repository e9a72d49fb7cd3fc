"""The calibration's reference models are run kinds (issue 34): the slice oracle (``slice-oracle``,
Levels 1-3 answered from the masks) and the appearance reader (``reader``) run through
``session.run`` like every kind (split, evaluation with every control, record, metrics last),
on the shared fixture build (a canonical phantom with mirrored counterfactuals)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # trained reference models on a calibration build (~60 s fixture)

pytest.importorskip("torch")


def _run(pipeline, tmp_path, probe: str, kind: str):
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.runs.spec import PredictorSpec

    rd = run(PredictorSpec(probe, kind, seed=0, features=str(pipeline["shards"]), n_boot=20), tmp_path / "runs",
             progress=False)
    return RunRecord.read(rd), json.loads((rd / "metrics.json").read_text())


@pytest.mark.slow
def test_the_slice_oracle_answers_level3_from_the_masks(pipeline, tmp_path):
    rec, m = _run(pipeline, tmp_path, "level3.relative_position", "slice-oracle")
    assert rec.kind == "slice-oracle" and m["track"] == "slice-oracle"
    assert m["test"]["accuracy"] >= 0.95 and m["mirror"]["accuracy"] >= 0.95  # the pixels' ceiling
    assert m["controls"]["blind"]["accuracy"] == m["controls"]["prior"]["accuracy"]  # its blind: the prior


def test_the_slice_oracle_is_exact_on_level1_and_answers_any_subset_alike(pipeline):
    from spar_bench.builder.shards import Build
    from spar_bench.experiments.calibration import split_items
    from spar_bench.probes.references.slice_oracle import SliceOracle
    from spar_bench.probes.tasks import get_probe

    build = Build(pipeline["shards"])
    t = split_items(pipeline["shards"], "level1.localisation")
    pred = SliceOracle(get_probe("level1.localisation"), build).predict(t)
    assert t.spec.score(t, pred, None, 0)["med_px"] == pytest.approx(0.0, abs=1e-3)
    t3 = split_items(pipeline["shards"], "level3.orientation")
    oracle = SliceOracle(get_probe("level3.orientation"), build)
    whole, order = oracle.predict(t3), np.random.default_rng(0).permutation(len(t3))
    np.testing.assert_array_equal(oracle.predict(t3.subset(order)), whole[order])
    with pytest.raises(Exception, match="Levels 1-3"):
        SliceOracle(get_probe("level4.relative_position"), build)


@pytest.mark.slow
def test_the_reader_is_a_run_kind(pipeline, tmp_path):
    rec, m = _run(pipeline, tmp_path, "level3.relative_position", "reader")
    assert rec.kind == "reader" and m["train"] is None
    assert m["test"]["accuracy"] >= m["controls"]["chance"]  # canonical anatomy: it learns the question's answer
