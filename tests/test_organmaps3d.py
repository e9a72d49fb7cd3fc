"""Level 4's computation model (run kind ``organmaps3d``): 3-D organ-map targets, the geometric
readout (fed the true label volumes it IS the mask oracle), a few training steps through
``session.run`` with every control, and the calibrated preset's plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.errors import ConfigError

SIZE = 16
ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "recall-vs-computation-3d-calibrated.yaml"
#: a tiny, fast model: the narrow ResNet-10 at an eighth of its width, 2 epochs on flipped copies
TINY = {"max_epochs": 2, "batch_size": 2, "flips": True, "model_args": {"widen_factor": 0.125}, "threads": 1}


@pytest.fixture(scope="module")
def vol4(tmp_path_factory) -> Path:
    """A random-layout phantom build of Level 4 only: 8 cases, 16^3 volumes, mirrored and flipped copies."""
    from spar_bench.builder.cli import cli as build_cli
    from tests.helpers import run_cmd

    root = tmp_path_factory.mktemp("vol4")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 8, "--layout", "random", "--in-plane", 64,
                               "--slices", 24, "--intensities", "distinct"]) == 0  # fmt: skip
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "b", "--levels",
                               "level4", "--volume-size", SIZE, "--counterfactual", "mirror+flip",
                               "--no-hf"]) == 0  # fmt: skip
    return root / "b"


def _targets(build_dir: Path, probe: str, split: str):
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    b = Build(build_dir)
    return b, load_targets(b, get_probe(probe), split, BuildKeys(b).keys("level4", split))


def test_shares3d_pool_each_cell_and_a_cell_aligned_organ_reads_out_exactly():
    from spar_bench.probes.finetune.organmaps3d import map_organs, organ_shares3d

    lab = np.zeros((1, 8, 8, 8), np.uint8)
    lab[0, 0:4, 4:8, 0:4] = 3  # one whole cell of the 2^3 grid: (z 0, row 1, col 0)
    lab[0, 6, 6, 6] = 5  # one voxel of cell (1, 1, 1)
    s = organ_shares3d(lab, 2, 17)
    assert s.shape == (1, 8, 17) and np.allclose(s.sum(-1), 1.0)
    assert s[0, 2, 3] == 1.0 and s[0, 7, 5] == pytest.approx(1 / 64)
    g = map_organs(s[0], 8, 2.0)
    assert np.allclose(g.centroid_vox[2], [1.5, 5.5, 1.5])  # the cell's centre, as voxel indices
    assert g.counts[2] == pytest.approx(64) and g.counts[4] == pytest.approx(1)
    assert np.isnan(g.centroid_vox[0]).all() and g.organs == [2, 4]
    with pytest.raises(ConfigError, match="outside"):
        organ_shares3d(lab + 17, 2, 17)


@pytest.mark.parametrize("probe", ["relative_position", "distance", "volume", "symmetry", "localisation"])
def test_the_readout_of_true_full_resolution_maps_is_the_mask_oracle(vol4, probe):
    """Grid = S: every cell one voxel, so the share-weighted centres and summed shares are the
    exact centroids and voxel counts, and the readout gives the stored (mask-oracle) answers on
    the original, mirrored and flipped items."""
    from spar_bench.probes.finetune.organmaps3d import localise, map_organs, organ_shares3d, readout
    from spar_bench.probes.runs.mask_oracle import MaskOracle

    b, t = _targets(vol4, f"level4.{probe}", "test")
    rules = MaskOracle(t.spec, b).rules()
    mm = b.read("level4", "test", ["mm_per_voxel"])["mm_per_voxel"]
    assert t.is_mirror.any() and t.flipped.any()
    for row in np.unique(t.rows).tolist():
        label = b.images("level4", "test", np.array([row]), field="label")
        organs = map_organs(organ_shares3d(label, SIZE, 17)[0], SIZE, float(mm[row]))
        items = np.flatnonzero(t.rows == row)
        if probe == "localisation":
            c, present = localise(organs, SIZE), t.y["present"][items[0]].astype(bool)
            assert np.allclose(c[present], t.y["centroid"][items[0]][present], atol=1e-5)
        else:
            assert (readout(probe, organs, t, items, rules) == t.y["answer"][items]).all(), row


def test_organmaps3d_trains_and_runs_through_session_run_with_every_control(vol4, tmp_path):
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.runs.spec import PredictorSpec

    spec = PredictorSpec("level4.relative_position", "organmaps3d", 0, features=str(vol4), n_boot=20, options=TINY)
    rd = run(spec, tmp_path / "runs", progress=False)
    assert rd == tmp_path / "runs" / "organmaps3d" / "level4.relative_position" / "organmaps3d" / "seed0"
    m, rec = json.loads((rd / "metrics.json").read_text()), RunRecord.read(rd)
    assert rec.kind == "organmaps3d" and m["track"] == "organmaps3d"
    assert rec.inputs["organ_maps_3d"]["max_epochs"] == 2 and "device" not in rec.inputs["organ_maps_3d"]
    assert rec.options["options"] == {k: v for k, v in TINY.items() if k != "threads"}
    assert m["training"]["grid"] == 4  # layer 1 (stride 4) at input 16: 4^3 tokens
    assert m["train"]["epochs_run"] == 2 and len(m["training"]["history"]) == 2
    for part in ("test", "mirror", "flipped"):
        assert 0.0 <= m[part]["accuracy"] <= 1.0
    c = m["controls"]
    assert c["blind"] == c["prior"] and c["blind_flipped"] == c["prior_flipped"]  # blind: the question prior
    # same spec, same folder: kept; another config is another run, refused
    assert run(spec, tmp_path / "runs", progress=False) == rd
    other = PredictorSpec(spec.probe, "organmaps3d", 0, features=str(vol4), n_boot=20, options={**TINY, "lr": 0.01})
    with pytest.raises(ConfigError):
        run(other, tmp_path / "runs", progress=False)


def test_organmaps3d_refuses_what_its_maps_cannot_answer_and_bad_options(vol4, tmp_path):
    from spar_bench.probes.finetune.organmaps3d import OrganMap3dConfig
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.runs.spec import PredictorSpec

    with pytest.raises(ConfigError, match="surfaces or lesions"):
        run(PredictorSpec("level4.adjacency", "organmaps3d", 0, features=str(vol4), options=TINY), tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'max_epochs'"):
        OrganMap3dConfig.from_options({"max_epoch": 3})
    with pytest.raises(ConfigError, match="must be of type int"):
        OrganMap3dConfig.from_options({"max_epochs": "3"})
    cfg = OrganMap3dConfig.from_options({"lr": 1, "model_args": {"widen_factor": 0.25}})
    assert cfg.lr == 1.0 and cfg.model_args["no_max_pool"] is True  # the narrow net's other args kept


def test_the_calibrated_preset_plans_the_computation_model_with_its_options(tmp_path):
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    exp = load_experiment(PRESET, {"OUT": str(tmp_path / "o"), "DEVICE": "cuda"})
    plan = make_plan(exp)
    ids = [s.id for s in plan.steps]
    assert ids == ["build:random", "predict:organmaps3d@random", "predict:oracle@random", "report"]
    (spec,) = [d for _, d in plan.step("predict:organmaps3d@random").specs]
    assert spec["kind"] == "organmaps3d" and spec["options"]["device"] == "cuda"
    assert spec["options"]["max_epochs"] == 150 and spec["options"]["layer"] == 0 and spec["options"]["flips"] is True
    assert "options" not in dict(plan.step("predict:oracle@random").specs)["predict"]
    bad = tmp_path / "bad.yaml"
    text = PRESET.read_text()
    assert text.count("lr: 0.003,") == 1
    bad.write_text(text.replace("lr: 0.003,", "lr: 0.003, epochz: 3,"))
    with pytest.raises(ConfigError, match="predictors.organmaps3d.options.*epochz"):
        make_plan(load_experiment(bad, {"OUT": str(tmp_path / "o")}))
    bad.write_text(text.replace("oracle: {bootstrap: 200}", "oracle: {bootstrap: 200, options: {lr: 1}}"))
    with pytest.raises(ConfigError, match="takes no options"):
        load_experiment(bad, {"OUT": str(tmp_path / "o")})


def test_flip_batch_flips_a_volume_and_its_organ_map_alike():
    """The ``flips`` augmentation: the flipped map of a volume is the map of the flipped labels."""
    import torch

    from spar_bench.probes.finetune.organmaps3d import flip_batch, organ_shares3d

    rng = np.random.default_rng(0)
    lab = rng.integers(0, 17, (6, 8, 8, 8)).astype(np.uint8)
    x, y = torch.from_numpy(lab), torch.from_numpy(organ_shares3d(lab, 4, 17))
    fx, fy = flip_batch(x, y, 4, np.random.default_rng(3))
    assert fy.shape == y.shape and not torch.equal(fx, x)  # some volume was flipped
    assert np.allclose(fy.numpy(), organ_shares3d(fx.numpy(), 4, 17))
    again = flip_batch(x, y, 4, np.random.default_rng(3))
    assert torch.equal(again[0], fx) and torch.equal(again[1], fy)  # seeded


def test_the_probes_of_one_seed_train_its_maps_once(vol4, tmp_path, monkeypatch):
    """Every probe of a seed reads the same maps (same build, volumes, config, seed): a run of
    several probes in one process trains them once per seed, and each probe's metrics record the
    same training; another seed trains its own."""
    from spar_bench.probes.finetune import organmaps3d as om
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.runs.spec import PredictorSpec

    calls = []
    real = om.train_maps
    monkeypatch.setattr(om, "train_maps", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    monkeypatch.setattr(om, "_FITTED", {})
    out = {}
    for probe, seed in (("level4.relative_position", 0), ("level4.distance", 0), ("level4.volume", 1)):
        spec = PredictorSpec(probe, "organmaps3d", seed, features=str(vol4), n_boot=20, options=TINY)
        out[probe] = json.loads((run(spec, tmp_path / "runs", progress=False) / "metrics.json").read_text())
    assert calls == [0, 1]
    assert out["level4.relative_position"]["training"]["history"] == out["level4.distance"]["training"]["history"]
