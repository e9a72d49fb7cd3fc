"""Metrics, Sinkhorn, Hungarian decoding and the patient bootstrap against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.probes import metrics as M
from spar_bench.probes.bootstrap import bootstrap_ci, group_indices
from spar_bench.probes.sinkhorn import hungarian_decode


def test_level1_med_sdr_hand_computed_and_absent_excluded():
    true = np.full((2, 16, 2), 0.5, np.float32)
    pred = true.copy()
    pred[0, 0] = (0.5 + 3 / 224, 0.5 + 4 / 224)  # 5 px
    pred[0, 1] = (0.5 + 12 / 224, 0.5)  # 12 px
    pred[1, 2] = (0.0, 0.0)  # absent below: must not count
    present = np.ones((2, 16), bool)
    present[1, 2] = False
    mm = np.array([2.0, 1.0], np.float32)
    m = M.level1_metrics(pred, true, present, mm)
    n = 31
    assert m["n"] == n
    assert m["med_px"] == pytest.approx((5 + 12) / n, rel=1e-5)
    assert m["med_mm"] == pytest.approx((10 + 24) / n, rel=1e-5)
    assert m["sdr10"] == pytest.approx((n - 1) / n)
    assert m["per_organ"]["liver"]["med_px"] == pytest.approx(2.5, rel=1e-5)
    assert m["per_organ"]["spleen"]["sdr10"] == pytest.approx(0.5)
    assert m["per_organ"]["kidney_left"]["n"] == 1
    assert m["per_organ"]["kidney_left"]["med_px"] == pytest.approx(0.0)


def test_atlas_is_mean_training_centroid_over_present():
    c = np.zeros((2, 16, 2), np.float32)
    c[0, 0] = (0.2, 0.4)
    c[1, 0] = (0.4, 0.8)
    c[1, 1] = (0.9, 0.9)
    present = np.zeros((2, 16), bool)
    present[:, 0] = True
    present[1, 1] = True
    a = M.atlas_predictions(c, present, 3)
    assert a.shape == (3, 16, 2)
    np.testing.assert_allclose(a[2, 0], (0.3, 0.6), rtol=1e-6)
    np.testing.assert_allclose(a[0, 1], (0.9, 0.9), rtol=1e-6)
    np.testing.assert_allclose(a[0, 5], (0.5, 0.5))  # never present: image centre


def test_kendall_tau_hand_computed():
    assert M.kendall_tau([0, 1, 2, 3], [0, 1, 2, 3]) == 1.0
    assert M.kendall_tau([0, 1, 2, 3], [3, 2, 1, 0]) == -1.0
    # one swapped adjacent pair out of 6 pairs: (5 - 1) / 6
    assert M.kendall_tau([0, 1, 2, 3], [1, 0, 2, 3]) == pytest.approx(4 / 6)
    assert np.isnan(M.kendall_tau([0], [0]))


def test_level2_permutation_accuracy_tile_accuracy_absent_excluded():
    target = np.full((3, 16), -1)
    present = np.zeros((3, 16), bool)
    present[:, :4] = True
    target[:, :4] = [0, 1, 2, 3]
    pred = target.copy()
    pred[1, :4] = [1, 0, 2, 3]  # two tiles wrong
    pred[2, 10] = 5  # absent position: ignored
    m = M.level2_metrics(pred, target, present)
    assert m["perm_acc"] == pytest.approx(2 / 3)
    assert m["tile_acc"] == pytest.approx(10 / 12)
    assert m["kendall_tau"] == pytest.approx((1 + 4 / 6 + 1) / 3)


def test_macro_f1_and_majority():
    y = np.array([0, 0, 0, 1, 1, 2])
    p = np.array([0, 0, 1, 1, 1, 0])
    # class0 tp2 fp1 fn1 -> 2/3 ; class1 tp2 fp1 fn0 -> 0.8 ; class2 tp0 fn1 -> 0
    assert M.macro_f1(y, p, 3) == pytest.approx((2 / 3 + 0.8 + 0) / 3)
    m = M.level3_metrics(y, p, 3, y_train=np.array([2, 2, 1]))
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["chance"] == pytest.approx(1 / 3)
    assert m["majority_class"] == 2
    assert m["majority"] == pytest.approx(1 / 6)  # train majority's rate on the test labels


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="pred"):
        M.level1_metrics(np.zeros((2, 16, 2)), np.zeros((3, 16, 2)), np.ones((3, 16), bool), np.ones(3))


def test_hungarian_decode_over_present_tiles_only():
    scores = np.zeros((1, 16, 16))
    present = np.zeros((1, 16), bool)
    present[0, [2, 5, 9]] = True
    # greedy would give both 2 and 5 slot 0; the optimum is 2->1, 5->0, 9->2
    scores[0, 2, 0], scores[0, 2, 1] = 5.0, 4.9
    scores[0, 5, 0], scores[0, 5, 1] = 5.0, 0.0
    scores[0, 9, 15] = 100.0  # slot 15 is not valid with 3 present tiles
    out = hungarian_decode(scores, present)
    assert out[0, 2] == 1 and out[0, 5] == 0 and out[0, 9] == 2
    assert (out[0, ~present[0]] == -1).all()


def test_sinkhorn_rows_and_columns_sum_to_one_within_masks():
    import torch

    from spar_bench.probes.sinkhorn import log_sinkhorn, slot_mask

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 16, 16, generator=g)
    present = torch.zeros(4, 16, dtype=torch.bool)
    present[0] = True
    present[1, [0, 3, 7]] = True
    present[2, :10] = True
    present[3, 15] = True
    cols = slot_mask(present)
    p = log_sinkhorn(scores, present, cols, n_iters=50).exp()
    for b in range(4):
        r, c = present[b], cols[b]
        torch.testing.assert_close(p[b][r][:, c].sum(1), torch.ones(int(r.sum())), atol=1e-3, rtol=0)
        torch.testing.assert_close(p[b][r][:, c].sum(0), torch.ones(int(c.sum())), atol=1e-3, rtol=0)
        assert float(p[b][~r].sum()) < 1e-6 and float(p[b][:, ~c].sum()) < 1e-6
    assert torch.isfinite(p).all()


def test_group_indices_and_bootstrap_is_seeded():
    parts = group_indices(np.array(["b", "a", "b", "c"]))
    assert [p.tolist() for p in parts] == [[1], [0, 2], [3]]
    x = np.arange(20, dtype=float)
    groups = np.repeat(np.arange(5), 4)
    a = bootstrap_ci(lambda i: x[i].mean(), groups, np.random.default_rng(3), 200)
    b = bootstrap_ci(lambda i: x[i].mean(), groups, np.random.default_rng(3), 200)
    assert a == b and a[0] < x.mean() < a[1]


def test_patient_bootstrap_wider_than_slice_bootstrap():
    """Slices of a patient are correlated: resampling slices understates the uncertainty."""
    rng = np.random.default_rng(0)
    n_pat, per = 10, 30
    patient_effect = rng.normal(0, 1, n_pat)
    values = np.repeat(patient_effect, per) + rng.normal(0, 0.1, n_pat * per)
    patients = np.repeat([f"p{i}" for i in range(n_pat)], per)
    lo_p, hi_p = bootstrap_ci(lambda i: values[i].mean(), patients, np.random.default_rng(1), 500)
    slices = np.arange(values.size).astype(str)
    lo_s, hi_s = bootstrap_ci(lambda i: values[i].mean(), slices, np.random.default_rng(1), 500)
    assert (hi_p - lo_p) > 2 * (hi_s - lo_s)


def test_level3_ci_present_with_groups():
    y = np.array([0, 1, 0, 1, 1, 0])
    m = M.level3_metrics(y, y, 2, groups=np.array(list("aabbcc")), rng=np.random.default_rng(0), n_reps=50)
    assert m["ci"]["accuracy"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="Generator"):
        M.level3_metrics(y, y, 2, groups=np.array(list("aabbcc")))
