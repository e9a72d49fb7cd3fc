"""``spar-probe fit`` / ``eval`` end to end on a real (tiny) pipeline.

phantom -> ``spar-build`` shards (with mirrored counterfactuals) -> ``spar-probe cache``
with the built-in ``dummy`` encoder -> fit. Built once per session (~20-40 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cmd


def _fit(pipeline, out, *extra) -> int:
    from spar_bench.probes.cli import cli

    return run_cmd(
        cli, ["fit", "--features", pipeline["cache"], "--out", out, "--bootstrap", 50, *extra]
    )


def _one(out: Path, probe: str, head: str, seed: int = 0) -> Path:
    """The one run folder of ``probe`` x ``head`` x ``seed`` under ``out`` (any options)."""
    (rd,) = [p for p in out.glob(f"*/{probe}/*/seed{seed}") if p.parent.name.split(",")[0] == head]
    return rd


def test_fit_cli_writes_run_and_rerun_is_identical(pipeline, tmp_path):
    args = [
        "--head",
        "mlp",
        "--probe",
        "level3.relative_position",
        "--seeds",
        "0",
        "--max-epochs",
        4,
    ]
    assert _fit(pipeline, tmp_path / "a", *args) == 0
    assert _fit(pipeline, tmp_path / "b", *args) == 0
    rd = _one(tmp_path / "a", "level3.relative_position", "mlp")
    assert rd.parts[-4] == "dummy-random-init"
    assert rd.parts[-2] == "mlp,max_epochs=4"  # options that differ from the defaults name the run
    assert {"config.json", "metrics.json", "head.pt"} <= {p.name for p in rd.iterdir()}
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["inputs"]["random_init"] is True and cfg["seed"] == 0 and cfg["kind"] == "head"
    assert {"torch", "numpy", "spar-bench"} <= set(cfg["versions"])
    assert len(cfg["inputs"]["cache_fingerprint"]) == 64
    m = json.loads((rd / "metrics.json").read_text())
    assert 0.0 <= m["test"]["accuracy"] <= 1.0
    lo, hi = m["test"]["ci"]["accuracy"]
    assert lo <= m["test"]["accuracy"] <= hi
    assert (
        m["controls"]["chance"] == 0.5 and "blind" in m["controls"] and "majority" in m["controls"]
    )
    assert m["mirror"] is not None and m["n_items"]["test_mirror"] > 0
    assert m["val_source"] == "val split"
    rd_b = _one(tmp_path / "b", "level3.relative_position", "mlp")
    assert (rd / "metrics.json").read_text() == (rd_b / "metrics.json").read_text()


def test_fit_level1_level2_token_head_with_atlas_and_mirror(pipeline, tmp_path):
    args = [
        "--head",
        "transformer",
        "--probe",
        "level1.localisation,level2.arrangement",
        "--max-epochs",
        2,
    ]
    assert _fit(pipeline, tmp_path, *args, "--no-controls") == 0
    m1 = json.loads(
        (_one(tmp_path, "level1.localisation", "transformer") / "metrics.json").read_text()
    )
    assert m1["test"]["med_px"] > 0 and set(m1["test"]["per_organ"]) >= {"liver", "spleen"}
    assert m1["controls"]["prior"]["med_px"] > 0 and "blind" not in m1["controls"]
    assert m1["mirror"]["med_px"] > 0
    m2 = json.loads(
        (_one(tmp_path, "level2.arrangement", "transformer") / "metrics.json").read_text()
    )
    assert 0 <= m2["test"]["perm_acc"] <= 1 and 0 < m2["controls"]["chance"] < 1


def test_fit_refuses_shards_with_another_fingerprint(pipeline, tmp_path, capsys):
    code = _fit(pipeline, tmp_path, "--probe", "level1.localisation", "--data", pipeline["other"])
    assert code == 2
    err = capsys.readouterr().err
    assert "fingerprint" in err and "re-run `spar-probe cache`" in err
    assert not list(tmp_path.rglob("metrics.json"))


def test_fit_unknown_head_and_probe_are_one_line_errors(pipeline, tmp_path, capsys):
    assert _fit(pipeline, tmp_path, "--head", "mpl", "--probe", "level1.localisation") == 2
    assert "Did you mean 'mlp'" in capsys.readouterr().err
    assert _fit(pipeline, tmp_path, "--probe", "level3.colour") == 2
    assert "unknown probe" in capsys.readouterr().err


def test_no_val_split_holds_out_patients_and_eval_transfers(pipeline, tmp_path, monkeypatch):
    from spar_bench.probes.cli import cli
    from spar_bench.probes.features import FeatureCache

    args = ["fit", "--features", pipeline["cache_noval"], "--out", tmp_path, "--bootstrap", 20,
            "--probe", "level3.counting", "--max-epochs", 3, "--no-controls"]  # fmt: skip
    assert run_cmd(cli, args) == 0
    rd = _one(tmp_path, "level3.counting", "mlp")
    m = json.loads((rd / "metrics.json").read_text())
    assert m["val_source"].startswith("held-out") and m["n_items"]["val"] > 0
    # eval on the full cache (same build): the test split gives the same predictions. From
    # another folder: the cache finds its build relative to itself.
    assert FeatureCache(pipeline["cache"]).meta["dataset_dir"] == "../shards"
    monkeypatch.chdir(tmp_path)
    assert run_cmd(cli, ["eval", "--run", rd, "--features", pipeline["cache"], "--bootstrap", 20]) == 0
    for name in ("config.json", "eval-dummy.json"):  # names and fingerprints, no local paths
        text = (rd / name).read_text()
        assert str(pipeline["root"]) not in text and "/tmp" not in text and str(tmp_path) not in text
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["inputs"]["features"] == "dummy-noval.h5" and cfg["build"] == "shards"
    e = json.loads((rd / "eval-dummy.json").read_text())
    assert e["features"] == "dummy.h5" and e["run"] == "/".join(rd.parts[-4:])
    assert e["test"]["accuracy"] == pytest.approx(m["test"]["accuracy"])
    assert e["test"]["n"] == m["test"]["n"]


@pytest.mark.slow
def test_fit_and_sweep_give_identical_metrics(pipeline, tmp_path):
    """One run, two ways (``fit`` in this process, ``sweep`` in a worker): same bytes."""
    from spar_bench.probes.cli import cli

    probe = "level3.relative_position"
    assert _fit(pipeline, tmp_path / "fit", "--head", "mlp", "--probe", probe) == 0
    assert run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--heads", "mlp", "--probes", probe,
                      "--seeds", 0, "--jobs", 1, "--bootstrap", 50, "--out", tmp_path / "sweep"]) == 0  # fmt: skip
    a = (_one(tmp_path / "fit", probe, "mlp") / "metrics.json").read_bytes()
    b = (_one(tmp_path / "sweep", probe, "mlp") / "metrics.json").read_bytes()
    assert a == b


@pytest.mark.slow
def test_sweep_grid_reproduces_fit_with_non_default_options_byte_for_byte(pipeline, tmp_path):
    """Every option of fit works in sweep; a --grid point equals the fit run with its options."""
    from spar_bench.probes.cli import cli

    probe = "level2.arrangement"
    common = ["--max-epochs", 3, "--batch-size", 32, "--patience", 2, "--train-mirrors",
              "--d-model", 32, "--n-layers", 1, "--proj-dim", 16, "--dropout", 0.0, "--layer", -1]  # fmt: skip
    assert _fit(pipeline, tmp_path / "fit", "--head", "transformer", "--probe", probe,
                "--lr", 3e-3, "--weight-decay", 0, "--no-controls", *common) == 0  # fmt: skip
    sweep = ["sweep", "--features", pipeline["cache"], "--heads", "transformer,mlp", "--probes", probe,
             "--seeds", 0, "--jobs", 2, "--bootstrap", 50, "--no-controls", "--out", tmp_path / "sweep",
             "--grid", "lr=3e-3,1e-2", "--grid", "wd=0", *common]  # fmt: skip
    assert run_cmd(cli, sweep) == 0
    name = "transformer,batch_size=32,d_model=32,dropout=0,lr=0.003,max_epochs=3,n_layers=1,patience=2," \
           "proj_dim=16,train_mirrors=1,weight_decay=0"
    fit_rd = _one(tmp_path / "fit", probe, "transformer")
    assert fit_rd.parent.name == name
    sweep_rd = tmp_path / "sweep" / fit_rd.relative_to(tmp_path / "fit")
    for f in ("metrics.json", "config.json"):
        assert (fit_rd / f).read_bytes() == (sweep_rd / f).read_bytes(), f
    cfg = json.loads((fit_rd / "config.json").read_text())
    assert cfg["options"]["head_options"] == {"d_model": 32, "dropout": 0.0, "n_layers": 1, "proj_dim": 16}
    assert cfg["extra"]["head_config"]["d_model"] == 32 and cfg["extra"]["head_config"]["n_heads"] == 4
    assert cfg["options"]["train"]["lr"] == 3e-3 and cfg["options"]["train"]["weight_decay"] == 0
    assert cfg["options"]["train_mirrors"] is True
    # the grid's other point and the mlp (dropout applies, token-head sizes do not) ran too
    runs = sorted(p.parent.parent.name for p in (tmp_path / "sweep").rglob("metrics.json"))
    assert len(runs) == 4 and name.replace("lr=0.003", "lr=0.01") in runs
    assert "mlp,batch_size=32,dropout=0,lr=0.003,max_epochs=3,patience=2,train_mirrors=1,weight_decay=0" in runs


def test_run_spec_is_frozen_json_and_options_are_checked(pipeline, tmp_path, capsys):
    import dataclasses

    from spar_bench.errors import ConfigError
    from spar_bench.probes.runs.spec import RunSpec, make_run, parse_grid

    run = make_run("c.h5", "level3.size", "transformer", 3, {"lr": 3e-4, "d_model": 96, "layer": -2})
    assert RunSpec.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 4  # type: ignore[misc]
    assert run.variant() == "d_model=96,layer=-2,lr=0.0003"
    assert len(parse_grid(["lr=1e-3,3e-4", "wd=0,0.01"])) == 4
    with pytest.raises(ConfigError, match="Did you mean 'weight_decay'"):
        parse_grid(["weight_decy=0"])
    with pytest.raises(ConfigError, match="head 'mlp' has no option 'd_model'"):
        make_run("c.h5", "level3.size", "mlp", 0, {"d_model": 64})
    assert _fit(pipeline, tmp_path, "--probe", "level3.size", "--d-model", 64) == 2
    assert "has no option 'd_model'" in capsys.readouterr().err
    assert run_cmd(__import__("spar_bench.probes.cli", fromlist=["cli"]).cli,
                ["sweep", "--features", pipeline["cache"], "--heads", "mlp,linear", "--n-layers", 3,
                 "--out", tmp_path]) == 2  # fmt: skip
    assert "none of the heads mlp, linear has it" in capsys.readouterr().err
