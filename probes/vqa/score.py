"""An MLLM's own metrics beside the shared evaluation (:func:`~..runs.evaluate.evaluate`).

The test items, mirrored (Level 4: flipped) copies and the controls (chance, majority, the
prior, the blind baseline) of an MLLM run are scored by the one evaluation every run kind
uses, from its answers (:class:`.predictor.Answered`): an unparseable answer is class -1, a
miss in accuracy and, in macro-F1, a miss of the true class (never a prediction of another
class). What only an MLLM has, :func:`extra_metrics` gives that evaluation as the run's own
controls (``controls.parse_rate``, ``controls.unparsed``, ``controls.circular``,
``controls.position_rate``): the share of headline answers parsed and the reasons of those
not, CircularEval (every question asked once per cyclic rotation of its options), and how
often each displayed position was chosen (a letter bias). CircularEval's confidence
intervals are the probes' 95 % bootstrap over patients; over fewer than 2 patients there is
none (``null``: resampling one patient gives back its score).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..bootstrap import bootstrap_ci
from ..runs.evaluate import MIN_PATIENTS_CI
from .questions import Questions


def patient_ci(metric, groups: np.ndarray, rng: np.random.Generator, n_boot: int) -> list[float] | None:
    """The patient-bootstrap 95 % CI of ``metric``, or None over fewer than 2 patients."""
    if np.unique(groups).size < MIN_PATIENTS_CI:
        return None
    return list(bootstrap_ci(metric, groups, rng, n_boot))


def answer_tables(qs: Questions, records: list[dict], n: int) -> dict[str, np.ndarray]:
    """Predicted class per question: ``image`` (Q, rotations), ``blind`` (Q,), -2 = not asked;
    ``position``: how often each displayed position was chosen on the original questions."""
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


def extra_metrics(qs: Questions, records: list[dict], tables: dict[str, np.ndarray], boot, n_boot: int) -> dict:
    """An MLLM's own controls, handed to the shared evaluation: ``parse_rate`` (the headline
    answers that named one option), ``unparsed`` (:func:`unparsed_reasons`), ``circular``
    (:func:`circular_metrics`, None without rotations) and ``position_rate`` (the share of
    answers at each displayed letter). ``boot(tag)``: the run's bootstrap generators."""
    orig = qs.original
    head = tables["image"][orig, 0]
    pos = tables["position"]
    return {
        "parse_rate": float((head >= 0).mean()) if head.size else None,
        "unparsed": unparsed_reasons(records),
        "circular": circular_metrics(qs.answer[orig], tables["image"][orig], qs.patient[orig], boot("circular"),
                                     n_boot),
        "position_rate": [float(v) for v in pos / max(pos.sum(), 1)],
    }  # fmt: skip
