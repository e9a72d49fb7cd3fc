"""Volume sources: :class:`VolumeSource`, the shared image + mask loading of every source
(read, check geometry, canonicalise, record provenance), and the folder helpers the
layouts share (:func:`find_image`, :func:`check_unique`, :meth:`VolumeSource.find_pairs`).

A masks-only folder is read with ``images="synthesize"``: the image is then a pseudo-CT
rendered from the masks by :func:`spar_bench.builder.synth.render.render_pseudo_ct`,
seeded per case and recorded. Concrete layouts (WORD, LiTS, TotalSegmentator, nnU-Net,
the phantom) subclass :class:`VolumeSource` and implement ``find``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from spar_bench.errors import CaseError, ConfigError
from spar_bench.seeding import derive_seed

from ..case import Case, CaseRef
from ..ontology import LabelMap, label_map_from_ids, map_labels, split_sided
from ..readers import (
    as_hu_int16,
    as_integer_labels,
    file_sha256,
    is_nifti,
    read_volume,
    strip_nifti_suffix,
)
from ..synth import render
from .base import Source


class MaskFile(NamedTuple):
    """One file a mask was read from, for the image/mask geometry check and the provenance digests."""

    path: Path
    #: The file's 4x4 voxel-to-world affine, as read.
    affine: np.ndarray
    #: The file's voxel grid shape, as read.
    shape: tuple[int, ...]


class MaskRead(NamedTuple):
    """A mask read by :meth:`VolumeSource.read_mask`, ready for canonicalisation."""

    #: Canonical organ ids (uint8, 0 = background) on the file's raw voxel grid.
    mask: np.ndarray
    #: The lesion channel on the same grid, or None when the source has no lesion label.
    lesion: np.ndarray | None
    #: The mask's voxel-to-world affine (before any header repair).
    affine: np.ndarray
    #: Every file the mask was read from (several for one-file-per-class layouts).
    files: list[MaskFile]
    #: Provenance extras recorded for the case; an ``"annotated"`` key overrides the label
    #: map's per-organ annotated flags for this case (and is popped, not recorded).
    extra: dict


def find_image(folder: Path, stem: str) -> Path | None:
    """``folder/<stem>.nii.gz``, ``.nii`` or a DICOM folder ``folder/<stem>/``, if present."""
    for candidate in (folder / f"{stem}.nii.gz", folder / f"{stem}.nii", folder / stem):
        if candidate.exists():
            return candidate
    return None


def _images_in(folder: Path, suffix: str = "") -> dict[str, Path]:
    """``case_id -> image`` of every ``<case_id><suffix>.nii[.gz]`` file or DICOM folder in ``folder``."""
    found: dict[str, Path] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not (is_nifti(path) or path.is_dir()):
            continue
        stem = strip_nifti_suffix(path.name)
        if stem.endswith(suffix):
            found[stem[: len(stem) - len(suffix)]] = path
    for case_id in found:  # the same preference as find_image: .nii.gz, .nii, DICOM folder
        found[case_id] = find_image(folder, f"{case_id}{suffix}") or found[case_id]
    return found


def _first_file(ref: CaseRef) -> Path | None:
    return ref.files.get("mask") or next(iter(ref.files.values()), None)


def check_unique(refs: list[CaseRef], root: Path) -> list[CaseRef]:
    """Sort refs by case_id; ConfigError when two files claim one case id."""
    seen: dict[str, CaseRef] = {}
    for ref in refs:
        if ref.case_id in seen:
            raise ConfigError(
                f"{root}: case id {ref.case_id!r} appears twice "
                f"({_first_file(seen[ref.case_id])} and {_first_file(ref)}); case ids must be unique"
            )
        seen[ref.case_id] = ref
    return sorted(refs, key=lambda r: r.case_id)


class VolumeSource(Source):
    """Shared :meth:`load`: read image and mask, check geometry, canonicalise, record provenance.

    Subclasses implement :meth:`find` and may override :meth:`get_label_map`,
    :meth:`read_mask` (several files per mask) and :meth:`resolve_affines` (header repairs).
    """

    labels_manifest: ClassVar[str] = ""

    def get_label_map(self) -> LabelMap:
        if not hasattr(self, "_label_map_cache"):
            self._label_map_cache = label_map_from_ids(self.labels_manifest)
        return self._label_map_cache

    def label_map(self) -> dict:
        return self.get_label_map().to_dict()

    # ---- hooks -------------------------------------------------------------------------
    def read_mask(self, ref: CaseRef) -> MaskRead:
        path = ref.files["mask"]
        raw, affine = read_volume(path, case_id=ref.case_id)
        raw = as_integer_labels(raw, case_id=ref.case_id, path=path)
        mask, lesion, ignored = map_labels(raw, self.get_label_map(), case_id=ref.case_id, path=path,
                                           unknown=self.unknown_labels)
        extra = {"ignored_label_ids": {str(k): v for k, v in ignored.items()}} if ignored else {}
        return MaskRead(mask, lesion, affine, [MaskFile(Path(path), affine, tuple(raw.shape))], extra)

    def resolve_affines(
        self, ref: CaseRef, image_affine: np.ndarray | None, mask_affine: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray, list[str]]:
        """Repair broken headers before the geometry check; return the repairs made (default none)."""
        return image_affine, mask_affine, []

    # ---- load --------------------------------------------------------------------------
    def load(self, ref: CaseRef) -> Case:
        return self.read_case(ref)

    def read_case(self, ref: CaseRef, *, masks_only: bool = False) -> Case:
        """:meth:`load`; ``masks_only`` reads only the masks (no image, nothing rendered: inspect)."""
        cid = ref.case_id
        if ref.problem:  # found incomplete (an image without its label, ...)
            raise CaseError(cid, _first_file(ref), ref.problem)
        image_path = None if masks_only else self._image_path(ref)
        read = self.read_mask(ref)
        mask, lesion, mask_files, extra = read.mask, read.lesion, read.files, read.extra
        annotated = extra.pop("annotated", self.get_label_map().annotated)
        image = image_affine = None
        if image_path is not None:
            data, image_affine = read_volume(image_path, case_id=cid)
            image = as_hu_int16(data, case_id=cid, path=image_path)
        image_affine, mask_affine, repairs = self.resolve_affines(ref, image_affine, read.affine, mask)
        if image is not None:
            _check_grids(cid, image_path, image_affine, image.shape, mask_files, mask_affine if repairs else None)
        image_c, mask_c, lesion_c, spacing, info = _to_canonical(image, image_affine, mask, lesion, mask_affine, extra)
        if self.get_label_map().sided and not mask_c.flags.writeable:  # a view of the file's bytes
            mask_c = mask_c.copy()
        sided = split_sided(mask_c, image_c) if self.get_label_map().sided else None
        if sided:
            extra["sided_split"] = sided
        provenance = self._provenance(ref, info, spacing, repairs, extra,
                                      [("image", image_path)] if image is not None else [], mask_files)
        synthesized = image_c is None and not masks_only
        if synthesized:
            seed = derive_seed(self.seed, self.name, cid, "pseudo-ct")
            image_c = render_pseudo_ct_checked(mask_c, spacing, lesion=lesion_c, seed=seed, case_id=cid)
            provenance["pseudo_ct_seed"] = seed
        provenance["image_synthesized"] = synthesized
        return Case(
            source=self.name, case_id=cid, split=ref.split, mask=mask_c, spacing=spacing, image=image_c,
            lesion=lesion_c, annotated=annotated, image_synthesized=synthesized, patient_id=ref.patient_id,
            provenance=provenance,
        )

    def _image_path(self, ref: CaseRef) -> Path | None:
        """The image to read (None when synthesizing); CaseError for a missing one."""
        if self.images == "synthesize":
            return None
        image_path = ref.files.get("image")
        if image_path is None:
            mask_path = ref.files.get("mask") or next(iter(ref.files.values()), None)
            raise CaseError(
                ref.case_id,
                mask_path,
                "no image for this case (masks-only folder); pass --images synthesize "
                "(images='synthesize') to render a pseudo-CT from the masks",
            )
        return image_path

    def _provenance(self, ref: CaseRef, info: dict, spacing, repairs: list[str], extra: dict,
                    hashed: list[tuple[str, Path]], mask_files: list[MaskFile]) -> dict[str, Any]:
        provenance: dict[str, Any] = {
            "source": self.name,
            "files": {role: str(p) for role, p in ref.files.items()},
            "sha256": {},
            "orientation": info,
            "spacing": list(spacing),
            "label_map": self.get_label_map().name,
            "repairs": repairs,
            **extra,
        }
        hashed = hashed + [(f"mask:{f.path.name}" if len(mask_files) > 1 else "mask", f.path) for f in mask_files]
        for role, p in hashed:
            provenance["sha256"][role] = file_sha256(p)  # digest taken while reading
        return provenance

    #: Image folders that may hold images without labels (nnU-Net's unlabelled imagesTs):
    #: they are used only when their label folder exists.
    unlabelled_image_dirs: ClassVar[tuple[str, ...]] = ()

    def find_pairs(self, split_dirs, image_suffix: str = "") -> list[CaseRef]:
        """Cases of a folder layout: each mask in ``label_dir`` with its image, if any.

        ``split_dirs`` lists ``(image_dir, label_dir, split)``; the image of mask
        ``X.nii.gz`` is ``image_dir/X<image_suffix>.nii[.gz]`` or a DICOM folder. An
        image without its mask, and a mask without its image in a folder that has
        images, are cases with a ``problem`` (never dropped without a word).
        """
        if not self.root.is_dir():
            raise ConfigError(f"{self.name} root {self.root} is not a folder; expected {self.needs}")
        refs: list[CaseRef] = []
        for image_dir, label_dir, split in split_dirs:
            folder = self.root / label_dir
            images = _images_in(self.root / image_dir, image_suffix)
            labels = sorted(p for p in folder.iterdir() if is_nifti(p) and not p.name.startswith(".")) \
                if folder.is_dir() else []
            # a label without its image is a problem beside other images; in a masks-only
            # folder it is what --images synthesize is for (load explains that)
            imaged = bool(images) and self.images != "synthesize"
            for path in labels:
                case_id = strip_nifti_suffix(path.name)
                files = {"mask": path}
                image = images.pop(case_id, None)
                problem = None
                if image is not None:
                    files["image"] = image
                elif imaged:
                    problem = (f"label without its image: no {image_dir}/{case_id}{image_suffix}.nii.gz "
                               "(nor a DICOM folder) beside the other images")
                refs.append(CaseRef(self.name, case_id, split, files, problem=problem))
            if not folder.is_dir() and image_dir in self.unlabelled_image_dirs:
                continue
            refs += [CaseRef(self.name, case_id, split, {"image": image},
                             problem=f"image without its label: no {label_dir}/{case_id}.nii.gz")
                     for case_id, image in images.items()]
        if not refs:
            raise ConfigError(f"no {self.name} cases found in {self.root}; expected {self.needs}")
        return check_unique(refs, self.root)


def _check_grids(case_id: str, image_path, image_affine, image_shape, mask_files: list[MaskFile],
                 repaired_affine) -> None:
    """Every mask file on the image's grid (compared in the canonical frame; repaired headers share one affine)."""
    from ..frame import check_same_geometry

    for f in mask_files:
        check_same_geometry(image_affine, image_shape, f.affine if repaired_affine is None else repaired_affine,
                            f.shape, case_id=case_id, image_path=image_path, mask_path=f.path)


