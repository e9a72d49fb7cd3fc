"""Organ-map pretraining (probes.finetune.organmaps): the targets, a run's files, keep and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError

torch = pytest.importorskip("torch")

TINY = ("timm:resnet10t", {"channels": [8, 8, 16, 16], "stem_width": 8,
                           "pretrained_cfg_overlay": {"input_size": [3, 64, 64]}})


def test_organ_shares_are_each_cells_label_fractions():
    from spar_bench.probes.finetune.organmaps import organ_shares

    lab = np.zeros((1, 4, 4), dtype=np.uint8)
    lab[0, :2, :2] = 3  # the top-left cell of a 2 x 2 grid, whole
    lab[0, 2, 2] = 1  # one pixel of four of the bottom-right cell
    s = organ_shares(lab, 2, 5)
    assert s.shape == (1, 4, 5) and s.dtype == np.float32
    np.testing.assert_allclose(s.sum(-1), 1.0)
    assert s[0, 0, 3] == 1.0 and s[0, 3, 1] == 0.25 and s[0, 3, 0] == 0.75
    assert s[0, 1, 0] == s[0, 2, 0] == 1.0  # row-major cells: (0, 1) then (1, 0)


def test_organ_shares_any_size_and_grid():
    from spar_bench.probes.finetune.organmaps import organ_shares

    lab = np.random.default_rng(0).integers(0, 17, size=(3, 224, 224), dtype=np.uint8)
    s = organ_shares(lab, 6, 17)  # 224 is not a multiple of 6: cells of 37 or 38 pixels
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(s.mean(1), [np.bincount(m.ravel(), minlength=17) / m.size for m in lab], atol=0.01)
    with pytest.raises(ConfigError, match="label 17 outside 0..16"):
        organ_shares(np.full((1, 4, 4), 17, dtype=np.uint8), 2, 17)


def _maps(n_cells=16, organ_cells=(0,), organ=5):
    """Shares of one slice: background everywhere, ``organ`` filling ``organ_cells``."""
    s = torch.zeros(1, n_cells, 17)
    s[0, :, 0] = 1.0
    s[0, list(organ_cells), 0], s[0, list(organ_cells), organ] = 0.0, 1.0
    return s


def _logits(shares):
    return torch.where(shares > 0.5, 6.0, -6.0)  # confident and right


def test_the_loss_without_dice_is_the_bce_and_dice_hears_a_small_organ():
    import torch.nn.functional as F

    from spar_bench.probes.finetune.organmaps import organ_map_loss

    big = _maps(organ_cells=range(12), organ=1)
    big[0, 15, 0], big[0, 15, 7] = 0.0, 1.0  # organ 7: one cell of sixteen
    right = _logits(big)
    missed = right.clone()
    missed[0, 15, 7], missed[0, 15, 0] = -6.0, 6.0  # organ 7 not seen at all
    assert torch.equal(organ_map_loss(missed, big), F.binary_cross_entropy_with_logits(missed, big))
    bce_cost = float(organ_map_loss(missed, big) - organ_map_loss(right, big))
    dice_cost = float(organ_map_loss(missed, big, dice=1.0) - organ_map_loss(right, big, dice=1.0))
    assert 0 < bce_cost < 0.05  # two outputs of 272 wrong: the BCE barely notices
    assert dice_cost > 0.45  # one of the two present organs lost: half the Dice term
    assert float(organ_map_loss(right, big, dice=1.0)) < 0.03  # right: near nothing to pay


def test_the_dice_term_counts_only_present_organs():
    from spar_bench.probes.finetune.organmaps import OrganMapConfig, organ_map_loss

    empty = _maps(organ_cells=())  # background only: no Dice term, the BCE alone
    z = torch.zeros_like(empty)
    assert torch.equal(organ_map_loss(z, empty, dice=2.0), organ_map_loss(z, empty))
    one = _maps(organ_cells=(3,), organ=4)
    # predicting absent organs nowhere is not rewarded or punished by the Dice term
    assert float(organ_map_loss(_logits(one), one, dice=1.0)) == pytest.approx(
        float(organ_map_loss(_logits(one), one)) + 1 - 2 * torch.sigmoid(torch.tensor(6.0)).item()
        / (1 + torch.sigmoid(torch.tensor(6.0)).item() + 15 * torch.sigmoid(torch.tensor(-6.0)).item()),
        rel=1e-5)
    with pytest.raises(ConfigError, match="Dice weight must be >= 0"):
        OrganMapConfig(dice=-0.5)


def _pretrain(pipeline, rd, epochs=2, dice=0.0, device="cpu"):
    from spar_bench.probes.finetune.organmaps import OrganMapConfig, pretrain_organ_maps

    cfg = OrganMapConfig(epochs=epochs, batch_size=16, seed=3, dice=dice)
    return pretrain_organ_maps(TINY[0], pipeline["shards"], rd, cfg, TINY[1], progress=False, device=device)


def _weights(rd):
    from safetensors.torch import load_file

    return load_file(str(rd / "encoder.safetensors"))


@pytest.mark.slow
def test_a_run_writes_its_files_is_kept_and_resumes_exactly(pipeline, tmp_path, one_torch_thread, monkeypatch):
    from spar_bench.probes.finetune import organmaps

    whole = _pretrain(pipeline, tmp_path / "a")
    hist = json.loads((whole / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in hist] == [0, 1] and all(np.isfinite(h["val_loss"]) for h in hist)
    from spar_bench.probes.runs.record import RunRecord

    rec = RunRecord.read(whole)  # the one record of every run kind
    assert rec.kind == "organ-maps" and rec.extra["grid"] ** 2 == rec.extra["n_tokens"]
    assert rec.inputs["model_args"] == TINY[1] and rec.options["organ_map_config"]["epochs"] == 2
    assert rec.files["encoder.safetensors"] and rec.files["timing.json"] is None  # a timing: presence only
    assert rec.extra["device"] == "cpu" and json.loads((whole / "timing.json").read_text())["images_per_s"] > 0
    assert str(tmp_path) not in (whole / "config.json").read_text()
    assert not (whole / organmaps.CHECKPOINT_FILE).exists()
    assert not (whole / organmaps.SHARE_HEAD_FILE).exists()  # no Dice term: the organ head gives the shares
    model = organmaps.load_organ_map_model(whole)
    assert model.share_head is model.head
    stamp = (whole / "encoder.safetensors").stat().st_mtime_ns
    assert _pretrain(pipeline, tmp_path / "a") == whole  # a finished run is kept
    assert (whole / "encoder.safetensors").stat().st_mtime_ns == stamp

    calls = {"n": 0}
    val_loss = organmaps._val_loss

    def interrupted(*a):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the second epoch never finishes
        return val_loss(*a)

    monkeypatch.setattr(organmaps, "_val_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _pretrain(pipeline, tmp_path / "b")
    assert not (tmp_path / "b" / "metrics.json").exists()  # nothing that looks finished
    assert (tmp_path / "b" / organmaps.CHECKPOINT_FILE).is_file()
    monkeypatch.setattr(organmaps, "_val_loss", val_loss)
    ckpt = torch.load(tmp_path / "b" / organmaps.CHECKPOINT_FILE, weights_only=False)
    ckpt["identity"]["organ_map_config"].pop("dice")  # a checkpoint from before the Dice weight: resumed too
    torch.save(ckpt, tmp_path / "b" / organmaps.CHECKPOINT_FILE)
    resumed = _pretrain(pipeline, tmp_path / "b")
    assert json.loads((resumed / "timing.json").read_text())["epochs"] == 1  # resumed, not restarted
    a, b = _weights(whole), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((resumed / "metrics.json").read_text())["history"] == hist

    with pytest.raises(ConfigError, match=r"finished with options.organ_map_config.epochs=2 \(now 3\)"):
        _pretrain(pipeline, tmp_path / "a", epochs=3)
    # a run written before the record, and before the Dice weight existed (trained without it): still kept
    legacy = {"encoder": rec.model, "model_args": TINY[1], "dataset_dir": pipeline["shards"].name,
              "dataset_fingerprint": rec.build_fingerprint, "command": "organ-maps", **rec.extra,
              "organ_map_config": {k: v for k, v in rec.options["organ_map_config"].items() if k != "dice"}}
    (whole / "config.json").write_text(json.dumps(legacy))
    assert _pretrain(pipeline, tmp_path / "a") == whole
    assert organmaps.load_organ_map_model(whole).share_head is not None
    with pytest.raises(ConfigError, match="finished run of other settings"):
        _pretrain(pipeline, tmp_path / "a", epochs=3)
    assert (whole / "encoder.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_the_export_is_what_the_cache_reads(pipeline, tmp_path, one_torch_thread):
    """``spar-probe cache --weights`` of the export: the trained network, with its model args."""
    import h5py

    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.finetune.organmaps import _Model

    rd = _pretrain(pipeline, tmp_path / "a", epochs=1)
    out = write_cache(TINY[0], pipeline["shards"], tmp_path / "c.h5",
                      CacheOptions(weights=str(rd / "encoder.safetensors"), levels=("level3",), splits=("test",),
                                   compute="fp32", dtype="fp32"),
                      progress=False)
    with h5py.File(out, "r") as f:
        tokens = f["level3/test/layer-1/tokens"][:2]  # the cache's order: the build's
        spec = json.loads(f.attrs["encoder_config"])
    assert spec["extra"]["model_args"]["channels"] == [8, 8, 16, 16]
    assert spec["weights"]["training"]["mode"] == "organ-maps"
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.model import encode
    from spar_bench.probes.finetune.organmaps import OrganMapConfig

    m = _Model(TINY[0], TINY[1], OrganMapConfig(epochs=1), 17, 1, torch.device("cpu"))
    from safetensors.torch import load_file

    m.enc.module.load_state_dict(load_file(str(rd / "encoder.safetensors")))
    m.enc.module.eval()
    with torch.no_grad():
        mine, _ = encode(m.enc, torch.from_numpy(Build(pipeline["shards"]).images("level3", "test", np.arange(2))))
    np.testing.assert_allclose(tokens, mine.numpy(), rtol=1e-4, atol=1e-5)


def test_map_geometry_centres_and_areas():
    from spar_bench.probes.finetune.organmaps import map_geometry

    maps = np.zeros((1, 4, 3), dtype=np.float32)  # a 2 x 2 grid of a 4 x 4 frame: cells of 2 x 2 px
    maps[0, 0, 1] = 1.0  # label 1 fills the top-left cell
    maps[0, 1, 2] = maps[0, 3, 2] = 0.5  # label 2: half of each right-hand cell
    centre, area = map_geometry(maps, 2, size=4)
    np.testing.assert_allclose(centre[0, 1], [1.0, 1.0])
    np.testing.assert_allclose(centre[0, 2], [3.0, 2.0])
    np.testing.assert_allclose(area[0], [0.0, 4.0, 4.0])


@pytest.mark.slow
def test_the_readout_of_true_maps_is_the_oracle(pipeline):
    """The computation model's geometric readout, given the true label map at pixel resolution
    (a 224 x 224 grid), answers every question as the mask oracle does: channels, centres, mm^2
    and the stated cuts are read right, so its misses are its perception's."""
    from spar_bench.builder.shards import Build
    from spar_bench.experiments.calibration import oracle_items
    from spar_bench.probes.finetune.organmaps import map_geometry, organ_shares
    from spar_bench.probes.finetune.readout import READOUT_PROBES, OrganMapReadout
    from spar_bench.probes.tasks import get_probe

    b = Build(pipeline["shards"])
    labels = b.images("level3", "test", np.arange(b.count("level3", "test")), field="label")
    centre, area = map_geometry(organ_shares(labels, 224, 17), 224)
    assert READOUT_PROBES == ("level3.relative_position", "level3.orientation", "level3.symmetry",
                              "level3.size", "level3.distance")
    for probe in READOUT_PROBES:
        t, oracle = oracle_items(pipeline["shards"], probe)  # the slice oracle on the test items
        mine = OrganMapReadout(get_probe(probe), b, pipeline["shards"], geometry=(centre, area)).predict(t)
        seen = oracle >= 0
        assert len(t) == len(oracle) and seen.mean() > 0.9, probe
        np.testing.assert_array_equal(mine[seen], oracle[seen], err_msg=probe)


