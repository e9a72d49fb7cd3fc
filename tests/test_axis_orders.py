"""Same voxels, other order: a mask stored in any of the 48 axis flips/permutations of its
image's grid is the same grid (beside a NIfTI image and beside a DICOM series written by
SimpleITK); a real difference (spacing, extent, origin, obliquity) is refused naming both files."""

from __future__ import annotations

import itertools
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from spar_bench.builder.frame import check_same_geometry
from spar_bench.builder.sources.word import WordSource
from spar_bench.errors import CaseError

SHAPE = (12, 10, 7)  # (i, j, k) of the image file
#: A RAS affine with every axis flipped/permuted: i -> anterior-posterior, j -> left-right, k -> S.
AFFINE = np.array([[0.0, -0.8, 0.0, 40.0], [0.9, 0.0, 0.0, -30.0], [0.0, 0.0, 2.5, 11.0], [0, 0, 0, 1]])


def labelled_mask() -> np.ndarray:
    """Asymmetric labels (no flip or permutation of it equals it): organs 1..4 in corners."""
    m = np.zeros(SHAPE, np.uint8)
    m[1:4, 1:3, 1:3] = 1
    m[8:11, 2:6, 2:5] = 2
    m[2:5, 6:9, 4:6] = 3
    m[6, 7, 1] = 4
    return m


def image_volume() -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.int16).reshape(SHAPE) % 200) - 100


def reorder(data: np.ndarray, affine: np.ndarray, perm: tuple[int, ...], flips: tuple[bool, ...]):
    """The same voxels with new axis a = old axis perm[a], flipped where flips[a]; its affine."""
    new = data.transpose(perm)
    t = np.zeros((4, 4))
    t[3, 3] = 1
    for a, (old, flip) in enumerate(zip(perm, flips, strict=True)):
        t[old, a] = -1.0 if flip else 1.0
        t[old, 3] = new.shape[a] - 1 if flip else 0.0
    new = new[tuple(slice(None, None, -1) if f else slice(None) for f in flips)]
    return np.ascontiguousarray(new), affine @ t


ORDERS = [(p, f) for p in itertools.permutations(range(3)) for f in itertools.product((False, True), repeat=3)]


def write_dicom_series(folder: Path, data: np.ndarray, affine: np.ndarray) -> None:
    """Write ``data`` (i, j, k) with a RAS ``affine`` as a DICOM series, one file per k, with SimpleITK."""
    import SimpleITK as sitk

    folder.mkdir(parents=True)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine
    spacing = np.sqrt((lps[:3, :3] ** 2).sum(axis=0))
    direction = lps[:3, :3] / spacing
    img = sitk.GetImageFromArray(data.transpose(2, 1, 0).astype(np.int16))  # sitk wants (z, y, x)
    img.SetSpacing(tuple(float(s) for s in spacing))
    img.SetOrigin(tuple(float(v) for v in lps[:3, 3]))
    img.SetDirection(tuple(float(v) for v in direction.ravel()))
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    orient = "\\".join(f"{v:.6f}" for v in (*direction[:, 0], *direction[:, 1]))
    for k in range(data.shape[2]):
        sl = img[:, :, k]
        pos = img.TransformIndexToPhysicalPoint((0, 0, k))
        for tag, value in (
            ("0008|0060", "CT"), ("0020|000d", "1.2.826.0.1.3680043.2.1125.1"),
            ("0020|000e", "1.2.826.0.1.3680043.2.1125.1.2"), ("0020|0013", str(k + 1)),
            ("0020|0032", "\\".join(f"{v:.6f}" for v in pos)), ("0020|0037", orient),
            ("0018|0050", f"{spacing[2]:.6f}"), ("0028|1052", "0"), ("0028|1053", "1"),
        ):
            sl.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"slice{k:03d}.dcm"))
        writer.Execute(sl)


