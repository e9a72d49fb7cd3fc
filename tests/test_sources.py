"""Source adapters on tiny synthetic layouts and on the real samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from click.testing import CliRunner

from spar_bench.builder.ontology import (
    apply_label_map,
    label_map_from_ids,
    label_map_from_names,
    normalise_name,
)
from spar_bench.builder.schema import N_ORGANS, ORGAN_ID, ORGANS
from spar_bench.builder.sources import SOURCES, sources_command
from spar_bench.builder.sources.lits import LitsSource
from spar_bench.builder.sources.nnunet import NnUNetSource
from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource
from spar_bench.builder.sources.word import WordSource
from spar_bench.errors import CaseError, ConfigError
from spar_bench.seeding import derive_seed

LPS = np.diag([-0.8, -0.8, 2.5, 1.0])
SHAPE = (12, 10, 6)


def save(path: Path, data: np.ndarray, affine: np.ndarray = LPS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def toy_mask(left_id: int = 2, right_id: int = 1, dtype=np.uint8) -> np.ndarray:
    """Organ ``right_id`` at small i, ``left_id`` at large i (voxel axis i points to L in LPS)."""
    m = np.zeros(SHAPE, dtype=dtype)
    m[1:4, 2:6, 1:5] = right_id
    m[8:11, 2:6, 1:5] = left_id
    return m


def columns(mask: np.ndarray, organ: str) -> float:
    return float(np.nonzero(mask == ORGAN_ID[organ])[2].mean())


@pytest.fixture
def fake_renderer(monkeypatch):
    """A stand-in for spar_bench.builder.synth.render.render_pseudo_ct that records its calls."""
    from spar_bench.builder.synth import render

    calls = []

    def render_pseudo_ct(mask, spacing, *, lesion=None, seed):
        calls.append({"shape": mask.shape, "spacing": spacing, "seed": seed, "lesion": lesion})
        return np.where(mask > 0, 50, -1000).astype(np.int16)

    monkeypatch.setattr(render, "render_pseudo_ct", render_pseudo_ct)
    return calls


# --- registry and CLI ----------------------------------------------------------------------


def test_registry_names_resolve_to_classes():
    for name in ("word", "lits", "totalsegmentator", "nnunet"):
        cls = SOURCES.get(name)
        assert cls.name == name and cls.needs


def test_sources_command_lists_needs():
    result = CliRunner().invoke(sources_command, [])
    assert result.exit_code == 0
    for name in ("word", "lits", "totalsegmentator", "nnunet"):
        assert any(line.startswith(name) for line in result.output.splitlines())
    assert "labelsTr" in result.output


# --- WORD ----------------------------------------------------------------------------------


def make_word(root: Path) -> None:
    for img_dir, lab_dir, cases in (
        ("imagesTr", "labelsTr", ["w_003", "w_001"]),
        ("imagesVal", "labelsVal", ["w_002"]),
        ("imagesTs", "labelsTs", ["w_004"]),
    ):
        for cid in cases:
            save(root / lab_dir / f"{cid}.nii.gz", toy_mask())
            save(root / img_dir / f"{cid}.nii", np.full(SHAPE, 30, dtype=np.int16))


def test_word_layout_splits_sorted_and_provenance(tmp_path):
    make_word(tmp_path)
    src = WordSource(tmp_path)
    refs = src.find()
    assert [r.case_id for r in refs] == ["w_001", "w_002", "w_003", "w_004"]
    assert [r.split for r in refs] == ["train", "val", "train", "test"]
    case = src.load(refs[0])
    assert case.shape == (SHAPE[2], SHAPE[1], SHAPE[0])
    assert case.spacing == pytest.approx((2.5, 0.8, 0.8))
    assert columns(case.mask, "liver") < columns(case.mask, "spleen")
    assert case.lesion is None and not case.image_synthesized
    prov = case.provenance
    assert set(prov["sha256"]) == {"image", "mask"} and len(prov["sha256"]["mask"]) == 64
    assert prov["orientation"]["axcodes"] == "LPS" and prov["label_map"] == "word"
    assert prov["repairs"] == []
    json.dumps(prov)  # JSON-serialisable
    assert src.label_map()["ids"]["16"] == "head_of_femur_right"


def test_word_find_errors(tmp_path):
    with pytest.raises(ConfigError, match="expected"):
        WordSource(tmp_path).find()
    with pytest.raises(ConfigError, match="not a folder"):
        WordSource(tmp_path / "nope").find()
    save(tmp_path / "labelsTr" / "dup.nii.gz", toy_mask())
    save(tmp_path / "labelsTs" / "dup.nii.gz", toy_mask())
    with pytest.raises(ConfigError, match="twice"):
        WordSource(tmp_path).find()


def test_word_masks_only_needs_synthesize(tmp_path, fake_renderer):
    save(tmp_path / "labelsTs" / "m_001.nii.gz", toy_mask())
    ref = WordSource(tmp_path).find()[0]
    with pytest.raises(CaseError, match="--images synthesize"):
        WordSource(tmp_path).load(ref)
    case = WordSource(tmp_path, images="synthesize", seed=7).load(ref)
    assert case.image_synthesized and case.image.dtype == np.int16
    assert fake_renderer[0]["seed"] == derive_seed(7, "word", "m_001", "pseudo-ct")
    assert case.provenance["pseudo_ct_seed"] == fake_renderer[0]["seed"]
    assert "image" not in case.provenance["sha256"]


def test_word_real_masks_only_with_renderer(word_labels_dir, fake_renderer):
    src = WordSource(word_labels_dir, images="synthesize")
    refs = src.find()
    assert len(refs) == 20 and all(r.split == "test" for r in refs)
    case = src.load(refs[0])
    assert case.image_synthesized and case.image.shape == case.mask.shape
    assert all(case.annotated) and sum(case.present()) >= 14
    assert columns(case.mask, "liver") < columns(case.mask, "spleen")


def test_word_dicom_image_folder(tmp_path):
    from helpers import write_dicom_series

    mask = toy_mask()
    image = (mask.astype(np.int16) * 100 - 50).astype(np.int16)
    save(tmp_path / "labelsTr" / "d_001.nii.gz", mask)
    write_dicom_series(tmp_path / "imagesTr" / "d_001", image, LPS)
    src = WordSource(tmp_path)
    ref = src.find()[0]
    assert ref.files["image"].is_dir()
    case = src.load(ref)
    assert np.array_equal(case.image > 0, case.mask > 0)
    assert len(case.provenance["sha256"]["image"]) == 64


# --- LiTS ----------------------------------------------------------------------------------


def test_lits_normal_case_and_lesion_channel(tmp_path):
    seg = toy_mask(left_id=0, right_id=1)
    seg[2, 3, 2] = 2
    save(tmp_path / "batch1" / "segmentation-3.nii", seg)
    save(tmp_path / "batch1" / "volume-3.nii", np.zeros(SHAPE, dtype=np.int16))
    src = LitsSource(tmp_path)
    ref = src.find()[0]
    assert ref.case_id == "lits_0003" and ref.split == "test"
    case = src.load(ref)
    assert case.lesion is not None and int(case.lesion.sum()) == 1
    assert int((case.mask == ORGAN_ID["liver"]).sum()) == int((seg > 0).sum())  # tumour is liver
    assert case.annotated == tuple(o == "liver" for o in ORGANS)
    assert case.provenance["repairs"] == []


@pytest.mark.parametrize("liver_at_large_i", [True, False])
def test_lits_identity_affine_is_repaired_and_reported(tmp_path, liver_at_large_i):
    seg = np.zeros(SHAPE, dtype=np.uint8)
    if liver_at_large_i:
        seg[8:11, 2:6, 1:5] = 1
    else:
        seg[1:4, 2:6, 1:5] = 1
    save(tmp_path / "segmentation-0.nii.gz", seg, np.eye(4))
    save(tmp_path / "volume-0.nii.gz", np.zeros(SHAPE, dtype=np.int16), np.eye(4))
    case = LitsSource(tmp_path).load(LitsSource(tmp_path).find()[0])
    repairs = " ".join(case.provenance["repairs"])
    assert "assumed 1 mm" in repairs and "liver centroid" in repairs
    assert case.spacing == (1.0, 1.0, 1.0)
    # Whatever the header said, the liver ends up on the patient's right (small column).
    assert columns(case.mask, "liver") < SHAPE[0] / 2
    with pytest.raises(CaseError, match="identity-like"):
        src = LitsSource(tmp_path, degenerate_affine="fail")
        src.load(src.find()[0])


def test_lits_one_degenerate_header_takes_the_other(tmp_path):
    save(tmp_path / "segmentation-1.nii.gz", toy_mask(left_id=0, right_id=1), LPS)
    save(tmp_path / "volume-1.nii.gz", np.zeros(SHAPE, dtype=np.int16), np.eye(4))
    case = LitsSource(tmp_path).load(LitsSource(tmp_path).find()[0])
    assert any("image affine was degenerate" in r for r in case.provenance["repairs"])
    assert case.spacing == pytest.approx((2.5, 0.8, 0.8))


# --- nnU-Net -------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["v2", "v1"])
def test_nnunet_dataset_json_by_name(tmp_path, style):
    names = {"background": 0, "Kidney (R)": 1, "left kidney": 2, "aorta": 3, "liver_tumor": 4}
    labels = names if style == "v2" else {str(v): k for k, v in names.items()}
    (tmp_path / "dataset.json").write_text(json.dumps({"labels": labels}))
    mask = toy_mask(left_id=2, right_id=1)
    mask[5, 5, 3] = 3
    mask[6, 5, 3] = 4
    save(tmp_path / "labelsTr" / "amos_0001.nii.gz", mask)
    save(tmp_path / "imagesTr" / "amos_0001_0000.nii.gz", np.zeros(SHAPE, dtype=np.int16))
    save(tmp_path / "labelsTs" / "amos_0002.nii.gz", mask)
    src = NnUNetSource(tmp_path)
    refs = src.find()
    assert [(r.case_id, r.split) for r in refs] == [("amos_0001", "train"), ("amos_0002", "test")]
    assert "image" in refs[0].files and "image" not in refs[1].files
    case = src.load(refs[0])
    assert columns(case.mask, "kidney_right") < columns(case.mask, "kidney_left")
    assert set(np.unique(case.mask)) == {0, ORGAN_ID["kidney_left"], ORGAN_ID["kidney_right"]}
    assert case.lesion is not None and int(case.lesion.sum()) == 1 and src.has_lesions
    lm = src.label_map()
    assert lm["ignored"] == ["aorta"] and "liver" not in lm["annotated"]
    assert case.annotated[ORGANS.index("kidney_left")] and not case.annotated[ORGANS.index("liver")]


def test_nnunet_missing_dataset_json(tmp_path):
    save(tmp_path / "labelsTr" / "x.nii.gz", toy_mask())
    with pytest.raises(ConfigError, match="dataset.json"):
        NnUNetSource(tmp_path).find()


# --- ontology ------------------------------------------------------------------------------


def test_normalise_name_synonyms():
    assert normalise_name("Kidney (R)") == normalise_name("right kidney") == normalise_name("kidney_right")
    lm = label_map_from_names("t", {"Gall Bladder": 1, "Urinary_Bladder": 2, "small bowel": 3, "Femur (L)": 4})
    assert lm.ids == {1: "gallbladder", 2: "bladder", 3: "intestine", 4: "head_of_femur_left"}


def test_word_label_map_is_identity_and_uint16_maps():
    lm = label_map_from_ids("word")
    assert lm.is_identity() and all(lm.annotated) and len(lm.ids) == N_ORGANS
    raw = np.arange(17, dtype=np.uint16).reshape(1, 1, 17)
    mask, lesion = apply_label_map(raw, lm, case_id="c", path="p")
    assert mask.dtype == np.uint8 and np.array_equal(mask.ravel(), np.arange(17)) and lesion is None


# --- TotalSegmentator ----------------------------------------------------------------------


def test_totalsegmentator_real_sample(totalseg_dir):
    src = TotalSegmentatorSource(totalseg_dir)
    refs = src.find()
    assert [(r.case_id, r.split) for r in refs] == [("s0001", "test")]
    case = src.load(refs[0])
    assert case.image.dtype == np.int16 and case.spacing == (3.0, 3.0, 3.0)
    assert not case.annotated[ORGANS.index("rectum")] and sum(case.annotated) == N_ORGANS - 1
    counts = case.voxel_counts()
    for organ in ("liver", "spleen", "kidney_left", "kidney_right", "adrenal", "intestine"):
        assert counts[organ] > 0, organ
    assert columns(case.mask, "liver") < columns(case.mask, "spleen")
    assert "femur_left" in src.label_map()["classes"]
    assert any("femur" in a for a in src.label_map()["approximations"])


def copy_ts_sample(totalseg_dir: Path, dst: Path, classes: tuple[str, ...]) -> Path:
    case = dst / "s0001" / "segmentations"
    case.mkdir(parents=True)
    shutil.copy(totalseg_dir / "s0001" / "ct.nii.gz", dst / "s0001" / "ct.nii.gz")
    for c in classes:
        shutil.copy(totalseg_dir / "s0001" / "segmentations" / f"{c}.nii.gz", case / f"{c}.nii.gz")
    return dst


def test_totalsegmentator_meta_and_missing_classes(totalseg_dir, tmp_path):
    root = copy_ts_sample(totalseg_dir, tmp_path, ("liver", "spleen"))
    with pytest.raises(ConfigError, match="meta.csv"):
        TotalSegmentatorSource(root).find()
    (root / "meta.csv").write_text("image_id;split\ns0001;holdout\n")
    with pytest.raises(ConfigError, match="unknown split 'holdout'"):
        TotalSegmentatorSource(root).find()
    (root / "meta.csv").write_text("image_id;split\ns0001;train\n")
    src = TotalSegmentatorSource(root)
    case = src.load(src.find()[0])
    assert case.split == "train"
    assert case.annotated[ORGANS.index("liver")] and not case.annotated[ORGANS.index("kidney_left")]
    assert "kidney_left" in case.provenance["missing_classes"]


def test_lits_header_without_sform_qform_uses_voxel_sizes(tmp_path):
    seg = np.zeros(SHAPE, dtype=np.uint8)
    seg[8:11, 2:6, 1:5] = 1
    seg[9, 3, 2] = 2
    for name, data in (("segmentation-5.nii", seg), ("volume-5.nii", np.zeros(SHAPE, dtype=np.int16))):
        img = nib.Nifti1Image(data, None)
        img.header.set_zooms((0.7, 0.7, 2.5))
        img.set_sform(None, code=0)
        img.set_qform(None, code=0)
        nib.save(img, str(tmp_path / name))
    src = LitsSource(tmp_path)
    case = src.load(src.find()[0])
    assert case.spacing == pytest.approx((2.5, 0.7, 0.7))
    assert "from the header voxel sizes" in " ".join(case.provenance["repairs"])
    assert columns(case.mask, "liver") < SHAPE[0] / 2 and int(case.lesion.sum()) == 1


@pytest.mark.slow
def test_word_real_masks_with_real_renderer(word_labels_dir):
    src = WordSource(word_labels_dir, images="synthesize", seed=3)
    ref = src.find()[1]
    a = src.load(ref)
    assert a.image.dtype == np.int16 and a.image.shape == a.mask.shape
    liver, air = a.image[a.mask == ORGAN_ID["liver"]], a.image[0, 0, :10]
    assert float(np.median(liver)) > float(np.median(air))  # an organ is denser than the air corner
    b = WordSource(word_labels_dir, images="synthesize", seed=3).load(ref)
    assert np.array_equal(a.image, b.image)  # seeded per case: deterministic
