"""3-D encoders (issue 24, Level 4 volumes): the ``monai:`` family, 3-D TorchScript, the cache of
volumes (token grids recorded; determinism across loader workers, ranks and resumes), the
token heads' 3-D position embeddings, and the one-line errors of a 2-D/3-D mix-up.

Every model is tiny, random and made here (no download); the builds are synthetic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.errors import ConfigError
from spar_bench.probes import cache as cache_mod
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.features import FeatureCache

S = 16  # the volumes' side
OPTS = CacheOptions(dtype="fp32", compute="fp32", batch_size=2, device="cpu", loader_workers=0)
TINY_VIT = {"input_size": 16, "patch_size": 8, "hidden_size": 24, "mlp_dim": 48, "num_layers": 2, "num_heads": 2}


class Tiny3d(torch.nn.Module):
    """Two 3-D conv stages: maps (B, 8, 4, 4, 4) and (B, 16, 2, 2, 2) of a (B, 1, 16, 16, 16) volume."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv3d(1, 8, 4, 4)
        self.b = torch.nn.Conv3d(8, 16, 2, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return [h, torch.tanh(self.b(h))]


def tiny_torchscript(folder: Path, sidecar: dict | None = None) -> Path:
    """A random 3-D TorchScript encoder saved in ``folder`` with its sidecar."""
    torch.manual_seed(0)
    path = folder / "tiny3d.pt"
    torch.jit.trace(Tiny3d().eval(), torch.zeros(1, 1, S, S, S)).save(str(path))
    (folder / "tiny3d.pt.json").write_text(json.dumps(sidecar or {"input_size": [S, S, S]}))
    return path


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """A synthetic build with Levels 1-4: 8 images, 7 volumes of 16^3 in shards of 3."""
    return write_synthetic_build(tmp_path_factory.mktemp("b3d") / "b", 8, shard_size=3,
                                 levels=("level1", "level2", "level3", "level4"), n_volumes=7, volume_size=S)


@pytest.fixture(scope="module")
def ts_model(tmp_path_factory) -> Path:
    return tiny_torchscript(tmp_path_factory.mktemp("ts3d"))


# --------------------------------------------------------------------------- encoders
def test_torchscript_3d_records_every_layers_grid(ts_model: Path) -> None:
    enc = load_encoder(f"torchscript:{ts_model}")
    spec = enc.spec
    assert spec.volumetric and spec.input_size == (S, S, S) and spec.in_chans == 1
    assert spec.extra["layer_grids"] == {"0": [4, 4, 4], "1": [2, 2, 2], "-1": [2, 2, 2]}
    assert (spec.grid, spec.dim, spec.n_layers, spec.n_tokens) == ((2, 2, 2), 16, 2, 8)
    vols = torch.randint(0, 256, (3, 20, 20, 20), dtype=torch.uint8)  # resized to 16^3
    out = enc(vols, [-1, 0])
    assert out[-1][0].shape == (3, 8, 16) and out[0][0].shape == (3, 64, 8) and out[0][1].shape == (3, 8)
    # the tokens are the maps flattened z-major: token (z, r, c) = map[:, :, z, r, c]
    x = enc.preprocess(vols)
    maps = enc.module(x)[0]
    np.testing.assert_array_equal(out[0][0][:, 1 * 16 + 2 * 4 + 3].numpy(), maps[:, :, 1, 2, 3].numpy())
    with pytest.raises(ValueError, match="3-D: expected uint8"):
        enc(torch.zeros(2, 224, 224, dtype=torch.uint8))


def test_torchscript_3d_tokens_and_channels_last(tmp_path: Path) -> None:
    class Tok(torch.nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0], 1, 64, 64).mean(-1).transpose(1, 2).repeat(1, 1, 4)  # (B, 64, 4)

    class Last(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.avg_pool3d(x, 4).permute(0, 2, 3, 4, 1)  # (B, 4, 4, 4, 1)

    for cls, side, grid in ((Tok, {"grid": [4, 4, 4]}, [4, 4, 4]), (Last, {"channels_last": True}, [4, 4, 4])):
        p = tmp_path / f"{cls.__name__}.pt"
        torch.jit.trace(cls(), torch.zeros(1, 1, S, S, S)).save(str(p))
        p.with_name(p.name + ".json").write_text(json.dumps({"input_size": [S, S, S], **side}))
        enc = load_encoder(f"torchscript:{p}")
        assert enc.spec.extra["layer_grids"]["-1"] == grid
        assert enc(torch.zeros(2, S, S, S, dtype=torch.uint8))[-1][0].shape[:2] == (2, 64)
    q = tmp_path / "Tok.pt"
    q.with_name(q.name + ".json").write_text(json.dumps({"input_size": [S, S, S], "grid": [3, 3, 3]}))
    with pytest.raises(ConfigError, match="does not hold the module's 64 patch tokens"):
        load_encoder(f"torchscript:{q}")


def test_monai_names_and_the_missing_extra(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="did you mean monai:resnet18"):
        load_encoder("monai:resnt18", random_init=True)
    with pytest.raises(ConfigError, match="no weights given"):
        load_encoder("monai:resnet10")
    monkeypatch.setitem(sys.modules, "monai", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        load_encoder("monai:resnet10", random_init=True)
    assert "pip install 'spar-bench[monai]'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch, args, grids", [
    ("resnet10", {"input_size": 16}, {"-1": [1, 1, 1], "0": [8, 8, 8], "3": [1, 1, 1]}),
    ("vit", TINY_VIT, {"-1": [2, 2, 2], "0": [2, 2, 2]}),
    ("swinunetr", {"input_size": 32, "feature_size": 12, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1]},
     {"-1": [1, 1, 1], "0": [16, 16, 16], "4": [1, 1, 1]}),
])
@pytest.mark.slow
def test_monai_architectures_give_token_grids(arch: str, args: dict, grids: dict) -> None:
    pytest.importorskip("monai")
    pytest.importorskip("einops")
    enc = load_encoder(f"monai:{arch}", random_init=True, model_kwargs=args)
    spec = enc.spec
    assert spec.volumetric and spec.family == "monai" and spec.random_init
    for v, g in grids.items():
        assert spec.extra["layer_grids"][v] == g
    vols = torch.randint(0, 256, (2, S, S, S), dtype=torch.uint8)
    layers = [-1, 0]
    out = enc(vols, layers)
    for v in layers:
        toks, pooled = out[v]
        assert toks.shape[:2] == (2, int(np.prod(spec.layer_grid(v)))) and pooled.shape == (2, toks.shape[-1])
        assert torch.isfinite(toks).all()
    again = load_encoder(f"monai:{arch}", random_init=True, model_kwargs=args)  # the seeded random init
    torch.testing.assert_close(again(vols, [-1])[-1][0], out[-1][0], rtol=0, atol=0)
    from spar_bench.probes.finetune.model import block_index

    groups = block_index(enc)  # --freeze-blocks: stem 0, then the stages (ViT: the blocks) in order
    first, last = next(iter(groups)), max(groups.values())
    assert groups[first] == 0 and last >= 3 and len(set(groups.values())) == last + 1


