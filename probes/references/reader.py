"""The appearance reader: a tiny model of known behaviour for Level 3 questions, as a
:class:`~.predictors.Predictor` (run kind ``reader``).

It reads every slice as appearance tokens (:func:`appearance_tokens`: per patch of a 16 x 16
tiling, the share of its pixels in each grey-level bin) and can do either of two things: find
organs A and B by their grey-level bins (attention over patches) and compare their centres
(computation), or answer from the question alone (a learned answer per organ pair and axis:
recall). Which it learns is up to its training layouts: trained on canonical phantoms of
``distinct`` organ intensities it recalls, trained on random layouts it computes. The
calibration tests (tests/test_calibration.py) judge the benchmark's controls on it. Its blind
baseline is the probe's prior.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spar_bench.builder.schema import LEVEL_SPECS, N_ORGANS
from spar_bench.errors import ConfigError

from ..finetune.organmaps import organ_shares, slice_level
from ..runs.build_job import OnBuild
from ..runs.predictors import ConstantPrior

READER_BINS, READER_GRID, READER_L2 = 24, 16, 0.1


def appearance_tokens(build, split: str, rows: np.ndarray, bins: int = READER_BINS,
                      grid: int = READER_GRID) -> np.ndarray:
    """``(N, grid*grid, bins)`` float32: per patch of a ``grid`` x ``grid`` tiling of each Level 3
    slice (224 frame), the share of its pixels in each of ``bins`` grey-level bins. Organs of
    ``distinct`` intensity fall in different bins: a patch's bins say which organs it holds."""

    img = build.images(slice_level(), split, rows).astype(np.int64) * bins // 256  # (N, 224, 224)
    side = img.shape[1] // grid
    return organ_shares(img[:, : grid * side, : grid * side], grid, bins)  # a grey-level bin per "label"


def reader_module(n_classes: int, bins: int, grid: int):
    """The reader network (see the module doc)."""
    import torch

    class Reader(torch.nn.Module):
        def __init__(self):
            super().__init__()
            lin = torch.linspace(-1.0, 1.0, grid)
            self.register_buffer("xy", torch.stack([lin.repeat(grid), lin.repeat_interleave(grid)], dim=1))
            self.organ = torch.nn.Parameter(torch.zeros(N_ORGANS, bins))
            self.recall = torch.nn.Parameter(torch.zeros(N_ORGANS + 1, N_ORGANS + 1, 2, n_classes))
            self.compare = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, n_classes))

        def forward(self, tokens, slice_of, a, b, axis):
            """``tokens (S, T, bins)`` of the slices, ``slice_of`` each item's slice; organs, axis."""
            w = torch.softmax(20.0 * torch.einsum("stk,ok->sot", tokens, self.organ), dim=2)
            centre = torch.einsum("sot,tc->soc", w, self.xy)  # every organ's centre on every slice
            d = centre[slice_of, a.clamp(min=0)] - centre[slice_of, b.clamp(min=0)]
            ax = torch.nn.functional.one_hot(axis.clamp(0, 1), 2).float()
            feats = torch.cat([d[:, :, None] * ax[:, None, :], d.abs()[:, :, None] * ax[:, None, :]], 1).flatten(1)
            return self.compare(feats) + self.recall[a + 1, b + 1, axis.clamp(0, 1)]

    return Reader()


def reader_inputs(build, t, split: str):
    """``(tokens, each item's slice, {organ_a, organ_b, axis, answer})`` of items ``t``, as tensors."""
    import torch

    rows, inv = np.unique(t.rows, return_inverse=True)
    tok = torch.from_numpy(appearance_tokens(build, split, rows))
    q = {k: torch.from_numpy(t.y[k].astype(np.int64)) for k in ("organ_a", "organ_b", "axis", "answer")}
    return tok, torch.from_numpy(inv.astype(np.int64)), q


@dataclass
class AppearanceReader(OnBuild):
    """The reader of one Level 3 probe on ``build``, trained by :meth:`fit` (full batch, Adam,
    ``steps``; ``l2`` penalises the organ bins' weights: finding organs has to pay for itself)."""

    spec: Any
    build: Any
    seed: int = 0
    steps: int = 300
    lr: float = 0.05
    l2: float = READER_L2
    model: Any = None
    kind: str = "reader"

    def __post_init__(self) -> None:
        if not self.spec.asks or LEVEL_SPECS[self.spec.level].volume:
            raise ConfigError(f"the appearance reader answers Level 3 questions, not {self.spec.name}")

    @classmethod
    def on_build(cls, spec, build) -> AppearanceReader:
        return cls(spec, build)

    def fit(self, train, val) -> None:
        """Train on ``train``'s original (not mirrored) items."""
        import torch

        tok, inv, q = reader_inputs(self.build, train, train.split)
        keep = torch.from_numpy(~np.asarray(train.is_mirror, bool))
        torch.manual_seed(self.seed)
        self.model = reader_module(self.spec.n_classes, tok.shape[-1], READER_GRID)
        opt = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        for _ in range(self.steps):
            opt.zero_grad()
            out = self.model(tok, inv[keep], q["organ_a"][keep], q["organ_b"][keep], q["axis"][keep])
            loss = torch.nn.functional.cross_entropy(out, q["answer"][keep]) + self.l2 * self.model.organ.pow(2).sum()
            loss.backward()
            opt.step()

    def predict(self, t, split: str = "test") -> np.ndarray:
        import torch

        if self.model is None:
            raise ConfigError(f"{self.spec.name}: the appearance reader predicts only after fit()")
        tok, inv, q = reader_inputs(self.build, t, split)
        with torch.no_grad():
            out = self.model(tok, inv, q["organ_a"], q["organ_b"], q["axis"])
        return out.argmax(1).numpy()

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)
