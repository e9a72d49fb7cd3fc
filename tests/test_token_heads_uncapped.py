"""Token heads not capped (issue 21, item 5): tokens reach the head without PCA
(``--proj-dim none``), one epoch ceiling that early stopping ends runs before, and a run
finished under the old default (token heads capped at 40) is refused, not reused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.cli import cli
from spar_bench.probes.heads import build_head
from spar_bench.probes.runs.spec import RunSpec, parse_grid, parse_value, proj_width
from spar_bench.probes.tasks import get_probe
from spar_bench.probes.train import DEFAULT_MAX_EPOCHS, TrainConfig

from helpers import run_cmd


def test_one_epoch_ceiling_for_every_head_recorded_as_a_number() -> None:
    cfg = TrainConfig()
    assert DEFAULT_MAX_EPOCHS == 300 and cfg.max_epochs == DEFAULT_MAX_EPOCHS
    assert cfg.epochs_for("tokens") == cfg.epochs_for("pooled") == DEFAULT_MAX_EPOCHS
    assert cfg.to_dict()["max_epochs"] == DEFAULT_MAX_EPOCHS  # config.json holds the number, not null
    assert TrainConfig(max_epochs=None).epochs_for("tokens") == DEFAULT_MAX_EPOCHS
    assert TrainConfig(max_epochs=40).epochs_for("tokens") == 40
    # the default names no folder; the old cap, asked for, does
    base = RunSpec("c.h5", "level1.localisation", "transformer")
    assert base.variant() == "" and base.replace(train=TrainConfig(max_epochs=40)).variant() == "max_epochs=40"


@pytest.mark.parametrize("text, value", [("none", "none"), ("None", "none"), ("0", "none"), ("16", 16), (" 128 ", 128)])
def test_proj_dim_parses_a_width_or_none(text, value) -> None:
    assert proj_width(text) == value
    assert parse_value("proj_dim", text) == value


@pytest.mark.parametrize("text", ["-1", "x", "1.5", ""])
def test_proj_dim_refuses_other_values_in_one_line(text) -> None:
    with pytest.raises(ConfigError, match="proj_dim: expected width >= 1 or none"):
        parse_value("proj_dim", text)


def test_grid_over_proj_dim_names_each_point() -> None:
    points = parse_grid(["proj_dim=none,128"])
    assert points == [{"proj_dim": "none"}, {"proj_dim": 128}]
    run = RunSpec("c.h5", "level1.localisation", "transformer", head_options=(("proj_dim", "none"),))
    assert run.variant() == "proj_dim=none"
    assert RunSpec.from_dict(json.loads(json.dumps(run.to_dict()))) == run


@pytest.mark.parametrize("head", ["transformer", "attnpool"])
def test_no_pca_keeps_every_channel_centred_with_one_scale(head) -> None:
    rng = np.random.default_rng(0)
    scales = np.array([1e-4, 1.0, 10.0, 100.0, 3.0, 0.5])
    tokens = (rng.normal(size=(400, 6)) * scales + 7.0).astype(np.float32)
    model = build_head(head, get_probe("level1.localisation"), 6, 5, proj_dim="none")
    assert model.proj_dim == 6 and model.no_pca
    model.fit_projection(tokens)
    assert torch.equal(model.proj_w, torch.eye(6))  # no rotation, no dropped channel
    scale = model.proj_scale.numpy()
    assert np.all(scale == scale[0])  # one global scale: no channel amplified against another
    x = tokens[:10].reshape(2, 5, 6)
    out = model.preproject(x)
    assert out.shape == (2, 5, 6)
    np.testing.assert_allclose(out, (x - tokens.mean(0)) * scale[0], rtol=1e-5, atol=1e-5)
    # the channels keep their relative sizes (PCA whitening would equalise them)
    sd = out.reshape(-1, 6).std(0)
    assert sd[3] > 50 * sd[1] and sd[0] < 1e-3 * sd[1]
    # the same head on the default projection reduces the width
    assert build_head(head, get_probe("level1.localisation"), 6, 5, proj_dim=4).proj_dim == 4


def test_fit_and_eval_without_pca_end_to_end(pipeline, tmp_path) -> None:
    out = tmp_path / "runs"
    args = ["fit", "--features", pipeline["cache"], "--out", out, "--head", "transformer", "--probe",
            "level1.localisation", "--proj-dim", "none", "--max-epochs", 2, "--bootstrap", 10, "--no-controls"]
    assert run_cmd(cli, args) == 0
    (rd,) = list(out.glob("*/level1.localisation/transformer,max_epochs=2,proj_dim=none/seed0"))
    rec = json.loads((rd / "config.json").read_text())
    cfg = rec["extra"]
    assert cfg["head_config"]["proj_dim"] == "none" and rec["options"]["head_options"] == {"proj_dim": "none"}
    state = torch.load(rd / "head.pt", weights_only=True)["state_dict"]
    assert state["proj_w"].shape == (cfg["in_dim"], cfg["in_dim"])  # every channel reaches the head
    assert state["embed.weight"].shape[1] == cfg["in_dim"]
    assert run_cmd(cli, ["eval", "--run", rd, "--features", pipeline["cache"], "--bootstrap", 10]) == 0
    assert run_cmd(cli, [*args[:-6], "--proj-dim", "-3"]) == 2


def test_a_run_finished_under_the_old_token_cap_is_refused(pipeline, tmp_path, capsys) -> None:
    """0.2 wrote ``max_epochs: null`` (= 40 for token heads); the folder name is the same
    (default options), so the sweep must name the stale run instead of reusing it."""
    out = tmp_path / "runs"
    sweep = lambda *extra: run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--out", out,  # noqa: E731
                                         "--heads", "transformer", "--probes", "level3.size", "--seeds", "0",
                                         "--bootstrap", 10, "--no-controls", "--jobs", 1, "--patience", 1, *extra])
    assert sweep() == 0
    (cfg_file,) = out.glob("*/level3.size/transformer,patience=1/seed0/config.json")
    capsys.readouterr()
    assert sweep() == 0 and "0 run(s) done" in capsys.readouterr().out  # same options: skipped
    cfg = json.loads(cfg_file.read_text())
    assert cfg["options"]["train"]["max_epochs"] == DEFAULT_MAX_EPOCHS
    cfg["options"]["train"]["max_epochs"] = None  # as 0.2 wrote it
    cfg_file.write_text(json.dumps(cfg))
    assert sweep() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"max_epochs=None (now {DEFAULT_MAX_EPOCHS})" in err
