"""The finetuned encoder + head as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

``fit`` trains the encoder and the head end to end (:class:`.loop.Trainer`, checkpointed and
resumable); ``predict`` encodes the items' images with the trained encoder once and runs the
head on them, so the run is scored by the same evaluation as a head on cached features.
Its blind baseline is ``fit``'s: the same head trained on the question alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runs.predictors import BlindHead


@dataclass
class FinetunedEncoder:
    """``encoding`` (the trainable encoder on its device) + ``model`` (the head) of run ``run``."""

    run: Any
    encoding: Any
    model: Any
    input_kind: str
    dims: tuple[int, int]
    trainer: Any = None
    val_split: str = "val"
    resume: bool = False
    kind: str = "finetune"

    def fit(self, train, val):
        """Train encoder and head (``trainer``); the training record (:class:`.loop.Trainer`'s)."""
        from .loop import Split

        level = self.run.spec.level
        return self.trainer.fit(Split(train, level, "train"), Split(val, level, self.val_split), self.resume)

    def predict(self, t, split: str = "test") -> np.ndarray:
        from ..train import predict
        from .data import remap

        rows = np.unique(t.rows)
        feats = self.encoding.features(self.run.spec.level, split, rows, self.model, self.input_kind)
        return predict(self.model, feats, remap(t, rows))

    def blind(self) -> BlindHead:
        return BlindHead.of(self.run, self.model, self.dims)
