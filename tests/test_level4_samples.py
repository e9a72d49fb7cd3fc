"""Level 4 samples (volumes): grid, resampling, measurements and questions.

Real anatomy: the 20 WORD label maps (masks only, L,P,S; a flat pseudo-image as in
test_samples_real.py) and the TotalSegmentator sample (R,A,S), each processed once per
module at a small cube (``S = 48``). Every answer of every question is recomputed from the
STORED label volume by independent scipy code (a mask oracle), on real and phantom cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import ndimage

from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, flip_case, mirror_case, process_case
from spar_bench.builder.samples.level4 import exact_gap, near_gaps, organ_measures
from spar_bench.builder.samples.volume import (
    VolumeGrid,
    reflect,
    resample_linear,
    resample_nearest,
    volume_for_case,
)
from spar_bench.builder.schema import BILATERAL_PAIRS, LEVEL4_PROBES, ORGAN_ID, organ_index
from spar_bench.errors import CaseError, ConfigError

P = {name: i for i, name in enumerate(LEVEL4_PROBES)}
S_REAL = 48
CFG_REAL = SampleConfig(levels=("level4",), volume_size=S_REAL, counterfactual="mirror+flip")


# --- an independent mask oracle: every answer from the stored label / lesion volume -------


def _oracle_measures(label: np.ndarray, mpv: float):
    idx = range(1, 17)
    counts = np.array(ndimage.sum_labels(np.ones_like(label), label, idx))
    with np.errstate(invalid="ignore", divide="ignore"):  # absent organs: NaN
        com = np.array(ndimage.center_of_mass(np.ones_like(label), label, idx), dtype=np.float64)
    return counts, com * mpv  # (z, row, col) mm


def _oracle_gap(label: np.ndarray, a: int, b: int, mpv: float) -> float:
    dist = ndimage.distance_transform_edt(label != a + 1, sampling=mpv)
    return max(0.0, float(dist[label == b + 1].min()) - mpv)


def assert_oracle_agrees(rows: dict, qs: dict, cfg: SampleConfig) -> dict[str, int]:
    """Every question's answer (and measures) recomputed from its stored row; returns counts."""
    checked = {p: 0 for p in LEVEL4_PROBES}
    for v in range(len(rows["key"])):
        label, mpv = rows["label"][v], float(rows["mm_per_voxel"][v])
        counts, c = _oracle_measures(label, mpv)
        vol = counts * mpv**3
        np.testing.assert_allclose(rows["volume_mm3"][v], vol, rtol=1e-5)
        for i in np.flatnonzero(qs["q_volume"] == v):
            probe = LEVEL4_PROBES[qs["q_probe"][i]]
            a, b, k = int(qs["q_organ_a"][i]), int(qs["q_organ_b"][i]), int(qs["q_organ_c"][i])
            ans, axis = int(qs["q_answer"][i]), int(qs["q_axis"][i])
            if a >= 0:
                assert counts[a] >= cfg.l4_min_voxels, (probe, a)
            if probe == "relative_position":
                comp = (2, 1, 0)[axis]
                assert abs(c[a, comp] - c[b, comp]) >= cfg.rel_margin_mm - 1e-6
                assert ans == (int(c[a, 1] < c[b, 1]) if axis == 1 else int(c[a, comp] > c[b, comp]))
                sep = (c[b, comp] - c[a, comp]) if axis == 1 else (c[a, comp] - c[b, comp])
                assert qs["q_measure_a"][i] == pytest.approx(sep, abs=1e-3)
            elif probe == "distance":
                ab, ac = np.linalg.norm(c[a] - c[b]), np.linalg.norm(c[a] - c[k])
                assert abs(ab - ac) >= cfg.rel_margin_mm - 1e-6 and ans == int(ac < ab)
                np.testing.assert_allclose([qs["q_measure_a"][i], qs["q_measure_b"][i]], [ab, ac], rtol=1e-5)
            elif probe == "volume":
                assert abs(vol[a] - vol[b]) / ((vol[a] + vol[b]) / 2) > cfg.symmetry_band
                assert ans == int(vol[a] > vol[b])
            elif probe == "symmetry":
                assert c[a, 2] >= c[b, 2]  # A is the member on the patient's left
                d = (vol[a] - vol[b]) / ((vol[a] + vol[b]) / 2)
                band = cfg.symmetry_band
                assert ans == (0 if d > band else 2 if d < -band else 1)
            elif probe == "adjacency":
                gap = _oracle_gap(label, a, b, mpv)
                assert qs["q_measure_a"][i] == pytest.approx(gap, abs=1e-4)
                assert (gap <= cfg.adjacency_mm and ans == 1) or (gap > 3 * cfg.adjacency_mm and ans == 0)
            elif probe in ("containment", "counting"):
                comps, n = ndimage.label(rows["lesion"][v], structure=np.ones((3, 3, 3)))
                sizes = np.bincount(comps.ravel())[1:]
                counted = sizes >= cfg.lesion_min_voxels
                if probe == "counting":
                    assert ans == min(int(counted.sum()), 3)
                else:
                    largest = int(np.argmax(np.where(counted, sizes, 0))) + 1
                    inside = (label[comps == largest] == a + 1).mean()
                    assert ans == int(inside > 0.5)
            checked[probe] += 1
    return checked