def test_a_build_without_slices_is_a_one_line_error(pipeline, tmp_path):
    from spar_bench.probes.finetune.organmaps import OrganMapConfig, pretrain_organ_maps

    with pytest.raises(ConfigError, match=r"has no level3 train slices \(build it with --levels level3\)"):
        pretrain_organ_maps(TINY[0], pipeline["other"], tmp_path / "r", OrganMapConfig(epochs=1), TINY[1],
                            progress=False)
    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        pretrain_organ_maps(TINY[0], pipeline["shards"], tmp_path / "r", OrganMapConfig(epochs=1), TINY[1],
                            progress=False, device="tpu")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_dice_run_gets_a_share_head_fitted_by_the_bce_alone(pipeline, tmp_path, one_torch_thread):
    """With a Dice term the organ head overstates shares; the share head, a BCE-only linear map of
    the frozen tokens started from it, fits the training shares better, and refits identically."""
    import torch.nn.functional as F

    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune import organmaps

    rd = _pretrain(pipeline, tmp_path / "d", epochs=1, dice=1.0)
    assert (rd / organmaps.SHARE_HEAD_FILE).is_file()
    assert np.isfinite(json.loads((rd / "metrics.json").read_text())["share_head_train_loss"])
    model = organmaps.load_organ_map_model(rd)
    x, y = organmaps._split_data(Build(pipeline["shards"]), "train", model.grid, 17)
    tokens = organmaps.patch_tokens(model.enc, x)
    with torch.no_grad():
        organ_bce = float(F.binary_cross_entropy_with_logits(model.head(tokens), y))
        share_bce = float(F.binary_cross_entropy_with_logits(model.share_head(tokens), y))
    assert share_bce < organ_bce
    where, share = organmaps.predict_maps(model, x.numpy()[:3])
    assert where.shape == share.shape == (3, model.grid**2, 17) and not np.array_equal(where, share)
    again, _ = organmaps.fit_share_head(model.enc, model.head, x, y, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 model.share_head.state_dict().values(), strict=True))
    (rd / organmaps.SHARE_HEAD_FILE).unlink()
    with pytest.raises(ConfigError, match="trained with a Dice term but has no share_head.pt"):
        organmaps.load_organ_map_model(rd)


