"""One evaluation for every run kind: the test items, the mirrored counterfactuals (and the
flipped ones of Level 4) and the controls (chance, majority, the prior, the blind baseline),
each with patient-bootstrap intervals, in one metrics layout.

The flipped block (``flipped``, ``controls.prior_flipped`` / ``blind_flipped``,
``n_items.test_flipped``) is written only for a level whose rows have ``is_flipped`` (Level
4; ``flipped`` is None when the build has no flipped copies), so the metrics of Levels 1-3
keep their layout byte for byte.

:func:`evaluate` scores a fitted :class:`~.predictors.Predictor`; :func:`controls` gives the
same controls to every kind (its blind baseline is the predictor's own :meth:`blind`), and a
kind with controls of its own hands them to the evaluation through its predictor's
``extra_metrics(splits, boot, n_boot)``: they are recorded in ``controls`` beside the shared
ones (an MLLM's parse rate, unparsed reasons, CircularEval and letter bias);
:func:`transfer` scores a finished run's predictions on another build or cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from spar_bench.provenance import build_unanswerable, protocol_versions

from .inputs import Splits

Boot = Callable[[str], "np.random.Generator"]
#: the fewest patients an MLLM's bootstrap intervals are drawn over (``ci_min_patients``)
MIN_PATIENTS_CI = 2


def score(t, pred: np.ndarray, rng: np.random.Generator | None, n_boot: int, prior: dict | None = None,
          min_patients: int = 1) -> dict:
    """Every metric the probe declares, of ``pred`` on ``t``; CIs (over patients) when ``rng``.

    With the run's ``prior`` (fitted on train), a Level 3 score also holds ``conflict``: the
    same ``pred`` on the items whose answer differs from the prior's (``ProbeSpec.conflict``).
    Over fewer than ``min_patients`` patients ``ci`` is null (a run spec's ``ci_min_patients``,
    2 for an MLLM: resampling one patient gives back its score; heads keep 1, their layout).
    """
    one = rng is not None and len(t) > 0 and np.unique(t.patient).size < min_patients
    if one:
        rng = None
    out = t.spec.score(t, pred, rng, n_boot)
    if one:
        out["ci"] = None
    conflict = t.spec.conflict(prior, t, pred, rng, n_boot) if len(t) else None
    if conflict is not None:
        out["conflict"] = conflict
    return out


def bootstraps(seed: int, *names: str) -> Boot:
    """The bootstrap generator of each scored part (``tag``), derived from the run's seed and names."""
    from spar_bench.seeding import derive_seed

    return lambda tag: np.random.default_rng(derive_seed(seed, "bootstrap", *names, tag))


def controls(run, predictor, s: Splits, prior: dict, boot: Boot, blind=None) -> dict:
    """Chance, majority, the prior (input-free optimum; none without training items: an MLLM
    asked on a build without a train split) and the blind baseline (the predictor without the
    image: :meth:`~.predictors.Predictor.blind`).

    ``blind``: the blind predictor already fitted (a batch trains them together), or None
    (fitted here when ``run.controls``).
    """
    spec, n_boot, mp = run.spec, run.n_boot, getattr(run, "ci_min_patients", 1)
    majority = spec.majority(s.tr)
    ctrl: dict[str, Any] = {"chance": spec.chance(s.te)}
    if majority is not None:
        ctrl["majority_class"] = majority
        ctrl["majority"] = spec.majority_rate(majority, s.te)
    if prior is not None:
        ctrl["prior"] = score(s.te, spec.prior_predict(prior, s.te), boot("prior"), n_boot, prior, mp)
        for name, t in counterfactuals(s):
            ctrl[f"prior_{name}"] = score(t, spec.prior_predict(prior, t), boot(f"prior-{name}"), n_boot, prior, mp)
    if not run.controls:
        return ctrl
    if blind is None:
        blind = predictor.blind()
        if blind is None:
            return ctrl
        blind.fit(s.tr, s.va)
    ctrl["blind"] = score(s.te, blind.predict(s.te, "test"), boot("blind"), n_boot, prior, mp)
    for name, t in counterfactuals(s):
        ctrl[f"blind_{name}"] = score(t, blind.predict(t, "test"), boot(f"blind-{name}"), n_boot, prior, mp)
    return ctrl


