"""``spar-probe finetune --encoder open_clip:...``: the export holds the vision tower (a timm
trunk, or open_clip's own ViT), names it, and ``spar-probe cache --weights`` / ``eval --data``
load it back over the model's architecture; exports of another family or tower are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError

from helpers import OPEN_CLIP_TOWERS, keep_trained_encoder, make_open_clip, run_cmd

pytest.importorskip("open_clip")

EXPORT = "encoder.safetensors"


def _finetune(pipeline, name: str, out: Path, monkeypatch) -> tuple[Path, object]:
    """A 1-epoch finetune of ``name``; returns the run folder and the trained encoder in memory."""
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.runs.session import run as run_finetune

    trained = keep_trained_encoder(monkeypatch)
    cfg = FinetuneConfig(batch_size=8, max_epochs=1, encoder_lr=1e-2, warmup_epochs=0, device="cpu", compute="fp32")
    fs = FinetuneSpec(name, str(pipeline["shards"]), "level1.localisation", "mlp", 0, cfg=cfg, n_boot=20,
                      controls=False)
    rd = run_finetune(fs, out, progress=False)
    return rd, trained["enc"]


def _pooled(enc, images) -> np.ndarray:
    from spar_bench.probes.finetune.model import encode

    enc.module.eval()
    with torch.no_grad():
        return encode(enc, torch.from_numpy(images))[1].float().numpy()


@pytest.mark.parametrize("tower", sorted(OPEN_CLIP_TOWERS))
def test_open_clip_export_recaches_to_the_runs_forward(pipeline, tmp_path: Path, tower: str, monkeypatch) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.encoders.base import read_export_meta
    from spar_bench.probes.encoders.open_clip_family import TOWER_MODULES
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.finetune.encoding import run_eval_reencoded

    name, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS[tower])
    rd, enc = _finetune(pipeline, name, tmp_path / "runs", monkeypatch)
    meta = read_export_meta(rd / EXPORT)
    assert meta["family"] == "open_clip" and meta["module"] == TOWER_MODULES[tower] == enc.spec.extra["module"]
    assert meta["training"]["label"] == "finetuned on build shards"

    cache = write_cache(name, pipeline["shards"], tmp_path / "ft.h5",
                        CacheOptions(weights=str(rd / EXPORT), levels=["level1"], splits=["test"], dtype="fp32",
                                     compute="fp32"), progress=False)
    images = Build(pipeline["shards"]).images("level1", "test", np.arange(4))
    with FeatureCache(cache) as fc:
        cached = fc.pooled("level1", "test")[:4]
        assert fc.meta["weights"]["training"]["label"] == "finetuned on build shards"
        assert fc.meta["encoder_config"]["extra"]["module"] == TOWER_MODULES[tower]
    np.testing.assert_allclose(cached, _pooled(enc, images), rtol=1e-4, atol=1e-5)
    frozen = _pooled(load_encoder(name), images)  # the folder's own (untrained) weights
    assert np.abs(frozen - cached).max() > 1e-3, "the export was not loaded: features are the folder's"

    # re-encoding the run's own build reproduces its test score; another build is re-encoded too
    m = json.loads((rd / "metrics.json").read_text())
    with pytest.raises(ConfigError, match="pass it again with --encoder open_clip:local-dir:PATH"):
        run_eval_reencoded(rd, pipeline["shards"], n_boot=20, device="cpu", compute="fp32")
    again = json.loads(run_eval_reencoded(rd, pipeline["shards"], n_boot=20, device="cpu", compute="fp32",
                                          encoder=name).read_text())
    assert again["test"]["med_px"] == pytest.approx(m["test"]["med_px"], rel=1e-4)


def test_open_clip_run_evals_another_build(pipeline, tmp_path: Path, monkeypatch) -> None:
    """``spar-probe eval --run RUN --data OTHER`` re-encodes the other build with the run's tower."""
    from spar_bench.probes.cli import cli

    name, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS["open_clip-vit"])
    rd, _ = _finetune(pipeline, name, tmp_path / "runs", monkeypatch)
    assert run_cmd(cli, ["eval", "--run", rd, "--data", pipeline["other"], "--bootstrap", 20,
                         "--encoder", name]) == 0
    out = json.loads((rd / f"eval-{Path(pipeline['other']).name}.json").read_text())
    assert out["features"] == "other-shards (re-encoded)" and out["data"] == "other-shards"
    assert out["training"]["label"] == "finetuned on build shards"
    assert np.isfinite(out["test"]["med_px"])