@pytest.mark.gpu
def test_organ_maps_train_and_read_out_on_cuda_like_on_the_cpu(pipeline, tmp_path):
    """The encoder trains on the GPU (fp32; the slices go over a batch at a time), its files are
    those of a CPU run, and the maps read out on either device agree with the CPU run's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune import organmaps

    runs = {d: _pretrain(pipeline, tmp_path / d, epochs=1, dice=1.0, device=d) for d in ("cpu", "cuda")}
    assert json.loads((runs["cuda"] / "config.json").read_text())["extra"]["device"] == "cuda"
    assert sorted(p.name for p in runs["cuda"].iterdir()) == sorted(p.name for p in runs["cpu"].iterdir())
    losses = {d: json.loads((rd / "metrics.json").read_text())["final_val_loss"] for d, rd in runs.items()}
    assert abs(losses["cuda"] - losses["cpu"]) < 0.05 * losses["cpu"], losses
    images = Build(pipeline["shards"]).images("level3", "test", np.arange(4))
    on_gpu = organmaps.predict_maps(organmaps.load_organ_map_model(runs["cuda"], "cuda"), images)
    on_cpu = organmaps.predict_maps(organmaps.load_organ_map_model(runs["cuda"]), images)
    for a, b in zip(on_gpu, on_cpu, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-2)  # TF32 convolutions on the GPU


# --------------------------------------------------------------------------- run kind ``organmaps``
#: the run kind's options for a tiny, quick map training (model args merge over MAP_MODEL_ARGS)
MAPS_OPTIONS = {"encoder": TINY[0], "model_args": TINY[1], "epochs": 1, "batch_size": 16}


@pytest.mark.slow
def test_the_organmaps_run_kind_is_the_calibrations_readout_scored_with_every_control(pipeline, tmp_path,
                                                                                      one_torch_thread):
    """``spar-probe predict --kind organmaps``: the maps trained once per seed for every probe, read
    out, scored by the evaluation of every run kind (mirrored counterfactuals, conflict items, the
    prior as the blind baseline); the test score is the calibration's cell of the same maps."""
    from spar_bench.experiments import calibration as cal
    from spar_bench.probes.cli import cli as probe_cli
    from spar_bench.probes.finetune.readout import OrganMapReadout
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.tasks import get_probe

    from helpers import run_cmd

    out = tmp_path / "runs"
    argv = ["predict", "--kind", "organmaps", "--data", pipeline["shards"], "--probe",
            "level3.relative_position,level3.size", "--seeds", "0", "--out", out, "--bootstrap", 20,
            *[a for k, v in MAPS_OPTIONS.items() for a in ("--option", f"{k}={json.dumps(v)}")]]  # fmt: skip
    assert run_cmd(probe_cli, argv) == 0
    (maps,) = (out / "organmaps" / "maps").glob("shards-*/seed0")  # one training for both probes
    for probe in ("level3.relative_position", "level3.size"):
        rd = out / "organmaps" / probe / "organmaps" / "seed0"
        m, rec = json.loads((rd / "metrics.json").read_text(encoding="utf-8")), RunRecord.read(rd)
        assert rec.kind == "organmaps" and m["track"] == "organmaps"
        assert rec.inputs["organ_maps"]["config"]["epochs"] == 1 and rec.inputs["organ_maps"]["encoder"] == TINY[0]
        assert m["training"]["maps"] == maps.relative_to(out).as_posix() and len(m["training"]["history"]) == 1
        assert str(tmp_path) not in (rd / "metrics.json").read_text(encoding="utf-8")
        assert 0.0 <= m["test"]["accuracy"] <= 1.0 and 0.0 <= m["mirror"]["accuracy"] <= 1.0
        assert m["controls"]["blind"] == m["controls"]["prior"]  # its blind baseline: the question prior
        t = cal.split_items(pipeline["shards"], probe)
        pred = OrganMapReadout(get_probe(probe), Build(pipeline["shards"]), maps).predict(t)
        cell = cal.score_model(t, pred, cal.prior_of(pipeline["shards"], probe), 0, 20)
        assert cell["value"] == m["test"]["accuracy"]  # the calibration's computation cell, same maps
    if "conflict" in cell:
        assert cell["conflict"] == m["test"]["conflict"]["accuracy"]
    stamp = (maps / "encoder.safetensors").stat().st_mtime_ns
    assert run_cmd(probe_cli, argv) == 0  # kept
    assert (maps / "encoder.safetensors").stat().st_mtime_ns == stamp
    assert run_cmd(probe_cli, [*argv, "--option", "lr=0.01"]) == 2  # another schedule, the same run folder: refused


