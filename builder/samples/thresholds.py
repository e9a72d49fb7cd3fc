"""Tertile thresholds of the size and distance probes, fixed on the training split.

* size: per organ, the two cut points ``np.quantile(areas, [1/3, 2/3])`` of the
  training questions' ``q_area_a_mm2``;
* distance: per unordered organ pair (key ``"<organ>|<organ>"``, names in class order),
  the tertiles of ``q_distance_mm``;
* every organ or pair with fewer than ``min_n`` (30) training questions, and every one
  never seen in training, uses the global tertiles of that probe over all training
  questions. Each entry records its ``n`` and whether it fell back.

Class = ``0`` if value < cut1, ``1`` if cut1 <= value < cut2, ``2`` otherwise.
Only original questions are used: :func:`original_questions` drops the questions of
mirrored slices (``is_mirror``). The same thresholds are applied unchanged to every split
and to transfer sources.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spar_bench.errors import ConfigError

from ..schema import LEVEL3_PROBES, ORGANS

METHOD = "tertiles"
MIN_N = 30
_SIZE, _DIST = LEVEL3_PROBES.index("size"), LEVEL3_PROBES.index("distance")


def pair_key(a: int, b: int) -> str:
    """Unordered pair key of organ indices ``a``, ``b``: names in class order joined by ``|``."""
    lo, hi = sorted((int(a), int(b)))
    return f"{ORGANS[lo]}|{ORGANS[hi]}"


def _cuts(values: np.ndarray) -> list[float]:
    return [float(c) for c in np.quantile(values, [1.0 / 3.0, 2.0 / 3.0])]


def _concat(questions: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    names = ("q_key", "q_probe", "q_organ_a", "q_organ_b", "q_area_a_mm2", "q_distance_mm")
    # a case without Level 3 slices may hand over an empty dict: nothing to fit on there
    questions = [q for q in questions if q and len(q.get("q_probe", q.get("q_key", ()))) > 0]
    if not questions:
        return {n: np.empty(0) for n in names}
    for i, q in enumerate(questions):
        missing = [n for n in names if n not in q]
        if missing:
            raise ConfigError(
                f"fit_thresholds: question table {i} lacks field(s) {', '.join(missing)}"
            )
    return {n: np.concatenate([np.asarray(q[n]) for q in questions]) for n in names}


def _fit_probe(values: np.ndarray, groups: list[str], probe: str, min_n: int) -> dict[str, Any]:
    if len(values) == 0:
        raise ConfigError(
            f"fit_thresholds: no {probe} questions in the training questions; "
            "fit on a split that has Level 3 slices (or take thresholds from another build)"
        )
    global_cuts = _cuts(values)
    entries: dict[str, Any] = {}
    group_arr = np.array(groups, dtype=object)
    for g in sorted(set(groups)):
        v = values[group_arr == g]
        fallback = len(v) < min_n
        entries[g] = {
            "cuts": global_cuts if fallback else _cuts(v),
            "n": int(len(v)),
            "fallback": fallback,
        }
    return {"global": {"cuts": global_cuts, "n": int(len(values))}, "groups": entries}


def original_questions(slices: dict[str, np.ndarray], questions: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The questions of one case whose slice is an original: ``slices["is_mirror"]`` (the
    case's ``level3`` rows, indexed by ``q_slice``) is False. Without that field, all of them."""
    if not questions or not len(next(iter(questions.values()))):
        return questions
    is_mirror = slices.get("is_mirror")
    if is_mirror is None or not len(is_mirror):
        return questions
    keep = ~np.asarray(is_mirror, dtype=bool)[questions["q_slice"]]
    return {k: v[keep] for k, v in questions.items()}


def fit_thresholds(questions: list[dict[str, np.ndarray]], min_n: int = MIN_N) -> dict[str, Any]:
    """Fit size and distance tertiles on training question tables (see the module doc).

    ``questions`` are original ``level3_questions`` tables (one per training case, through
    :func:`original_questions`). Returns a JSON-serialisable dict recorded in the manifest.
    """
    q = _concat(questions)
    probe = q["q_probe"].astype(np.int64)
    size = probe == _SIZE
    dist = probe == _DIST
    size_groups = [ORGANS[int(a)] for a in q["q_organ_a"][size]]
    dist_groups = [
        pair_key(a, b) for a, b in zip(q["q_organ_a"][dist], q["q_organ_b"][dist], strict=True)
    ]
    return {
        "method": METHOD,
        "min_n": int(min_n),
        "classes": "0 if v < cuts[0], 1 if cuts[0] <= v < cuts[1], 2 otherwise",
        "size": {
            "quantity": "q_area_a_mm2",
            "grouping": "organ",
            **_fit_probe(q["q_area_a_mm2"][size].astype(np.float64), size_groups, "size", min_n),
        },
        "distance": {
            "quantity": "q_distance_mm",
            "grouping": "organ pair",
            **_fit_probe(
                q["q_distance_mm"][dist].astype(np.float64), dist_groups, "distance", min_n
            ),
        },
    }


def cuts_for(thresholds: dict[str, Any], probe: str, a: int, b: int = -1) -> list[float]:
    """The two cut points a ``size`` question about organ ``a`` (or a ``distance`` question
    about the pair ``a``, ``b``) is classified with: its organ's or pair's entry, else the
    probe's global cuts."""
    group = ORGANS[int(a)] if probe == "size" else pair_key(a, b)
    return thresholds[probe]["groups"].get(group, thresholds[probe]["global"])["cuts"]


def _classify(value: float, cuts: list[float]) -> int:
    return int(np.searchsorted(np.asarray(cuts, dtype=np.float64), value, side="right"))


def apply_thresholds(
    questions: dict[str, np.ndarray], thresholds: dict[str, Any]
) -> dict[str, np.ndarray]:
    """A copy of ``questions`` with ``q_answer`` filled for size and distance questions.

    Pure: the input is not modified. Organs and pairs without an entry use the global cuts.
    """
    for probe in ("size", "distance"):
        if probe not in thresholds or "global" not in thresholds[probe]:
            raise ConfigError(
                f"apply_thresholds: thresholds lack the {probe!r} entry; refit them with fit_thresholds"
            )
    out = dict(questions)
    answer = np.array(questions["q_answer"], dtype=np.int8, copy=True)
    probe = np.asarray(questions["q_probe"]).astype(np.int64)
    a_idx, b_idx = np.asarray(questions["q_organ_a"]), np.asarray(questions["q_organ_b"])
    for i in np.flatnonzero(probe == _SIZE):
        cuts = cuts_for(thresholds, "size", a_idx[i])
        answer[i] = _classify(float(questions["q_area_a_mm2"][i]), cuts)
    for i in np.flatnonzero(probe == _DIST):
        cuts = cuts_for(thresholds, "distance", a_idx[i], b_idx[i])
        answer[i] = _classify(float(questions["q_distance_mm"][i]), cuts)
    out["q_answer"] = answer
    return out
