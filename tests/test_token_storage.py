"""Token storage reductions for many-token encoders: exact shapes, values, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.token_storage import (
    Projection,
    Reducer,
    TokenStorage,
    dequantise_int8,
    pca_projection,
    pool_grid,
    quantise_int8,
    random_projection,
)


def _tokens(b=3, prefix=1, h=6, w=6, d=8, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, prefix + h * w, d, generator=g)


def test_pool_grid_keeps_prefix_and_area_averages_patches() -> None:
    t = _tokens()
    out = pool_grid(t, 1, (6, 6), 3)
    assert out.shape == (3, 1 + 9, 8)
    assert torch.equal(out[:, 0], t[:, 0])
    patches = t[:, 1:].reshape(3, 6, 6, 8)
    top_left = patches[:, :2, :2].mean(dim=(1, 2))  # 6 -> 3: each output averages a 2x2 block
    torch.testing.assert_close(out[:, 1], top_left)
    bottom_right = patches[:, 4:, 4:].mean(dim=(1, 2))
    torch.testing.assert_close(out[:, -1], bottom_right)


def test_pool_grid_uneven_grid_37_to_14() -> None:
    t = _tokens(b=1, prefix=1, h=37, w=37, d=4)
    out = pool_grid(t, 1, (37, 37), 14)
    assert out.shape == (1, 1 + 14 * 14, 4)
    # area averaging preserves the mean of a constant field exactly
    const = torch.full((1, 1 + 37 * 37, 4), 2.5)
    assert torch.allclose(pool_grid(const, 1, (37, 37), 14), torch.full((1, 197, 4), 2.5))


def test_int8_round_trip_is_within_half_a_step_per_channel() -> None:
    t = _tokens(b=4, d=16) * torch.linspace(0.01, 100, 16)  # channels of very different scales
    q, scale = quantise_int8(t)
    assert q.dtype == torch.int8 and q.shape == t.shape and scale.shape == (4, 16)
    back = dequantise_int8(q.numpy(), scale.numpy())
    err = np.abs(back - t.numpy())
    assert (err <= scale.numpy()[:, None, :] * 0.5 + 1e-6).all()
    assert np.abs(q.numpy()).max() == 127


def test_int8_zero_channel_stays_zero() -> None:
    t = _tokens(b=2, d=4)
    t[:, :, 2] = 0
    q, scale = quantise_int8(t)
    assert (q[:, :, 2] == 0).all() and (scale[:, 2] == 0).all()
    assert np.isfinite(dequantise_int8(q.numpy(), scale.numpy())).all()


def test_pca_projection_is_deterministic_orthonormal_and_ordered() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 6)) * np.array([5, 4, 3, 2, 1, 0.5]) + 3.0
    mean, comps = pca_projection(x, 3)
    mean2, comps2 = pca_projection(x.copy(), 3)
    assert mean.tobytes() == mean2.tobytes() and comps.tobytes() == comps2.tobytes()
    assert comps.shape == (6, 3)
    np.testing.assert_allclose(comps.T @ comps, np.eye(3), atol=1e-5)
    var = ((x - mean) @ comps).var(axis=0)
    assert var[0] > var[1] > var[2]
    # the leading axes are the high-variance coordinates
    assert set(np.abs(comps).argmax(axis=0)) == {0, 1, 2}


def test_random_projection_is_seeded() -> None:
    a, b, c = random_projection(16, 4, 1), random_projection(16, 4, 1), random_projection(16, 4, 2)
    assert a[1].tobytes() == b[1].tobytes() and a[1].tobytes() != c[1].tobytes()
    assert a[1].shape == (16, 4) and not a[0].any()


def test_reducer_applies_grid_then_projection_then_int8() -> None:
    t = _tokens(b=2, prefix=1, h=6, w=6, d=8)
    pooled = t[:, 1:].mean(dim=1)
    proj = Projection(*random_projection(8, 3, 0))
    red = Reducer(TokenStorage(grid=2, proj="random:3", int8=True), n_prefix=1, grid=(6, 6),
                  projections={-1: proj})
    out = red("level3", {-1: (t, pooled)})[-1]
    assert out["tokens"].shape == (2, 1 + 4, 3) and out["tokens"].dtype == torch.int8
    assert out["token_scale"].shape == (2, 3) and torch.equal(out["pooled"], pooled)  # pooled unreduced
    expect = proj.apply(pool_grid(t, 1, (6, 6), 2))
    back = dequantise_int8(out["tokens"].numpy(), out["token_scale"].numpy())
    assert np.abs(back - expect.numpy()).max() <= out["token_scale"].max().item() / 2 + 1e-6
    plain = Reducer.identity()("level3", {-1: (t, pooled)})[-1]
    assert set(plain) == {"tokens", "pooled"} and torch.equal(plain["tokens"], t)


def test_reducer_pools_per_tile_token_sets_tile_by_tile() -> None:
    tiles = [_tokens(b=2, prefix=1, h=4, w=4, d=5, seed=s) for s in range(16)]
    stacked = torch.cat(tiles, dim=1)  # (2, 16 * 17, 5): per-tile encoding of Levels 1-2
    red = Reducer(TokenStorage(grid=2), n_prefix=1, grid=(4, 4), tiled=("level1",), tiles=16)
    out = red("level1", {-1: (stacked, stacked[:, 0])})[-1]["tokens"]
    assert out.shape == (2, 16 * 5, 5)
    for p, tile in enumerate(tiles):
        torch.testing.assert_close(out[:, p * 5:(p + 1) * 5], pool_grid(tile, 1, (4, 4), 2))


def test_reducer_infers_square_grids_of_other_layers_and_refuses_others() -> None:
    red = Reducer(TokenStorage(grid=2), n_prefix=0, grid=(7, 7))
    t = _tokens(b=1, prefix=0, h=14, w=14, d=3)  # an earlier CNN stage: 14 x 14, not the final 7 x 7
    assert red.pool("level3", t).shape == (1, 4, 3)
    with pytest.raises(ConfigError, match="no square patch grid"):
        red.pool("level3", torch.zeros(1, 10, 3))


@pytest.mark.parametrize("kw, message", [
    ({"grid": 0}, "--token-grid"),
    ({"proj": "pca"}, "--token-proj"),
    ({"proj": "svd:8"}, "--token-proj"),
    ({"proj": "pca:0"}, "--token-proj"),
])
def test_bad_options_are_refused_in_one_line(kw, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        TokenStorage.parse(**kw)
    assert "\n" not in str(e.value)


def test_encoder_checks_and_record() -> None:
    s = TokenStorage.parse(grid=14, proj="pca:128", int8=True)
    assert TokenStorage.from_dict(s.to_dict()) == s
    assert s.describe() == "grid 14x14, pca:128, int8"
    assert TokenStorage.parse(proj="none").identity and TokenStorage().describe() == "full tokens"
    s.check_encoder(1, (37, 37), 768, "enc")
    with pytest.raises(ConfigError, match="larger than"):
        s.check_encoder(1, (7, 7), 768, "enc")
    with pytest.raises(ConfigError, match="more dimensions"):
        TokenStorage.parse(proj="pca:1024").check_encoder(1, (37, 37), 768, "enc")
    with pytest.raises(ConfigError, match="known token grid"):
        TokenStorage.parse(grid=7).check_encoder(0, None, 768, "enc")


def test_moments_accumulated_in_batches_give_the_pca_of_the_whole_sample() -> None:
    from spar_bench.probes.token_storage import Moments

    g = torch.Generator().manual_seed(3)
    t = torch.randn(10, 5, 6, generator=g) * torch.tensor([4.0, 3, 2, 1, 0.5, 0.1]) + 1.0
    m = Moments()
    for chunk in t.split(3):
        m.update(chunk)
    p = m.pca(2)
    mean, comps = pca_projection(t.reshape(-1, 6).numpy(), 2)
    np.testing.assert_allclose(p.mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p.components, comps, rtol=1e-4, atol=1e-5)
    assert m.n == 50
    with pytest.raises(ConfigError, match="training images"):
        Moments().pca(2)


# -- in the feature cache: spar-probe cache --token-grid / --token-proj / --token-int8 ----------
EXACT = dict(dtype="fp32", compute="fp32", batch_size=4, device="cpu")


@pytest.fixture(scope="module")
def reduced(pipeline, tmp_path_factory):
    """Full-token and reduced (grid 3, pca:8, int8) dummy caches of the shared build's Level 3."""
    from spar_bench.probes.cache import CacheOptions, write_cache

    out = tmp_path_factory.mktemp("storage")
    storage = TokenStorage.parse(grid=3, proj="pca:8", int8=True)
    full = write_cache("dummy", pipeline["shards"], out / "full.h5", CacheOptions(levels=["level3"], **EXACT),
                       progress=False)
    small = write_cache("dummy", pipeline["shards"], out / "small.h5",
                        CacheOptions(levels=["level3"], token_storage=storage, **EXACT), progress=False)
    return full, small


