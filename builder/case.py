"""One canonical case: what every source adapter produces and every sampler consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .schema import N_ORGANS, ORGANS


@dataclass(frozen=True)
class CaseRef:
    """A case found on disk, before it is read.

    ``files`` maps a role (``"image"``, ``"mask"``, ``"mask:<class>"``, ``"dicom"``)
    to a path. ``case_id`` is unique within its source and stable across runs.
    ``patient_id`` groups cases of one patient (splits and bootstrap are by patient).
    ``problem`` is set by ``find`` for a case it cannot build (an image without its
    label, a ``meta.csv`` row without its folder): loading it raises a CaseError with
    that text, so the build stops on it or, with ``--on-error skip``, records it.
    """

    source: str
    case_id: str
    split: str
    files: dict[str, Path]
    patient_id: str | None = None
    problem: str | None = None

    @property
    def patient(self) -> str:
        return self.patient_id or self.case_id


@dataclass
class Case:
    """A case in the canonical frame (see :mod:`spar_bench.builder.schema`).

    Arrays are indexed ``[z, row, col]``: z inferior->superior, row 0 anterior,
    col 0 = patient's right.

    Attributes:
        image: int16 Hounsfield units, or ``None`` until a masks-only case is rendered.
        mask: uint8 canonical organ ids (0 background, 1..16 = ``ORGANS``).
        lesion: uint8 binary lesion channel, or ``None`` when the source has no
            lesion annotation (then the counting probe is not asked).
        spacing: voxel size in mm, ``(z, row, col)``.
        annotated: for each canonical organ, whether the source annotates it at all
            (TotalSegmentator has no rectum: ``False``). An annotated organ can still
            be absent from a case; an unannotated one is never zero-filled silently.
        image_synthesized: the image is a pseudo-CT rendered from the masks.
        provenance: JSON-serialisable record: files and sha256, orientation found and
            applied, label map used, repairs made.
    """

    source: str
    case_id: str
    split: str
    mask: np.ndarray
    spacing: tuple[float, float, float]
    image: np.ndarray | None = None
    lesion: np.ndarray | None = None
    annotated: tuple[bool, ...] = (True,) * N_ORGANS
    image_synthesized: bool = False
    patient_id: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mask.ndim != 3:
            raise ValueError(f"case {self.case_id}: mask must be 3-D [z,row,col], got {self.mask.shape}")
        for name in ("image", "lesion"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != self.mask.shape:
                raise ValueError(
                    f"case {self.case_id}: {name} shape {arr.shape} != mask shape {self.mask.shape}"
                )
        if len(self.annotated) != N_ORGANS:
            raise ValueError(f"case {self.case_id}: annotated needs {N_ORGANS} flags")

    @property
    def patient(self) -> str:
        return self.patient_id or self.case_id

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.mask.shape)  # type: ignore[return-value]

    def voxel_counts(self) -> dict[str, int]:
        """Voxels per canonical organ (0 for absent organs)."""
        counts = np.bincount(self.mask.ravel(), minlength=N_ORGANS + 1)
        return {name: int(counts[i + 1]) for i, name in enumerate(ORGANS)}

    def present(self) -> tuple[bool, ...]:
        counts = np.bincount(self.mask.ravel(), minlength=N_ORGANS + 1)
        return tuple(bool(c) for c in counts[1 : N_ORGANS + 1])
