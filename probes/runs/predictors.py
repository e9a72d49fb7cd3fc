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
  and the MLLM's answers (:class:`spar_bench.probes.vqa.predictor.Answered`) implement it in their packages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import RUN_PACKAGES, package_versions

from ..train import predict, seeded, train_head
from .build_job import OnBuild
from .inputs import Splits, cache_identity, finite, load_features
from .record import RunRecord
from .spec import RunSpec
from .store import HEAD_FILE, HEAD_FILES, METRICS_FILE, finished


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

    # Optional: ``extra_metrics(splits, boot, n_boot) -> dict``, a kind's own controls, which the
    # evaluation records in ``controls`` beside the shared ones (an MLLM's parse rate, unparsed
    # reasons, CircularEval and letter bias: :meth:`~spar_bench.probes.vqa.predictor.Answered.extra_metrics`).


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
        return train_head(self.model, (self.zero, blind_targets(train)), (self.zero, blind_targets(val)),
                          self.run.train, self.run.seed, progress=self.progress)  # fmt: skip

    def predict(self, t, split: str = "test") -> np.ndarray:
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
        return train_head(self.model, (self.feats["train"], train), (self.feats[self.val_split], val),
                          self.run.train, self.run.seed, progress=self.progress)  # fmt: skip

    def predict(self, t, split: str = "test") -> np.ndarray:
        return predict(self.model, self.feats[split], t)

    def blind(self) -> BlindHead:
        return BlindHead.of(self.run, self.model, self.dims)

    @staticmethod
    def load(rd: Path):
        """``(run spec, run record, prior, model)`` of a finished run folder; one-line errors."""
        import torch

        from ..heads import build_head

        if not (rd / HEAD_FILE).is_file() or not (rd / METRICS_FILE).is_file():
            raise ConfigError(f"{rd}: not a finished run directory (needs head.pt and metrics.json)")
        try:
            saved = torch.load(rd / HEAD_FILE, map_location="cpu", weights_only=False)
            rec = RunRecord.from_saved(saved["config"], rd / HEAD_FILE)
            run = spec_of(rec)
            model = build_head(run.head, run.spec, rec.extra["in_dim"], rec.extra["n_tokens"],
                               **rec.extra["head_config"])  # fmt: skip
            model.load_state_dict(saved["state_dict"])
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable or foreign head.pt is one line
            raise ConfigError(
                f"{rd / HEAD_FILE}: unreadable trained head ({type(e).__name__}: {str(e)[:120]}); "
                "re-run `spar-probe fit` for this run"
            ) from None
        return run, rec, saved.get("prior"), model


# --------------------------------------------------------------------------- a head run's record
def spec_of(rec):
    """The :class:`~.spec.RunSpec` of the head a run's record holds (a head run's ``options``; a
    finetune run's head in ``extra["run"]``)."""

    d = rec.options if rec.kind == "head" or rec.legacy else rec.extra.get("run", {})
    return RunSpec.from_dict({k: v for k, v in d.items() if k != "head_defaults"})


def head_options(run) -> dict[str, Any]:
    """A head run's ``options``: its spec (paths by name only; the device left out: it changes
    no trained weight beyond numerics) and the head's defaults (a run finished under other
    defaults is another run)."""
    from ..heads import head_defaults

    d = run.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k != "device"}
    return {**d, "features": Path(run.features).name, "data": Path(run.data).name if run.data else None,
            "head_defaults": head_defaults(run.head)}  # fmt: skip


def head_record(run, cache):
    """The :class:`~.record.RunRecord` of head run ``run`` on ``cache``, as far as it is known
    before training (its identity); :func:`head_extra` adds what training resolved."""

    from ..encoders.base import published_name, published_weights

    w = cache.meta.get("weights")
    model = published_name(str(cache.meta["encoder"]), w) if cache.meta.get("encoder") else None
    inputs = {"features": Path(run.features).name, "cache_fingerprint": cache.fingerprint,
              "cache_identity": cache_identity(cache), "random_init": bool(cache.random_init),
              "weights": published_weights(w) if isinstance(w, dict) else None}  # no path
    return RunRecord(kind="head", probe=run.probe, head=run.head, seed=run.seed, variant=run.variant(),
                     model=model, build_fingerprint=cache.fingerprint, inputs=inputs, options=head_options(run),
                     versions=package_versions(RUN_PACKAGES))  # fmt: skip


def head_extra(run, head) -> dict[str, Any]:
    """What a head run resolved: its head's config and input widths, seeds, train config."""
    from spar_bench.seeding import derive_seed

    from ..heads import head_input

    return {"probe_spec": run.spec.describe(), "head_input": head_input(run.head),
            "head_config": head.model.cfg if hasattr(head.model, "cfg") else {},
            "in_dim": head.dims[0], "n_tokens": head.dims[1], "device": run.train.device,
            "seeds": {"torch": run.seed,
                      "bootstrap": [derive_seed(run.seed, "bootstrap", run.probe, run.head, "test")]}}


def finished_run(run, rd: Path, cache, grid_prune: int = 0, replace: str = "delete that folder") -> bool:
    """Whether ``rd`` holds a finished, whole run of ``run`` on ``cache`` (kept); one finished with
    other options (``--bootstrap``, ``--no-controls``, head defaults that changed since), or on
    a cache of another build or identity (dtypes, encoder configuration), is refused (``replace``:
    how the command replaces it); so is a run pruned by ``--grid-prune K`` when the sweep asks for
    another ``grid_prune`` (0: a full run). A damaged run is run again.

    A folder's name holds only the options that differ from their defaults, so a run finished
    under other defaults (an older spar-bench), or on another build of the same encoder, sits
    where ``run`` would write: skipping it would report the old run as this one.
    """

    if not finished(rd, head_record(run, cache), HEAD_FILES, replace):
        return False
    try:
        pruned = json.loads((rd / METRICS_FILE).read_text(encoding="utf-8"))["train"].get("pruned_at")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{rd}: a finished run with an unreadable metrics.json ({e}); delete the folder to "
                          "rerun it") from None  # fmt: skip
    if pruned is not None and pruned != grid_prune:
        asked = f"--grid-prune {grid_prune}" if grid_prune else "a full run"
        raise ConfigError(f"{rd}: pruned after epoch {pruned} (--grid-prune {pruned}) and this sweep asks for "
                          f"{asked}; rerun with --grid-prune {pruned}, or delete the folder to train it")  # fmt: skip
    return True


# --------------------------------------------------------------------------- reference predictors
@dataclass
class ConstantPrior(OnBuild):
    """The probe's prior (its input-free optimum, fitted on the training items) as a predictor.

    It never looks at an image, so it is its own blind baseline; a run of it reports what
    the label distribution alone earns on every probe and control.
    """

    spec: Any
    prior: dict | None = None
    kind: str = "prior"

    @classmethod
    def on_build(cls, spec, build) -> ConstantPrior:
        return cls(spec)

    def fit(self, train, val) -> None:
        self.prior = self.spec.fit_prior(train)

    def predict(self, t, split: str = "test") -> np.ndarray:
        if self.prior is None:
            raise ConfigError(f"{self.spec.name}: the constant-prior predictor predicts only after fit()")
        return self.spec.prior_predict(self.prior, t)

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)