@pytest.mark.slow
def test_monai_weights_from_a_folder_and_a_wrapped_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("monai")
    pytest.importorskip("einops")
    from safetensors.torch import save_file

    ref = load_encoder("monai:vit", random_init=True, model_kwargs=TINY_VIT)
    sd = {k: v.contiguous() for k, v in ref.module.state_dict().items()}
    folder = tmp_path / "vit_folder"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_args": TINY_VIT}))
    wrapped = tmp_path / "whole_network.pt"  # a whole network's checkpoint: module.vit.<key>
    torch.save({"state_dict": {f"module.vit.{k}": v for k, v in sd.items()} | {"module.out.weight": torch.zeros(1)}},
               wrapped)
    vols = torch.randint(0, 256, (2, S, S, S), dtype=torch.uint8)
    want = ref(vols)[-1][0]
    for weights, kw in ((folder, {}), (wrapped, {"model_kwargs": TINY_VIT})):
        enc = load_encoder("monai:vit", weights=str(weights), **kw)
        assert not enc.spec.random_init and enc.spec.weights["kind"] in ("dir", "file")
        torch.testing.assert_close(enc(vols)[-1][0], want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="MONAI refuses the model arguments"):
        load_encoder("monai:vit", random_init=True, model_kwargs={**TINY_VIT, "no_such_arg": 1})


# --------------------------------------------------------------------------- cache
def test_cache_of_volumes_records_the_grid_and_skips_2d_levels(build: Path, ts_model: Path, tmp_path: Path) -> None:
    out = write_cache(f"torchscript:{ts_model}", build, tmp_path / "c.h5",
                      CacheOptions(**{**OPTS.__dict__, "layers": (-1, 0)}), progress=False)
    with FeatureCache(out) as fc:
        assert fc.levels() == ["level4"]  # a 3-D encoder reads the volumes only
        assert fc.token_grid("level4", -1) == [0, 2, 2, 2] and fc.token_grid("level4", 0) == [0, 4, 4, 4]
        toks = fc.tokens("level4", "train", 0)
        assert toks.shape == (7, 64, 8)
        from spar_bench.builder.shards import Build

        enc = load_encoder(f"torchscript:{ts_model}")
        vols = torch.from_numpy(Build(build).images("level4", "train", np.arange(7)))
        np.testing.assert_allclose(toks, enc(vols, [0])[0][0].numpy(), rtol=0, atol=1e-6)
    d2 = write_cache("dummy", build, tmp_path / "d.h5", OPTS, progress=False)  # a 2-D one skips Level 4
    with FeatureCache(d2) as fc:
        assert fc.levels() == ["level1", "level2", "level3"] and fc.token_grid("level3") is None
        assert "token_grid" not in fc.meta


