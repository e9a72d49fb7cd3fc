"""Token storage reductions for many-token encoders: exact shapes, values, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.token_storage import (
    Projection,
    TokenStorage,
    dequantise_int8,
    pca_projection,
    pool_grid,
    quantise_int8,
    random_projection,
    reduce_tokens,
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


def test_reduce_tokens_applies_grid_then_projection_then_int8() -> None:
    t = _tokens(b=2, prefix=1, h=6, w=6, d=8)
    mean, comps = random_projection(8, 3, 0)
    out = reduce_tokens(TokenStorage(grid=2, proj="random:3", int8=True), t, 1, (6, 6), Projection(mean, comps))
    assert out["tokens"].shape == (2, 1 + 4, 3) and out["tokens"].dtype == torch.int8
    assert out["token_scale"].shape == (2, 3)
    plain = reduce_tokens(TokenStorage(), t, 1, (6, 6), None)
    assert set(plain) == {"tokens"} and torch.equal(plain["tokens"], t)


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
