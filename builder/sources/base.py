"""The interface every source adapter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from ..case import Case, CaseRef

#: How a source gets its image: ``auto`` reads images where they exist and fails on a
#: masks-only folder with a hint; ``require`` fails when any image is missing;
#: ``synthesize`` renders a pseudo-CT from the masks (recorded in the case).
IMAGE_MODES = ("auto", "require", "synthesize")


class Source(ABC):
    """A folder of CT cases in one layout.

    Subclasses set ``name`` and ``needs`` (one line: what must be on disk) and
    implement :meth:`find` and :meth:`load`. ``find`` is cheap (lists files, reads no
    voxels) and returns refs sorted by ``case_id``; ``load`` reads one case into the
    canonical frame or raises :class:`~spar_bench.errors.CaseError`.
    """

    name: ClassVar[str]
    needs: ClassVar[str]
    has_lesions: ClassVar[bool] = False
    #: How :meth:`find` assigns splits (recorded per case as ``split_origin``).
    split_rule: ClassVar[str] = "as the source lists it"

    def __init__(self, root: str | Path, *, images: str = "auto", seed: int = 0, unknown_labels: str = "fail"):
        if images not in IMAGE_MODES:
            raise ValueError(f"images must be one of {IMAGE_MODES}, got {images!r}")
        if unknown_labels not in ("fail", "ignore"):
            raise ValueError(f"unknown_labels must be 'fail' or 'ignore', got {unknown_labels!r}")
        self.unknown_labels = unknown_labels
        self.root = Path(root)
        self.images = images
        self.seed = seed  # for pseudo-CT rendering of masks-only cases

    @abstractmethod
    def find(self) -> list[CaseRef]: ...

    @abstractmethod
    def load(self, ref: CaseRef) -> Case: ...

    def label_map(self) -> dict:
        """The label map used (written into the build manifest)."""
        return {}
