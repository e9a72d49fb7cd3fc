"""One CT with TotalSegmentator's own PREDICTED label map (not a reference segmentation).

``ROOT/ct.nii.gz`` (or ``.nii``, or a DICOM folder ``ROOT/ct/``) and ``ROOT/seg_predicted.nii.gz``:
one multi-label file in TotalSegmentator's class ids with its class table in the NIfTI header
extension (what ``TotalSegmentator --ml`` writes), read as the ``totalsegmentator`` source reads
its multi-label files. The case is ``ROOT``'s folder name, in the ``test`` split (a transfer
build: scored, never trained on). The source's name says the labels are a model's prediction,
so every key, table and report that names the source says it too; the manifest records
``labels: predicted``. Example: the full TotalSegmentator example CT of ``../shared/data/real-ct/ts-example``.
"""

from __future__ import annotations

from pathlib import Path

from spar_bench.errors import ConfigError

from ..case import CaseRef
from .totalsegmentator import TotalSegmentatorSource
from .volume import MaskRead, find_image

SEG_FILE = "seg_predicted.nii.gz"


class TotalSegmentatorPredictedSource(TotalSegmentatorSource):
    """``ROOT/ct.nii.gz`` + ``ROOT/seg_predicted.nii.gz`` (a TotalSegmentator prediction), split test."""

    name = "totalsegmentator-predicted"
    needs = f"ROOT/ct.nii.gz and ROOT/{SEG_FILE} (TotalSegmentator's multi-label prediction with its class table)"
    split_rule = "test (one predicted case)"

    def find(self) -> list[CaseRef]:
        seg = self.root / SEG_FILE
        image = find_image(self.root, "ct") if self.root.is_dir() else None
        if not seg.is_file() or image is None:
            raise ConfigError(f"totalsegmentator-predicted root {self.root}: expected {self.needs}")
        return [CaseRef(self.name, Path(self.root).resolve().name, "test", {"segmentations": seg, "image": image})]

    def read_mask(self, ref: CaseRef) -> MaskRead:
        read = super().read_mask(ref)
        read.extra["labels"] = "predicted (TotalSegmentator's own output, not a reference segmentation)"
        return read