def test_reduced_cache_shapes_record_and_values(reduced) -> None:
    import h5py

    from spar_bench.probes.features import FeatureCache

    full, small = reduced
    with h5py.File(small, "r") as f:
        g = f["level3/test/layer-1"]
        assert g["tokens"].dtype == np.int8 and g["tokens"].shape[1:] == (1 + 9, 8)
        assert g["token_scale"].shape == (g["tokens"].shape[0], 8)
        assert g["pooled"].shape[1:] == (16,)  # pooled vectors are never reduced
        assert f["token_projection/layer-1"].attrs["fitted_on"] == "train"
        mean, comps = f["token_projection/layer-1/mean"][()], f["token_projection/layer-1/components"][()]
    with FeatureCache(full) as a, FeatureCache(small) as b:
        assert b.token_storage == {"grid": 3, "proj": "pca:8", "int8": True}
        assert b.levels() == a.levels() == ["level3"]  # token_projection is not a level
        assert a.token_storage == {"grid": None, "proj": None, "int8": False}
        assert b.meta["cache_args"]["token_storage"] == b.token_storage
        assert "token_storage" not in a.meta["cache_args"]  # full-token caches keep their arguments
        for split in ("train", "test"):
            np.testing.assert_array_equal(a.pooled("level3", split), b.pooled("level3", split))
            expect = Projection(mean, comps).apply(pool_grid(torch.from_numpy(a.tokens("level3", split)), 1, (7, 7), 3))
            got = b.tokens("level3", split, rows=np.arange(5))
            assert got.dtype == np.float32 and got.shape == (5, 10, 8)
            step = np.abs(expect[:5].numpy()).max(axis=1, keepdims=True) / 127
            assert (np.abs(got - expect[:5].numpy()) <= step / 2 + 1e-5).all()


