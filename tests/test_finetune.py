"""``spar-probe finetune``: tiny timm ViT and ResNet trained end to end on the tiny phantom
pipeline of test_fit (64 px inputs so a few steps take seconds on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError

from helpers import keep_trained_encoder, run_cmd

TINY_VIT = ("timm:vit_tiny_patch16_224", {"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64})
TINY_RESNET = ("timm:resnet10t", {"pretrained_cfg_overlay": {"input_size": [3, 64, 64]}})




def _finetune(pipeline, out, model, probe, head="mlp", **kw):
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.runs.session import run as run_finetune

    opts = {"batch_size": 8, "max_epochs": 2, "encoder_lr": 1e-3, "warmup_epochs": 0.5,
            "device": "cpu", "compute": "fp32"}
    opts.update(kw.pop("cfg", {}))
    kw.setdefault("init", "scratch")
    kw.setdefault("controls", False)
    run_kw = {k: kw.pop(k) for k in ("resume", "overwrite") if k in kw}
    fs = FinetuneSpec(model[0], str(pipeline["shards"]), probe, head, 0, model_kwargs=model[1],
                      cfg=FinetuneConfig(**opts), n_boot=20, **kw)
    return run_finetune(fs, out, progress=False, **run_kw)


def _tensors(rd: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    head = torch.load(rd / "head.pt", map_location="cpu", weights_only=False)["state_dict"]
    return {**load_file(str(rd / "encoder.safetensors")), **{f"head.{k}": v for k, v in head.items()}}


@pytest.mark.slow
def test_encoder_lr_0_keeps_the_encoder_as_loaded_batchnorm_statistics_included(pipeline, tmp_path: Path) -> None:
    """encoder_lr 0 trains the head only: the BatchNorm running statistics of a ResNet do not
    move either (the encoder stays in eval mode), so the export is the encoder as initialised
    (from scratch: running means 0, variances 1, no batch counted)."""
    from safetensors.torch import load_file

    rd = _finetune(pipeline, tmp_path / "lr0", TINY_RESNET, "level3.relative_position",
                   cfg={"encoder_lr": 0.0, "max_epochs": 1})
    trained = _finetune(pipeline, tmp_path / "lr", TINY_RESNET, "level3.relative_position", cfg={"max_epochs": 1})
    frozen, moved = load_file(str(rd / "encoder.safetensors")), load_file(str(trained / "encoder.safetensors"))
    means = [k for k in frozen if k.endswith("running_mean")]
    assert means and all(torch.all(frozen[k] == 0) for k in means)
    assert all(torch.all(frozen[k.replace("running_mean", "running_var")] == 1) for k in means)
    assert all(int(frozen[k.replace("running_mean", "num_batches_tracked")]) == 0 for k in means
               if k.replace("running_mean", "num_batches_tracked") in frozen)
    assert any(not torch.all(moved[k] == 0) for k in means)  # a trained encoder's statistics move


def test_vit_from_scratch_learns_exports_and_recaches(pipeline, tmp_path: Path) -> None:
    """Loss falls; the export re-cached (and re-encoded by eval) scores what the run scored."""
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.finetune.encoding import run_eval_reencoded
    from spar_bench.probes.runs.session import run_eval

    rd = _finetune(pipeline, tmp_path / "runs", TINY_VIT, "level1.localisation", cfg={"max_epochs": 3})
    m = json.loads((rd / "metrics.json").read_text())
    losses = m["train"]["train_loss"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert m["train"]["stopped_by"] == "max_epochs"  # 3 epochs, patience 5: the cap ended it (the report flags it)
    assert m["training"]["mode"] == "scratch" and m["random_init"] is False
    assert m["training"]["label"] == "trained from scratch on build shards"
    assert rd.parts[-4] == "timm-vit_tiny_patch16_224-scratch-shards"
    assert not (rd / "checkpoint.pt").exists() and not (rd / "best.pt").exists()

    cache = write_cache(TINY_VIT[0], pipeline["shards"], tmp_path / "ft.h5",
                        CacheOptions(weights=str(rd / "encoder.safetensors"), levels=["level1"], splits=["test"],
                                     dtype="fp32", compute="fp32"), progress=False)
    from spar_bench.probes.features import FeatureCache

    with FeatureCache(cache) as fc:
        assert fc.meta["weights"]["training"]["label"] == "trained from scratch on build shards"
        assert not fc.random_init
    recached = json.loads(run_eval(rd, cache, n_boot=20).read_text())
    reencoded = json.loads(run_eval_reencoded(rd, pipeline["shards"], n_boot=20, device="cpu",
                                              compute="fp32").read_text())
    assert list(recached) == list(reencoded)  # one writer of eval-*.json, one set of keys
    assert recached["data"] is None and recached["cache_fingerprint"] and recached["training"] == m["training"]
    assert reencoded["cache_fingerprint"] is None and reencoded["data"] == "shards"
    assert reencoded["variant"] == json.loads((rd / "config.json").read_text())["variant"] != ""
    for other in (recached, reencoded):
        assert other["test"]["med_px"] == pytest.approx(m["test"]["med_px"], rel=1e-4)
        assert other["mirror"]["med_px"] == pytest.approx(m["mirror"]["med_px"], rel=1e-4)

    # frozen and trained-from-scratch runs side by side in one report
    from spar_bench.probes.cli import cli
    from spar_bench.probes.runs.report import write_report

    assert run_cmd(cli, ["fit", "--features", pipeline["cache"], "--out", tmp_path / "runs", "--probe",
                      "level1.localisation", "--max-epochs", 2, "--bootstrap", 20, "--no-controls"]) == 0
    text = write_report(tmp_path / "runs", tmp_path / "report").read_text()
    assert "timm-vit_tiny_patch16_224-scratch-shards (trained from scratch on build shards)" in text
    assert "dummy-random-init" in text


class _Killed(Exception):
    pass


@pytest.mark.slow
def test_resume_gives_the_same_weights(pipeline, tmp_path: Path, monkeypatch) -> None:
    """Killed after its first (mid-epoch) checkpoint, a resumed run ends where an uninterrupted one does."""
    from spar_bench.probes.finetune import loop

    kw = {"cfg": {"checkpoint_every": 1}}
    trained = keep_trained_encoder(monkeypatch)
    whole = _finetune(pipeline, tmp_path / "a", TINY_RESNET, "level1.localisation", **kw)
    trained_enc = trained["enc"]
    save = loop.Trainer.save

    def save_then_die(self, batches):
        save(self, batches)
        raise _Killed

    monkeypatch.setattr(loop.Trainer, "save", save_then_die)
    with pytest.raises(_Killed):
        _finetune(pipeline, tmp_path / "b", TINY_RESNET, "level1.localisation", **kw)
    monkeypatch.setattr(loop.Trainer, "save", save)
    with pytest.raises(ConfigError, match="--resume"):
        _finetune(pipeline, tmp_path / "b", TINY_RESNET, "level1.localisation", **kw)
    resumed = _finetune(pipeline, tmp_path / "b", TINY_RESNET, "level1.localisation", resume=True, **kw)
    a, b = _tensors(whole), _tensors(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ma, mb = (json.loads((r / "metrics.json").read_text()) for r in (whole, resumed))
    assert ma["test"] == mb["test"] and ma["train"]["train_loss"] == mb["train"]["train_loss"]
    _assert_export_recaches_to_the_runs_forward(pipeline, whole, trained_enc, tmp_path)


def _assert_export_recaches_to_the_runs_forward(pipeline, rd: Path, enc, tmp_path: Path) -> None:
    """Cached features of the export = the trained encoder's own forward (``enc``, the run's
    encoder in memory when it exported) on the same images."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.finetune.model import encode

    cache = write_cache(TINY_RESNET[0], pipeline["shards"], tmp_path / "r.h5",
                        CacheOptions(weights=str(rd / "encoder.safetensors"), levels=["level1"], splits=["test"],
                                     dtype="fp32", compute="fp32"), progress=False)
    enc.module.eval()
    images = torch.from_numpy(Build(pipeline["shards"]).images("level1", "test", np.arange(4)))
    with torch.no_grad():
        _, pooled = encode(enc, images)
    with FeatureCache(cache) as fc:
        cached = fc.pooled("level1", "test")[:4]
    np.testing.assert_allclose(cached, pooled.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_token_head_finetune_and_controls(pipeline, tmp_path: Path) -> None:
    """A token head (fixed PCA of the initial tokens) trains through the encoder; controls as fit's."""
    rd = _finetune(pipeline, tmp_path / "runs", TINY_VIT, "level3.orientation", head="transformer",
                   cfg={"max_epochs": 1, "freeze_blocks": 1}, controls=True)
    m = json.loads((rd / "metrics.json").read_text())
    assert {"chance", "majority", "blind"} <= set(m["controls"])
    config = json.loads((rd / "config.json").read_text())["extra"]
    assert config["finetune_config"]["freeze_blocks"] == 1 and config["head_input"] == "tokens"
    # from scratch: no PCA of the random initial tokens (its whitening scaled them by up to 1e6);
    # the head reads the tokens unprojected, at full width, and says so
    d = config["in_dim"]
    assert config["head_config"]["proj_dim"] == d
    head = torch.load(rd / "head.pt", map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(head["proj_w"], torch.eye(d)) and torch.equal(head["proj_scale"], torch.ones(d))
    assert torch.equal(head["proj_mean"], torch.zeros(d))


def test_an_encoder_without_weights_is_refused(pipeline, tmp_path: Path) -> None:
    from spar_bench.probes.cli import cli
    from spar_bench.probes.finetune.model import freeze_blocks, load_trainable

    with pytest.raises(ConfigError, match="--init scratch"):
        load_trainable("timm:resnet10t", weights=None, init="weights", seed=0)
    with pytest.raises(ConfigError, match="random-init"):
        load_trainable("dummy", weights=None, init="weights", seed=0)
    with pytest.raises(ConfigError, match="not both"):
        load_trainable("timm:resnet10t", weights="w.pt", init="scratch", seed=0)
    enc = load_trainable(*TINY_VIT[:1], weights=None, init="scratch", seed=0, model_kwargs=TINY_VIT[1])
    assert freeze_blocks(enc, 1) > 0
    assert not enc.module.blocks[0].attn.qkv.weight.requires_grad
    assert enc.module.norm.weight.requires_grad
    rc = run_cmd(cli, ["finetune", "--encoder", "timm:resnet10t", "--data", pipeline["shards"],
                    "--probe", "level1.localisation", "--out", tmp_path / "runs"])
    assert rc == 2 and not (tmp_path / "runs").exists()


def test_schedule_warms_up_then_decays() -> None:
    from spar_bench.probes.finetune.config import lr_factor

    f = [lr_factor(s, 4, 20) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False)) and f[-1] < 0.05


def test_hf_export_recaches(tmp_path: Path) -> None:
    """An hf encoder's trained state dict, exported, loads back as hf:DIR --weights FILE."""
    pytest.importorskip("transformers")
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.finetune.model import encode, export_encoder

    from helpers import images, make_hf_dinov2

    name, _ = make_hf_dinov2(tmp_path)
    enc = load_encoder(name)
    with torch.no_grad():
        for p in enc.module.parameters():
            p.add_(0.01)  # "trained"
    path = export_encoder(enc, tmp_path / "encoder.safetensors", {"training": {"label": "finetuned on build x"}})
    again = load_encoder(name, weights=str(path))
    assert again.spec.weights["training"]["label"] == "finetuned on build x"
    x = images(2)
    with torch.no_grad():
        ref = encode(enc, x)[1]
    torch.testing.assert_close(again(x)[-1][1], ref)
    # `eval --run` of an hf:DIR run loads its encoder the same way (it once rebuilt it random-init)
    from spar_bench.probes.finetune.encoding import load_run_encoder

    torch.testing.assert_close(load_run_encoder(tmp_path, {"encoder": name, "seed": 0})(x)[-1][1], ref)
    # a run records the folder by base name + content hash only: its path is given again,
    # and a folder of the same name with another content is refused
    import shutil

    from spar_bench.errors import ConfigError

    recorded = {"encoder": enc.spec.name, "seed": 0}
    assert enc.spec.name.startswith("hf:tiny_dinov2@") and again.spec.name == enc.spec.name
    with pytest.raises(ConfigError, match="pass it again with --encoder hf:PATH"):
        load_run_encoder(tmp_path, recorded)
    torch.testing.assert_close(load_run_encoder(tmp_path, recorded, name)(x)[-1][1], ref)
    other = tmp_path / "other" / "tiny_dinov2"
    shutil.copytree(name[len("hf:"):], other)
    proc = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**proc, "image_mean": [0.4, 0.4, 0.4]}))
    with pytest.raises(ConfigError, match="its content differs"):
        load_run_encoder(tmp_path, recorded, f"hf:{other}")