def test_the_organmaps_run_kind_refuses_what_it_cannot_answer_in_one_line(pipeline, tmp_path, capsys):
    from spar_bench.probes.cli import cli as probe_cli

    from helpers import run_cmd

    base = ["predict", "--kind", "organmaps", "--data", pipeline["shards"], "--out", tmp_path / "r"]
    for extra, why in ((["--probe", "level3.counting"], "organmaps reads out level3.relative_position"),
                       (["--probe", "level3.size", "--option", "epochz=1"], "did you mean 'epochs'"),
                       (["--probe", "level3.size", "--option", "seed=1"], "the maps' seed is the run's"),
                       (["--probe", "level3.size", "--option", "epochs=x"], "option epochs must be of type int")):
        assert run_cmd(probe_cli, [*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert why in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r" / "organmaps" / "maps").exists()


def test_an_experiment_plans_organmaps_with_its_options_checked(tmp_path):
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    def exp(options: str) -> Path:
        path = tmp_path / "e.yaml"
        path.write_text(f"experiment: t\nout: {tmp_path}/out\nbuilds:\n  p:\n    phantom: {{n: 4}}\n"
                        f"predictors:\n  organmaps: {{options: {options}}}\nprobes: level3.size\n", encoding="utf-8")
        return path

    plan = make_plan(load_experiment(exp("{epochs: 3, dice: 1}")))
    (spec,) = [d for _, d in plan.step("predict:organmaps@p").specs]
    assert spec["kind"] == "organmaps" and spec["options"] == {"epochs": 3, "dice": 1}
    with pytest.raises(ConfigError, match=r"predictors\.organmaps\.options.*did you mean 'epochs'"):
        make_plan(load_experiment(exp("{epochz: 3}")))
