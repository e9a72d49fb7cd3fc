"""``spar-probe sweep`` and ``spar-probe report`` on the tiny real pipeline of test_fit."""

from __future__ import annotations

import json

import pytest

from spar_bench.probes.runs.report import aggregate, collect, render_markdown

from helpers import run_cmd


@pytest.mark.slow
def test_sweep_two_jobs_skips_finished_and_report_writes_md_json_png(pipeline, tmp_path, capsys):
    from spar_bench.probes.cli import cli

    runs = tmp_path / "runs"
    args = ["sweep", "--features", pipeline["cache"], "--heads", "mlp,linear",
            "--probes", "level1.localisation,level3.symmetry", "--seeds", "0,1", "--out", runs,
            "--jobs", 2, "--max-epochs", 2, "--bootstrap", 20]  # fmt: skip
    assert run_cmd(cli, args) == 0
    assert len(list(runs.rglob("metrics.json"))) == 8
    capsys.readouterr()
    assert run_cmd(cli, args) == 0
    assert "skipping 8 finished run(s)" in capsys.readouterr().out

    (rd,) = list(runs.glob("*/level3.symmetry/mlp,max_epochs=2/seed0"))
    assert run_cmd(cli, ["eval", "--run", rd, "--features", pipeline["cache"], "--bootstrap", 20]) == 0
    out = tmp_path / "report"
    assert run_cmd(cli, ["report", runs, "--out", out]) == 0
    md = (out / "report.md").read_text()
    assert "RANDOM-INIT FEATURES" in md
    assert "## level1.localisation" in md and "## level3.symmetry" in md
    # 2 epochs, patience 8: both seeds ended at the cap, still improving, and the report says so
    assert "| dummy-random-init | mlp [max_epochs=2] | 2 (cap: 2) |" in md and "(cap: k) k seeds ended" in md
    (m0,) = [json.loads(p.read_text()) for p in runs.glob("*/level3.symmetry/mlp,max_epochs=2/seed0/metrics.json")]
    assert m0["train"]["stopped_by"] == "max_epochs" and m0["train"]["epochs_run"] == 2
    assert "transfer: dummy" in md
    for png in ("level1.localisation.png", "level3.symmetry.png", "level1.localisation-per-organ.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "report.json").read_text())
    assert rep["random_init_used"] is True and rep["n_runs"] == 8
    row = rep["probes"]["level3.symmetry"][0]
    assert row["seeds"] == [0, 1] and row["chance"] == pytest.approx(1 / 3)


def test_report_mean_std_over_seeds_and_no_banner_without_random_init(tmp_path):
    for seed, acc in ((0, 0.6), (1, 0.8)):
        d = tmp_path / "enc" / "level3.size" / "mlp" / f"seed{seed}"
        d.mkdir(parents=True)
        m = {"probe": "level3.size", "head": "mlp", "seed": seed, "encoder": "enc", "random_init": False,
             "test": {"accuracy": acc, "macro_f1": acc, "ci": {"accuracy": [acc - 0.1, acc + 0.1]}},
             "controls": {"chance": 1 / 3, "majority": 0.4, "blind": {"accuracy": 0.5},
                          "prior": {"accuracy": 0.55}},
             "mirror": {"accuracy": acc - 0.2}}  # fmt: skip
        (d / "metrics.json").write_text(json.dumps(m))
    table = aggregate(collect(tmp_path))
    (row,) = table["level3.size"]
    assert row["mean"] == pytest.approx(0.7) and row["std"] == pytest.approx(0.1414213, rel=1e-5)
    assert row["ci_low"] == pytest.approx(0.6) and row["mirror"] == pytest.approx(0.5)
    assert row["prior"] == pytest.approx(0.55) and row["blind_below_prior"] is True
    md = render_markdown(table, any_random=False)
    assert "RANDOM-INIT" not in md
    # headline, CI, macro-F1, chance, majority, prior, blind (below the prior: flagged), mirror,
    # prior (mirror), blind (mirror)
    assert (
        "| enc | mlp | 2 | 70.0 +- 14.1 | [60.0, 80.0] | 70.0 | 33.3 | 40.0 | 55.0 | 50.0 (!) | 50.0 | - | - |"
        in md
    )
    assert "(!) The blind head scores below the prior" in md


def test_report_transfer_shows_mean_std_and_ci_for_every_metric(tmp_path):
    """Transfer evaluations get every declared metric, mean +- std over seeds and the CI."""
    for seed, acc in ((0, 0.5001), (1, 0.5005)):
        d = tmp_path / "enc" / "level3.size" / "mlp" / f"seed{seed}"
        d.mkdir(parents=True)
        m = {"probe": "level3.size", "head": "mlp", "seed": seed, "encoder": "enc", "random_init": False,
             "test": {"accuracy": 0.7, "macro_f1": 0.6}, "controls": {"prior": {"accuracy": 0.6},
             "blind": {"accuracy": 0.61}}, "mirror": None}  # fmt: skip
        (d / "metrics.json").write_text(json.dumps(m))
        e = {"features": "ts.h5", "test": {"accuracy": acc, "macro_f1": acc - 0.1,
             "ci": {"accuracy": [acc - 0.01, acc + 0.01], "macro_f1": [acc - 0.11, acc - 0.09]}}}  # fmt: skip
        (d / "eval-ts.json").write_text(json.dumps(e))
    (row,) = aggregate(collect(tmp_path))["level3.size"]
    assert not row["blind_below_prior"]
    assert row["transfer"]["ts"]["mean"] == pytest.approx(0.5003)
    md = render_markdown({"level3.size": [row]}, any_random=False)
    assert "| transfer: ts |" in md and "50.0 +- 0.0 [49.0, 51.0]" in md
    assert "| enc | mlp | transfer: ts | 50.0 +- 0.0 [49.0, 51.0] | 40.0 +- 0.0 [39.0, 41.0] |" in md


def test_one_seed_shows_no_spread_two_seeds_show_mean_std(tmp_path):
    """A cell of one seed is its value (never ``+- 0.0``: one seed has no spread), in the main
    table, the transfer column and the metrics table; a cell of two seeds is mean +- std."""
    for seed in (0, 1):
        d = tmp_path / "enc" / "level3.size" / "mlp" / f"seed{seed}"
        d.mkdir(parents=True)
        m = {"probe": "level3.size", "head": "mlp", "seed": seed, "encoder": "enc", "random_init": False,
             "test": {"accuracy": 0.7 + 0.1 * seed, "macro_f1": 0.6, "ci": {"accuracy": [0.6, 0.8]}},
             "controls": {"prior": {"accuracy": 0.6}, "blind": {"accuracy": 0.61}}, "mirror": None}  # fmt: skip
        (d / "metrics.json").write_text(json.dumps(m))
        (d / "eval-ts.json").write_text(json.dumps({"features": "ts.h5", "test": {"accuracy": 0.5, "macro_f1": 0.4}}))
        rows = aggregate(collect(tmp_path))["level3.size"]
        md = render_markdown({"level3.size": rows}, any_random=False)
        if seed == 0:
            assert " +- 0." not in md and "| enc | mlp | 1 | 70.0 | [60.0, 80.0] |" in md
            assert "| enc | mlp | transfer: ts | 50.0 | 40.0 |" in md
        else:
            assert "| enc | mlp | 2 | 75.0 +- 7.1 | [60.0, 80.0] |" in md
            assert "| enc | mlp | transfer: ts | 50.0 +- 0.0 | 40.0 +- 0.0 |" in md


def test_report_on_empty_folder_is_a_clear_error(tmp_path, capsys):
    from spar_bench.probes.cli import cli

    assert run_cmd(cli, ["report", tmp_path, "--out", tmp_path / "r"]) == 2
    assert "no metrics.json found" in capsys.readouterr().err


def test_protocol_line_explains_old_runs_only_when_there_are_some() -> None:
    from spar_bench.probes.runs.report import _protocol_line

    assert _protocol_line({"p": [{"protocol": ["1.2"]}]}) == "Protocol (docs/PROTOCOL.md) of these runs: 1.2."
    mixed = _protocol_line({"p": [{"protocol": ["1.2"]}, {"protocol": ["<1.2"]}]})
    assert "runs made before the version was recorded" in mixed and "[protocol X]" in mixed


def test_random_init_banner_names_only_the_control_rows_beside_pretrained_ones():
    from spar_bench.probes.runs.report import random_init_banner

    assert random_init_banner([], ["a", "b"]) == []
    every = "\n".join(random_init_banner(["a", "b", "a"], ["a", "b"]))
    assert "RANDOM-INIT FEATURES" in every and "Every encoder below" in every
    some = "\n".join(random_init_banner(["lite0-random"], ["lite0-imagenet", "lite0-random"]))
    assert "RANDOM-INIT FEATURES in the rows marked `random-init`** (lite0-random)" in some
    assert "lite0-imagenet" not in some and "Every encoder" not in some
