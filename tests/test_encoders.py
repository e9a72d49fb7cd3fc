"""Encoder registry and the four families, with tiny models saved and loaded OFFLINE in tmp_path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.encoders import ENCODERS, load_encoder, register_encoder, registry_rows
from spar_bench.probes.encoders.base import EncoderSpec
from spar_bench.registry import DuplicateNameError

from helpers import (
    TINY_VIT,
    images,
    make_hf_dinov2,
    make_open_clip,
    make_timm_resnet,
    make_timm_vit,
    make_torchscript,
)


# -- registry ------------------------------------------------------------------------------
def test_import_is_cheap() -> None:
    code = "import sys, spar_bench.probes.encoders, spar_bench.probes.cache, spar_bench.probes.features; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_unknown_name_suggests() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'dummy'"):
        load_encoder("dumy")
    with pytest.raises(ConfigError, match="unknown encoder family 'tim'.*Did you mean 'timm'"):
        load_encoder("tim:resnet50", random_init=True)


def test_register_user_encoder_and_duplicates() -> None:
    from spar_bench.probes.encoders.base import load_dummy

    register_encoder("my-enc", lambda rest, **kw: load_dummy(rest, dim=8, **kw), family="custom")
    try:
        enc = load_encoder("my-enc")
        assert enc.spec.dim == 8
        with pytest.raises(DuplicateNameError):
            register_encoder("my-enc", load_dummy)
        with pytest.raises(ValueError, match="':'"):
            register_encoder("timm:x", load_dummy)
        assert any(r["name"] == "my-enc" for r in registry_rows())
    finally:
        ENCODERS.unregister("my-enc")
    assert "my-enc" not in ENCODERS


def test_entry_point_group(monkeypatch) -> None:
    import importlib.metadata as md

    import spar_bench.probes.encoders as pe

    ep = md.EntryPoint("ep-enc", "spar_bench.probes.encoders.base:load_dummy", pe.ENTRY_POINT_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep] if group == pe.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(pe, "_entry_points_loaded", False)
    try:
        assert load_encoder("ep-enc").spec.family == "dummy"
    finally:
        ENCODERS.unregister("ep-enc")


def test_encoders_command_lists_without_downloads() -> None:
    from click.testing import CliRunner

    from spar_bench.probes.cli.encoders import encoders_command

    res = CliRunner().invoke(encoders_command, [])
    assert res.exit_code == 0, res.output
    assert "timm:<...>" in res.output and "raddino" in res.output and "dummy" in res.output
    res = CliRunner().invoke(encoders_command, ["--json"])
    rows = json.loads(res.output)
    assert {"name", "family", "input", "tokens", "dim", "pooled", "weights"} <= set(rows[0])


# -- weights / random init -----------------------------------------------------------------
def test_random_init_must_be_explicit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--random-init"):
        load_encoder("timm:resnet10t")
    with pytest.raises(ConfigError, match="do not exist"):
        load_encoder("timm:resnet10t", weights=str(tmp_path / "nope.pth"))
    enc = load_encoder("timm:resnet10t", random_init=True)
    assert enc.spec.random_init and enc.spec.weights == {"kind": "random-init"}


def test_wrong_weights_are_refused(tmp_path: Path) -> None:
    torch.save({"foo": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(ConfigError, match="do not fit the model"):
        load_encoder("timm:resnet10t", weights=str(tmp_path / "bad.pth"))


def test_missing_extra_gives_one_line_hint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "open_clip", None)
    with pytest.raises(ConfigError, match=r"pip install 'spar-bench\[transformers\]'") as e:
        load_encoder("hf:facebook/dinov2-small", revision="abc")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"spar-bench\[open_clip\]"):
        load_encoder("open_clip:ViT-B-32", random_init=True)


def test_hub_ids_need_a_pinned_revision() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="--revision"):
        load_encoder("raddino")


# -- families: tokens equal the model's own forward ---------------------------------------
def test_spec_is_json_roundtrip() -> None:
    enc = load_encoder("dummy")
    d = json.loads(enc.spec.to_json())
    assert d["n_tokens"] == 50 and d["weights"]["kind"] == "random-init"
    assert EncoderSpec(**{k: v for k, v in d.items() if k != "n_tokens"}).n_tokens == 50


def test_dummy_is_deterministic() -> None:
    a = load_encoder("dummy")(images(), [-1, -2])
    b = load_encoder("dummy")(images(), [-1, -2])
    for v in (-1, -2):
        assert torch.equal(a[v][0], b[v][0]) and a[v][0].shape == (3, 50, 16)
    assert not torch.equal(a[-1][0], a[-2][0])


def test_timm_vit_matches_forward_features(tmp_path: Path) -> None:
    import timm

    name, kw = make_timm_vit(tmp_path)
    enc = load_encoder(name, **kw)
    s = enc.spec
    assert (s.n_prefix, s.grid, s.dim, s.pooled, s.n_layers) == (1, (14, 14), 32, "cls", 2)
    assert s.weights["kind"] == "file" and len(s.weights["sha256"]) == 64 and not s.random_init
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **TINY_VIT).eval()
    ref.load_state_dict(torch.load(kw["weights"]))
    x = images()
    out = enc(x, [-1, 0])
    with torch.no_grad():
        px = (x.float() / 255).unsqueeze(1).expand(-1, 3, -1, -1)
        px = (px - 0.5) / 0.5  # the model's pretrained_cfg mean/std
        want = ref.forward_features(px)
        b0 = ref.blocks[0](ref.norm_pre(ref.patch_drop(ref._pos_embed(ref.patch_embed(px)))))
    torch.testing.assert_close(out[-1][0], want)
    torch.testing.assert_close(out[-1][1], want[:, 0])
    torch.testing.assert_close(out[0][0], b0)
    with pytest.raises(ConfigError, match="out of range"):
        enc(x, [5])


@pytest.mark.slow
def test_timm_resnet_flattens_feature_maps(tmp_path: Path) -> None:
    import timm

    name, kw = make_timm_resnet(tmp_path)
    enc = load_encoder(name, **kw)
    assert enc.spec.input_size == (176, 176)  # from timm's pretrained cfg, not hard-coded
    assert enc.spec.pooled == "avgpool" and enc.spec.patch_size == 32
    out = enc(images(2), [-1, -2])
    ref = timm.create_model("resnet10t", pretrained=False, num_classes=0).eval()
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(kw["weights"]))
    with torch.no_grad():
        fmap = ref.forward_features(enc.preprocess(images(2)))
        pooled = ref(enc.preprocess(images(2)))
    torch.testing.assert_close(out[-1][0], fmap.flatten(2).transpose(1, 2))
    torch.testing.assert_close(out[-1][1], pooled)
    assert out[-2][0].shape[-1] == 256


def test_timm_weights_folder(tmp_path: Path) -> None:
    import timm
    from safetensors.torch import save_file

    d = tmp_path / "folder"
    d.mkdir()
    m = timm.create_model("resnet10t", pretrained=False, num_classes=0)
    save_file(m.state_dict(), str(d / "model.safetensors"))
    cfg = {"architecture": "resnet10t", "pretrained_cfg": {"input_size": [3, 224, 224], "mean": [0.1] * 3}}
    (d / "config.json").write_text(json.dumps(cfg))
    enc = load_encoder("timm:resnet10t", weights=str(d))
    assert enc.spec.input_size == (224, 224) and enc.spec.mean == (0.1, 0.1, 0.1)
    assert enc.spec.weights["kind"] == "dir"
    with pytest.raises(ConfigError, match="is for 'resnet10t'"):
        load_encoder("timm:resnet18", weights=str(d))


def test_hf_dinov2_local_dir(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    name, kw = make_hf_dinov2(tmp_path)
    enc = load_encoder(name)
    s = enc.spec
    assert s.input_size == (112, 112) and s.grid == (8, 8) and s.n_prefix == 1 and s.dim == 32
    assert s.mean == (0.5, 0.5, 0.5) and s.weights["kind"] == "dir"
    ref = transformers.AutoModel.from_pretrained(name[3:], local_files_only=True).eval()
    x = images(2)
    out = enc(x, [-1, -2])
    with torch.no_grad():
        r = ref(pixel_values=enc.preprocess(x), output_hidden_states=True)
    torch.testing.assert_close(out[-1][0], r.last_hidden_state)
    torch.testing.assert_close(out[-2][0], r.hidden_states[-2])
    torch.testing.assert_close(out[-1][1], r.last_hidden_state[:, 0])


@pytest.mark.slow
def test_open_clip_local_dir(tmp_path: Path) -> None:
    open_clip = pytest.importorskip("open_clip")
    name, kw = make_open_clip(tmp_path)
    enc = load_encoder(name)
    s = enc.spec
    assert s.family == "open_clip" and s.mean == (0.4, 0.4, 0.4) and s.n_prefix == 1
    assert s.weights["kind"] == "file" and s.weights["name"] == "open_clip_pytorch_model.bin"
    assert "path" not in s.weights and re.fullmatch(r"open_clip:local-dir:tiny_clip@[0-9a-f]{8}", s.name)
    model = open_clip.create_model(name[len("open_clip:"):]).eval()
    x = images(2)
    with torch.no_grad():
        want = model.visual.trunk.forward_features(enc.preprocess(x))
    torch.testing.assert_close(enc(x)[-1][0], want)


@pytest.mark.slow
def test_open_clip_without_checkpoint_needs_random_init(tmp_path: Path) -> None:
    pytest.importorskip("open_clip")
    name, _ = make_open_clip(tmp_path)
    (tmp_path / "tiny_clip" / "open_clip_pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match="--random-init"):
        load_encoder(name)
    assert load_encoder(name, random_init=True).spec.random_init


@pytest.mark.slow
def test_local_models_are_named_by_folder_name_and_content(tmp_path: Path) -> None:
    """No local path in a spec: base name + content hash; another location of the same
    content has the same name, another content in a folder of the same name another one."""
    import shutil

    from spar_bench.probes.encoders.base import is_local_name, published_name

    pytest.importorskip("open_clip")
    (tmp_path / "a").mkdir()
    name, _ = make_open_clip(tmp_path / "a")
    copy = tmp_path / "b" / "tiny_clip"
    shutil.copytree(tmp_path / "a" / "tiny_clip", copy)
    first, same = load_encoder(name).spec, load_encoder(f"open_clip:local-dir:{copy}").spec
    assert first.name == same.name and is_local_name(first.name)
    assert str(tmp_path) not in json.dumps(first.to_dict())
    other = tmp_path / "c" / "tiny_clip"
    shutil.copytree(copy, other)
    cfg = json.loads((other / "open_clip_config.json").read_text())
    cfg["preprocess_cfg"]["mean"] = [0.5, 0.5, 0.5]
    (other / "open_clip_config.json").write_text(json.dumps(cfg))
    assert load_encoder(f"open_clip:local-dir:{other}").spec.name != first.name
    # names recorded by older caches and runs: their path replaced by base name + hash
    sha = {"kind": "dir", "sha256": "ab" * 32}
    assert published_name("hf:/home/me/models/tiny/", sha) == "hf:tiny@abababab"
    assert published_name("open_clip:local-dir:/x/BiomedCLIP", {"kind": "file", "sha256": "cd" * 32}) \
        == "open_clip:local-dir:BiomedCLIP@cdcdcdcd"
    assert published_name("torchscript:/x/m.pt", {"kind": "file"}) == "torchscript:m.pt"
    for kept in ("hf:microsoft/rad-dino", "timm:resnet50", "dummy", first.name):
        assert published_name(kept, sha if kept.startswith("hf:m") else None) == kept
    # an older cache's run folder: named from the base name + hash, not the path
    from types import SimpleNamespace

    from spar_bench.probes.runs.inputs import encoder_slug

    old = SimpleNamespace(meta={"encoder": "hf:/home/me/tiny", "weights": {**sha, "path": "/home/me/tiny"}},
                          path="c.h5", random_init=False)
    assert encoder_slug(old) == "hf-tiny-abababab"
    # one encoder name with two local weights files: two run folders, never one
    for sha, slug in (("ef" * 32, "timm-resnet50-efefefef"), ("12" * 32, "timm-resnet50-12121212")):
        cache = SimpleNamespace(meta={"encoder": "timm:resnet50", "weights": {"kind": "file", "name": "w.pt", "sha256": sha}},
                                path="c.h5", random_init=False)  # fmt: skip
        assert encoder_slug(cache) == slug
    hub = SimpleNamespace(meta={"encoder": "timm:resnet50", "weights": {"kind": "hub", "repo": "timm/resnet50"}},
                          path="c.h5", random_init=False)  # fmt: skip
    assert encoder_slug(hub) == "timm-resnet50"


def test_torchscript(tmp_path: Path) -> None:
    name, _ = make_torchscript(tmp_path)
    enc = load_encoder(name)
    assert enc.spec.grid == (8, 8) and enc.spec.dim == 8 and enc.spec.n_layers == 2
    out = enc(images(2), [-1, -2])
    torch.testing.assert_close(out[-1][0], torch.relu(out[-2][0]))
    torch.testing.assert_close(out[-1][1], out[-1][0].mean(1))
    with pytest.raises(ConfigError, match="drop --weights"):
        load_encoder(name, random_init=True)


def test_random_init_is_the_same_network_in_every_process() -> None:
    """Two runs (or two ranks of a distributed cache) of --random-init encode with one network."""
    import torch

    from spar_bench.probes.encoders import load_encoder

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = load_encoder("timm:resnet10t", random_init=True)
    torch.manual_seed(999)  # whatever the caller's RNG state
    b = load_encoder("timm:resnet10t", random_init=True)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.manual_seed(123)
    load_encoder("timm:resnet10t", random_init=True)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
