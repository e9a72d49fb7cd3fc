"""Canonical frame: real anatomy decides left/right, and re-encoded copies give identical arrays."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage as ndi

from spar_bench.builder.frame import (
    canonical_transform,
    check_same_geometry,
    is_degenerate_affine,
    to_canonical,
    voxel_spacing,
)
from spar_bench.builder.readers import read_dicom_series, read_nifti, sitk_to_ras_affine
from spar_bench.builder.schema import ORGAN_ID
from spar_bench.errors import CaseError

from helpers import write_dicom_series


def organ_columns(mask: np.ndarray, organs: tuple[str, ...]) -> dict[str, float]:
    """Mean column index of each organ in a canonical [z,row,col] mask."""
    ids = [ORGAN_ID[o] for o in organs]
    boxes = ndi.find_objects(mask, max_label=max(ids))
    out = {}
    for organ, i in zip(organs, ids, strict=True):
        box = boxes[i - 1]
        assert box is not None, f"{organ} missing"
        cols = np.nonzero(mask[box] == i)[2] + box[2].start
        out[organ] = float(cols.mean())
    return out


def assert_anatomy(mask: np.ndarray, name: str) -> None:
    c = organ_columns(mask, ("liver", "spleen", "kidney_left", "kidney_right"))
    assert c["liver"] < c["spleen"], f"{name}: liver column {c['liver']:.1f} >= spleen {c['spleen']:.1f}"
    assert c["kidney_right"] < c["kidney_left"], f"{name}: right kidney not at a smaller column than left"


def word_files(word_labels_dir: Path) -> list[Path]:
    files = sorted((word_labels_dir / "labelsTs").glob("*.nii.gz"))
    assert len(files) == 20
    return files


# --- real anatomy ------------------------------------------------------------------------


@pytest.mark.slow
def test_all_real_word_maps_have_patient_right_at_small_columns(word_labels_dir):
    for path in word_files(word_labels_dir):
        data, affine = read_nifti(path, case_id=path.name)
        mask, spacing, info = to_canonical(data, affine)
        assert info["axcodes"] == "LPS"
        assert spacing[0] >= 2.0 and spacing[1] < 1.0  # z is the slice axis
        assert_anatomy(mask.astype(np.uint8), path.name)


def test_two_real_word_maps_anatomy(word_labels_dir):
    for path in word_files(word_labels_dir)[:2]:
        data, affine = read_nifti(path, case_id=path.name)
        assert_anatomy(to_canonical(data, affine)[0], path.name)


def test_real_totalsegmentator_case_ras_gives_same_answers(totalseg_dir):
    from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource

    src = TotalSegmentatorSource(totalseg_dir)
    case = src.load(src.find()[0])
    assert case.provenance["orientation"]["axcodes"] == "RAS"
    assert_anatomy(case.mask, "totalsegmentator s0001")


# --- re-encodings ------------------------------------------------------------------------


def _flip_axis(data, affine, axis):
    n = data.shape[axis]
    flip = np.eye(4)
    flip[axis, axis] = -1
    flip[axis, 3] = n - 1
    return np.flip(data, axis), affine @ flip


def _permute(data, affine, order):
    perm = np.eye(4)[:, [*order, 3]]
    return data.transpose(order), affine @ perm


@pytest.fixture(scope="module")
def small_word_case(request):
    """A real WORD map downsampled 4x in-plane (keeps orientation, fast to re-encode)."""
    word_labels_dir = request.getfixturevalue("word_labels_dir")
    path = word_files(word_labels_dir)[3]
    data, affine = read_nifti(path, case_id=path.name)
    data = np.ascontiguousarray(data[::4, ::4, :])
    affine = affine @ np.diag([4.0, 4.0, 1.0, 1.0])
    return data.astype(np.uint8), affine


def _save(tmp_path: Path, name: str, data, affine) -> Path:
    path = tmp_path / f"{name}.nii.gz"
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


@pytest.mark.parametrize(
    "encode",
    ["identity", "flip_i", "flip_j", "flip_k", "transpose_ij", "transpose_kji", "ras", "uint16"],
)
def test_reencoded_copies_are_identical(small_word_case, tmp_path, encode):
    data, affine = small_word_case
    ref, ref_spacing, _ = to_canonical(data, affine)
    assert_anatomy(ref, "downsampled")
    d, a = data, affine
    if encode.startswith("flip_"):
        d, a = _flip_axis(d, a, "ijk".index(encode[-1]))
    elif encode == "transpose_ij":
        d, a = _permute(d, a, (1, 0, 2))
    elif encode == "transpose_kji":
        d, a = _permute(d, a, (2, 1, 0))
    elif encode == "ras":
        d, a = _flip_axis(*_flip_axis(d, a, 0), 1)
    elif encode == "uint16":
        d = d.astype(np.uint16)
    path = _save(tmp_path, encode, np.ascontiguousarray(d), a)
    back, back_affine = read_nifti(path, case_id=encode)
    out, spacing, info = to_canonical(back, back_affine)
    if encode == "ras":
        assert info["axcodes"] == "RAS"
    assert np.array_equal(out, ref)
    assert np.allclose(spacing, ref_spacing)




def test_dicom_series_gives_identical_canonical_array(small_word_case, tmp_path):
    data, affine = small_word_case
    data = np.ascontiguousarray(data[:, :, 40:80])  # 40 slices keep the DICOM round trip fast
    affine = affine.copy()
    affine[:3, 3] = affine[:3, :3] @ np.array([0, 0, 40]) + affine[:3, 3]
    ref, ref_spacing, _ = to_canonical(data, affine)
    folder = tmp_path / "dicom"
    write_dicom_series(folder, data, affine)
    back, back_affine = read_dicom_series(folder, case_id="dcm")
    assert np.allclose(back_affine, affine, atol=1e-3)
    out, spacing, _ = to_canonical(back, back_affine)
    assert np.array_equal(out, ref)
    assert np.allclose(spacing, ref_spacing, atol=1e-4)


# --- helpers -----------------------------------------------------------------------------


def test_transform_info_and_spacing():
    affine = np.diag([0.8, 0.7, 2.5, 1.0])  # R, A, S with anisotropic voxels
    data = np.zeros((4, 3, 2), dtype=np.uint8)
    out, spacing, info = to_canonical(data, affine)
    assert info["axcodes"] == "RAS" and info["target_axcodes"] == "LPS"
    assert out.shape == (2, 3, 4)
    assert spacing == pytest.approx((2.5, 0.7, 0.8))
    assert voxel_spacing(affine) == pytest.approx((0.8, 0.7, 2.5))
    assert canonical_transform(np.diag([-1.0, -1, 1, 1]))["axcodes"] == "LPS"


def test_sitk_affine_lps_to_ras():
    affine = sitk_to_ras_affine((1, 0, 0, 0, 1, 0, 0, 0, 1), (0.5, 0.5, 2.0), (10.0, 20.0, 30.0))
    assert np.allclose(affine[:3, :3], np.diag([-0.5, -0.5, 2.0]))
    assert np.allclose(affine[:3, 3], [-10.0, -20.0, 30.0])


def test_degenerate_affine_detection():
    assert is_degenerate_affine(np.eye(4))
    assert is_degenerate_affine(np.diag([-1.0, 1.0, 1.0, 1.0]) + np.array([[0, 0, 0, 5.0]] * 3 + [[0, 0, 0, 0]]))
    assert not is_degenerate_affine(np.diag([0.7, 0.7, 2.5, 1.0]))


def test_check_same_geometry_names_both_files():
    a = np.diag([0.8, 0.8, 2.0, 1.0])
    check_same_geometry(a, (4, 4, 4), a.copy(), (4, 4, 4), case_id="c", image_path="img.nii", mask_path="m.nii")
    b = a.copy()
    b[0, 3] = 5.0
    with pytest.raises(CaseError) as e:
        check_same_geometry(a, (4, 4, 4), b, (4, 4, 5), case_id="c", image_path="img.nii", mask_path="m.nii")
    msg = str(e.value)
    assert "case c" in msg and "img.nii" in msg and "m.nii" in msg
    assert "origin" in msg and "shape" in msg


def test_describe_transform_words():
    from spar_bench.builder.frame import describe_transform

    assert describe_transform(canonical_transform(np.diag([1.0, 1, 1, 1]) * 0.9 + np.diag([0, 0, 0, 0.1]))) == (
        "i->col flipped, j->row flipped, k->z"
    )
    assert describe_transform(canonical_transform(np.diag([-0.9, -0.9, 2.0, 1.0]))) == "i->col, j->row, k->z"