def test_a_2d_3d_mix_up_is_one_line(build: Path, ts_model: Path, tmp_path: Path) -> None:
    for enc, levels, says in ((f"torchscript:{ts_model}", ("level3",), "is 3-D: it encodes volumes (Level 4) only"),
                              ("dummy", ("level4",), "is 2-D: it encodes images (Levels 1-3) only")):
        with pytest.raises(ConfigError) as e:
            write_cache(enc, build, tmp_path / "x.h5", CacheOptions(**{**OPTS.__dict__, "levels": levels}),
                        progress=False)
        assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x.h5").exists()


def content(path: Path) -> dict:
    found: dict = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        found["attrs"] = {k: v for k, v in f.attrs.items() if k != "versions"}
    return found


def assert_same(a: Path, b: Path) -> None:
    ca, cb = content(a), content(b)
    assert ca.keys() == cb.keys() and ca.pop("attrs") == cb.pop("attrs")
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


@pytest.mark.slow
def test_volume_cache_is_the_same_across_workers_ranks_and_resumes(build: Path, ts_model: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    name = f"torchscript:{ts_model}"
    one = write_cache(name, build, tmp_path / "one.h5", OPTS, progress=False)
    two = write_cache(name, build, tmp_path / "two.h5", CacheOptions(**{**OPTS.__dict__, "loader_workers": 2}),
                      progress=False)
    assert_same(one, two)

    class Stop(Exception):
        pass

    def stop(level, split, lo, hi):
        if lo >= 2:
            raise Stop

    with pytest.raises(Stop):
        write_cache(name, build, tmp_path / "resumed.h5", OPTS, progress=False, on_batch=stop)
    assert_same(one, write_cache(name, build, tmp_path / "resumed.h5", OPTS, progress=False))

    monkeypatch.setattr(cache_mod, "barrier", lambda ranks, timeout: None)  # the ranks run in turn here
    for rank in (1, 0):  # rank 0 merges once both parts are done
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        write_cache(name, build, tmp_path / "ranks.h5", OPTS, progress=False)
    assert_same(one, tmp_path / "ranks.h5")


def test_token_grid_storage_pools_the_3d_grid(build: Path, ts_model: Path, tmp_path: Path) -> None:
    from spar_bench.probes.token_storage import TokenStorage

    opts = CacheOptions(**{**OPTS.__dict__, "layers": (0,), "token_storage": TokenStorage(grid=2)})
    out = write_cache(f"torchscript:{ts_model}", build, tmp_path / "g.h5", opts, progress=False)
    full = write_cache(f"torchscript:{ts_model}", build, tmp_path / "f.h5",
                       CacheOptions(**{**OPTS.__dict__, "layers": (0,)}), progress=False)
    with FeatureCache(out) as g, FeatureCache(full) as f:
        assert g.token_grid("level4", 0) == [0, 2, 2, 2]
        t = f.tokens("level4", "train", 0).reshape(7, 4, 4, 4, 8)
        want = t.reshape(7, 2, 2, 2, 2, 2, 2, 8).mean(axis=(2, 4, 6)).reshape(7, 8, 8)  # 2x2x2 blocks
        np.testing.assert_allclose(g.tokens("level4", "train", 0), want, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- heads
def test_token_heads_get_3d_positions_and_2d_heads_are_unchanged() -> None:
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.heads.positions import GridPositions

    torch.manual_seed(0)
    flat = build_head("attnpool", "level3.relative_position", 16, 9)
    assert isinstance(flat.pos, torch.nn.Parameter) and "token_grid" not in flat.cfg
    for name in ("attnpool", "transformer"):
        torch.manual_seed(0)
        head = build_head(name, "level1.localisation", 16, 1 + 8, token_grid=[1, 2, 2, 2])
        assert isinstance(head.pos, GridPositions) and head.cfg["token_grid"] == [1, 2, 2, 2]
        head.fit_projection(np.random.default_rng(0).normal(size=(64, 16)))
        x = torch.as_tensor(head.preproject(np.random.default_rng(1).normal(size=(3, 9, 16)).astype(np.float32)))
        assert head(x).shape == (3, 16, 2)
        again = build_head(name, "level1.localisation", 16, 9, **head.cfg)  # reloaded from its recorded cfg
        again.load_state_dict(head.state_dict())
        with pytest.raises(ValueError, match="built for 9"):
            head(x[:, :5])
    pos = GridPositions([0, 2, 3, 4], 5)
    emb = pos(24).detach()
    z, r, c = (p.detach() for p in pos.axes)
    torch.testing.assert_close(emb[1 * 12 + 2 * 4 + 3], z[1] + r[2] + c[3])
    with pytest.raises(ValueError, match="holds 9 tokens"):
        GridPositions([1, 2, 2, 2], 4, n_tokens=10)


# --------------------------------------------------------------------------- end to end on a phantom build
@pytest.fixture(scope="module")
def phantom4(tmp_path_factory) -> Path:
    """A real phantom build of Level 4 only: 8 cases, 16^3 volumes (5 train, 1 val, 2 test)."""
    from spar_bench.builder.cli import cli as build_cli
    from tests.helpers import run_cmd

    root = tmp_path_factory.mktemp("phantom4")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 8, "--layout", "canonical", "--in-plane", 64,
                               "--slices", 24]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "b", "--levels",
                               "level4", "--volume-size", S, "--no-hf"]) == 0  # fmt: skip
    return root / "b"