# --- real anatomy ------------------------------------------------------------------------


def _native_centroids(mask: np.ndarray, spacing) -> tuple[np.ndarray, np.ndarray]:
    """(16,) voxel counts and (16, 3) centroids (z, row, col) in native mm, NaN absent."""
    flat = np.flatnonzero(mask)
    values = mask.ravel()[flat].astype(np.int64)
    zrc = np.unravel_index(flat, mask.shape)
    counts = np.bincount(values, minlength=17)[1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        cen = np.stack(
            [np.bincount(values, weights=zrc[ax], minlength=17)[1:] / counts * spacing[ax] for ax in range(3)],
            axis=1,
        )
    return counts, cen


def _load_word(path) -> Case:
    import nibabel as nib

    img = nib.load(path)
    assert nib.aff2axcodes(img.affine) == ("L", "P", "S")
    mask = np.ascontiguousarray(np.asarray(img.dataobj).transpose(2, 1, 0)).astype(np.uint8)
    spacing = tuple(float(s) for s in img.header.get_zooms()[::-1])
    return Case("word", path.name.split(".")[0], "test", mask, spacing, image=mask.astype(np.int16))


def _processed(case: Case) -> dict:
    counts, cen = _native_centroids(case.mask, case.spacing)
    out = process_case(case, CFG_REAL, 2024)
    return {"native_counts": counts, "native_centroid": cen, **out}


@pytest.fixture(scope="module")
def word_l4(word_labels_dir):
    """Each of the 20 WORD maps: native counts/centroids and its Level 4 output (mask dropped)."""
    paths = sorted((word_labels_dir / "labelsTs").glob("*.nii.gz"))
    assert len(paths) == 20
    return {p.name: _processed(_load_word(p)) for p in paths}


@pytest.fixture(scope="module")
def totalseg_l4(totalseg_dir):
    from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource

    src = TotalSegmentatorSource(totalseg_dir)
    case = src.load(src.find()[0])
    assert case.provenance["orientation"]["axcodes"] == "RAS"
    return _processed(case)


def _x(rows, v, name):
    return rows["centroid"][v, organ_index(name), 0]


def _z(rows, v, name):
    return rows["centroid"][v, organ_index(name), 2]


def _check_patient_left(out: dict, name: str) -> None:
    rows = out["level4"]
    orig, mirror, flip = 0, 1, 2
    assert rows["key"][mirror].endswith("/mirror") and rows["key"][flip].endswith("/flip")
    for left, right in (("spleen", "liver"), ("kidney_left", "kidney_right")):
        assert _x(rows, orig, left) > _x(rows, orig, right), (name, left, right)
        assert _x(rows, mirror, left) < _x(rows, mirror, right), (name, left, right)
        assert _x(rows, flip, left) > _x(rows, flip, right), (name, left, right)


@pytest.mark.slow
def test_word_patient_left_and_superior(word_l4):
    n_pelvis = 0
    for name, out in word_l4.items():
        _check_patient_left(out, name)
        rows = out["level4"]
        present = rows["present"][0]
        kidney_z = min(_z(rows, 0, "kidney_left"), _z(rows, 0, "kidney_right"))
        for low in ("bladder", "head_of_femur_left", "head_of_femur_right"):
            if present[organ_index(low)]:
                n_pelvis += 1
                assert _z(rows, 0, "liver") > _z(rows, 0, low), (name, low)
                assert _z(rows, 2, "liver") < _z(rows, 2, low), (name, low)  # the flip
                if low != "bladder":
                    assert _z(rows, 0, low) < kidney_z, (name, low)
    assert n_pelvis >= 40  # the pelvic organs are present in most WORD maps


@pytest.mark.slow
def test_word_questions_agree_with_real_anatomy(word_l4):
    """The relative_position questions asked about (spleen, liver) and the kidneys say 'left'."""
    n = 0
    pairs = {(organ_index("spleen"), organ_index("liver")), (organ_index("kidney_left"), organ_index("kidney_right"))}
    for out in word_l4.values():
        q = out["level4_questions"]
        rp = (q["q_probe"] == P["relative_position"]) & (q["q_axis"] == 0)
        for i in np.flatnonzero(rp):
            a, b, mirrored = int(q["q_organ_a"][i]), int(q["q_organ_b"][i]), q["q_volume"][i] == 1
            if (a, b) in pairs or (b, a) in pairs:
                expect_left = ((a, b) in pairs) != bool(mirrored)
                assert q["q_answer"][i] == int(expect_left)
                n += 1
    assert n > 0


def _check_centroids_map_back(out: dict, name: str) -> None:
    rows = out["level4"]
    size, mpv = S_REAL, float(rows["mm_per_voxel"][0])
    present_native = out["native_counts"] > 0
    # nothing is cut: every organ present natively has voxels in the stored label
    assert (rows["present"][0] == present_native).all(), name
    vox = rows["centroid"][0][:, ::-1].astype(np.float64) * size - 0.5  # (z, row, col)
    mm = rows["origin_mm"][0].astype(np.float64) + vox * mpv
    err = np.abs(mm - out["native_centroid"]).max(axis=1) / mpv  # in voxels
    stored = np.rint(rows["volume_mm3"][0] / mpv**3)
    # within one voxel for the organs taking part (>= 8 stored voxels), but the adrenal: both
    # glands share one label, so nearest-neighbour sampling may weigh the two unequally
    taking_part = (stored >= CFG_REAL.l4_min_voxels) & (np.arange(16) != organ_index("adrenal"))
    assert err[taking_part].max() < 1.0, (name, err.round(2))
    assert err[present_native].max() < 2.5, (name, err.round(2))


@pytest.mark.slow
def test_word_stored_centroids_map_back_to_native(word_l4):
    for name, out in word_l4.items():
        _check_centroids_map_back(out, name)


@pytest.mark.slow
def test_word_mask_oracle_agrees_on_every_question(word_l4):
    total = {p: 0 for p in LEVEL4_PROBES}
    for name in sorted(word_l4)[:4]:
        out = word_l4[name]
        for p, n in assert_oracle_agrees(out["level4"], out["level4_questions"], CFG_REAL).items():
            total[p] += n
    assert all(total[p] > 0 for p in LEVEL4_PROBES[:5]), total
    assert total["containment"] == total["counting"] == 0  # WORD has no lesion channel


def test_totalsegmentator_sample_same_answers(totalseg_l4):
    _check_patient_left(totalseg_l4, "totalsegmentator s0001")
    _check_centroids_map_back(totalseg_l4, "totalsegmentator s0001")
    checked = assert_oracle_agrees(totalseg_l4["level4"], totalseg_l4["level4_questions"], CFG_REAL)
    assert checked["relative_position"] > 0


# --- counterfactuals on a phantom ----------------------------------------------------------


@pytest.fixture(scope="module")
def phantom_case() -> Case:
    from spar_bench.builder.phantom.generate import make_phantom

    p = make_phantom(3, in_plane=64, n_slices=32)
    return Case("phantom", "p3", "train", p.mask, tuple(p.spacing), image=p.image, lesion=p.lesion)


PHANTOM_CFG = SampleConfig(levels=("level4",), volume_size=32, counterfactual="mirror+flip", l4_min_voxels=4)


def test_mirror_and_flip_expectations(phantom_case):
    out = process_case(phantom_case, PHANTOM_CFG, 7)
    rows, q = out["level4"], out["level4_questions"]
    assert rows["is_mirror"].tolist() == [False, True, False]
    assert rows["is_flipped"].tolist() == [False, False, True]
    assert set(rows["origin_key"]) == {"phantom/p3/level4/0"}
    assert len(set(q["q_seed"])) == 1
    orig = np.flatnonzero(q["q_volume"] == 0)
    for copy, flipped_axis in ((1, 0), (2, 2)):
        other = np.flatnonzero(q["q_volume"] == copy)
        assert len(other) == len(orig)  # same candidates, same seed: the same questions
        for i, j in zip(orig, other, strict=True):
            probe = LEVEL4_PROBES[q["q_probe"][i]]
            assert q["q_probe"][j] == q["q_probe"][i] and q["q_axis"][j] == q["q_axis"][i]
            ans, ans2 = int(q["q_answer"][i]), int(q["q_answer"][j])
            if probe == "relative_position" and q["q_axis"][i] == flipped_axis:
                assert ans2 == 1 - ans
                assert q["q_measure_a"][j] == pytest.approx(-q["q_measure_a"][i], abs=1e-3)
            elif probe == "symmetry" and copy == 1:
                assert ans2 == 2 - ans and q["q_organ_a"][j] == q["q_organ_b"][i]
            else:
                assert ans2 == ans, probe
                np.testing.assert_allclose(q["q_measure_a"][j], q["q_measure_a"][i], rtol=1e-5)
    counted = {p: int((q["q_probe"][orig] == P[p]).sum()) for p in LEVEL4_PROBES}
    assert all(counted[p] > 0 for p in ("relative_position", "distance", "volume", "adjacency", "counting")), counted
    assert_oracle_agrees(rows, q, PHANTOM_CFG)


def test_counterfactual_copies_are_the_reflected_cube(phantom_case):
    base = volume_for_case(phantom_case, 32, 10.0, 40.0, 400.0)
    for fn, axis, n_axis in ((mirror_case, 2, 2), (flip_case, 0, 0)):
        direct = volume_for_case(fn(phantom_case), 32, 10.0, 40.0, 400.0)
        extent = (phantom_case.shape[n_axis] - 1) * phantom_case.spacing[n_axis]
        refl = reflect(base, axis, extent)
        np.testing.assert_allclose(direct.grid.origin_mm, refl.grid.origin_mm, atol=1e-9)
        np.testing.assert_array_equal(direct.label, refl.label)
        np.testing.assert_array_equal(direct.lesion, refl.lesion)
        assert np.abs(direct.image.astype(int) - refl.image).max() <= 1


def test_mirror_only_gives_no_flip_and_levels_1_3_unchanged(phantom_case):
    m = process_case(phantom_case, SampleConfig(levels=("level4",), volume_size=16, counterfactual="mirror"), 7)
    assert m["level4"]["is_mirror"].tolist() == [False, True] and not m["level4"]["is_flipped"].any()
    plain = process_case(phantom_case, SampleConfig(levels=("level3",), counterfactual="mirror"), 7)
    both = process_case(phantom_case, SampleConfig(levels=("level3", "level4"), volume_size=16,
                                                   counterfactual="mirror+flip"), 7)  # fmt: skip
    assert set(both) == {"level3", "level3_questions", "level4", "level4_questions"}
    for part in ("level3", "level3_questions"):
        for name, arr in plain[part].items():
            np.testing.assert_array_equal(both[part][name], arr, err_msg=name)


# --- determinism -------------------------------------------------------------------------


def test_deterministic_per_seed(phantom_case):
    a = process_case(phantom_case, PHANTOM_CFG, 11)
    b = process_case(phantom_case, PHANTOM_CFG, 11)
    c = process_case(phantom_case, PHANTOM_CFG, 12)
    for part in ("level4", "level4_questions"):
        for name in a[part]:
            np.testing.assert_array_equal(a[part][name], b[part][name], err_msg=name)
    np.testing.assert_array_equal(a["level4"]["image"], c["level4"]["image"])  # seeds draw questions only
    qa, qc = a["level4_questions"], c["level4_questions"]
    assert len(qa["q_probe"]) != len(qc["q_probe"]) or any(
        not np.array_equal(qa[f], qc[f]) for f in ("q_organ_a", "q_organ_b", "q_organ_c", "q_axis")
    )
    assert qa["q_seed"][0] != qc["q_seed"][0]


# --- counting, containment, adjacency on known shapes --------------------------------------


def _identity_case(mask: np.ndarray, lesion: np.ndarray | None, spacing=(1.0, 1.0, 1.0)) -> Case:
    """A cube case whose Level 4 grid is the native grid (labelled corners, no margin)."""
    mask = mask.copy()
    mask[0, 0, 0] = mask[-1, -1, -1] = ORGAN_ID["colon"]  # the labelled box is the whole array
    return Case("synth", "k", "train", mask, spacing, image=(mask * 7).astype(np.int16), lesion=lesion)


def _cfg(**kw) -> SampleConfig:
    return SampleConfig(levels=("level4",), volume_size=32, fov_margin_mm=0.0, **kw)


def test_identity_grid_is_the_native_grid():
    mask = np.zeros((32, 32, 32), np.uint8)
    mask[3:9, 4:10, 20:25] = ORGAN_ID["liver"]
    case = _identity_case(mask, None, spacing=(2.0, 2.0, 2.0))
    vol = volume_for_case(case, 32, 0.0, 40.0, 400.0)
    assert vol.grid.mm_per_voxel == 2.0 and vol.grid.origin_mm == (0.0, 0.0, 0.0)
    np.testing.assert_array_equal(vol.label, case.mask)


def test_counting_and_containment_26_connectivity():
    mask = np.zeros((32, 32, 32), np.uint8)
    mask[2:14, 2:14, 2:14] = ORGAN_ID["liver"]
    mask[2:14, 2:14, 18:30] = ORGAN_ID["spleen"]
    lesion = np.zeros_like(mask)
    lesion[4:7, 4:7, 4:7] = 1  # 27 voxels in the liver
    lesion[7:9, 7:9, 7:9] = 1  # 8 voxels touching it at one corner only: 26-connected
    lesion[4:6, 4:6, 20:21] = 1  # 4 voxels in the spleen: counted (>= 3)
    lesion[10, 10, 24:26] = 1  # 2 voxels: too small
    out = process_case(_identity_case(mask, lesion), _cfg(), 3)
    q = out["level4_questions"]
    cnt = np.flatnonzero(q["q_probe"] == P["counting"])
    assert q["q_answer"][cnt].tolist() == [2] and q["q_measure_a"][cnt].tolist() == [2.0]
    cont = np.flatnonzero(q["q_probe"] == P["containment"])
    assert q["q_organ_a"][cont[0]] == organ_index("liver") and q["q_answer"][cont].tolist() == [1, 0]
    assert q["q_measure_b"][cont[0]] == 35.0  # the merged component, mm^3 at 1 mm voxels
    assert q["q_organ_a"][cont[1]] != organ_index("liver")
    assert out["level4"]["has_lesion"].tolist() == [True]


def test_containment_needs_a_majority_organ():
    mask = np.zeros((32, 32, 32), np.uint8)
    mask[2:14, 2:14, 2:10] = ORGAN_ID["liver"]
    mask[2:14, 2:14, 10:20] = ORGAN_ID["spleen"]
    lesion = np.zeros_like(mask)
    lesion[4:6, 4:6, 8:12] = 1  # 16 voxels, half in each organ: no container
    q = process_case(_identity_case(mask, lesion), _cfg(), 3)["level4_questions"]
    assert not (q["q_probe"] == P["containment"]).any()
    assert q["q_answer"][q["q_probe"] == P["counting"]].tolist() == [1]


def test_no_lesion_channel_no_lesion_questions():
    mask = np.zeros((32, 32, 32), np.uint8)
    mask[2:14, 2:14, 2:14] = ORGAN_ID["liver"]
    out = process_case(_identity_case(mask, None), _cfg(), 3)
    q = out["level4_questions"]
    assert not np.isin(q["q_probe"], [P["containment"], P["counting"]]).any()
    assert out["level4"]["has_lesion"].tolist() == [False] and not out["level4"]["lesion"].any()


def test_adjacency_gaps_in_mm():
    label = np.zeros((40, 40, 40), np.uint8)  # a cube, as stored
    label[4:10, 4:10, 2:10] = 1  # A: liver
    label[4:10, 4:10, 10:16] = 2  # B: spleen, face-touching A: gap 0
    label[4:10, 4:10, 19:25] = 3  # C: kidney_left, 3 empty voxels after B: gap 3 x 2.5 mm
    label[16:20, 16:20, 34:38] = 4  # D: kidney_right, far, diagonal
    mpv = 2.5
    g = organ_measures(label, mpv, 8)
    np.testing.assert_array_equal(g.box_lo[2], [4, 4, 19])
    np.testing.assert_array_equal(g.box_hi[2], [9, 9, 24])
    assert g.box_lo[5].tolist() == [40, 40, 40] and g.box_hi[5].tolist() == [-1, -1, -1]  # absent
    assert exact_gap(label, 0, 1, mpv, g) == 0.0
    assert exact_gap(label, 1, 2, mpv, g) == pytest.approx(7.5)
    d_exp = math.sqrt(7**2 + 7**2 + 10**2) * mpv - mpv  # nearest voxel centres: 7, 7, 10 apart
    assert exact_gap(label, 2, 3, mpv, g) == pytest.approx(d_exp)
    assert exact_gap(label, 3, 2, mpv) == pytest.approx(d_exp)  # boxes measured when not given
    gaps = near_gaps(label, g, 9.0)
    assert gaps[0, 1] == 0.0 and gaps[1, 2] == pytest.approx(7.5) and gaps[2, 1] == pytest.approx(7.5)
    assert np.isinf(gaps[2, 3]) and np.isinf(gaps[0, 3])  # beyond the reach: unknown, > 9 mm
    assert np.isinf(gaps[0, 2])  # A to C: voxel centres 10 apart, gap 22.5 mm > 9 mm
    assert near_gaps(label, g, 25.0)[0, 2] == pytest.approx(22.5)


def test_adjacency_questions_threshold():
    mask = np.zeros((32, 32, 32), np.uint8)
    mask[4:10, 4:10, 2:8] = ORGAN_ID["liver"]
    mask[4:10, 4:10, 10:16] = ORGAN_ID["spleen"]  # gap 2 mm to the liver: touching
    mask[4:10, 4:10, 21:27] = ORGAN_ID["stomach"]  # gap 5 mm to the spleen: in between, skipped
    mask[20:26, 20:26, 4:10] = ORGAN_ID["pancreas"]  # far from everything
    out = process_case(_identity_case(mask, None), _cfg(l4_questions_per_probe=16), 5)
    q = out["level4_questions"]
    adj = np.flatnonzero(q["q_probe"] == P["adjacency"])
    got = {frozenset((int(q["q_organ_a"][i]), int(q["q_organ_b"][i]))): int(q["q_answer"][i]) for i in adj}
    liver, spleen, stomach = organ_index("liver"), organ_index("spleen"), organ_index("stomach")
    assert got[frozenset((liver, spleen))] == 1
    assert frozenset((spleen, stomach)) not in got
    assert got[frozenset((liver, stomach))] == 0  # 13 mm > 9 mm
    assert q["q_measure_a"][adj][[frozenset((int(q["q_organ_a"][i]), int(q["q_organ_b"][i])))
                                  == frozenset((liver, spleen)) for i in adj]].tolist() == [2.0]  # fmt: skip


# --- resampling, grid, config, bad input ---------------------------------------------------


def test_linear_resampling_matches_scipy_inside_the_scan():
    rng = np.random.default_rng(0)
    image = rng.normal(0, 100, (12, 20, 18)).astype(np.int16)
    grid = VolumeGrid(origin_mm=(3.1, 2.3, 4.7), mm_per_voxel=0.9, size=10)
    spacing = (2.5, 1.1, 1.3)
    got = resample_linear(image, grid, spacing)
    coords = np.meshgrid(*(grid.native_coords(ax, spacing[ax]) for ax in range(3)), indexing="ij")
    want = ndimage.map_coordinates(image.astype(np.float64), coords, order=1, mode="nearest")
    np.testing.assert_allclose(got, want, atol=1e-2)
    far = VolumeGrid(origin_mm=(100.0, 0.0, 0.0), mm_per_voxel=1.0, size=4)
    assert (resample_linear(image, far, spacing) == -1024).all()
    assert not resample_nearest(image.clip(0, 5).astype(np.uint8), far, spacing).any()


def test_empty_case_gives_no_rows_and_bad_input_is_one_line():
    empty = Case("synth", "e", "train", np.zeros((4, 5, 6), np.uint8), (1.0, 1.0, 1.0),
                 image=np.zeros((4, 5, 6), np.int16))  # fmt: skip
    out = process_case(empty, SampleConfig(levels=("level4",), volume_size=8), 1)
    assert out["level4"]["image"].shape == (0, 8, 8, 8) and len(out["level4_questions"]["q_key"]) == 0
    with pytest.raises(CaseError, match="has no image"):
        process_case(Case("synth", "n", "train", np.ones((4, 5, 6), np.uint8), (1.0,) * 3), _cfg(), 1)
    bad = Case("synth", "b", "train", np.full((4, 5, 6), 20, np.uint8), (1.0,) * 3, image=np.zeros((4, 5, 6), np.int16))
    with pytest.raises(CaseError, match="label id 20"):
        process_case(bad, _cfg(), 1)
    flat = Case("synth", "f", "train", np.ones((4, 5, 6), np.uint8), (0.0, 1.0, 1.0), image=np.zeros((4, 5, 6), np.int16))
    with pytest.raises(CaseError, match=r"spacing must be > 0 mm on every axis") as err:
        process_case(flat, _cfg(), 1)
    assert "\n" not in str(err.value) and str(err.value).startswith("case f: ")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"volume_size": 4}, r"volume_size \(--volume-size\) 4: must be an integer from 8 to"),
        ({"volume_size": 16.0}, r"volume_size \(--volume-size\) 16.0: must be an integer from 8 to"),
        ({"l4_questions_per_probe": 0}, "l4_questions_per_probe"),
        ({"l4_min_voxels": 0}, "l4_min_voxels"),
        ({"adjacency_mm": 0.0}, "adjacency_mm must be a number > 0"),
        ({"counterfactual": "flip"}, r"'mirror\+flip', got 'flip'"),
    ],
)
def test_config_errors_are_one_line(kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        SampleConfig(**kw)
    assert "\n" not in str(err.value)


def test_level4_fields_recorded_only_with_level4():
    plain = SampleConfig()
    assert "volume_size" not in plain.to_dict() and SampleConfig.from_dict(plain.to_dict()) == plain
    l4 = SampleConfig(levels=("level3", "level4"), volume_size=64, adjacency_mm=2.0, counterfactual="mirror+flip")
    d = l4.to_dict()
    assert d["volume_size"] == 64 and d["l4_min_voxels"] == 8 and SampleConfig.from_dict(d) == l4


@pytest.mark.slow
def test_symmetry_uses_bilateral_pairs(word_l4):
    members = {organ_index(x) for pair in BILATERAL_PAIRS for x in pair}
    n = 0
    for out in word_l4.values():
        q = out["level4_questions"]
        sym = q["q_probe"] == P["symmetry"]
        assert set(q["q_organ_a"][sym].tolist()) <= members
        n += int(sym.sum())
    assert n > 20