def test_init_scratch_on_a_folder_with_a_checkpoint_speaks_of_init_scratch(pipeline, tmp_path: Path) -> None:
    from spar_bench.probes.cli import cli
    from spar_bench.probes.finetune.config import FinetuneSpec
    from spar_bench.probes.runs.session import run as run_finetune

    name, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS["open_clip-vit"])
    with pytest.raises(ConfigError, match="holds the weights; drop --init scratch") as e:
        run_finetune(FinetuneSpec(name, str(pipeline["shards"]), "level1.localisation", init="scratch"),
                     tmp_path / "runs")
    assert "--random-init" not in str(e.value) and not (tmp_path / "runs").exists()
    # `spar-probe cache` keeps speaking of its own flag
    assert run_cmd(cli, ["cache", "--encoder", name, "--random-init", "--data", pipeline["shards"],
                         "--out", tmp_path / "c.h5", "--levels", "level1"]) == 2


def _export(enc, path: Path, encoder: str) -> Path:
    from spar_bench.probes.finetune.model import export_encoder

    return export_encoder(enc, path, {"encoder": encoder, "training": {"label": "finetuned on build x"}})


def test_foreign_exports_are_refused_naming_the_file(pipeline, tmp_path: Path) -> None:
    """A timm export, the other tower's export, or an export with missing / reshaped keys:
    one line naming the file, exit 2, no cache."""
    from safetensors.torch import load_file, save_file

    from spar_bench.probes.cli import cli
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.encoders.base import EXPORT_META_KEY
    from spar_bench.probes.finetune.model import read_export_meta

    vit, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS["open_clip-vit"], "vit")
    trunk, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS["timm-trunk"], "trunk")
    wide, _ = make_open_clip(tmp_path, {**OPEN_CLIP_TOWERS["open_clip-vit"], "width": 32}, "wide")
    timm_file = _export(load_encoder("timm:test_vit", random_init=True), tmp_path / "timm.safetensors", "timm:test_vit")
    trunk_file = _export(load_encoder(trunk), tmp_path / "trunk.safetensors", trunk)
    vit_file = _export(load_encoder(vit), tmp_path / "vit.safetensors", vit)
    state = load_file(str(vit_file))
    state.pop(sorted(state)[0])
    holed = tmp_path / "holed.safetensors"
    save_file(state, str(holed), metadata={EXPORT_META_KEY: json.dumps(read_export_meta(vit_file))})

    cases = [(vit, timm_file, "an export of the timm encoder timm:test_vit"),
             (vit, trunk_file, "'visual.trunk', but .* loads its 'visual'"),
             (trunk, vit_file, "'visual', but .* loads its 'visual.trunk'"),
             (vit, holed, r"do not fit the model \(missing 1"),
             (wide, vit_file, "tensors of another shape"),
             ("timm:test_vit", vit_file, "an export of the open_clip encoder")]
    for encoder, file, why in cases:
        with pytest.raises(ConfigError, match=why) as e:
            load_encoder(encoder, weights=str(file))
        assert file.name in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "c.h5"
    assert run_cmd(cli, ["cache", "--encoder", vit, "--weights", timm_file, "--data", pipeline["shards"],
                         "--out", out, "--levels", "level1"]) == 2
    assert not out.exists()
    # a plain state dict is not an export: the folder keeps its weights
    with pytest.raises(ConfigError, match="takes only a `spar-probe finetune` export"):
        load_encoder(vit, weights=str(tmp_path / "vit" / "open_clip_pytorch_model.bin"))


def test_builtin_open_clip_name_takes_an_export_over_its_architecture(tmp_path: Path) -> None:
    """``open_clip:NAME --weights EXPORT`` builds NAME without a CLIP checkpoint (the export is
    loaded over it); a plain file stays open_clip's ``pretrained`` checkpoint."""
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.encoders.open_clip_family import _source

    vit, _ = make_open_clip(tmp_path, OPEN_CLIP_TOWERS["open_clip-vit"], "vit")
    path = _export(load_encoder(vit), tmp_path / "vit.safetensors", vit)
    meta = {"family": "open_clip", "module": "visual"}
    model, pretrained, record = _source("ViT-B-32", "open_clip:ViT-B-32", str(path), False, meta)
    assert (model, pretrained) == ("ViT-B-32", None)
    assert record["kind"] == "file" and record["training"]["label"] == "finetuned on build x"
    plain = tmp_path / "clip.bin"
    plain.write_bytes(b"x")
    assert _source("ViT-B-32", "open_clip:ViT-B-32", str(plain), False, None)[1] == str(plain)
