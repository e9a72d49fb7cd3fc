"""Every bad input gives one CaseError naming the case and the file; inspect can skip bad cases."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from spar_bench.builder.cli import cli
from spar_bench.builder.readers import read_volume
from spar_bench.builder.sources.word import WordSource
from spar_bench.clitools import run_cli
from spar_bench.errors import CaseError

AFFINE = np.diag([-0.8, -0.8, 2.5, 1.0])


def save(path: Path, data: np.ndarray, affine: np.ndarray = AFFINE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def toy_mask(dtype=np.uint8) -> np.ndarray:
    m = np.zeros((12, 10, 6), dtype=dtype)
    m[1:4, 2:6, 1:5] = 1  # "liver" at small i
    m[8:11, 2:6, 1:5] = 2
    return m


def make_case(root: Path, case_id: str, *, mask=None, image=None, mask_affine=AFFINE) -> tuple[Path, Path]:
    mask = toy_mask() if mask is None else mask
    image = np.full(mask.shape, 40, dtype=np.int16) if image is None else image
    img = save(root / "imagesTr" / f"{case_id}.nii.gz", image)
    msk = save(root / "labelsTr" / f"{case_id}.nii.gz", mask, mask_affine)
    return img, msk


def load_only(root: Path, case_id: str):
    src = WordSource(root)
    ref = next(r for r in src.find() if r.case_id == case_id)
    return src.load(ref)


def expect_case_error(root: Path, case_id: str, path: Path, *words: str) -> str:
    with pytest.raises(CaseError) as e:
        load_only(root, case_id)
    msg = str(e.value)
    assert msg.startswith(f"case {case_id}:"), msg
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    assert "\n" not in msg
    return msg


def test_good_case_loads(tmp_path):
    make_case(tmp_path, "good")
    case = load_only(tmp_path, "good")
    assert case.mask.dtype == np.uint8 and case.image.dtype == np.int16


def test_missing_file(tmp_path):
    img, _ = make_case(tmp_path, "c1")
    src = WordSource(tmp_path)
    ref = src.find()[0]
    img.unlink()
    with pytest.raises(CaseError, match="file not found") as e:
        src.load(ref)
    assert "c1" in str(e.value) and str(img) in str(e.value)


def test_truncated_gzip(tmp_path):
    _, msk = make_case(tmp_path, "c2", mask=np.random.default_rng(0).integers(0, 3, (40, 40, 20), dtype=np.uint8),
                       image=np.zeros((40, 40, 20), dtype=np.int16))
    raw = msk.read_bytes()
    msk.write_bytes(raw[: len(raw) // 2])
    expect_case_error(tmp_path, "c2", msk, "unreadable or truncated")


def test_geometry_mismatch_names_both_files(tmp_path):
    shifted = AFFINE.copy()
    shifted[2, 3] = 7.5
    img, msk = make_case(tmp_path, "c3", mask_affine=shifted)
    msg = expect_case_error(tmp_path, "c3", msk, "origin", "not on the same voxel grid")
    assert str(img) in msg


def test_nan_image(tmp_path):
    image = np.zeros(toy_mask().shape, dtype=np.float32)
    image[3, 3, 3] = np.nan
    img, _ = make_case(tmp_path, "c4", image=image)
    expect_case_error(tmp_path, "c4", img, "NaN")


def test_unknown_label_value(tmp_path):
    mask = toy_mask()
    mask[0, 0, 0] = 17
    _, msk = make_case(tmp_path, "c5", mask=mask)
    expect_case_error(tmp_path, "c5", msk, "unknown label value", "17")


def test_non_integer_labels(tmp_path):
    mask = toy_mask(np.float32)
    mask[5, 5, 2] = 1.5
    _, msk = make_case(tmp_path, "c6", mask=mask)
    expect_case_error(tmp_path, "c6", msk, "non-integer")


def test_empty_mask_file(tmp_path):
    _, msk = make_case(tmp_path, "c7")
    msk.write_bytes(b"")
    expect_case_error(tmp_path, "c7", msk, "empty")


def test_all_zero_mask(tmp_path):
    _, msk = make_case(tmp_path, "c8", mask=np.zeros((4, 4, 4), dtype=np.uint8),
                       image=np.zeros((4, 4, 4), dtype=np.int16))
    expect_case_error(tmp_path, "c8", msk, "no labelled voxel")


def test_four_d_and_zero_size(tmp_path):
    p4 = save(tmp_path / "four.nii.gz", np.zeros((3, 3, 3, 2), dtype=np.int16))
    with pytest.raises(CaseError, match="3-D") as e:
        read_volume(p4, case_id="x")
    assert str(p4) in str(e.value)
    p1 = save(tmp_path / "single.nii.gz", np.zeros((3, 3, 3, 1), dtype=np.int16))
    assert read_volume(p1, case_id="x")[0].shape == (3, 3, 3)
    p0 = save(tmp_path / "zero.nii.gz", np.zeros((3, 0, 3), dtype=np.int16))
    with pytest.raises(CaseError, match="zero size"):
        read_volume(p0, case_id="x")


def test_unsupported_file_type(tmp_path):
    p = tmp_path / "scan.mha"
    p.write_bytes(b"x")
    with pytest.raises(CaseError, match="unsupported file type"):
        read_volume(p, case_id="x")


def test_inspect_skip_continues_and_fail_stops(tmp_path, capsys):
    make_case(tmp_path, "a_good")
    mask = toy_mask()
    mask[0, 0, 0] = 99
    _, bad = make_case(tmp_path, "b_bad", mask=mask)
    make_case(tmp_path, "c_good")
    code = run_cli(cli, ["inspect", "--source", "word", "--root", str(tmp_path), "--on-error", "skip"])
    out = capsys.readouterr().out
    assert code == 0
    assert "case b_bad: SKIPPED:" in out and "unknown label value" in out and str(bad) in out
    assert "case a_good (source word" in out and "case c_good (source word" in out
    assert "2 case(s) read, 1 skipped" in out

    code = run_cli(cli, ["inspect", "--source", "word", "--root", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2
    err_lines = captured.err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: case b_bad:")
    assert "case c_good" not in captured.out


def test_integer_scaled_ct_is_read_without_float(tmp_path):
    raw = np.array([0, 1000, 1040, 3000], dtype=np.int16).reshape(1, 2, 2).repeat(2, axis=0)
    img = nib.Nifti1Image(raw, AFFINE)
    img.header.set_slope_inter(1, -1024)
    path = tmp_path / "ct.nii.gz"
    nib.save(img, str(path))
    data, _ = read_volume(path, case_id="ct")
    assert data.dtype.kind == "i"
    assert np.array_equal(data, raw.astype(np.int32) - 1024)


def make_dicom_case(root: Path, case_id: str) -> Path:
    """A WORD case whose image is a DICOM series folder (6 slices); returns that folder."""
    from helpers import write_dicom_series

    mask = toy_mask()
    save(root / "labelsTr" / f"{case_id}.nii.gz", mask)
    folder = root / "imagesTr" / case_id
    write_dicom_series(folder, (mask.astype(np.int16) * 100 - 50), AFFINE)
    return folder


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_broken_dicom_slice_is_named_as_such(tmp_path, damage):
    folder = make_dicom_case(tmp_path, "d1")
    assert load_only(tmp_path, "d1").image.shape[0] == 6  # intact series reads
    bad = sorted(folder.glob("*.dcm"))[3]
    raw = bad.read_bytes()
    bad.write_bytes({"truncated": raw[:300], "empty": b"", "garbage": b"not a dicom file"}[damage])
    msg = expect_case_error(tmp_path, "d1", bad, "broken DICOM slice")
    assert "voxel grid" not in msg


def test_missing_dicom_slice_is_a_gap_not_a_grid_mismatch(tmp_path):
    folder = make_dicom_case(tmp_path, "d2")
    sorted(folder.glob("*.dcm"))[2].unlink()
    msg = expect_case_error(tmp_path, "d2", folder, "uneven DICOM slice spacing", "slice_0001.dcm", "slice_0003.dcm")
    assert "voxel grid" not in msg


def test_a_folder_where_a_nifti_file_is_expected(tmp_path):
    make_case(tmp_path, "c9")
    label = tmp_path / "labelsTr" / "c9.nii.gz"
    label.unlink()
    label.mkdir()
    expect_case_error(tmp_path, "c9", label, "is a folder, but a NIfTI file (.nii / .nii.gz) is expected here")
