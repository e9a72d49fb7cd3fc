"""Per-tile encoding of Levels 1-2 (issue 21, item 6): ``spar-probe cache --tile-encoding per-tile``.

Each 56-pixel tile of a mosaic is resized to the encoder's input and encoded alone; the 16
token sets are stacked tile by tile and the 16 pooled vectors set side by side. Level 3 is
encoded whole. Recorded in the cache, named in the runs' encoder folder and the report.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from spar_bench.builder.shards import Build
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.cli import cli
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.encoders.base import encode_tiles
from spar_bench.probes.features import FeatureCache

from helpers import run_cmd

EXACT = dict(dtype="fp32", compute="fp32", batch_size=4, device="cpu")
LEVELS = ("level1", "level2", "level3")


@pytest.fixture(scope="module")
def tiled(pipeline, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiles") / "dummy-tiles.h5"
    return write_cache("dummy", pipeline["shards"], out, CacheOptions(tile_encoding="per-tile", **EXACT), progress=False)


def test_encode_tiles_cuts_row_major_and_stacks() -> None:
    enc = load_encoder("dummy")
    mosaics = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = encode_tiles(enc, mosaics, [-1], grid=4)
    toks, pooled = out[-1]
    assert toks.shape == (3, 16 * 50, 16) and pooled.shape == (3, 16 * 16)
    for b, p in ((0, 0), (1, 6), (2, 15)):
        r, c = divmod(p, 4)
        alone_t, alone_p = enc(mosaics[b:b + 1, r * 56:(r + 1) * 56, c * 56:(c + 1) * 56], [-1])[-1]
        torch.testing.assert_close(toks[b, p * 50:(p + 1) * 50], alone_t[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pooled[b, p * 16:(p + 1) * 16], alone_p[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not split"):
        encode_tiles(enc, mosaics[:, :223], [-1])


def test_per_tile_cache_shapes_and_values(pipeline, tiled) -> None:
    enc = load_encoder("dummy")
    build = Build(pipeline["shards"])
    with FeatureCache(tiled) as fc:
        for level in LEVELS:
            for split in fc.splits(level):
                n, toks, pooled = fc.count(level, split), fc.tokens(level, split), fc.pooled(level, split)
                if level == "level3":  # questions read whole slices: encoded whole
                    assert toks.shape == (n, 50, 16) and pooled.shape == (n, 16)
                else:
                    assert toks.shape == (n, 16 * 50, 16) and pooled.shape == (n, 16 * 16)
        image = build.read("level2", "train", ["image"])["image"][:1]
        tile = torch.from_numpy(np.ascontiguousarray(image[:, 56:112, 168:224]))  # tile 7: row 1, column 3
        alone_t, alone_p = enc(tile, [-1])[-1]
        np.testing.assert_allclose(fc.tokens("level2", "train", rows=np.arange(1))[0, 7 * 50:8 * 50],
                                   alone_t[0].numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(fc.pooled("level2", "train")[0, 7 * 16:8 * 16], alone_p[0].numpy(),
                                   atol=1e-5, rtol=1e-5)


def test_per_tile_is_recorded_and_mosaic_is_the_default(pipeline, tiled, tmp_path) -> None:
    with FeatureCache(tiled) as fc:
        assert fc.tile_encoding == "per-tile" and fc.meta["tile_encoding"] == "per-tile"
        layout = fc.meta["tile_layout"]
        assert layout["levels"] == ["level1", "level2"] and layout["grid"] == [4, 4]
        assert layout["tile_px"] == 56 and layout["resize_to"] == [224, 224] and layout["tokens_per_tile"] == 50
        assert fc.meta["cache_args"]["tile_encoding"] == "per-tile"
    with FeatureCache(pipeline["cache"]) as fc:  # made with the default
        assert fc.tile_encoding == "mosaic" and "tile_layout" not in fc.meta
        assert "tile_encoding" not in fc.meta["cache_args"]  # older mosaic caches still resume
    # resuming a cache with the other tile encoding is refused, naming it
    argv = ["cache", "--encoder", "dummy", "--data", pipeline["shards"], "--out", tiled, "--dtype", "fp32",
            "--compute", "fp32", "--batch", 4, "--device", "cpu"]
    assert run_cmd(cli, argv) == 2
    assert run_cmd(cli, [*argv, "--tile-encoding", "per-tile"]) == 0  # the same arguments: already complete
    assert run_cmd(cli, [*argv[:6], "--out", tmp_path / "x.h5", "--tile-encoding", "tiles"]) == 2
    assert not (tmp_path / "x.h5").exists()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_per_tile_cache_is_deterministic(pipeline, tiled, tmp_path) -> None:
    opts = CacheOptions(tile_encoding="per-tile", levels=["level2"], **EXACT)
    again = write_cache("dummy", pipeline["shards"], tmp_path / "again.h5", opts, progress=False)
    twice = write_cache("dummy", pipeline["shards"], tmp_path / "twice.h5", opts, progress=False)
    assert _sha(again) == _sha(twice)  # same bytes
    with FeatureCache(again) as a, FeatureCache(tiled) as b:  # same arrays as the all-levels cache
        for split in a.splits("level2"):
            assert a.tokens("level2", split).tobytes() == b.tokens("level2", split).tobytes()
            assert a.pooled("level2", split).tobytes() == b.pooled("level2", split).tobytes()


@pytest.mark.slow
def test_fit_report_over_a_per_tile_cache(pipeline, tiled, tmp_path, capsys) -> None:
    runs = tmp_path / "runs"
    args = ["sweep", "--features", tiled, "--out", runs, "--heads", "mlp,transformer", "--probes",
            "level1.localisation,level2.arrangement", "--seeds", "0", "--max-epochs", 2, "--bootstrap", 10,
            "--jobs", 1]
    assert run_cmd(cli, args) == 0
    rds = sorted(runs.glob("*/*/*/seed0"))
    assert len(rds) == 4 and {rd.parts[-4] for rd in rds} == {"dummy-per-tile-random-init"}
    for rd in rds:
        rec = json.loads((rd / "config.json").read_text())
        cfg = {**rec["extra"], "head": rec["head"]}
        m = json.loads((rd / "metrics.json").read_text())
        assert m["encoder"] == "dummy-per-tile-random-init"
        if cfg["head"] == "mlp":
            assert cfg["in_dim"] == 16 * 16  # the 16 tiles' pooled vectors side by side
        else:
            assert (cfg["in_dim"], cfg["n_tokens"]) == (16, 16 * 50)  # the 16 token sets stacked
    for rd in rds:  # a head trained on tiles is not scored on whole mosaics
        capsys.readouterr()
        assert run_cmd(cli, ["eval", "--run", rd, "--features", pipeline["cache"], "--bootstrap", 10]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("does not match run" in err or "tile encoding mosaic" in err)
    assert run_cmd(cli, ["report", runs, "--out", tmp_path / "report"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "dummy-per-tile-random-init" in md
    with h5py.File(tiled) as f:  # the runs came from the tiled features
        assert f.attrs["tile_encoding"] == "per-tile"
