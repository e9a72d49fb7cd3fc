"""Scores of an MLLM run, in the probes' metrics format, plus the MLLM controls.

Unparseable answers (class -1) count wrong: in accuracy, and in macro-F1 as a miss of
the true class (never as a prediction of some other class). Confidence intervals are the
probes' 95 % bootstrap over patients (:mod:`spar_bench.probes.bootstrap`); over fewer than
2 patients there is no interval (``null``: resampling one patient gives back its score).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spar_bench.seeding import derive_seed

from ..bootstrap import bootstrap_ci
from ..metrics import by_axis, macro_f1
from .questions import Questions

MIN_PATIENTS_CI = 2


def patient_ci(metric, groups: np.ndarray, rng: np.random.Generator, n_boot: int) -> list[float] | None:
    """The patient-bootstrap 95 % CI of ``metric``, or None over fewer than 2 patients."""
    if np.unique(groups).size < MIN_PATIENTS_CI:
        return None
    return list(bootstrap_ci(metric, groups, rng, n_boot))


def answer_metrics(y: np.ndarray, pred: np.ndarray, n: int, groups: np.ndarray | None,
                   rng: np.random.Generator | None, n_boot: int) -> dict[str, Any]:
    """Accuracy, macro-F1, chance and parse rate (+ patient-bootstrap CIs).

    The probe spec's own ``score`` (:mod:`spar_bench.probes.tasks`) takes class indices
    only; an MLLM's answer may be none (-1), which must count as a miss, so the track
    scores here, with the same metric names, chance and bootstrap.
    """
    y, pred = np.asarray(y, np.int64), np.asarray(pred, np.int64)
    if y.size == 0:
        return {"n": 0}
    hit = (y == pred).astype(np.float64)
    out: dict[str, Any] = {
        "accuracy": float(hit.mean()), "macro_f1": macro_f1(y, pred, n),
        "chance": 1.0 / n, "n": int(y.size),
        "parse_rate": float((pred >= 0).mean()), "n_unparsed": int((pred < 0).sum()),
    }
    if groups is not None and rng is not None:
        out["ci"] = {
            "accuracy": patient_ci(lambda i: float(hit[i].mean()), groups, rng, n_boot),
            "macro_f1": patient_ci(lambda i: macro_f1(y[i], pred[i], n), groups, rng, n_boot),
        }
    return out


def _tables(qs: Questions, records: list[dict], n: int) -> dict[str, np.ndarray]:
    """Predicted class per question: ``image`` (Q, rotations), ``blind`` (Q,), -2 = not asked."""
    index = {str(k): i for i, k in enumerate(qs.key)}
    image = np.full((len(qs), n), -2, dtype=np.int64)
    blind = np.full(len(qs), -2, dtype=np.int64)
    position = np.zeros(n, dtype=np.int64)
    for r in records:
        i = index[r["key"]]
        if r["variant"] == "blind":
            blind[i] = r["class"]
        else:
            image[i, r["rotation"]] = r["class"]
            if r["choice"] is not None and qs.original[i]:
                position[r["choice"]] += 1
    return {"image": image, "blind": blind, "position": position}


def circular_metrics(y: np.ndarray, image: np.ndarray, groups: np.ndarray,
                     rng: np.random.Generator, n_boot: int) -> dict[str, Any] | None:
    """CircularEval: right under every rotation (strict), and the mean over rotations."""
    asked = (image != -2).all(axis=1)
    if image.shape[1] < 2 or not asked.any():
        return None
    right = image[asked] == y[asked, None]
    strict, mean = right.all(axis=1).astype(np.float64), right.mean(axis=1)
    g = groups[asked]
    return {
        "strict": float(strict.mean()), "mean": float(mean.mean()),
        "per_rotation": [float(v) for v in right.mean(axis=0)],
        "n_rotations": int(image.shape[1]), "n": int(asked.sum()),
        "ci": {"strict": patient_ci(lambda i: float(strict[i].mean()), g, rng, n_boot),
               "mean": patient_ci(lambda i: float(mean[i].mean()), g, rng, n_boot)},
    }


def axes_and_conflicts(t, pred: np.ndarray, prior: dict | None, boot, tag: str, n_boot: int) -> dict[str, Any]:
    """``per_axis`` (probes with axes: relative position) and ``conflict`` (the items whose
    answer differs from the prior's; ``ProbeSpec.conflict``, the function heads use) of
    ``pred`` on the items ``t``."""
    spec, out = t.spec, {}
    if spec.axes:
        rng, y = boot(f"{tag}-axis"), t.y["answer"]
        out["per_axis"] = by_axis(t.y["axis"], spec.axes, lambda m: answer_metrics(
            y[m], pred[m], spec.n_classes, t.patient[m], rng, n_boot))
    conflict = spec.conflict(prior, t, pred, boot(f"{tag}-conflict"), n_boot)
    if conflict is not None:
        out["conflict"] = conflict
    return out


def _controls(qs: Questions, t: dict[str, np.ndarray], train, part) -> dict[str, Any]:
    """Chance, majority and the prior (from the probe spec, as for heads), blind runs, and
    how often each displayed position was chosen (a letter bias CircularEval exposes)."""
    spec, orig, mir = qs.spec, qs.original, qs.is_mirror
    te, te_m = qs.t.subset(orig), qs.t.subset(mir)
    ctrl: dict[str, Any] = {"chance": spec.chance(te)}
    if train is not None and len(train):
        maj = spec.majority(train)
        ctrl["majority_class"], ctrl["majority"] = maj, spec.majority_rate(maj, te)
        prior = spec.fit_prior(train)
        ctrl["prior"] = part(orig, spec.prior_predict(prior, te), "prior", full=True)
        ctrl["prior_mirror"] = part(mir, spec.prior_predict(prior, te_m), "prior-mirror", full=True)
    ctrl["blind"] = part(orig, t["blind"], "blind")
    ctrl["blind_mirror"] = part(mir, t["blind"], "blind-mirror")
    if qs.volume is not None:  # Level 4: the flipped copies beside the mirrored ones
        flip = qs.is_flipped
        if train is not None and len(train):
            ctrl["prior_flipped"] = part(flip, spec.prior_predict(prior, qs.t.subset(flip)), "prior-flipped",
                                         full=True)
        ctrl["blind_flipped"] = part(flip, t["blind"], "blind-flipped")
    pos = t["position"]
    ctrl["position_rate"] = [float(v) for v in pos / max(pos.sum(), 1)]
    return ctrl


def unparsed_reasons(records: list[dict]) -> dict[str, Any]:
    """Unparseable answers by the parser's reason (``reason`` in answers.jsonl, see
    :data:`spar_bench.probes.vqa.parse.REASONS`): on the headline items (``test``: original
    questions with the image, rotation 0, the parse rate's items) and over ``all`` answers."""
    test: dict[str, int] = {}
    every: dict[str, int] = {}
    for r in records:
        if r.get("choice") is not None:
            continue
        why = r.get("reason") or "unparseable"
        every[why] = every.get(why, 0) + 1
        if r["variant"] == "image" and r["rotation"] == 0 and not r["mirror"] and not r.get("flipped"):
            test[why] = test.get(why, 0) + 1
    return {"test": dict(sorted(test.items())), "all": dict(sorted(every.items())),
            "n_answers": len(records)}


def score_run(qs: Questions, records: list[dict], train, seed: int, n_boot: int,
              head: str) -> dict[str, Any]:
    """The MLLM's scores for the run's metrics.json (``runs.evaluate.run_metrics`` lays it out):
    test (rotation 0), its parse rate and unparsed reasons, mirror, CircularEval, controls."""
    n = qs.spec.n_classes
    t = _tables(qs, records, n)
    probe = qs.spec.name
    boot = lambda tag: np.random.default_rng(derive_seed(seed, "bootstrap", probe, head, tag))  # noqa: E731
    orig, mir = qs.original, qs.is_mirror
    y, g = qs.answer, qs.patient

    prior = qs.spec.fit_prior(train) if train is not None and len(train) else None

    def part(mask, pred, tag, full=False):
        """Metrics of ``pred`` (all items, or only those of ``mask`` when not ``full``)."""
        p = pred if full else pred[mask]
        if not mask.any() or (p == -2).all():
            return None
        out = answer_metrics(y[mask], p, n, g[mask], boot(tag), n_boot)
        return {**out, **axes_and_conflicts(qs.t.subset(mask), p, prior, boot, tag, n_boot)}

    test = part(orig, t["image"][:, 0], "test")
    flipped = {} if qs.volume is None else {"flipped": part(qs.is_flipped, t["image"][:, 0], "flipped")}
    return {
        "test": test,
        "parse_rate": (test or {}).get("parse_rate"),
        "unparsed": unparsed_reasons(records),
        "mirror": part(mir, t["image"][:, 0], "mirror"),
        **flipped,
        "circular": circular_metrics(y[orig], t["image"][orig], g[orig], boot("circular"), n_boot),
        "controls": _controls(qs, t, train, part),
    }
