"""Read CT images and label maps from NIfTI files and DICOM series into one representation.

Every reader returns ``(data, affine)``: ``data`` is indexed ``(i, j, k)`` exactly as
stored in the file, and ``affine`` is the 4x4 voxel-to-world matrix in nibabel's RAS+
convention (world ``x`` grows towards the patient's Right, ``y`` towards Anterior, ``z``
towards Superior). :mod:`spar_bench.builder.frame` turns this into the canonical ``[z, row, col]``.

* NIfTI headers are parsed by nibabel (never ``get_fdata``: no float64 copy of a 100 MB
  volume), from the file's bytes read once: hashed there (:func:`file_sha256` gives the
  provenance digest without a second read) and gunzipped in one zlib call into an output
  presized from the gzip trailer (no chunked stream reads, no regrowth, the CRC checked
  by zlib as it inflates). The voxels are a read-only view of those decompressed bytes
  (no copy); integer scaling makes a new array, other scaling goes through nibabel.
* A DICOM series folder is read with SimpleITK's ``ImageSeriesReader``. SimpleITK
  returns arrays ``(z, y, x)`` and LPS physical coordinates; the array is transposed
  to ``(x, y, z)`` and the affine built from direction, spacing and origin, then its
  first two rows are negated (LPS -> RAS).

Every problem becomes a :class:`~spar_bench.errors.CaseError` naming the case and the
file: missing file, a folder where a NIfTI file is expected, unreadable / truncated / empty
file, a broken DICOM slice or a gap in a series, 4-D or zero-size data, NaN or infinite
intensities, non-integer label values.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from pathlib import Path

import numpy as np

from spar_bench.errors import CaseError

NIFTI_SUFFIXES = (".nii.gz", ".nii")

#: Reading a file yields (data indexed (i, j, k), 4x4 RAS affine).
Volume = tuple[np.ndarray, np.ndarray]


def strip_nifti_suffix(name: str) -> str:
    """``"word_0014.nii.gz"`` -> ``"word_0014"`` (also ``.nii``)."""
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_nifti(path: Path) -> bool:
    return path.name.endswith(NIFTI_SUFFIXES)


def _squeeze_to_3d(data: np.ndarray, *, case_id: str, path: Path) -> np.ndarray:
    """Drop trailing singleton axes (``(x, y, z, 1)``); refuse real 4-D and empty data."""
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise CaseError(
            case_id,
            path,
            f"expected a 3-D volume, got shape {tuple(data.shape)} "
            "(4-D / multi-channel data is not supported: split it into 3-D files)",
        )
    if data.size == 0:
        raise CaseError(case_id, path, f"volume has zero size (shape {tuple(data.shape)})")
    return data


def _stored_voxels(proxy, buf: bytes) -> np.ndarray:
    """The stored (unscaled) voxels of a nibabel array proxy: a read-only view of ``buf``,
    the file's decompressed bytes (nibabel would copy them into a new array)."""
    shape = tuple(int(s) for s in proxy.shape)
    dtype = np.dtype(proxy.dtype)
    offset = int(proxy.offset)
    n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset + n_bytes > len(buf):
        raise OSError(f"Expected {n_bytes} bytes, got {max(len(buf) - offset, 0)} bytes - could the file be damaged?")
    return np.ndarray(shape, dtype, buffer=buf, offset=offset, order=getattr(proxy, "order", "F"))


def _read_dataobj(proxy, buf: bytes) -> np.ndarray:
    """Voxel values of a nibabel array proxy, with integer scaling kept in integers.

    CT files often store int16 with ``scl_inter = -1024``; nibabel would return float64
    (8 bytes per voxel). An integral slope and intercept on integer storage are applied in
    int32 (int64 for 32-bit storage) instead; unscaled voxels are a read-only view of
    ``buf`` (:func:`_stored_voxels`); any other scaling goes through nibabel.
    """
    slope = float(getattr(proxy, "slope", 1.0))
    inter = float(getattr(proxy, "inter", 0.0))
    dtype = np.dtype(getattr(proxy, "dtype", np.float64))
    scaled = (slope, inter) != (1.0, 0.0)
    if not scaled:
        return _stored_voxels(proxy, buf)
    if dtype.kind in "iu" and slope.is_integer() and inter.is_integer():
        data = _stored_voxels(proxy, buf).astype(np.int64 if dtype.itemsize >= 4 else np.int32)
        if slope != 1.0:
            data *= int(slope)
        data += int(inter)
        return data
    return np.asanyarray(proxy)


