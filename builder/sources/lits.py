"""LiTS (Liver Tumor Segmentation challenge): ``volume-N.nii[.gz]`` + ``segmentation-N.nii[.gz]``.

Labels: 1 liver, 2 tumour (``manifests/labels/lits.json``). Tumour voxels are liver in
the organ mask and form the lesion channel; every other canonical organ is flagged
not annotated.

Broken headers
--------------
Several LiTS volumes carry an identity-like affine (identity, or axis-aligned 1 mm
voxels: no spacing information), or a header with ``sform_code == qform_code == 0``
(no declared orientation). Such a header is "degenerate". Rule, applied per case and REPORTED in
``case.provenance["repairs"]``:

1. If only one of image / segmentation has a degenerate affine, it takes the other
   file's affine (same voxel grid: the shapes must agree).
2. If both are degenerate, the voxel grid is kept, with the header's voxel sizes when
   they are not all 1 mm, else 1 mm (recorded as assumed), and the lateral axis is decided from anatomy: the liver lies on the
   patient's right, so the ``i`` axis is oriented such that the liver's centroid falls
   on the patient's right half. Anterior/posterior and superior/inferior are taken from
   the header as they are and recorded as unverified.
   With ``degenerate_affine="fail"`` such a case raises a CaseError instead.

Cases are all put in the split ``test`` by default (LiTS is an evaluation source here);
``split=`` changes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import numpy as np

from spar_bench.errors import CaseError, ConfigError

from ..case import CaseRef
from ..frame import is_degenerate_affine, voxel_spacing
from ..readers import is_nifti, nifti_has_orientation, strip_nifti_suffix
from ..schema import ORGAN_ID, SPLITS
from .volume import VolumeSource, check_unique

_VOLUME = re.compile(r"^volume-(\d+)$")
DEGENERATE_MODES = ("repair", "fail")


class LitsSource(VolumeSource):
    """LiTS: ``ROOT/**/volume-N.nii[.gz]`` with ``segmentation-N.nii[.gz]`` in the same or a sibling folder."""

    name = "lits"
    needs = "ROOT/volume-N.nii[.gz] and ROOT/segmentation-N.nii[.gz] (any subfolders; 1 liver, 2 tumour)"
    has_lesions = True
    labels_manifest: ClassVar[str] = "lits"
    split_rule: ClassVar[str] = "default: test (LiTS has no official split here; see --split-ratio)"

    def __init__(
        self,
        root: str | Path,
        *,
        images: str = "auto",
        seed: int = 0,
        split: str = "test",
        degenerate_affine: str = "repair",
        unknown_labels: str = "fail",
    ):
        super().__init__(root, images=images, seed=seed, unknown_labels=unknown_labels)
        if split not in SPLITS:
            raise ConfigError(f"lits split must be one of {SPLITS}, got {split!r}")
        if degenerate_affine not in DEGENERATE_MODES:
            raise ConfigError(f"degenerate_affine must be one of {DEGENERATE_MODES}, got {degenerate_affine!r}")
        self.split = split
        self.degenerate_affine = degenerate_affine

    def find(self) -> list[CaseRef]:
        if not self.root.is_dir():
            raise ConfigError(f"lits root {self.root} is not a folder; expected {self.needs}")
        segs: dict[str, Path] = {}
        vols: dict[str, Path] = {}
        for path in sorted(self.root.rglob("*")):
            if not is_nifti(path):
                continue
            stem = strip_nifti_suffix(path.name)
            if m := _VOLUME.match(stem):
                vols[m.group(1)] = path
            elif m := re.match(r"^segmentation-(\d+)$", stem):
                segs[m.group(1)] = path
        refs = []
        for number, seg in segs.items():
            files, problem = {"mask": seg}, None
            if number in vols:
                files["image"] = vols[number]
            elif vols and self.images != "synthesize":
                problem = f"label without its image: no volume-{number}.nii[.gz] beside the other volumes"
            refs.append(CaseRef(self.name, f"lits_{int(number):04d}", self.split, files, problem=problem))
        refs += [CaseRef(self.name, f"lits_{int(number):04d}", self.split, {"image": vol},
                         problem=f"image without its label: no segmentation-{number}.nii[.gz] found")
                 for number, vol in vols.items() if number not in segs]
        if not refs:
            raise ConfigError(f"no lits cases found in {self.root}; expected {self.needs}")
        return check_unique(refs, self.root)

    def resolve_affines(
        self, ref: CaseRef, image_affine: np.ndarray | None, mask_affine: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray, list[str]]:
        mask_path, image_path = ref.files["mask"], ref.files.get("image")
        bad_mask = is_degenerate_affine(mask_affine) or not nifti_has_orientation(mask_path)
        bad_image = image_affine is not None and (
            is_degenerate_affine(image_affine) or not nifti_has_orientation(image_path)
        )
        if not (bad_mask or bad_image):
            return image_affine, mask_affine, []
        if self.degenerate_affine == "fail":
            which = mask_path if bad_mask else image_path
            raise CaseError(
                ref.case_id, which,
                "identity-like affine (no orientation/spacing information); "
                "use degenerate_affine='repair' or fix the header",
            )
        if image_affine is not None and bad_image != bad_mask:
            if bad_image:
                return mask_affine.copy(), mask_affine, [f"image affine was degenerate: took the affine of {mask_path}"]
            return image_affine, image_affine.copy(), [f"mask affine was degenerate: took the affine of {image_path}"]
        # Both degenerate (or mask-only): 1 mm voxels, lateral axis from the liver's side.
        liver = mask == ORGAN_ID["liver"]
        if not liver.any():
            raise CaseError(
                ref.case_id, mask_path,
                "identity-like affine and no liver voxel to decide left/right from; fix the header",
            )
        counts = liver.sum(axis=(1, 2), dtype=np.int64)
        centroid_i = float((np.arange(mask.shape[0]) * counts).sum() / counts.sum())
        centre = (mask.shape[0] - 1) / 2.0
        # Voxel axis i points to the patient's Right ("R") iff the liver sits at large i.
        sign_x = 1.0 if centroid_i >= centre else -1.0
        spacing = voxel_spacing(mask_affine)
        if is_degenerate_affine(mask_affine):
            spacing, spacing_note = (1.0, 1.0, 1.0), "spacing unknown, assumed 1 mm on every axis"
        else:
            spacing_note = f"spacing {tuple(round(v, 4) for v in spacing)} mm from the header voxel sizes"
        affine = np.diag([sign_x * spacing[0], spacing[1], spacing[2], 1.0])
        repairs = [
            f"image and mask headers were degenerate (identity-like or no sform/qform): {spacing_note}",
            f"lateral axis from anatomy: liver centroid at i={centroid_i:.1f} of {mask.shape[0]}, so voxel axis i "
            f"points to the patient's {'right' if sign_x > 0 else 'left'}",
            "anterior/posterior and superior/inferior taken from the header unverified (j->A, k->S)",
        ]
        return (affine.copy() if image_affine is not None else None), affine, repairs
