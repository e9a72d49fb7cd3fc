"""One run lifecycle for every run kind (issue 22): a new kind is one Predictor class.

The constant prior and the MLLMs (the oracle, the dummy) run through
``spar_bench.probes.runs.session.run``: the same split by patient, the same evaluation with
every control, the same store and the same metrics schema as a head on cached features
(``spar-probe fit``), and the report reads them side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

PROBE = "level3.relative_position"


def _run(pipeline, tmp_path: Path, predictor_of, head: str):
    """A given predictor instance (``predictor_of(build)``) run by the one lifecycle in folder ``head``."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.session import BuildJob, execute
    from spar_bench.probes.runs.spec import PredictorSpec

    build = Build(pipeline["shards"])
    run = PredictorSpec(PROBE, head, seed=0, features=str(pipeline["shards"]), n_boot=50)
    rd = execute(BuildJob.of(run, predictor_of(build), build, tmp_path / "runs", head))
    return rd, json.loads((rd / "metrics.json").read_text())


def test_constant_prior_scores_what_the_prior_control_scores(pipeline, tmp_path):
    from spar_bench.probes.runs.predictors import ConstantPrior
    from spar_bench.probes.tasks import get_probe

    rd, m = _run(pipeline, tmp_path, lambda b: ConstantPrior(get_probe(PROBE)), "prior")
    assert rd.name == "seed0" and rd.parent.name == "prior"
    assert m["track"] == "prior" and m["train"] is None
    assert m["test"]["accuracy"] == m["controls"]["prior"]["accuracy"]
    assert m["controls"]["blind"]["accuracy"] == m["controls"]["prior"]["accuracy"]  # no image to lose
    assert m["mirror"] is not None and m["mirror"]["accuracy"] == m["controls"]["prior_mirror"]["accuracy"]
    assert m["n_items"]["test"] > 0 and m["n_patients"]["test"] >= 2


def test_mllm_oracle_through_the_same_path_reads_the_image(pipeline, tmp_path):
    """An MLLM spec is data (the model named, not loaded): ``session.run`` opens its job, which
    loads the backend and opens the response cache."""
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.vqa.ask import AskConfig
    from spar_bench.probes.vqa.predictor import MllmSpec, close_backends

    spec = MllmSpec("oracle", str(pipeline["shards"]), PROBE, AskConfig(n_boot=50, circular=False))
    try:
        rd = run(spec, tmp_path / "runs")
    finally:
        close_backends()
    m = json.loads((rd / "metrics.json").read_text())
    assert rd == tmp_path / "runs" / "oracle" / PROBE / "vqa-loglik" / "seed0"
    assert (tmp_path / "runs" / ".vqa-cache" / "oracle.sqlite").is_file()  # the default response cache
    assert m["track"] == "vqa"
    assert m["test"]["accuracy"] == 1.0 and m["mirror"]["accuracy"] == 1.0
    assert m["controls"]["blind"]["accuracy"] == 0.0  # the oracle abstains without the slice
    conflict = m["test"].get("conflict")
    assert conflict is None or conflict["n"] == 0 or conflict["accuracy"] == 1.0


def test_dummy_mllm_and_every_kind_share_one_metrics_schema(pipeline, tmp_path):
    from spar_bench.probes.cli import cli
    from spar_bench.probes.runs.predictors import ConstantPrior
    from spar_bench.probes.runs.report import write_report
    from spar_bench.probes.tasks import get_probe

    from helpers import run_cmd

    _, mp = _run(pipeline, tmp_path, lambda b: ConstantPrior(get_probe(PROBE)), "prior")
    assert run_cmd(cli, ["fit", "--features", pipeline["cache"], "--probe", PROBE, "--head", "linear",
                         "--max-epochs", 2, "--bootstrap", 50, "--out", tmp_path / "runs"]) == 0  # fmt: skip
    fitted = json.loads(next((tmp_path / "runs").glob(f"*/{PROBE}/linear*/seed0/metrics.json")).read_text())
    assert run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--probe", "relative_position",
                         "--bootstrap", 50, "--out", tmp_path / "runs"]) == 0  # fmt: skip
    asked = json.loads(next((tmp_path / "runs").glob(f"dummy/{PROBE}/vqa-loglik/seed0/metrics.json")).read_text())
    assert asked["track"] == "vqa" and asked["train"] is None and "circular" in asked["controls"]
    for m in (mp, asked):
        assert set(fitted) <= set(m), set(fitted) - set(m)
        assert set(fitted["controls"]) <= set(m["controls"])
        assert {"accuracy", "macro_f1", "ci", "conflict"} <= set(m["test"])
    assert 0.0 <= asked["test"]["accuracy"] <= 1.0 and "blind" in asked["controls"]
    report = write_report(tmp_path / "runs", tmp_path / "report")
    text = (report / "report.md").read_text() if report.is_dir() else Path(report).read_text()
    for name in ("dummy", "prior", "linear"):
        assert name in text


def test_a_finished_predictor_run_is_kept_and_another_refused(pipeline, tmp_path, capsys):
    from spar_bench.errors import ConfigError
    from spar_bench.probes.runs.predictors import ConstantPrior
    from spar_bench.probes.tasks import get_probe

    rd, _ = _run(pipeline, tmp_path, lambda b: ConstantPrior(get_probe(PROBE)), "prior")
    before = (rd / "metrics.json").read_bytes()
    _run(pipeline, tmp_path, lambda b: ConstantPrior(get_probe(PROBE)), "prior")
    assert "kept" in capsys.readouterr().err and (rd / "metrics.json").read_bytes() == before

    with pytest.raises(ConfigError, match="kind=prior"):  # another kind of predictor, same folder
        _run(pipeline, tmp_path, lambda b: ConstantPrior(get_probe(PROBE), kind="other"), "prior")


def test_predictors_satisfy_the_protocol():
    from spar_bench.probes.finetune.predictor import FinetunedEncoder
    from spar_bench.probes.runs.predictors import BlindHead, CachedHead, ConstantPrior, Predictor
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.predictor import Answered

    assert isinstance(ConstantPrior(get_probe(PROBE)), Predictor)
    for cls in (CachedHead, BlindHead, FinetunedEncoder, Answered):
        assert all(callable(getattr(cls, name, None)) for name in ("fit", "predict", "blind")), cls
    assert np.array_equal(ConstantPrior(get_probe(PROBE)).blind().spec.class_names, get_probe(PROBE).class_names)