#: sha256 of the files read last: ``(resolved path, size, mtime_ns) -> hex digest``.
_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGESTS_KEEP = 256


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, from the digest taken when :func:`read_nifti` read it, if it did.

    A file that changed since (size or modification time) is hashed again; folders and
    unread files go to :func:`spar_bench.hashing.sha256_file`.
    """
    from spar_bench.hashing import sha256_file

    path = Path(path)
    if path.is_file():
        digest = _DIGESTS.get(_file_key(path))
        if digest is not None:
            return digest
    return sha256_file(path)


#: Deflate never inflates more than about 1032:1; a trailer claiming more is no size hint.
_MAX_DEFLATE_RATIO = 1032


def gunzip(raw: bytes) -> bytes:
    """The first gzip member of ``raw``, decompressed (zlib checks its CRC and length).

    One zlib call whose output buffer is presized from the trailer's ISIZE (the size of a
    single-member file's data, mod 2**32): no regrowth and no copy of the result.
    :func:`_load_nifti_once` falls back to :func:`gzip.decompress` (every member) when the
    first member does not hold the whole image.
    """

    isize = int.from_bytes(raw[-4:], "little") if len(raw) >= 18 else 0
    hint = isize if 0 < isize <= _MAX_DEFLATE_RATIO * len(raw) + (1 << 16) else 1 << 16
    return zlib.decompress(raw, wbits=31, bufsize=hint)


def _nifti_from_bytes(data: bytes):
    import nibabel as nib

    klass = nib.Nifti2Image if data[:4] in (b"\x1c\x02\x00\x00", b"\x00\x00\x02\x1c") else nib.Nifti1Image
    holder = nib.FileHolder(fileobj=io.BytesIO(data))
    return klass.from_file_map({"header": holder, "image": holder})


def _voxel_end(img) -> int:
    """Byte offset just past the voxels the header of ``img`` declares."""
    proxy = img.dataobj
    shape = tuple(int(s) for s in getattr(proxy, "shape", img.shape))
    return int(getattr(proxy, "offset", 0)) + int(np.prod(shape, dtype=np.int64)) * np.dtype(img.get_data_dtype()).itemsize


def _load_nifti_once(path: Path):
    """``(nibabel image, its decompressed bytes)`` of a NIfTI file read ONCE: bytes hashed
    (kept for :func:`file_sha256`), gunzipped in one call (:func:`gunzip`), parsed in memory."""

    key = _file_key(path)
    raw = path.read_bytes()
    if len(_DIGESTS) >= _DIGESTS_KEEP:
        _DIGESTS.clear()
    _DIGESTS[key] = hashlib.sha256(raw).hexdigest()
    if not path.name.endswith(".gz"):
        return _nifti_from_bytes(raw), raw
    data = gunzip(raw)
    img = _nifti_from_bytes(data)
    if len(data) < _voxel_end(img):  # a multi-member file (bgzip): read every member
        data = gzip.decompress(raw)
        img = _nifti_from_bytes(data)
    return img, data


def read_nifti(path: str | Path, *, case_id: str) -> Volume:
    """Read a ``.nii`` / ``.nii.gz`` file into ``(data, affine)``; errors name the file."""
    path = Path(path)
    if not path.exists():
        raise CaseError(case_id, path, "file not found")
    if path.stat().st_size == 0:
        raise CaseError(case_id, path, "file is empty (0 bytes); re-download or re-export it")
    try:
        img, buf = _load_nifti_once(path)
        shape = tuple(int(s) for s in img.shape)
        if len(shape) < 3 or 0 in shape:
            return _squeeze_to_3d(np.empty(shape), case_id=case_id, path=path), img.affine
        data = _read_dataobj(img.dataobj, buf)
        affine = np.asarray(img.affine, dtype=np.float64)
    except CaseError:
        raise
    except Exception as e:  # nibabel, gzip, zlib and OS errors all mean "cannot read it"
        raise CaseError(
            case_id, path, f"unreadable or truncated NIfTI file ({type(e).__name__}: {e})"
        ) from None
    if not np.all(np.isfinite(affine)):
        raise CaseError(case_id, path, "header affine contains NaN or inf")
    return _squeeze_to_3d(data, case_id=case_id, path=path), affine


def nifti_has_orientation(path: str | Path) -> bool:
    """Whether a NIfTI header declares its geometry (``sform_code`` or ``qform_code`` > 0).

    With both codes 0 nibabel falls back to an affine built from the voxel sizes alone,
    whose orientation is a guess. Reads the header only. A non-NIfTI path (a DICOM folder)
    returns True: DICOM always states its geometry.
    """
    import nibabel as nib

    path = Path(path)
    if path.is_dir() or not is_nifti(path):
        return True
    try:
        header = nib.load(str(path)).header
        return bool(int(header["sform_code"]) > 0 or int(header["qform_code"]) > 0)
    except Exception:  # unreadable files are reported by read_nifti itself
        return True


def sitk_to_ras_affine(direction: tuple[float, ...], spacing: tuple[float, ...], origin: tuple[float, ...]) -> np.ndarray:
    """The RAS affine of a SimpleITK image given as direction (row-major 3x3), spacing, origin (LPS)."""
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(direction, dtype=np.float64).reshape(3, 3) * np.asarray(spacing, dtype=np.float64)
    lps[:3, 3] = origin
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps


def _sitk_reason(e: BaseException, path: Path) -> str:
    """The informative last line of a SimpleITK exception, without its file name."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = lines[-1].removeprefix("sitk::ERROR:").strip() if lines else type(e).__name__
    return last.replace(f'"{path}"', "the file").replace(str(path), "the file")


