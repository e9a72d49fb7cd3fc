"""Counting from real lesions: LiTS-like and KiTS-like folders, nnU-Net lesion label names."""

from __future__ import annotations

import numpy as np
import pytest
from lesion_folders import make_kits_folder, make_lits_folder
from spar_bench.builder.ontology import label_map_from_names
from spar_bench.builder.samples import SampleConfig, process_case
from spar_bench.builder.schema import LEVEL3_PROBES, ORGAN_ID, ORGANS
from spar_bench.builder.sources.lits import LitsSource
from spar_bench.builder.sources.nnunet import NnUNetSource

COUNTING = LEVEL3_PROBES.index("counting")
CFG = SampleConfig(levels=("level3",))


def counting_answers(case) -> np.ndarray:
    q = process_case(case, CFG, 0)["level3_questions"]
    return q["q_answer"][q["q_probe"] == COUNTING]


@pytest.mark.parametrize(
    "dataset, labels, host",
    [
        ("MSD Liver", {"background": 0, "liver": 1, "cancer": 2}, "liver"),
        ("MSD Pancreas", {"background": 0, "pancreas": 1, "cancer": 2}, "pancreas"),
        ("KiTS19", {"background": 0, "Kidney": 1, "Tumor": 2}, "kidney"),
        ("MSD Colon", {"background": 0, "colon cancer primaries": 1}, None),
        ("LiTS as nnU-Net", {"background": 0, "liver": 1, "liver tumour": 2}, "liver"),
    ],
)
def test_lesion_names_make_a_lesion_channel(dataset, labels, host):
    lm = label_map_from_names(dataset, labels)
    assert lm.has_lesions and len(lm.lesion_ids) == 1, dataset
    raw = lm.lesion_ids[0]
    assert lm.ids[raw] == host  # the lesion voxels belong to the host organ (or background)
    if host is None:  # a lesion alone never annotates its organ
        assert not any(lm.annotated)
    elif host == "kidney":
        assert lm.sided and lm.annotated[ORGANS.index("kidney_left")] and lm.annotated[ORGANS.index("kidney_right")]
    else:
        assert lm.annotated[ORGANS.index(host)] and sum(lm.annotated) == 1


def test_two_organs_and_an_unqualified_tumour_stay_background():
    lm = label_map_from_names("x", {"liver": 1, "spleen": 2, "tumor": 3})
    assert lm.has_lesions and lm.ids[3] is None  # which organ hosts it is unknown


def test_lits_like_folder_gives_counting_questions(tmp_path):
    root = make_lits_folder(tmp_path / "lits", 3)
    src = LitsSource(root)
    refs = src.find()
    assert [r.case_id for r in refs] == ["lits_0000", "lits_0001", "lits_0002"]
    case = src.load(refs[0])
    assert case.provenance["orientation"]["axcodes"] == "RAS"
    liver_cols = np.nonzero(case.mask == ORGAN_ID["liver"])[2]
    assert liver_cols.mean() < case.shape[2] / 2  # liver on the patient's right: small columns
    assert case.lesion is not None and case.lesion.any()
    assert not (case.lesion.astype(bool) & (case.mask != ORGAN_ID["liver"])).any()
    out = process_case(case, CFG, 0)
    q = out["level3_questions"]
    assert len(out["level3"]["slice_index"]) > 0  # one organ only, yet Level 3 slices
    assert set(q["q_probe"].tolist()) == {COUNTING}  # organ probes keep the two-organ rule
    answers = np.concatenate([counting_answers(src.load(r)) for r in refs])
    assert (answers >= 2).any() and (answers == 0).any()  # several components per slice, and none


def test_kits_like_folder_kidneys_split_by_side_with_lesions(tmp_path):
    root = make_kits_folder(tmp_path / "kits", 2)
    src = NnUNetSource(root)
    refs = src.find()
    assert src.has_lesions and [r.split for r in refs] == ["train", "test"]
    case = src.load(refs[0])
    cols = {o: np.nonzero(case.mask == ORGAN_ID[o])[2] for o in ("kidney_left", "kidney_right")}
    assert cols["kidney_right"].max() < case.shape[2] / 2 < cols["kidney_left"].min()
    assert case.provenance["sided_split"]["stem"] == "kidney"
    assert case.provenance["orientation"]["axcodes"] == "SPL"
    assert case.lesion.any() and not (case.lesion.astype(bool) & (case.mask == 0)).any()
    q = process_case(case, CFG, 0)["level3_questions"]
    probes = set(q["q_probe"].tolist())
    assert COUNTING in probes and LEVEL3_PROBES.index("symmetry") in probes  # two kidneys: pair probes too
