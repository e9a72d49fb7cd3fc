"""Samples of real WORD label maps, checked against a separate, simple recomputation.

The WORD masks are read with nibabel here (axis codes L,P,S = canonical voxel
orientation: [z,row,col] = array transposed (2,1,0)). They have no CT, so the image is a
flat 0 HU body with organ-specific values: the body, hence the field of view, is the
whole volume.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy import ndimage

from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, process_case
from spar_bench.builder.schema import BILATERAL_PAIRS, LEVEL3_PROBES, ORGAN_ID, organ_index

from helpers import assert_mirror_consistent

CASES = ("word_0016", "word_0129")  # 0.72 mm pixels; uint16 label map
CFG = SampleConfig(samples_per_case=4, counterfactual="mirror")


def load_word(root, case_id: str) -> Case:
    import nibabel as nib

    img = nib.load(root / "labelsTs" / f"{case_id}.nii.gz")
    assert nib.aff2axcodes(img.affine) == ("L", "P", "S")
    mask = np.ascontiguousarray(np.asarray(img.dataobj).transpose(2, 1, 0))
    spacing = tuple(float(s) for s in img.header.get_zooms()[::-1])
    image = np.where(mask > 0, 40 + mask.astype(np.int16), 0).astype(np.int16)
    return Case("word", case_id, "test", mask, spacing, image=image)


@pytest.fixture(scope="module")
def real(word_labels_dir):
    out = {}
    for cid in CASES:
        case = load_word(word_labels_dir, cid)
        t0 = time.perf_counter()
        out[cid] = (case, process_case(case, CFG, 2024))
        print(f"\n{cid}: process_case with mirror {time.perf_counter() - t0:.2f} s")
    return out


def frame_by_hand(case: Case, margin: float = 10.0) -> tuple[float, float, float]:
    """(origin_row_mm, origin_col_mm, mm_per_pixel) when the body is the whole volume."""
    _, h, w = case.mask.shape
    sr, sc = case.spacing[1], case.spacing[2]
    ext_r, ext_c = h * sr + 2 * margin, w * sc + 2 * margin
    side = max(ext_r, ext_c)
    mid_r, mid_c = (h - 1) * sr / 2, (w - 1) * sc / 2
    return mid_r - side / 2, mid_c - side / 2, side / 224


def native_measures(case: Case, z: int, organ: int):
    """(row_mm, col_mm, area_mm2) of organ index ``organ`` on slice z, via scipy."""
    sl = case.mask[z] == organ + 1
    r, c = ndimage.center_of_mass(sl)
    return r * case.spacing[1], c * case.spacing[2], sl.sum() * case.spacing[1] * case.spacing[2]


@pytest.mark.slow
def test_level3_answers_match_independent_recomputation(real):
    n_checked = {p: 0 for p in LEVEL3_PROBES}
    for case, out in real.values():
        s, q = out["level3"], out["level3_questions"]
        originals = np.flatnonzero(~s["is_mirror"][q["q_slice"]])
        for i in originals[:: max(1, len(originals) // 150)]:
            z = int(s["slice_index"][q["q_slice"][i]])
            probe = LEVEL3_PROBES[q["q_probe"][i]]
            a, b = int(q["q_organ_a"][i]), int(q["q_organ_b"][i])
            ra, ca, area_a = native_measures(case, z, a)
            if b >= 0:
                rb, cb, area_b = native_measures(case, z, b)
            ans = int(q["q_answer"][i])
            if probe == "relative_position":
                assert ans == (int(ca > cb) if q["q_axis"][i] == 0 else int(ra < rb))
            elif probe == "orientation":
                ang = math.degrees(math.atan2(ra - rb, cb - ca))
                assert ans == round(ang / 45) % 8
            elif probe == "symmetry":
                assert ca > cb  # A is the member on the patient's left
                d = (area_a - area_b) / ((area_a + area_b) / 2)
                assert ans == (0 if d > 0.15 else 2 if d < -0.15 else 1)
            elif probe == "size":
                assert q["q_area_a_mm2"][i] == pytest.approx(area_a, rel=1e-5)
            elif probe == "distance":
                assert q["q_distance_mm"][i] == pytest.approx(
                    math.hypot(ra - rb, ca - cb), rel=1e-4
                )
            n_checked[probe] += 1
    assert all(n_checked[p] > 0 for p in LEVEL3_PROBES if p != "counting"), n_checked


def test_level1_centroids_match_center_of_mass_in_224_frame(real):
    for case, out in real.values():
        l1 = out["level1"]
        r0, c0, mpp = frame_by_hand(case)
        originals = np.flatnonzero(~l1["is_mirror"])
        assert l1["mm_per_pixel"][0] == pytest.approx(mpp, rel=1e-6)
        for i in originals:
            for o in np.flatnonzero(l1["present"][i]):
                r_mm, c_mm, _ = native_measures(case, int(l1["slice_index"][i, o]), int(o))
                x, y = (c_mm - c0) / mpp - 0.5, (r_mm - r0) / mpp - 0.5
                assert abs(l1["centroid"][i, o, 0] * 224 - x) < 0.5
                assert abs(l1["centroid"][i, o, 1] * 224 - y) < 0.5


def test_level3_centroids_match_the_resampled_label(real):
    for _, out in real.values():
        s, q = out["level3"], out["level3_questions"]
        offsets = []
        for i in np.flatnonzero(q["q_probe"] == LEVEL3_PROBES.index("size"))[:200]:
            lab = s["label"][q["q_slice"][i]] == q["q_organ_a"][i] + 1
            if lab.sum() < 300:  # small organs: nearest-neighbour error dominates
                continue
            y, x = ndimage.center_of_mass(lab)
            offsets.append((q["q_centroid_a"][i, 0] - x, q["q_centroid_a"][i, 1] - y))
        offsets = np.array(offsets)
        assert len(offsets) > 20
        # no systematic offset (a half-pixel convention error would show as ~0.5 here) ...
        assert np.abs(offsets.mean(axis=0)).max() < 0.1
        # ... and thin organs (colon) only scatter by the nearest-neighbour resampling error
        assert np.abs(offsets).max() < 0.75


def test_real_anatomy_liver_right_of_spleen(real):
    liver, spleen = ORGAN_ID["liver"] - 1, ORGAN_ID["spleen"] - 1
    kl, kr = organ_index("kidney_left"), organ_index("kidney_right")
    for _, out in real.values():
        l1 = out["level1"]
        orig = ~l1["is_mirror"]
        both = orig & l1["present"][:, liver] & l1["present"][:, spleen]
        assert both.any()
        assert (l1["centroid"][both, liver, 0] < l1["centroid"][both, spleen, 0]).all()
        kid = orig & l1["present"][:, kl] & l1["present"][:, kr]
        assert (l1["centroid"][kid, kr, 0] < l1["centroid"][kid, kl, 0]).all()
        # and in the mirror, the other way round
        mboth = l1["is_mirror"] & l1["present"][:, liver] & l1["present"][:, spleen]
        assert (l1["centroid"][mboth, liver, 0] > l1["centroid"][mboth, spleen, 0]).all()


def test_mirror_on_real_masks(real):
    total = {p: 0 for p in LEVEL3_PROBES}
    for _, out in real.values():
        for p, n in assert_mirror_consistent(out, x_tol=1e-3).items():
            total[p] += n
    assert total["relative_position"] > 50 and total["symmetry"] > 0, total


def test_symmetry_uses_bilateral_pairs(real):
    for _, out in real.values():
        q = out["level3_questions"]
        sym = np.flatnonzero(q["q_probe"] == LEVEL3_PROBES.index("symmetry"))
        members = {organ_index(x) for pair in BILATERAL_PAIRS for x in pair}
        assert set(q["q_organ_a"][sym].tolist()) <= members