def counterfactuals(s: Splits) -> list[tuple[str, Any]]:
    """The counterfactual test items that have items: ``("mirror", te_mirror)``, then Level 4's
    ``("flipped", te_flipped)``."""
    parts = [("mirror", s.te_mirror), ("flipped", s.te_flipped)]
    return [(name, t) for name, t in parts if t is not None and len(t)]


def evaluate(run, predictor, s: Splits, prior: dict, blind=None) -> dict[str, Any]:
    """``test``, ``mirror`` (None without mirrored items), Level 4's ``flipped`` (likewise; absent
    for Levels 1-3) and ``controls`` of a fitted predictor, its own (``extra_metrics``) included."""
    boot, mp = bootstraps(run.seed, run.probe, run.head), getattr(run, "ci_min_patients", 1)
    cf = {name: score(t, predictor.predict(t, "test"), boot(name), run.n_boot, prior, mp)
          for name, t in counterfactuals(s)}  # fmt: skip
    out = {"test": score(s.te, predictor.predict(s.te, "test"), boot("test"), run.n_boot, prior, mp),
           "mirror": cf.get("mirror")}  # fmt: skip
    if s.te_flipped is not None:
        out["flipped"] = cf.get("flipped")
    ctrl = controls(run, predictor, s, prior, boot, blind)
    extra = getattr(predictor, "extra_metrics", None)
    if extra is not None:  # a kind's own controls, beside the shared ones
        ctrl.update(extra(s, boot, run.n_boot))
    return {**out, "controls": ctrl}


def run_metrics(run, s: Splits, scored: dict[str, Any], *, encoder: str, train: dict | None,
                training: dict | None, manifest: dict, layer: int | None = None, variant: str | None = None,
                random_init: bool = False, track: str | None = None) -> dict[str, Any]:
    """The one ``metrics.json`` layout of every run kind, which the report reads: what ran
    (probe, head, variant, seed, encoder, layer), on what (items and patients per split, where
    validation came from), how it trained (``train``; None: nothing was trained), the
    evaluation (``scored``: :func:`evaluate`'s test, mirror and controls), how its encoder was
    trained (``training``), the protocol versions of the build and, from its manifest, the
    share of the probe's questions it dropped as not answerable from their pixels."""

    spec = run.spec
    return {
        "probe": run.probe, "head": run.head, "variant": run.variant() if variant is None else variant,
        "seed": run.seed, "encoder": encoder, "random_init": random_init, "layer": layer,
        **({"track": track} if track else {}),
        "headline": spec.headline, "higher_is_better": spec.higher_is_better, "val_source": s.val_source,
        "n_items": {"train": len(s.tr), "val": len(s.va), "test": len(s.te), "test_mirror": len(s.te_mirror),
                    **({} if s.te_flipped is None else {"test_flipped": len(s.te_flipped)})},
        "n_patients": {"train": int(np.unique(s.tr.patient).size), "test": int(np.unique(s.te.patient).size)},
        "train": train, **scored, "training": training, **protocol_versions(manifest),
        "build_unanswerable": build_unanswerable(manifest, run.probe),
    }  # fmt: skip


def transfer(t, pred: np.ndarray, seed: int, n_boot: int, prior: dict | None, majority) -> dict[str, Any]:
    """A finished run's predictions ``pred`` on the items ``t`` of another build: ``test`` and
    ``mirror`` with intervals, and the controls that need no training (chance, majority with
    the class the run's training set chose, and the run's prior when it has one)."""
    spec = t.spec
    rng = bootstraps(seed, "eval")
    keep, mir = t.original, t.is_mirror
    orig = t.subset(keep)
    out: dict[str, Any] = {
        "test": score(orig, pred[keep], rng("test"), n_boot, prior),
        "mirror": score(t.subset(mir), pred[mir], rng("mirror"), n_boot, prior) if mir.any() else None,
    }
    if t.is_flipped is not None:
        flip = t.flipped
        out["flipped"] = score(t.subset(flip), pred[flip], rng("flipped"), n_boot, prior) if flip.any() else None
    out["controls"] = {"chance": spec.chance(orig), "majority": spec.majority_rate(majority, orig)}
    if prior is not None:
        out["controls"]["prior"] = score(orig, spec.prior_predict(prior, orig), rng("prior"), n_boot, prior)
    return out