def _to_canonical(image, image_affine, mask, lesion, mask_affine, extra: dict):
    """``(image, mask, lesion, spacing, info)`` in the canonical frame.

    The mask goes through its OWN transform (another axis order of the image's grid is
    fine; recorded in ``extra["mask_orientation"]``); spacing and ``info`` are the image's.
    The arrays are views of the arrays read (no copy; read-only where those are).
    """
    from ..frame import apply_canonical, canonical_spacing, canonical_transform

    ref_affine = image_affine if image is not None else mask_affine
    info = canonical_transform(ref_affine)
    spacing = canonical_spacing(ref_affine, info)
    mask_info = canonical_transform(mask_affine)
    if mask_info["transform"] != info["transform"]:
        extra["mask_orientation"] = mask_info
    mask_c = apply_canonical(mask, mask_info)
    lesion_c = apply_canonical(lesion, mask_info) if lesion is not None else None
    image_c = apply_canonical(image, info) if image is not None else None
    return image_c, mask_c, lesion_c, spacing, info


def render_pseudo_ct_checked(
    mask: np.ndarray, spacing: tuple[float, float, float], *, lesion: np.ndarray | None, seed: int, case_id: str
) -> np.ndarray:
    """Call :func:`spar_bench.builder.synth.render.render_pseudo_ct` and check what it returns."""
    image = render.render_pseudo_ct(mask, spacing, lesion=lesion, seed=seed)
    if image.shape != mask.shape:
        raise CaseError(case_id, None, f"pseudo-CT has shape {image.shape}, mask {mask.shape}")
    return np.asarray(image, dtype=np.int16)
