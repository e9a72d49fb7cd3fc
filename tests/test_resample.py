"""The numpy resampling equals torch's grid_sample / antialiased interpolate bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.builder.samples.resample import fma32, resize_aa, sample_bilinear, sample_nearest


def _torch_fma_kernels():
    """torch, if its CPU kernels are the vectorised x86-64 ones the builder reproduces."""
    torch = pytest.importorskip("torch")
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        pytest.skip(f"torch runs its {cap} CPU kernels here (no FMA); the reference is AVX2/AVX-512")
    return torch


def test_fma32_is_correctly_rounded():
    from fractions import Fraction

    rng = np.random.default_rng(0)
    n = 3000
    a = ((rng.random(n) * 2 - 1) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.random(n) * 2.0 ** rng.integers(-30, 5, n)).astype(np.float32)
    c = ((rng.random(n) * 2 - 1) * 2.0 ** rng.integers(-40, 30, n)).astype(np.float32)
    got = fma32(a, b, c)
    for i in range(n):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        x = np.float32(float(exact))
        near = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
        best = min(near, key=lambda v: (abs(Fraction(float(v)) - exact),
                                        int(np.array(v).view(np.int32)) & 1))
        assert got[i] == best, (a[i], b[i], c[i])


@pytest.mark.parametrize("dtype,fill", [(np.int16, -1000.0), (np.uint8, 0.0), (np.float32, 3.5)])
def test_grid_sampling_equals_torch(dtype, fill):
    torch = _torch_fma_kernels()
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    for _ in range(6):
        h, w = (int(v) for v in rng.integers(5, 160, 2))
        vol = rng.integers(-1024, 2000, (5, h, w)) if dtype == np.int16 else rng.integers(0, 17, (5, h, w))
        vol = vol.astype(dtype) if dtype != np.float32 else (vol * rng.random(vol.shape)).astype(dtype)
        gx = (np.linspace(-1.3, 1.1, 64) * rng.uniform(0.5, 1.5)).astype(np.float32)
        gy = (np.linspace(-1.05, 1.2, 64) * rng.uniform(0.5, 1.5)).astype(np.float32)
        grid = torch.from_numpy(np.stack(np.meshgrid(gx, gy, indexing="xy"), axis=-1))[None]
        zs = np.array([0, 2, 3])
        src = torch.from_numpy(vol[zs].astype(np.float32) - np.float32(fill))[:, None]
        for mode, ours in (("bilinear", sample_bilinear), ("nearest", sample_nearest)):
            ref = F.grid_sample(src, grid.expand(3, -1, -1, -1), mode=mode, padding_mode="zeros",
                                align_corners=False)[:, 0].numpy() + np.float32(fill)
            got = ours(vol, zs, gy, gx, fill)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, ref)


def test_antialiased_resize_equals_torch():
    torch = _torch_fma_kernels()
    F = torch.nn.functional
    rng = np.random.default_rng(2)
    shapes = [(1, 1), (1, 40), (40, 1), (60, 1), (3, 200), (224, 224), (224, 9), (7, 5)]
    shapes += [tuple(int(v) for v in rng.integers(1, 225, 2)) for _ in range(60)]
    for h, w in shapes:
        img = rng.integers(0, 256, (h, w)).astype(np.uint8)
        img[rng.random((h, w)) < 0.3] = 0
        scale = 56 / max(h, w)
        nh, nw = max(1, min(56, round(h * scale))), max(1, min(56, round(w * scale)))
        t = torch.from_numpy(img.astype(np.float32))[None, None]
        ref = F.interpolate(t, size=(nh, nw), mode="bilinear", align_corners=False,
                            antialias=True)[0, 0].numpy()
        np.testing.assert_array_equal(resize_aa(img, nh, nw), ref, err_msg=f"{(h, w)} -> {(nh, nw)}")
        fl = (img * rng.random((h, w))).astype(np.float32)
        ref = F.interpolate(torch.from_numpy(fl)[None, None], size=(nh, nw), mode="bilinear",
                            align_corners=False, antialias=True)[0, 0].numpy()
        np.testing.assert_array_equal(resize_aa(fl, nh, nw), ref, err_msg=f"float {(h, w)}")