def test_pca_is_fitted_on_the_training_split_only(pipeline, reduced, tmp_path) -> None:
    """The projection of a cache of every split equals that of a cache of the train split alone."""
    import h5py

    from spar_bench.probes.cache import CacheOptions, write_cache

    only = write_cache("dummy", pipeline["shards"], tmp_path / "train.h5",
                       CacheOptions(levels=["level3"], splits=["train"],
                                    token_storage=TokenStorage.parse(grid=3, proj="pca:8", int8=True), **EXACT),
                       progress=False)
    with h5py.File(reduced[1], "r") as a, h5py.File(only, "r") as b:
        for name in ("mean", "components"):
            assert a[f"token_projection/layer-1/{name}"][()].tobytes() == b[f"token_projection/layer-1/{name}"][()].tobytes()
        assert a["level3/train/layer-1/tokens"][()].tobytes() == b["level3/train/layer-1/tokens"][()].tobytes()


@pytest.mark.slow
def test_reduced_cache_is_deterministic_and_fits_end_to_end(pipeline, reduced, tmp_path) -> None:
    import hashlib

    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    again = write_cache("dummy", pipeline["shards"], tmp_path / "again.h5",
                        CacheOptions(levels=["level3"],
                                     token_storage=TokenStorage.parse(grid=3, proj="pca:8", int8=True), **EXACT),
                        progress=False)
    sha = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (reduced[1], again)]
    assert sha[0] == sha[1]
    runs = tmp_path / "runs"
    assert run_cmd(cli, ["fit", "--features", reduced[1], "--data", pipeline["shards"], "--head", "transformer",
                         "--probe", "level3.size", "--seeds", "0", "--max-epochs", "1", "--out", runs]) == 0
    assert list(runs.rglob("metrics.json"))


def test_random_projection_cache_and_cli_errors(pipeline, tmp_path, capsys) -> None:
    from spar_bench.probes.cli import cli
    from spar_bench.probes.features import FeatureCache

    from helpers import run_cmd

    out = tmp_path / "rnd.h5"
    assert run_cmd(cli, ["cache", "--encoder", "dummy", "--data", pipeline["shards"], "--out", out,
                         "--levels", "level3", "--token-proj", "random:4", "--device", "cpu"]) == 0
    with FeatureCache(out) as c:
        assert c.tokens("level3", "val", rows=[0]).shape == (1, 50, 4)
        assert c.token_storage["proj"] == "random:4"
    capsys.readouterr()
    for bad, words in ((["--token-proj", "svd:3"], "--token-proj"), (["--token-grid", "9"], "larger than")):
        assert run_cmd(cli, ["cache", "--encoder", "dummy", "--data", pipeline["shards"], "--out",
                             tmp_path / "bad.h5", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "bad.h5").exists()


def test_runs_over_reduced_tokens_get_their_own_encoder_folder(reduced) -> None:
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.runs.inputs import encoder_slug

    assert TokenStorage.parse(grid=14, proj="pca:128", int8=True).slug() == "-tokens-grid14-pca128-int8"
    with FeatureCache(reduced[0]) as full, FeatureCache(reduced[1]) as small:
        assert encoder_slug(full) == "dummy-random-init"
        assert encoder_slug(small) == "dummy-tokens-grid3-pca8-int8-random-init"


def test_a_projection_under_torchrun_is_refused_in_one_line(pipeline, tmp_path, monkeypatch) -> None:
    from spar_bench.probes.cache import CacheOptions, write_cache

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="--token-proj is not supported under torchrun"):
        write_cache("dummy", pipeline["shards"], tmp_path / "c.h5",
                    CacheOptions(levels=["level3"], token_storage=TokenStorage.parse(proj="random:4"), **EXACT),
                    progress=False)
    assert not list(tmp_path.iterdir())