def _broken_slice(case_id: str, path: Path, why: str) -> CaseError:
    return CaseError(
        case_id, path, f"broken DICOM slice ({why}); the series in {path.parent.name}/ would miss it: "
        "replace the file, or remove it if it is not part of the series",
    )


def _raise_broken_slice(folder: Path, names: list[str], *, case_id: str) -> None:
    """Name the first slice of the series that does not read on its own (if any)."""
    import SimpleITK as sitk

    for name in names:
        try:
            sitk.ReadImage(name)
        except Exception as e:
            raise _broken_slice(case_id, Path(name), _sitk_reason(e, Path(name))) from None


def _check_slices(folder: Path, names: list[str], *, case_id: str) -> None:
    """Every file of a series folder is a readable slice, and the slices are evenly spaced.

    GDCM leaves a file it cannot parse out of the series, which then reads as a volume one
    slice short (a misleading image/mask grid mismatch); a deleted slice gives a gap.
    """
    import SimpleITK as sitk

    listed = {Path(n).name for n in names}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in listed:
            try:
                info = sitk.ImageFileReader()
                info.SetFileName(str(path))
                info.ReadImageInformation()
            except Exception as e:  # a file GDCM could not place: broken, empty, not DICOM
                raise _broken_slice(case_id, path, _sitk_reason(e, path)) from None
    if len(names) < 3:
        return
    positions = []
    for name in names:
        info = sitk.ImageFileReader()
        info.SetFileName(name)
        info.ReadImageInformation()
        positions.append(np.asarray(info.GetOrigin(), dtype=np.float64))
    steps = np.linalg.norm(np.diff(np.stack(positions), axis=0), axis=1)
    if steps.min() <= 0 or steps.max() > 1.5 * steps.min():
        at = int(np.argmax(steps)) if steps.min() > 0 else int(np.argmin(steps))
        raise CaseError(
            case_id, folder,
            f"uneven DICOM slice spacing ({steps.min():.4g} to {steps.max():.4g} mm, between "
            f"{Path(names[at]).name} and {Path(names[at + 1]).name}): a slice is missing or duplicated",
        )


