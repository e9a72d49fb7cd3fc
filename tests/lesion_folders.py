"""Synthetic LiTS-like and KiTS-like folders: lesions inside an organ, several components per slice.

Volumes are drawn in the canonical frame ``[z, row, col]`` (col 0 = patient's right) and
written in another axis order (LiTS-like: R,A,S; KiTS-like: S,P,L stored z-first like
KiTS), so every load goes through the reorientation. Deterministic from the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel import orientations as nio

SHAPE = (20, 64, 64)  # z, row, col
SPACING = (2.5, 1.5, 1.5)


def save_canonical(path: Path, canon: np.ndarray, axcodes: tuple[str, str, str], spacing=SPACING) -> Path:
    """Write a canonical ``[z, row, col]`` array as NIfTI with voxel axes ``axcodes``."""
    data = canon.transpose(2, 1, 0)  # (i, j, k) = (col, row, z): L, P, S
    affine = np.diag([-spacing[2], -spacing[1], spacing[0], 1.0])
    affine[:3, 3] = (30.0, -12.0, -80.0)
    t = nio.ornt_transform(nio.axcodes2ornt(("L", "P", "S")), nio.axcodes2ornt(axcodes))
    new = np.ascontiguousarray(nio.apply_orientation(data, t))
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(new, affine @ nio.inv_ornt_aff(t, data.shape)), str(path))
    return path


def _body(shape=SHAPE) -> np.ndarray:
    rr, cc = np.mgrid[: shape[1], : shape[2]]
    ell = ((rr - shape[1] / 2) / (shape[1] * 0.42)) ** 2 + ((cc - shape[2] / 2) / (shape[2] * 0.46)) ** 2 <= 1
    return np.broadcast_to(ell, shape)


def _add_lesions(organ: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` small ellipsoids (1-5 slices, radius 1.2-3 px) centred inside ``organ``."""
    lesion = np.zeros(organ.shape, bool)
    zz, rr, cc = np.nonzero(organ)
    z_i, r_i, c_i = np.mgrid[: organ.shape[0], : organ.shape[1], : organ.shape[2]]
    for _ in range(n):
        k = rng.integers(len(zz))
        rad, half = rng.uniform(1.2, 3.0), rng.integers(0, 3)
        blob = ((r_i - rr[k]) ** 2 + (c_i - cc[k]) ** 2 <= rad * rad) & (np.abs(z_i - zz[k]) <= half)
        lesion |= blob
    return lesion & organ


def lits_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(HU image, labels 0/1 liver/2 tumour), canonical. Liver on the patient's right."""
    rng = np.random.default_rng(seed)
    body = _body()
    liver = np.zeros(SHAPE, bool)
    liver[3:17, 14:40, 8 + rng.integers(0, 3) : 30] = True
    lesion = _add_lesions(liver, rng, int(rng.integers(0, 14)))
    labels = np.where(lesion, 2, np.where(liver, 1, 0)).astype(np.uint8)
    image = np.where(body, 40, -1000).astype(np.int16)
    image[liver] = 60
    image[lesion] = 20
    return image, labels


def make_lits_folder(root: Path, n: int, *, first: int = 0) -> Path:
    """``root/volume-N.nii.gz`` + ``root/segmentation-N.nii.gz`` (R,A,S like most LiTS files)."""
    for i in range(first, first + n):
        image, labels = lits_case(1000 + i)
        save_canonical(root / f"volume-{i}.nii.gz", image, ("R", "A", "S"))
        save_canonical(root / f"segmentation-{i}.nii.gz", labels, ("R", "A", "S"))
    return root


def kits_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(HU image, labels 0/1 kidney (both sides, one label)/2 tumour), canonical."""
    rng = np.random.default_rng(seed)
    body = _body()
    kidneys = np.zeros(SHAPE, bool)
    kidneys[4:16, 34:50, 10:22] = True  # patient's right
    kidneys[5:17, 34:50, 42:54] = True  # patient's left
    lesion = _add_lesions(kidneys, rng, int(rng.integers(0, 10)))
    labels = np.where(lesion, 2, np.where(kidneys, 1, 0)).astype(np.uint8)
    image = np.where(body, 40, -1000).astype(np.int16)
    image[kidneys] = 150
    image[lesion] = 60
    return image, labels


def make_kits_folder(root: Path, n: int) -> Path:
    """nnU-Net layout as KiTS ships it: dataset.json (kidney, tumor), z-first files (S,P,L)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "kidney": 1, "tumor": 2}}))
    for i in range(n):
        image, labels = kits_case(2000 + i)
        split = "Tr" if i < n - 1 else "Ts"
        save_canonical(root / f"images{split}" / f"case_{i:05d}_0000.nii.gz", image, ("S", "P", "L"))
        save_canonical(root / f"labels{split}" / f"case_{i:05d}.nii.gz", labels, ("S", "P", "L"))
    return root


def make_word_folder(root: Path, n_per_split: tuple[int, int, int] = (3, 1, 1)) -> Path:
    """A WORD-layout folder (imagesTr/labelsTr, Val, Ts) of tiny synthetic cases with 4 organs."""
    k = 0
    for split, n in zip(("Tr", "Val", "Ts"), n_per_split, strict=True):
        for _ in range(n):
            rng = np.random.default_rng(3000 + k)
            labels = np.zeros(SHAPE, np.uint8)
            s = int(rng.integers(0, 3))
            labels[2:18, 14:40, 8 + s : 30] = 1  # liver, patient's right
            labels[4:14, 14:30, 44:56] = 2  # spleen, left
            labels[5:15, 40:52, 40 - s : 50] = 3  # kidney_left
            labels[5:15, 40:52, 14:24] = 4  # kidney_right
            image = np.where(_body(), 40, -1000).astype(np.int16)
            image[labels > 0] = 60
            save_canonical(root / f"images{split}" / f"word_{k:04d}.nii.gz", image, ("L", "P", "S"))
            save_canonical(root / f"labels{split}" / f"word_{k:04d}.nii.gz", labels, ("L", "P", "S"))
            k += 1
    return root