@pytest.fixture(scope="module", params=["nifti", "dicom"])
def image_folder(request, tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp(f"orders-{request.param}")
    (root / "imagesTs").mkdir()
    if request.param == "nifti":
        nib.save(nib.Nifti1Image(image_volume(), AFFINE), root / "imagesTs" / "c.nii.gz")
    else:
        write_dicom_series(root / "imagesTs" / "c", image_volume(), AFFINE)
    return root, request.param


def load_with_mask(root: Path, data: np.ndarray, affine: np.ndarray):
    (root / "labelsTs").mkdir(exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), root / "labelsTs" / "c.nii.gz")
    src = WordSource(root)
    return src.load(src.find()[0])


@pytest.mark.slow
def test_all_48_axis_orders_give_the_same_canonical_labels(image_folder):
    root, kind = image_folder
    ref = load_with_mask(root, labelled_mask(), AFFINE)
    assert set(np.unique(ref.mask)) == {0, 1, 2, 3, 4}
    distinct = set()
    for perm, flips in ORDERS:
        data, aff = reorder(labelled_mask(), AFFINE, perm, flips)
        distinct.add(data.tobytes() + bytes(str(data.shape), "ascii"))
        case = load_with_mask(root, data, aff)
        assert np.array_equal(case.mask, ref.mask), (kind, perm, flips)
        assert np.array_equal(case.image, ref.image) and case.spacing == ref.spacing
    assert len(distinct) == 48  # the 48 files really differ on disk


@pytest.mark.parametrize("what", ["spacing", "extent", "origin", "oblique"])
def test_a_real_difference_is_refused_naming_both_files(image_folder, what):
    root, _ = image_folder
    data, aff = reorder(labelled_mask(), AFFINE, (2, 0, 1), (True, False, True))
    if what == "spacing":
        aff = aff @ np.diag([1.0, 1.0, 1.01, 1.0])
    elif what == "extent":
        data = data[:, :, :-1]
    elif what == "origin":
        aff = aff.copy()
        aff[1, 3] += 0.5
    else:
        c, s = np.cos(np.radians(3)), np.sin(np.radians(3))
        aff = np.array([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]) @ aff
    with pytest.raises(CaseError, match="not on the same voxel grid") as e:
        load_with_mask(root, data, aff)
    msg = str(e.value)
    assert "imagesTs" in msg and "labelsTs" in msg
    expected = {"spacing": "spacing", "extent": "shape", "origin": "origin", "oblique": "direction"}[what]
    assert expected in msg


def test_check_same_geometry_accepts_flips_and_permutations_only():
    for perm, flips in ORDERS:
        _, aff = reorder(labelled_mask(), AFFINE, perm, flips)
        shape = tuple(SHAPE[p] for p in perm)
        check_same_geometry(AFFINE, SHAPE, aff, shape, case_id="c", image_path="i", mask_path="m")
    _, aff = reorder(labelled_mask(), AFFINE, (1, 0, 2), (False, False, False))
    with pytest.raises(CaseError, match="shape"):  # permuted affine, but the data kept its shape
        check_same_geometry(AFFINE, SHAPE, aff, SHAPE, case_id="c", image_path="i", mask_path="m")


def test_a_build_with_the_mask_in_another_axis_order_gives_the_same_shards(tmp_path):
    """Done-when: an image/mask pair in different axis orders builds, with the labels of the one-order pair."""
    import json

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    from lesion_folders import make_word_folder

    one = make_word_folder(tmp_path / "one", (2, 0, 1))
    other = tmp_path / "other"
    import shutil

    shutil.copytree(one, other)
    for path in sorted((other / "labelsTr").glob("*.nii.gz")):
        img = nib.load(str(path))
        data, aff = reorder(np.asarray(img.dataobj), img.affine, (2, 0, 1), (True, False, True))
        nib.save(nib.Nifti1Image(data, aff), str(path))
    args = ["--source", "word", "--levels", "level1,level3", "--samples-per-case", "2", "--no-hf"]
    assert run_cli(cli, [*args, "--root", str(one), "--out", str(tmp_path / "a")]) == 0
    assert run_cli(cli, [*args, "--root", str(other), "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert a["fingerprint"] == b["fingerprint"]  # every shard byte-identical: same labels, same questions
    reordered = [c["provenance"].get("mask_orientation") for c in b["cases"]]
    assert [m is not None for m in reordered] == [True, True, False]
    assert reordered[0]["axcodes"] != a["cases"][0]["provenance"]["orientation"]["axcodes"]
