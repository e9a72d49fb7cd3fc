"""Predictors: what a run trains and asks for answers, behind one interface.

A :class:`Predictor` is fitted on the training items (validation items for early stopping)
and predicts the items of a split; :meth:`Predictor.blind` gives the same predictor without
the image (the blind baseline), or None when it has none. The run's evaluation
(:mod:`.evaluate`) and runner (:mod:`.session`) know nothing else about it, so a new run
kind is one class:

* :class:`CachedHead`: a probe head on cached features (``spar-probe fit``/``sweep``);
* :class:`BlindHead`: the same head on the question alone (every item reads one zero row);
* :class:`ConstantPrior`: the probe's input-free optimum, fitted on train (a reference
  predictor: every score it gets comes from the label distribution alone);
* the finetuned encoder + head (:class:`spar_bench.probes.finetune.predictor.FinetunedEncoder`)
  and the MLLM (:class:`spar_bench.probes.vqa.predictor.Mllm`) implement it in their packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from spar_bench.errors import ConfigError

from .inputs import Splits, finite, load_features
from .store import HEAD_FILE, METRICS_FILE


@runtime_checkable
class Predictor(Protocol):
    """What a run needs of the thing it evaluates."""

    #: the run kind it reports (``head``, ``finetune``, ``mllm``, ``prior``)
    kind: str

    def fit(self, train, val) -> Any:
        """Train on ``train`` (Targets), stopping on ``val``; returns a training record or None."""

    def predict(self, t, split: str) -> np.ndarray:
        """Predictions for the items ``t`` of cache/build split ``split`` (the spec's layout)."""

    def blind(self) -> Predictor | None:
        """The same predictor without the image (not yet fitted), or None."""


def blind_targets(t):
    """The same items with every feature row pointing at a single all-zero row."""
    b = t.subset(np.arange(len(t)))
    b.rows = np.zeros(len(t), dtype=np.int64)
    return b


# --------------------------------------------------------------------------- heads on cached features
def new_head(cache, run, kind: str):
    """A seeded head sized from the cache; token heads get their fixed PCA projection."""
    from spar_bench.seeding import derive_seed

    from ..heads import build_head
    from ..train import seeded

    level, layer, seed = run.spec.level, run.layer, run.seed
    first = (
        np.asarray(cache.pooled(level, "train", layer=layer)[:1])
        if kind == "pooled"
        else np.asarray(cache.tokens(level, "train", layer=layer, rows=np.arange(1)))
    )
    in_dim, n_tokens = int(first.shape[-1]), (int(first.shape[1]) if kind == "tokens" else 1)
    grid = cache.token_grid(level, layer) if kind == "tokens" else None  # a 3-D encoder's (Level 4)
    cfg = {**run.head_config, **({"token_grid": grid} if grid else {})}
    model = seeded(lambda: build_head(run.head, run.spec, in_dim, n_tokens, **cfg), seed)
    if kind == "tokens":
        rng = np.random.default_rng(derive_seed(seed, "projection", run.probe))
        n = len(cache.keys(level, "train"))
        rows = np.sort(rng.choice(n, size=min(n, max(1, 50000 // n_tokens)), replace=False))
        sample = np.asarray(cache.tokens(level, "train", layer=layer, rows=rows), np.float32)
        model.fit_projection(finite(sample, cache, level, "train", layer).reshape(-1, in_dim))
    return model, in_dim, n_tokens


@dataclass
class BlindHead:
    """The blind baseline of a head run: the same seeded head (token heads: with the real
    head's fixed projection) trained on the question alone."""

    run: Any
    model: Any
    zero: np.ndarray
    kind: str = "blind"
    progress: bool = False

    @classmethod
    def of(cls, run, model, dims: tuple[int, int]) -> BlindHead:
        """The blind baseline of ``run``, whose real head is ``model`` (``dims``: its in_dim, n_tokens)."""
        from ..heads import build_head, head_input
        from ..train import seeded

        # the real head's options (a scratch finetune widens proj_dim), per-token positions: it reads one token
        cfg = {k: v for k, v in getattr(model, "cfg", run.head_config).items() if k != "token_grid"}
        blind = seeded(lambda: build_head(run.head, run.spec, *dims, **cfg), run.seed)
        pooled = head_input(run.head) == "pooled"
        if not pooled:  # the same fixed projection as the real head; one token in, one position
            proj = {k: v for k, v in model.state_dict().items() if k.startswith("proj_")}
            blind.load_state_dict({**blind.state_dict(), **proj})
            blind.read_one_token()
        zero = np.zeros((1, dims[0]) if pooled else (1, 1, model.proj_dim), np.float32)
        return cls(run, blind, zero)

    def fit(self, train, val):
        from ..train import train_head

        return train_head(self.model, (self.zero, blind_targets(train)), (self.zero, blind_targets(val)),
                          self.run.train, self.run.seed, progress=self.progress)  # fmt: skip

    def predict(self, t, split: str = "test") -> np.ndarray:
        from ..train import predict

        return predict(self.model, self.zero, blind_targets(t))

    def blind(self) -> None:
        return None


@dataclass
class CachedHead:
    """A probe head trained on a feature cache: ``run`` (a :class:`~.spec.RunSpec`), its seeded
    ``model``, ``dims`` ``(in_dim, n_tokens)`` and the features of each split it reads."""

    run: Any
    model: Any
    dims: tuple[int, int]
    feats: dict[str, np.ndarray] = field(default_factory=dict)
    val_split: str = "val"
    progress: bool = True
    kind: str = "head"

    @classmethod
    def new(cls, run, cache, splits: Splits) -> CachedHead:
        """The seeded head of ``run`` sized from ``cache``, with the features of the splits it reads."""
        from ..heads import head_input

        kind = head_input(run.head)
        model, in_dim, n_tokens = new_head(cache, run, kind)
        feats = {sp: load_features(cache, kind, run.spec.level, sp, run.layer, model)
                 for sp in dict.fromkeys(("train", splits.val_split, "test"))}  # fmt: skip
        return cls(run, model, (in_dim, n_tokens), feats, splits.val_split)

    def fit(self, train, val):
        from ..train import train_head

        return train_head(self.model, (self.feats["train"], train), (self.feats[self.val_split], val),
                          self.run.train, self.run.seed, progress=self.progress)  # fmt: skip

    def predict(self, t, split: str = "test") -> np.ndarray:
        from ..train import predict

        return predict(self.model, self.feats[split], t)

    def blind(self) -> BlindHead:
        return BlindHead.of(self.run, self.model, self.dims)

    @staticmethod
    def load(rd: Path):
        """``(run spec, config dict, prior, model)`` of a finished run folder; one-line errors."""
        import torch

        from ..heads import build_head
        from .spec import RunSpec

        if not (rd / HEAD_FILE).is_file() or not (rd / METRICS_FILE).is_file():
            raise ConfigError(f"{rd}: not a finished run directory (needs head.pt and metrics.json)")
        try:
            saved = torch.load(rd / HEAD_FILE, map_location="cpu", weights_only=False)
            c = saved["config"]
            run = RunSpec.from_dict(c["run"])
            model = build_head(run.head, run.spec, c["in_dim"], c["n_tokens"], **c["head_config"])
            model.load_state_dict(saved["state_dict"])
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable or foreign head.pt is one line
            raise ConfigError(
                f"{rd / HEAD_FILE}: unreadable trained head ({type(e).__name__}: {str(e)[:120]}); "
                "re-run `spar-probe fit` for this run"
            ) from None
        return run, c, saved.get("prior"), model


# --------------------------------------------------------------------------- reference predictors
@dataclass
class ConstantPrior:
    """The probe's prior (its input-free optimum, fitted on the training items) as a predictor.

    It never looks at an image, so it is its own blind baseline; a run of it reports what
    the label distribution alone earns on every probe and control.
    """

    spec: Any
    prior: dict | None = None
    kind: str = "prior"

    def fit(self, train, val) -> None:
        self.prior = self.spec.fit_prior(train)

    def predict(self, t, split: str = "test") -> np.ndarray:
        if self.prior is None:
            raise ConfigError(f"{self.spec.name}: the constant-prior predictor predicts only after fit()")
        return self.spec.prior_predict(self.prior, t)

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)
