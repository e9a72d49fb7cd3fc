"""slice_stats (blocks of slices, labelled voxels only) equals a plain per-slice count."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.builder.case import Case
from spar_bench.builder.samples import frame224
from spar_bench.errors import CaseError


def _reference(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z_n, h, w = mask.shape
    area = np.zeros((z_n, 17), np.int64)
    cent = np.full((z_n, 17, 2), np.nan)
    for z in range(z_n):
        for lab in range(17):
            rr, cc = np.nonzero(mask[z] == lab)
            area[z, lab] = len(rr)
            if len(rr) and (lab or mask[z].any()):
                cent[z, lab] = (rr.sum() / len(rr), cc.sum() / len(rr))
            elif len(rr):  # background of an empty slice: centroid 0 (as always recorded)
                cent[z, lab] = (0.0, 0.0)
    return area, cent


@pytest.mark.parametrize("block", [1, 3, 16])
def test_slice_stats_equals_per_slice_reference(monkeypatch, block):
    monkeypatch.setattr(frame224, "STATS_BLOCK", block)
    rng = np.random.default_rng(block)
    for _ in range(5):
        z, h, w = (int(v) for v in rng.integers(1, 30, 3))
        mask = rng.integers(0, 17, (z, h, w)).astype(np.uint8)
        mask[rng.random(mask.shape) < rng.random()] = 0
        mask[::3] = 0
        stats = frame224.slice_stats(Case("x", "c", "test", mask, (1.0, 1.0, 1.0)))
        area, cent = _reference(mask)
        np.testing.assert_array_equal(stats.area_px, area)
        np.testing.assert_array_equal(stats.centroid_rc, cent)


def test_slice_stats_names_the_slice_of_a_bad_label():
    mask = np.zeros((4, 5, 5), np.uint8)
    mask[2, 1, 1] = 40
    with pytest.raises(CaseError, match="label id 40 on slice z=2"):
        frame224.slice_stats(Case("x", "c", "test", mask, (1.0, 1.0, 1.0)))


def test_slice_stats_of_a_flipped_view_equals_its_copy():
    """Canonical arrays are views of the file's voxels (flipped axes): same statistics."""
    rng = np.random.default_rng(7)
    stored = rng.integers(0, 17, (9, 23, 31)).astype(np.uint8)
    stored[rng.random(stored.shape) < 0.7] = 0
    view = stored[:, ::-1, ::-1]
    a = frame224.slice_stats(Case("x", "c", "test", view, (1.0, 1.0, 1.0)))
    b = frame224.slice_stats(Case("x", "c", "test", np.ascontiguousarray(view), (1.0, 1.0, 1.0)))
    np.testing.assert_array_equal(a.area_px, b.area_px)
    np.testing.assert_array_equal(a.centroid_rc, b.centroid_rc)
