"""Confidence intervals by bootstrap over PATIENTS, never over slices or samples.

Samples of one patient are correlated (neighbouring slices, several mosaics per
volume), so resampling them independently understates the uncertainty. Here a
replicate draws patient ids with replacement and takes ALL items of each drawn
patient (a patient drawn twice contributes twice), then recomputes the metric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_REPS = 1000


def group_indices(groups: Sequence[str] | np.ndarray) -> list[np.ndarray]:
    """Item indices of each distinct group, groups in sorted order (deterministic)."""
    groups = np.asarray(groups)
    uniq, inverse = np.unique(groups, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=uniq.size))[:-1]
    return np.split(order, bounds)


def bootstrap_ci(
    metric: Callable[[np.ndarray], float],
    groups: Sequence[str] | np.ndarray,
    rng: np.random.Generator,
    n_reps: int = DEFAULT_REPS,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile CI of ``metric(indices)`` under resampling of ``groups`` (patient ids).

    Args:
        metric: maps an index array (into the items, may repeat) to a float; NaN
            replicates (e.g. no valid item drawn) are dropped.
        groups: the patient id of every item.
        rng: an explicit, seeded generator.
        n_reps: replicates (default 1000).
        level: coverage (default 0.95: the 2.5th and 97.5th percentiles).

    Returns:
        ``(low, high)``; ``(nan, nan)`` when there are no items.
    """
    parts = group_indices(groups)
    if not parts:
        return float("nan"), float("nan")
    values = np.empty(n_reps, dtype=np.float64)
    for r in range(n_reps):
        pick = rng.integers(0, len(parts), size=len(parts))
        values[r] = metric(np.concatenate([parts[j] for j in pick]))
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    a = (1.0 - level) / 2.0
    low, high = np.quantile(values, [a, 1.0 - a])
    return float(low), float(high)
