"""TotalSegmentator class files are united exactly: ids by organ order, overlaps counted."""

from __future__ import annotations

import shutil

import nibabel as nib
import numpy as np
import pytest

from spar_bench.builder.schema import ORGAN_ID
from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource
from spar_bench.errors import CaseError


def test_overlapping_class_files_are_counted_and_written_in_organ_order(totalseg_dir, tmp_path):
    root = tmp_path / "ts"
    shutil.copytree(totalseg_dir, root)
    seg = root / "s0001" / "segmentations"
    liver, spleen = nib.load(str(seg / "liver.nii.gz")), nib.load(str(seg / "spleen.nii.gz"))
    a = np.asanyarray(liver.dataobj).astype(np.uint8)
    b = np.asanyarray(spleen.dataobj).astype(np.uint8)
    b[a > 0] = 1  # the spleen file claims every liver voxel too
    nib.save(nib.Nifti1Image(b, spleen.affine, spleen.header), str(seg / "spleen.nii.gz"))
    src = TotalSegmentatorSource(root)
    case = src.load(src.find()[0])
    assert case.provenance["overlap_voxels"] == int(np.count_nonzero(a))  # liver first, spleen second
    assert np.count_nonzero(case.mask == ORGAN_ID["liver"]) == 0  # the later organ (spleen) wins
    assert np.count_nonzero(case.mask == ORGAN_ID["spleen"]) == int(np.count_nonzero(b))


def test_a_non_binary_class_file_is_refused(totalseg_dir, tmp_path):
    root = tmp_path / "ts"
    shutil.copytree(totalseg_dir, root)
    path = root / "s0001" / "segmentations" / "stomach.nii.gz"
    img = nib.load(str(path))
    data = np.asanyarray(img.dataobj).astype(np.uint8)
    data[data > 0] = 3
    nib.save(nib.Nifti1Image(data, img.affine, img.header), str(path))
    src = TotalSegmentatorSource(root)
    with pytest.raises(CaseError, match="binary class mask has value 3"):
        src.load(src.find()[0])