def _metrics(runs: Path, probe: str, head: str) -> dict:
    (path,) = runs.glob(f"*/{probe}/{head}*/seed0/metrics.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_random_3d_encoder_sits_at_its_blind_baseline(phantom4: Path, ts_model: Path, tmp_path: Path) -> None:
    """Issue 24's done-when: heads on a random 3-D encoder's cache (pooled, and attnpool over the
    4x4x4 token grid of layer 0 with 3-D positions) score no better than the same head given the
    question alone (pooled over the two heads: tests/helpers.py assert_at_blind)."""
    from spar_bench.probes.cli import cli
    from tests.helpers import assert_at_blind, run_cmd

    cache = write_cache(f"torchscript:{ts_model}", phantom4, tmp_path / "c.h5",
                        CacheOptions(**{**OPTS.__dict__, "layers": (-1, 0)}), progress=False)
    runs, probe = tmp_path / "runs", "level4.relative_position"
    for head, layer in (("linear", -1), ("attnpool", 0)):
        assert run_cmd(cli, ["fit", "--features", cache, "--data", phantom4, "--probe", probe, "--head", head,
                             "--layer", layer, "--out", runs, "--bootstrap", 200]) == 0
    (head_pt,) = runs.glob(f"*/{probe}/attnpool*/seed0/head.pt")
    assert json.loads(torch.load(head_pt, weights_only=False)["config"])["extra"]["head_config"]["token_grid"] == [0, 4, 4, 4]
    found = [_metrics(runs, probe, head) for head in ("linear", "attnpool")]
    for m in found:
        assert m["random_init"] is False and m["n_items"]["test"] >= 16  # a TorchScript file: its own weights
    assert_at_blind(found)


@pytest.mark.slow
def test_finetune_from_scratch_of_a_3d_encoder(phantom4: Path, tmp_path: Path) -> None:
    """``spar-probe finetune`` trains a monai: encoder from scratch with a token head on a Level 4
    probe; the head records the 3-D grid; the export is read back by ``spar-probe cache``; a 2-D
    encoder on a Level 4 probe is one line."""
    pytest.importorskip("monai")
    pytest.importorskip("einops")
    from spar_bench.probes.cli import cli
    from tests.helpers import run_cmd

    runs, probe = tmp_path / "runs", "level4.relative_position"
    args = ["finetune", "--encoder", "monai:vit", "--init", "scratch", "--model-args", json.dumps(TINY_VIT),
            "--data", phantom4, "--head", "attnpool", "--probe", probe, "--out", runs, "--max-epochs", 1,
            "--batch-size", 4, "--device", "cpu", "--compute", "fp32", "--bootstrap", 20]
    assert run_cmd(cli, args) == 0
    (rd,) = runs.glob(f"*/{probe}/*/seed0")
    config = json.loads((rd / "config.json").read_text())["extra"]
    assert config["head_config"]["token_grid"] == [0, 2, 2, 2] and config["n_tokens"] == 8
    assert "blind" in json.loads((rd / "metrics.json").read_text())["controls"]
    out = write_cache("monai:vit", phantom4, tmp_path / "ft.h5",
                      CacheOptions(**{**OPTS.__dict__, "weights": str(rd / "encoder.safetensors")}), progress=False)
    with FeatureCache(out) as fc:
        assert fc.meta["weights"]["training"]["mode"] == "scratch" and fc.token_grid("level4") == [0, 2, 2, 2]
    with pytest.raises(ConfigError, match="is 2-D: it encodes images"):
        from spar_bench.probes.finetune.config import FinetuneSpec
        from spar_bench.probes.runs.session import run as run_finetune

        run_finetune(FinetuneSpec("dummy", str(phantom4), probe, "mlp", 0, init="scratch"), tmp_path / "r2",
                     progress=False)
