"""The mirror counterfactual: labels recomputed on flipped volumes agree with geometry."""

from __future__ import annotations

import numpy as np

from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, mirror_case, process_case
from spar_bench.builder.schema import LEVEL3_PROBES, ORGAN_ID

from helpers import assert_mirror_consistent

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
