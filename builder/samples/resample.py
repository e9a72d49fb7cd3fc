"""Resampling in numpy, with the float32 arithmetic of torch's CPU kernels (no torch import).

The builder used ``torch.nn.functional.grid_sample`` (the 224 frame) and
``torch.nn.functional.interpolate(..., antialias=True)`` (Level 1-2 tiles). Importing
torch cost about 4 s in every worker process, for these two calls only. This module
computes the same float32 numbers with numpy, operation for operation, so that shards
keep their bytes:

* torch's x86-64 kernels (AVX2 and AVX-512 builds) contract ``a * b + c`` into one
  fused multiply-add (one rounding) in the places listed below. :func:`fma32` is an
  exact float32 FMA: the product of two float32 values is exact in float64, and the
  float64 sum is rounded to odd (a TwoSum error term decides the last bit) before the
  one rounding to float32, which makes the double rounding exact.
* grid sampling (``align_corners=False``, zeros padding): coordinate
  ``x = fma(g + 1, size / 2, -0.5)``; ``x0 = floor(x)``, ``w = x - x0``, ``e = 1 - w``
  (rows: ``n``, ``s``); corner weights ``nw = s * e``, ``ne = s * w``, ``sw = n * e``,
  ``se = n * w``; value ``fma(v_se, se, fma(v_sw, sw, fma(v_ne, ne, v_nw * nw)))`` with
  out-of-volume corners read as 0. Nearest: ``round-half-even(x)``.
* antialiased bilinear resize: separable, width first, then height (an axis of
  unchanged size is skipped); per output the triangle-filter weights of
  ``_compute_indices_min_size_weights_aa`` (float32, with its float/double promotions);
  accumulation ``acc = v0 * w0`` then, for taps ``j = 1 .. k-1``, the first
  ``4 * ((k - 1) // 4)`` as ``acc + round(v_j * w_j)`` and the rest as
  ``fma(v_j, w_j, acc)`` (torch's loop is vectorised by 4). torch's height pass on a
  ONE-column image gives every output row the value of the first (its zero-stride
  path reads the taps of output 0); this is reproduced, so that bytes do not change.

``tests/test_resample.py`` checks equality with torch on random inputs wherever torch
runs an AVX2 or AVX-512 kernel. torch's non-vectorised build (``DEFAULT``) rounds
differently (no FMA), so shards built there with torch differed from x86-64 builds;
with this module the bytes no longer depend on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

F32, F64 = np.float32, np.float64
#: Weights at or above this (and values that are integers below 2**16) keep every float64
#: partial sum exact, so the fast float64 path rounds once; smaller weights take fma32.
_EXACT_WEIGHT = 2.0**-11


def fma32(a, b, c) -> np.ndarray:
    """Exact float32 fused multiply-add ``round32(a * b + c)`` of float32 arrays."""
    p = np.multiply(a, b, dtype=F64)  # exact: 24 + 24 bits
    c64 = np.asarray(c, dtype=F64)
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)  # TwoSum: s + err == p + c exactly
    fix = (err != 0) & ((s.view(np.int64) & 1) == 0)
    if fix.any():  # round to odd, so that the rounding to float32 below is correct
        s[fix] = np.nextafter(s[fix], np.copysign(np.inf, err[fix]))
    return s.astype(F32)


def _fma32_fast(a, b, c) -> np.ndarray:
    """``fma32`` where ``a * b + c`` is known to be exact in float64 (one rounding)."""
    acc = np.multiply(a, b, dtype=F64)
    acc += c
    return acc.astype(F32)


# -- grid sampling of the 224 frame ----------------------------------------------------
@dataclass(frozen=True)
class AxisSamples:
    """Sampling positions of one output axis (float32 arithmetic of the grid sampler)."""

    lo: np.ndarray  # floor index (int64)
    frac: np.ndarray  # x - floor(x), float32
    rest: np.ndarray  # 1 - frac, float32
    nearest: np.ndarray  # round-half-even index (int64)

    @classmethod
    def from_grid(cls, g: np.ndarray, size: int) -> AxisSamples:
        g = np.asarray(g, dtype=F32)
        x = fma32(g + F32(1), F32(size / 2), F32(-0.5))
        x0 = np.floor(x)
        frac = x - x0
        return cls(lo=x0.astype(np.int64), frac=frac, rest=F32(1) - frac,
                   nearest=np.rint(x).astype(np.int64))


def _gather(volume: np.ndarray, zs: np.ndarray, rows: np.ndarray, cols: np.ndarray,
            fill: float) -> np.ndarray:
    """float32 ``volume[zs][:, rows][:, :, cols] - fill``; 0 where a row or col is outside."""
    h, w = volume.shape[1:]
    r_ok, c_ok = (rows >= 0) & (rows < h), (cols >= 0) & (cols < w)
    r, c = np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)
    # slices by indexing (np.take would first copy a non-contiguous volume whole), then take
    sub = np.take(np.take(volume[np.asarray(zs)], r, axis=1), c, axis=2)
    vals = np.subtract(sub, F32(fill), dtype=F32)  # exact: integers, or float32 as before
    if not (r_ok.all() and c_ok.all()):
        vals *= (r_ok[:, None] & c_ok[None, :])  # out-of-volume corners read as 0
    return vals


def sample_nearest(volume: np.ndarray, zs: np.ndarray, gy: np.ndarray, gx: np.ndarray,
                   fill: float) -> np.ndarray:
    """``grid_sample(mode="nearest")`` of slices ``zs`` on the separable grid ``(gy, gx)``."""
    ys = AxisSamples.from_grid(gy, volume.shape[1])
    xs = AxisSamples.from_grid(gx, volume.shape[2])
    return _gather(volume, zs, ys.nearest, xs.nearest, fill) + F32(fill)


def _exact_inputs(volume: np.ndarray, fill: float) -> bool:
    """Integer values below 2**16 after subtracting ``fill`` (the fast path's condition)."""
    return volume.dtype in (np.uint8, np.int8, np.int16) and abs(fill) < 2**15


def sample_bilinear(volume: np.ndarray, zs: np.ndarray, gy: np.ndarray, gx: np.ndarray,
                    fill: float) -> np.ndarray:
    """``grid_sample(mode="bilinear", padding_mode="zeros")`` of slices ``zs`` (+ ``fill``)."""
    ys = AxisSamples.from_grid(gy, volume.shape[1])
    xs = AxisSamples.from_grid(gx, volume.shape[2])
    weights = (ys.rest[:, None] * xs.rest[None, :], ys.rest[:, None] * xs.frac[None, :],
               ys.frac[:, None] * xs.rest[None, :], ys.frac[:, None] * xs.frac[None, :])
    n_r, n_c = len(ys.lo), len(xs.lo)
    both = _gather(volume, zs, np.concatenate([ys.lo, ys.lo + 1]),
                   np.concatenate([xs.lo, xs.lo + 1]), fill)  # one gather for the 4 corners
    vals = [both[:, :n_r, :n_c], both[:, :n_r, n_c:], both[:, n_r:, :n_c], both[:, n_r:, n_c:]]
    acc = vals[0] * weights[0]
    if _exact_inputs(volume, fill):
        tiny = np.zeros(weights[0].shape, dtype=bool)
        for wt in weights:
            tiny |= (wt > 0) & (wt < _EXACT_WEIGHT)
        exact_acc = acc[:, tiny]
        for v, wt in zip(vals[1:], weights[1:], strict=True):
            acc = _fma32_fast(v, wt, acc)
            exact_acc = fma32(v[:, tiny], wt[tiny], exact_acc)
        acc[:, tiny] = exact_acc
    else:
        for v, wt in zip(vals[1:], weights[1:], strict=True):
            acc = fma32(v, wt, acc)
    return acc + F32(fill)


# -- antialiased bilinear resize (Level 1-2 tiles) -------------------------------------
@dataclass(frozen=True)
class AaAxis:
    """Taps of one axis: first input index, tap count and float32 weights per output."""

    start: np.ndarray  # (n_out,) int64
    taps: np.ndarray  # (n_out,) int64
    weights: np.ndarray  # (n_out, max_taps) float32, 0 beyond taps


@lru_cache(maxsize=4096)
def aa_axis(n_in: int, n_out: int) -> AaAxis:
    """Triangle-filter taps of torch's antialiased bilinear resize from ``n_in`` to ``n_out``."""
    scale = F32(n_in) / F32(n_out)
    up = scale < 1.0
    support = F32(1.0) if up else F32(1.0 * float(scale))
    max_taps = int(np.ceil(support)) * 2 + 1
    invscale = F32(1.0) if up else F32(1.0 / float(scale))
    start = np.zeros(n_out, np.int64)
    taps = np.zeros(n_out, np.int64)
    weights = np.zeros((n_out, max_taps), F32)
    for i in range(n_out):
        center = F32(float(scale) * (i + 0.5))
        lo = max(int(float(F32(center - support)) + 0.5), 0)
        k = min(int(float(F32(center + support)) + 0.5), n_in) - lo
        k = min(max(k, 0), max_taps)
        total = F32(0)
        for j in range(k):
            t = abs(F32((float(F32(F32(j + lo) - center)) + 0.5) * float(invscale)))
            wj = F32(1) - t if t < 1 else F32(0)
            weights[i, j] = wj
            total = F32(total + wj)
        if total != 0:
            weights[i, :k] = weights[i, :k] / total
        start[i], taps[i] = lo, k
    return AaAxis(start, taps, weights)


def _aa_pass(img: np.ndarray, n_out: int, small_ints: bool) -> np.ndarray:
    """Resize axis 0 of a float32 2-D array (the accumulation order of the module doc).

    ``small_ints``: the values are integers in 0..255 (then float64 sums are exact
    unless a weight is tiny, and one float64 rounding is the FMA).
    """
    ax = aa_axis(img.shape[0], n_out)
    n_in = img.shape[0]
    idx = np.minimum(ax.start[:, None] + np.arange(ax.weights.shape[1]), n_in - 1)
    vals = img[idx]  # (n_out, max_taps, cols); taps beyond k have weight 0
    acc = vals[:, 0] * ax.weights[:, :1]
    n_unfused = 4 * ((ax.taps - 1) // 4)
    tiny = bool(((ax.weights > 0) & (ax.weights < _EXACT_WEIGHT)).any())
    fused = _fma32_fast if small_ints and not tiny else fma32
    for j in range(1, ax.weights.shape[1]):
        wj = ax.weights[:, j : j + 1]
        v = vals[:, j]
        use_fma = j > n_unfused
        if use_fma.all():  # only the branch that is used when all outputs take the same one
            acc = fused(v, wj, acc)
        elif not use_fma.any():
            acc = acc + v * wj
        else:
            acc = np.where(use_fma[:, None], fused(v, wj, acc), acc + v * wj)
    return acc


def resize_aa(img: np.ndarray, nh: int, nw: int) -> np.ndarray:
    """``interpolate(bilinear, align_corners=False, antialias=True)`` of a 2-D image, float32.

    ``img`` is uint8 (a windowed tile crop) or float32.
    """
    arr = np.asarray(img)
    small_ints = arr.dtype == np.uint8
    out = arr.astype(F32)
    if nw != out.shape[1]:
        out = _aa_pass(out.T, nw, small_ints).T
        small_ints = False
    if nh != out.shape[0]:
        if out.shape[1] == 1:  # torch's zero-stride path: every row takes output 0's taps
            out = np.repeat(_aa_pass(out, nh, small_ints)[:1], nh, axis=0)
        else:
            out = _aa_pass(out, nh, small_ints)
    return np.ascontiguousarray(out)