def test_gradient_accumulation_steps_once_per_accum_batches(pipeline, tmp_path: Path) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.data import epoch_batches

    rd = _finetune(pipeline, tmp_path / "runs", TINY_VIT, "level1.localisation",
                   cfg={"max_epochs": 2, "batch_size": 4, "accum": 3, "patience": 5})
    m = json.loads((rd / "metrics.json").read_text())
    b = Build(pipeline["shards"])
    is_mirror = b.read("level1", "train", ["is_mirror"])["is_mirror"]
    n_batches = len(epoch_batches(np.flatnonzero(~is_mirror), 4, 0, 0))
    assert n_batches > 3
    assert m["train"]["optimizer_steps"] == 2 * -(-n_batches // 3)


def test_bench_finetune_runs(pipeline, tmp_path: Path) -> None:
    """bench/finetune.py measures both paths on a tiny encoder (keeps it working as the loop changes)."""
    from helpers import load_script

    mod = load_script(Path(__file__).resolve().parents[1] / "bench" / "finetune.py", "bench_finetune")
    out = tmp_path / "b.json"
    assert mod.main(["--data", str(pipeline["shards"]), "--encoder", TINY_VIT[0], "--model-args",
                     json.dumps(TINY_VIT[1]), "--batch", "4", "--batches", "2", "--repeats", "1",
                     "--compute", "fp32", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bare_img_s"] > 0 and r["finetune_img_s"] > 0 and r["peak_rss_mib"] > 0