def read_dicom_series(folder: str | Path, *, case_id: str) -> Volume:
    """Read the one DICOM series in ``folder`` into ``(data (x, y, z), RAS affine)``."""
    import SimpleITK as sitk

    folder = Path(folder)
    if not folder.is_dir():
        raise CaseError(case_id, folder, "DICOM folder not found")
    try:
        series = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    except Exception as e:
        raise CaseError(case_id, folder, f"cannot list DICOM series ({e})") from None
    if not series:
        raise CaseError(case_id, folder, "folder holds no readable DICOM series")
    if len(series) > 1:
        raise CaseError(
            case_id,
            folder,
            f"folder holds {len(series)} DICOM series ({', '.join(series)}); keep one series per folder",
        )
    names = list(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series[0]))
    _check_slices(folder, names, case_id=case_id)
    try:
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(names)
        img = reader.Execute()
        data = sitk.GetArrayFromImage(img)  # (z, y, x)
    except Exception as e:
        _raise_broken_slice(folder, names, case_id=case_id)
        raise CaseError(case_id, folder, f"unreadable DICOM series ({type(e).__name__}: {e})") from None
    if img.GetDimension() != 3 or img.GetNumberOfComponentsPerPixel() != 1:
        raise CaseError(case_id, folder, "DICOM series is not a single-channel 3-D volume")
    data = np.ascontiguousarray(data.transpose(2, 1, 0))
    affine = sitk_to_ras_affine(img.GetDirection(), img.GetSpacing(), img.GetOrigin())
    return _squeeze_to_3d(data, case_id=case_id, path=folder), affine


def read_volume(path: str | Path, *, case_id: str) -> Volume:
    """Read a NIfTI file or a DICOM series folder (a directory) into ``(data, affine)``."""
    path = Path(path)
    if path.is_dir() and is_nifti(path):
        raise CaseError(case_id, path, "is a folder, but a NIfTI file (.nii / .nii.gz) is expected here")
    if path.is_dir():
        return read_dicom_series(path, case_id=case_id)
    if not path.exists():
        raise CaseError(case_id, path, "file not found")
    if not is_nifti(path):
        raise CaseError(case_id, path, "unsupported file type: expected .nii, .nii.gz or a DICOM folder")
    return read_nifti(path, case_id=case_id)


def as_hu_int16(data: np.ndarray, *, case_id: str, path: str | Path) -> np.ndarray:
    """Image intensities as int16 HU: reject NaN/inf, round floats, clip to the int16 range."""
    if data.dtype == np.int16:
        return data
    if np.issubdtype(data.dtype, np.floating):
        finite = np.isfinite(data)
        if not finite.all():
            n_bad = int(data.size - np.count_nonzero(finite))
            raise CaseError(case_id, path, f"image contains {n_bad} NaN or infinite intensities")
        data = np.rint(data)
    elif not np.issubdtype(data.dtype, np.integer) and data.dtype != np.bool_:
        raise CaseError(case_id, path, f"image has unsupported data type {data.dtype}")
    return np.clip(data, -32768, 32767).astype(np.int16)


def as_integer_labels(data: np.ndarray, *, case_id: str, path: str | Path) -> np.ndarray:
    """Label values as a non-negative integer array; reject NaN, fractions and negatives."""
    if data.dtype == np.bool_:
        return data.view(np.uint8)
    if np.issubdtype(data.dtype, np.floating):
        if not np.all(np.isfinite(data)):
            raise CaseError(case_id, path, "label map contains NaN or infinite values")
        rounded = np.rint(data)
        bad = rounded != data
        if bad.any():
            example = float(data[bad].flat[0])
            raise CaseError(
                case_id,
                path,
                f"label map has non-integer values (e.g. {example:g}); "
                "is this an image or a probability map instead of a label map?",
            )
        data = rounded
        lo, hi = float(data.min()), float(data.max())
        if lo < 0:
            raise CaseError(case_id, path, f"label map has negative label value {lo:g}")
        return data.astype(np.uint8 if hi <= 255 else np.uint16 if hi <= 65535 else np.int64)
    if not np.issubdtype(data.dtype, np.integer):
        raise CaseError(case_id, path, f"label map has unsupported data type {data.dtype}")
    if np.issubdtype(data.dtype, np.signedinteger):
        lo = int(data.min())
        if lo < 0:
            raise CaseError(case_id, path, f"label map has negative label value {lo}")
    return data
