"""The mirror counterfactual: labels recomputed on flipped volumes agree with geometry."""

from __future__ import annotations

import numpy as np
import pytest
from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, mirror_case, process_case
from spar_bench.builder.schema import BILATERAL_PAIRS, LEVEL3_PROBES, ORGAN_ID, organ_index

P = {name: i for i, name in enumerate(LEVEL3_PROBES)}


def asymmetric_case() -> Case:
    shape = (6, 50, 70)
    rng = np.random.default_rng(0)
    mask = np.zeros(shape, np.uint8)
    mask[:, 5:18, 4:25] = ORGAN_ID["liver"]
    mask[:, 8:16, 50:60] = ORGAN_ID["spleen"]
    mask[:, 30:40, 45:55] = ORGAN_ID["kidney_left"]
    mask[:, 30:39, 12:20] = ORGAN_ID["kidney_right"]
    mask[:, 20:26, 30:42] = ORGAN_ID["pancreas"]
    image = (rng.normal(0, 40, shape) + 20 * mask).astype(np.int16)
    image[:, :, :2] = -1000  # asymmetric air margin: the body box is off-centre
    lesion = np.zeros(shape, np.uint8)
    lesion[0, 6:9, 6:9] = 1
    lesion[0, 12:15, 12:15] = 1
    return Case("synth", "m", "train", mask, (2.0, 0.9, 1.1), image=image, lesion=lesion)


def test_mirror_case_flips_columns_only():
    case = asymmetric_case()
    m = mirror_case(case)
    assert (m.mask == case.mask[:, :, ::-1]).all() and (m.image == case.image[:, :, ::-1]).all()
    assert (m.lesion == case.lesion[:, :, ::-1]).all()
    assert m.provenance["mirror"] and "mirror" not in case.provenance
    assert m.spacing == case.spacing and m.case_id == case.case_id
    assert (mirror_case(m).mask == case.mask).all()


def assert_mirror_consistent(out: dict, x_tol: float = 1e-4) -> dict[str, int]:
    """Check every geometric consequence of the mirror; return counts of checked questions."""
    checked = {p: 0 for p in LEVEL3_PROBES}
    for level in ("level1", "level2"):
        rec = out[level]
        n = len(rec["key"]) // 2
        orig, mir = slice(0, n), slice(n, 2 * n)
        assert not rec["is_mirror"][orig].any() and rec["is_mirror"][mir].all()
        assert rec["origin_key"][mir].tolist() == rec["key"][orig].tolist()
        assert rec["key"][mir].tolist() == [k + "/mirror" for k in rec["key"][orig]]
        np.testing.assert_array_equal(rec["slice_index"][mir], rec["slice_index"][orig])
        np.testing.assert_array_equal(rec["seed"][mir], rec["seed"][orig])
        c0, c1 = rec["centroid"][orig].astype(np.float64), rec["centroid"][mir].astype(np.float64)
        np.testing.assert_allclose(c1[..., 0], (223.0 - 224.0 * c0[..., 0]) / 224.0, atol=x_tol)
        np.testing.assert_allclose(c1[..., 1], c0[..., 1], atol=1e-5)
    s = out["level3"]
    n_s = len(s["key"]) // 2
    assert s["origin_key"][n_s:].tolist() == s["key"][:n_s].tolist()
    # the mirrored slices are the flipped original slices (same field of view, mirrored)
    np.testing.assert_allclose(
        s["image"][n_s:].astype(int), s["image"][:n_s, :, ::-1].astype(int), atol=1
    )
    assert (s["label"][n_s:] == s["label"][:n_s, :, ::-1]).mean() > 0.999
    q = out["level3_questions"]
    n_q = len(q["q_key"]) // 2
    a, b = slice(0, n_q), slice(n_q, 2 * n_q)
    assert (q["q_slice"][b] == q["q_slice"][a] + n_s).all()
    assert q["q_key"][b].tolist() == [k.replace("/q", "/mirror/q") for k in q["q_key"][a]]
    np.testing.assert_array_equal(q["q_probe"][a], q["q_probe"][b])
    for i in range(n_q):
        j = n_q + i
        probe = LEVEL3_PROBES[q["q_probe"][i]]
        ans0, ans1 = int(q["q_answer"][i]), int(q["q_answer"][j])
        if probe == "symmetry":
            assert ans1 == 2 - ans0  # left_larger <-> right_larger, similar stays
            names = {
                organ_index(x): organ_index(y)
                for pair in BILATERAL_PAIRS
                for x, y in (pair, pair[::-1])
            }
            assert q["q_organ_a"][j] == names[int(q["q_organ_a"][i])]
            assert q["q_area_a_mm2"][j] == pytest.approx(q["q_area_b_mm2"][i])
        else:
            assert q["q_organ_a"][j] == q["q_organ_a"][i] and q["q_organ_b"][j] == q["q_organ_b"][i]
        if probe == "relative_position":
            assert ans1 == (1 - ans0 if q["q_axis"][i] == 0 else ans0)
        elif probe == "orientation":
            assert ans1 == (4 - ans0) % 8
        elif probe in ("size", "distance", "counting"):
            assert ans1 == ans0
            for name in ("q_area_a_mm2", "q_distance_mm"):
                np.testing.assert_allclose(q[name][j], q[name][i], rtol=1e-5)
            assert q["q_count"][j] == q["q_count"][i]
        checked[probe] += 1
    return checked


def test_mirror_counterfactual_on_synthetic_case():
    cfg = SampleConfig(
        samples_per_case=3, counterfactual="mirror", l3_min_area_mm2=20.0, l3_questions_per_probe=8
    )
    out = process_case(asymmetric_case(), cfg, 9)
    checked = assert_mirror_consistent(out)
    assert all(checked[p] > 0 for p in LEVEL3_PROBES), checked
    plain = process_case(
        asymmetric_case(),
        SampleConfig(samples_per_case=3, l3_min_area_mm2=20.0, l3_questions_per_probe=8),
        9,
    )
    for level in plain:  # the originals are unchanged by adding the counterfactual
        n = len(next(iter(plain[level].values())))
        for name, arr in plain[level].items():
            np.testing.assert_array_equal(out[level][name][:n], arr, err_msg=f"{level}.{name}")
