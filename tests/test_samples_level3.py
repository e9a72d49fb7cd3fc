"""Level 3 slices and questions, and the size/distance thresholds, on synthetic cases."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, apply_thresholds, fit_thresholds, process_case
from spar_bench.builder.samples.level3 import count_lesions, empty_questions, orientation_sector
from spar_bench.builder.samples.thresholds import original_questions, pair_key
from spar_bench.builder.schema import LEVEL3_PROBES, ORGAN_ID, organ_index
from spar_bench.errors import ConfigError

P = {name: i for i, name in enumerate(LEVEL3_PROBES)}
CFG = SampleConfig(levels=("level3",), l3_questions_per_probe=50, l3_min_area_mm2=20.0)
SPACING = (2.5, 1.0, 1.0)


def layout_case(lesion: bool = False) -> Case:
    """8 slices, 48x64, 1 mm pixels. Liver right-anterior, spleen left, kidneys posterior.

    kidney_left (patient's left, larger col) is 10x10 = 100 mm^2, kidney_right 10x7 = 70 mm^2
    (d = 0.35: left larger). Slice 6 holds only the liver (not a Level 3 slice).
    """
    shape = (8, 48, 64)
    mask = np.zeros(shape, dtype=np.uint8)
    mask[:, 5:15, 5:20] = ORGAN_ID["liver"]  # centroid row 9.5, col 12
    mask[:6, 5:15, 45:55] = ORGAN_ID["spleen"]  # row 9.5, col 49.5
    mask[:6, 30:40, 40:50] = ORGAN_ID["kidney_left"]  # row 34.5, col 44.5
    mask[:6, 30:40, 10:17] = ORGAN_ID["kidney_right"]  # row 34.5, col 13
    image = np.full(shape, 30, dtype=np.int16)
    les = None
    if lesion:
        les = np.zeros(shape, dtype=np.uint8)
        les[0, 6:8, 6:8] = 1  # 4 voxels
        les[0, 8, 8] = 1  # diagonal neighbour: same component (8-connectivity)
        les[0, 10:12, 15:17] = 1  # second component
        les[0, 13, 30] = 1  # one voxel: about 7 pixels of the 224 frame (0.375 mm pixels), counted
        les[2, 6:9, 6:9] = 1
    return Case("synth", "l3", "train", mask, SPACING, image=image, lesion=les)


def by_probe(q, probe):
    return np.flatnonzero(q["q_probe"] == P[probe])


def test_slices_keys_and_fields():
    out = process_case(layout_case(), CFG, 5)
    s, q = out["level3"], out["level3_questions"]
    assert s["slice_index"].tolist() == [0, 2, 4]  # stride 2; slice 6 has one organ
    assert s["key"].tolist() == [f"synth/l3/level3/{z:05d}" for z in (0, 2, 4)]
    assert s["image"].shape == (3, 224, 224) and s["label"].dtype == np.uint8
    assert set(np.unique(s["label"])) == {0, 1, 2, 3, 4}
    assert not s["lesion"].any()
    assert len(q["q_key"]) > 0 and q["q_slice"].max() == 2
    for key, row in zip(q["q_key"], q["q_slice"], strict=True):
        assert key.startswith(s["key"][row] + "/q")
    assert (q["q_seed"] == s["seed"][q["q_slice"]]).all()
    assert len(by_probe(q, "counting")) == 0  # no lesion mask: no counting questions


def test_relative_position_and_orientation_answers_by_hand():
    q = process_case(layout_case(), CFG, 5)["level3_questions"]
    col = {1: 12.0, 2: 49.5, 3: 44.5, 4: 13.0}
    row = {1: 9.5, 2: 9.5, 3: 34.5, 4: 34.5}
    rel = by_probe(q, "relative_position")
    assert len(rel) > 0
    seen_answers = set()
    for i in rel:
        a, b = q["q_organ_a"][i] + 1, q["q_organ_b"][i] + 1
        if q["q_axis"][i] == 0:
            assert abs(col[a] - col[b]) >= CFG.rel_margin_mm
            assert q["q_answer"][i] == int(col[a] > col[b])
        else:
            assert abs(row[a] - row[b]) >= CFG.rel_margin_mm
            assert q["q_answer"][i] == int(row[a] < row[b])
        seen_answers.add(int(q["q_answer"][i]))
    assert seen_answers == {0, 1}
    # liver vs spleen on the anterior/posterior axis: same row -> never asked (and the pair
    # is drawn, so this check cannot pass vacuously)
    liver_spleen = [i for i in rel if {q["q_organ_a"][i], q["q_organ_b"][i]} == {0, 1}]
    assert liver_spleen and all(q["q_axis"][i] == 0 for i in liver_spleen)
    for i in by_probe(q, "orientation"):
        a, b = q["q_organ_a"][i] + 1, q["q_organ_b"][i] + 1
        ang = math.degrees(math.atan2(row[a] - row[b], col[b] - col[a]))
        assert q["q_answer"][i] == round(ang / 45) % 8
    # liver -> spleen points to the patient's left (sector 0), spleen -> liver right (4)
    pairs = {
        (int(q["q_organ_a"][i]), int(q["q_organ_b"][i])): int(q["q_answer"][i])
        for i in by_probe(q, "orientation")
    }
    drawn = {k: v for k, v in pairs.items() if k in ((0, 1), (1, 0))}
    assert drawn, "no liver/spleen orientation question: the check below would be vacuous"
    assert all(v == (0 if k == (0, 1) else 4) for k, v in drawn.items())


def test_orientation_sector_compass():
    names = [
        "left",
        "left-anterior",
        "anterior",
        "right-anterior",
        "right",
        "right-posterior",
        "posterior",
        "left-posterior",
    ]
    for s, _ in enumerate(names):
        ang = math.radians(45 * s)
        assert orientation_sector(math.cos(ang), math.sin(ang)) == s
    assert orientation_sector(1.0, 0.3) == 0 and orientation_sector(-1.0, -0.01) == 4


def test_symmetry_size_distance():
    q = process_case(layout_case(), CFG, 5)["level3_questions"]
    sym = by_probe(q, "symmetry")
    assert len(sym) == 3  # one kidney pair on each of 3 slices
    for i in sym:
        assert q["q_organ_a"][i] == organ_index("kidney_left")  # larger column: patient's left
        assert q["q_answer"][i] == 0  # 100 vs 70 mm^2: left larger
        assert q["q_area_a_mm2"][i] == pytest.approx(100.0) and q["q_area_b_mm2"][
            i
        ] == pytest.approx(70.0)
    size = by_probe(q, "size")
    assert (q["q_answer"][size] == -1).all()
    areas = {0: 150.0, 1: 100.0, 2: 100.0, 3: 70.0}
    for i in size:
        assert q["q_area_a_mm2"][i] == pytest.approx(areas[int(q["q_organ_a"][i])])
    dist = by_probe(q, "distance")
    assert (q["q_answer"][dist] == -1).all()
    i = [j for j in dist if {int(q["q_organ_a"][j]), int(q["q_organ_b"][j])} == {0, 1}]
    assert i and q["q_distance_mm"][i[0]] == pytest.approx(37.5)
    unused = np.concatenate([by_probe(q, "relative_position"), by_probe(q, "orientation")])
    assert np.isnan(q["q_distance_mm"][unused]).all() and (q["q_count"][unused] == -1).all()


def test_symmetry_similar_and_right_larger():
    case = layout_case()
    mask = case.mask.copy()
    mask[:, 30:40, 10:17] = 0
    mask[:, 30:40, 8:17] = ORGAN_ID["kidney_right"]  # 90 vs 100 mm^2: similar
    mask[4, 30:40, 5:25] = ORGAN_ID["kidney_right"]  # 200 vs 100 on slice 4: right larger
    q = process_case(Case("synth", "sym", "train", mask, SPACING, image=case.image), CFG, 5)[
        "level3_questions"
    ]
    sym = by_probe(q, "symmetry")
    assert q["q_answer"][sym].tolist() == [1, 1, 2]


def test_counting_components():
    lesion = np.zeros((20, 20), np.uint8)
    lesion[1:3, 1:3] = 1
    lesion[3, 3] = 1  # diagonal: joins the first component
    lesion[10, 10] = lesion[10, 11] = 1  # 2 voxels < 3
    assert count_lesions(lesion, 3) == 1 and count_lesions(lesion, 1) == 2
    out = process_case(layout_case(lesion=True), CFG, 5)
    q = out["level3_questions"]
    cnt = by_probe(q, "counting")
    # eligibility per probe: slice 6 shows only the liver, so it carries counting alone
    assert out["level3"]["slice_index"].tolist() == [0, 2, 4, 6]
    assert len(cnt) == 4  # one per slice
    # counted on the stored 224 mask (protocol 1.4): the one-voxel lesion covers ~7 pixels there
    assert q["q_count"][cnt].tolist() == [3, 1, 0, 0] and q["q_answer"][cnt].tolist() == [3, 1, 0, 0]
    for j in cnt:  # the stored mask is what was counted
        assert count_lesions(out["level3"]["lesion"][q["q_slice"][j]], CFG.lesion_min_pixels) == q["q_count"][j]
    few = SampleConfig(levels=("level3",), l3_questions_per_probe=50, l3_min_area_mm2=20.0, lesion_min_pixels=8)
    q8 = process_case(layout_case(lesion=True), few, 5)["level3_questions"]
    assert q8["q_count"][by_probe(q8, "counting")].tolist() == [2, 1, 0, 0]  # the 7-pixel region: below 8
    assert (q["q_organ_a"][cnt] == -1).all()
    assert out["level3"]["lesion"][0].any() and not out["level3"]["lesion"][2].any()
    on_6 = q["q_slice"] == 3
    assert on_6.sum() == 1 and q["q_probe"][on_6][0] == P["counting"]


def test_counting_slices_whatever_the_organ_count():
    """A lesion case: a slice with one organ, or a lesion outside any organ, carries counting only;
    a slice with no organ and no counted lesion is not a Level 3 slice; organ probes keep 2 organs."""
    case = layout_case(lesion=True)
    mask, les = case.mask.copy(), case.lesion.copy()
    mask[mask != ORGAN_ID["liver"]] = 0  # only the liver is left: no slice has two organs
    les[4, 30:33, 40:43] = 1  # a lesion on slice 4, outside the liver
    mask[6] = 0  # slice 6: nothing at all
    out = process_case(Case("synth", "one", "train", mask, SPACING, image=case.image, lesion=les), CFG, 5)
    q = out["level3_questions"]
    assert out["level3"]["slice_index"].tolist() == [0, 2, 4]
    assert set(q["q_probe"].tolist()) == {P["counting"]}
    assert q["q_answer"].tolist() == [3, 1, 1]  # the one-voxel lesion is ~7 pixels at 224: counted
    no_lesion = process_case(Case("synth", "one", "train", mask, SPACING, image=case.image), CFG, 5)
    assert len(no_lesion["level3"]["slice_index"]) == 0  # without lesions: the two-organ rule


def test_questions_per_probe_cap_and_determinism():
    cfg = SampleConfig(levels=("level3",), l3_questions_per_probe=2, l3_min_area_mm2=20.0)
    a = process_case(layout_case(), cfg, 1)["level3_questions"]
    b = process_case(layout_case(), cfg, 1)["level3_questions"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    for s in range(3):
        for p in range(len(LEVEL3_PROBES)):
            assert ((a["q_slice"] == s) & (a["q_probe"] == p)).sum() <= 2
    draws = {
        tuple(process_case(layout_case(), cfg, g)["level3_questions"]["q_organ_a"])
        for g in range(6)
    }
    assert len(draws) > 1  # the global seed changes the draws


# ---------------------------------------------------------------- thresholds
def _table(probe: str, organs_a, organs_b, values, mirror=False):
    n = len(values)
    suffix = "/mirror" if mirror else ""
    return {
        "q_key": np.array([f"s/c/level3/{i:05d}{suffix}/q000" for i in range(n)], dtype=object),
        "q_probe": np.full(n, P[probe], np.int8),
        "q_organ_a": np.array(organs_a, np.int8),
        "q_organ_b": np.array(organs_b, np.int8),
        "q_answer": np.full(n, -1, np.int8),
        "q_area_a_mm2": np.array(values if probe == "size" else [np.nan] * n, np.float32),
        "q_distance_mm": np.array(values if probe == "distance" else [np.nan] * n, np.float32),
    }


def _training():
    liver = _table("size", [0] * 30, [-1] * 30, np.arange(1, 31) * 10.0)  # 10..300
    spleen = _table("size", [1] * 5, [-1] * 5, [1.0, 2, 3, 4, 5])  # < 30: fallback
    dist = _table(
        "distance", [0] * 40 + [3] * 2, [2] * 40 + [2] * 2, list(np.arange(40.0)) + [500.0, 600.0]
    )
    mirrored = _table("size", [0] * 3, [-1] * 3, [1e6] * 3, mirror=True)
    mirrored["q_slice"] = np.zeros(3, np.int32)  # questions of a mirrored slice: left out
    return [liver, spleen, dist, original_questions({"is_mirror": np.array([True])}, mirrored)]


def test_original_questions_by_the_slices_mirror_flag():
    """Questions are dropped by their slice's is_mirror, not by their key."""
    q = _table("size", [0] * 4, [-1] * 4, [1.0, 2.0, 3.0, 4.0])
    q["q_slice"] = np.array([0, 1, 1, 2], np.int32)
    kept = original_questions({"is_mirror": np.array([False, True, False])}, q)
    assert kept["q_area_a_mm2"].tolist() == [1.0, 4.0]
    assert original_questions({}, q) is q and original_questions({"is_mirror": np.array([True])}, {}) == {}


def test_fit_thresholds_tertiles_and_fallback():
    th = fit_thresholds(_training())
    liver = th["size"]["groups"]["liver"]
    assert liver["n"] == 30 and not liver["fallback"]
    np.testing.assert_allclose(liver["cuts"], np.quantile(np.arange(1, 31) * 10.0, [1 / 3, 2 / 3]))
    spleen = th["size"]["groups"]["spleen"]
    assert (
        spleen["fallback"] and spleen["n"] == 5 and spleen["cuts"] == th["size"]["global"]["cuts"]
    )
    assert th["size"]["global"]["n"] == 35  # mirrored questions ignored
    assert not th["distance"]["groups"][pair_key(2, 0)]["fallback"]
    assert th["distance"]["groups"]["kidney_left|kidney_right"]["fallback"]
    assert th["method"] == "tertiles" and th["min_n"] == 30
    assert json.loads(json.dumps(th)) == th


def test_apply_thresholds_pure_and_consistent():
    th = json.loads(json.dumps(fit_thresholds(_training())))
    q = _training()[0]
    before = {k: v.copy() for k, v in q.items()}
    res = apply_thresholds(q, th)
    for k in before:
        np.testing.assert_array_equal(q[k], before[k])  # input untouched
    assert np.bincount(res["q_answer"]).tolist() == [10, 10, 10]
    # unseen organ -> global cuts; unseen pair -> global cuts
    unseen = apply_thresholds(_table("size", [7], [-1], [1e9]), th)
    assert unseen["q_answer"].tolist() == [2]
    pair = apply_thresholds(_table("distance", [5], [6], [-1.0]), th)
    assert pair["q_answer"].tolist() == [0]
    # other probes untouched
    other = _table("size", [0], [-1], [10.0])
    other["q_probe"][:] = P["symmetry"]
    other["q_answer"][:] = 2
    assert apply_thresholds(other, th)["q_answer"].tolist() == [2]


def test_fit_thresholds_refuses_empty():
    with pytest.raises(ConfigError, match="no size questions"):
        fit_thresholds([empty_questions(), {}])
    # empty tables (cases without Level 3 slices) are skipped, not an error
    th = fit_thresholds([{}, empty_questions(), *_training()])
    assert th == fit_thresholds(_training())


def test_level_hooks_finish_only_the_open_answers():
    """Level 3's hooks fit and apply the tertiles; a level without hooks is complete as sampled."""
    from spar_bench.builder.samples.levels import LEVEL_HOOKS, level_hooks

    assert sum(h.fits_thresholds for h in LEVEL_HOOKS.values()) <= 1  # one manifest entry
    plain, l3 = level_hooks("level1"), level_hooks("level3")
    assert not plain.fits_thresholds and plain.fit([]) is None and not plain.needs_thresholds(_training()[0])
    assert l3.fits_thresholds and l3.needs_thresholds(_training()[0])
    other = _table("size", [0], [-1], [10.0])
    other["q_probe"][:] = P["symmetry"]
    assert not l3.needs_thresholds(other) and not l3.needs_thresholds({})
    th = l3.fit(_training())
    assert th == fit_thresholds(_training())
    q = _training()[0]
    assert plain.finalise({}, q, th, CFG) is q and plain.answerable(q, th).all()
    out = process_case(layout_case(), CFG, 5)
    rows, q3 = out["level3"], out["level3_questions"]
    th3 = l3.fit([q3])
    done = l3.finalise(rows, q3, th3, CFG)
    assert (q3["q_answer"] == -1).any() and (done["q_answer"] >= 0).all()
    np.testing.assert_array_equal(done["q_answer"], apply_thresholds(q3, th3)["q_answer"])
    assert "q_pixel_answer" in done and "q_pixel_answer" not in q3  # pure: the input is untouched
    assert l3.answerable(done, th3).dtype == bool and len(l3.answerable(done, th3)) == len(q3["q_key"])
