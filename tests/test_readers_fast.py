"""The builder's NIfTI reader (bytes gunzipped once, voxels a view of them) gives nibabel's values.

It also reads multi-member gzip files (bgzip-style), and names a file cut short.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from spar_bench.builder.readers import file_sha256, read_nifti
from spar_bench.errors import CaseError
from spar_bench.hashing import sha256_file

AFFINE = np.diag([-0.8, -0.8, 2.5, 1.0])


def _save(path: Path, data: np.ndarray, *, slope=None, inter=None, dtype=None) -> Path:
    img = nib.Nifti1Image(data, AFFINE)
    if dtype is not None:
        img.set_data_dtype(dtype)
    if slope is not None:
        img.header.set_slope_inter(slope, inter)
    nib.save(img, str(path))
    return path


CASES = {
    "uint8.nii.gz": dict(data=np.arange(7 * 6 * 5, dtype=np.uint8).reshape(7, 6, 5) % 17),
    "int16.nii": dict(data=(np.arange(7 * 6 * 5, dtype=np.int16).reshape(7, 6, 5) * 13 - 900)),
    "ct-intercept.nii.gz": dict(data=np.arange(7 * 6 * 5, dtype=np.float64).reshape(7, 6, 5) - 1024,
                                slope=1.0, inter=-1024.0, dtype=np.int16),
    "float-slope.nii.gz": dict(data=np.linspace(-5, 5, 7 * 6 * 5).reshape(7, 6, 5),
                               slope=0.25, inter=0.5, dtype=np.int16),
    "bigendian.nii.gz": dict(data=np.arange(7 * 6 * 5, dtype=">i2").reshape(7, 6, 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_equal_nibabel(tmp_path, name):
    path = _save(tmp_path / name, **CASES[name])
    data, affine = read_nifti(path, case_id="c")
    expected = np.asanyarray(nib.load(str(path)).dataobj)
    np.testing.assert_array_equal(data, expected)
    np.testing.assert_allclose(affine, AFFINE)
    assert file_sha256(path) == sha256_file(path)  # the digest taken while reading


def test_multi_member_gzip_reads_every_member(tmp_path):
    data = (np.arange(9 * 8 * 7, dtype=np.int16).reshape(9, 8, 7) * 7) % 301
    plain = _save(tmp_path / "x.nii", data).read_bytes()
    cut = len(plain) // 3  # members split inside the header's extent and inside the voxels
    path = tmp_path / "x.nii.gz"
    path.write_bytes(gzip.compress(plain[:cut]) + gzip.compress(plain[cut:]))
    got, _ = read_nifti(path, case_id="c")
    np.testing.assert_array_equal(got, data)


def test_truncated_uncompressed_file_is_named(tmp_path):
    path = _save(tmp_path / "m.nii", np.ones((10, 10, 10), np.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CaseError, match="unreadable or truncated") as e:
        read_nifti(path, case_id="c")
    assert str(path) in str(e.value)


def test_voxels_are_read_only_views(tmp_path):
    path = _save(tmp_path / "m.nii.gz", np.ones((4, 4, 4), np.uint8))
    data, _ = read_nifti(path, case_id="c")
    assert not data.flags.writeable  # nothing downstream may edit the file's voxels in place
