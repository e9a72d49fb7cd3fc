"""Metrics of the eight probes (pure numpy). Absent organs are excluded everywhere.

* Level 1 (localisation): mean Euclidean distance (MED) in pixels of the 224 frame
  (``|pred - true| * 224`` on normalised coordinates) and in mm (times the sample's
  ``mm_per_pixel``), success detection rate within 10 px (SDR@10), and both per organ.
  Level 4 (3-D localisation) is the same function, :func:`localisation_metrics`, on (x, y, z)
  in the volume's voxels (``|pred - true| * S`` for an S^3 volume, times ``mm_per_voxel`` in
  mm) with SDR within 10 voxels (``med_vox``, ``med_mm``, ``sdr10_vox``).
* Level 2 (arrangement): exact permutation accuracy (every present tile at its right
  slot: the headline), per-tile accuracy (overall and, given the tiles' organs, per
  organ), mean Kendall's tau between predicted and true slots of the present tiles.
  ``by_k``: the same per number k of present tiles, beside its chance 1/k!.
* Level 3 (questions): accuracy, macro-F1, chance (1/n_classes) and the majority-class
  rate (majority class taken from TRAIN, its rate measured on the evaluated split);
  :func:`by_axis` splits a probe whose questions have axes (relative position: left/right,
  anterior/posterior); :func:`conflict_metrics` scores the conflict items, whose answer in
  the image differs from the prior's (canonical anatomy's) answer.

Every ``*_metrics`` function also accepts ``groups`` (patient ids) to add 95 %
bootstrap-over-patients confidence intervals (see :mod:`spar_bench.probes.bootstrap`).
"""

from __future__ import annotations

from collections.abc import Callable
from math import factorial

import numpy as np

from spar_bench.builder.schema import IMAGE_SIZE, ORGANS

from .bootstrap import DEFAULT_REPS, bootstrap_ci

SDR_RADIUS_PX = 10.0


def _check(name: str, a: np.ndarray, shape: tuple) -> None:
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")


# --------------------------------------------------------------------------- Level 1 (and 4)
#: the metric keys of :func:`level1_metrics` (2-D, pixels of the 224 frame) and of Level 4 (voxels)
LEVEL1_KEYS = ("med_px", "med_mm", "sdr10")
LEVEL4_KEYS = ("med_vox", "med_mm", "sdr10_vox")
SDR_RADIUS_VOX = 10.0


def localisation_errors(pred: np.ndarray, true: np.ndarray, present: np.ndarray,
                        size: float | np.ndarray = IMAGE_SIZE) -> np.ndarray:
    """Per (item, organ) error in pixels (voxels) of the frame; NaN where the organ is absent.

    ``pred`` and ``true`` are ``(N, 16, k)`` normalised coordinates in [0, 1] (k = 2: (x, y)
    of the 224 frame; k = 3: (x, y, z) of a volume); ``size`` is the frame's side in pixels
    or voxels (a scalar or one per item).
    """
    pred = np.asarray(pred, dtype=np.float64)
    true = np.asarray(true, dtype=np.float64)
    present = np.asarray(present, dtype=bool)
    _check("pred", pred, true.shape)
    _check("present", present, true.shape[:2])
    size = np.asarray(size, dtype=np.float64)
    err = np.linalg.norm(pred - true, axis=-1) * (size[:, None] if size.ndim else size)
    err[~present] = np.nan
    return err


def _nanmean(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else float("nan")


def level1_metrics(
    pred: np.ndarray,
    true: np.ndarray,
    present: np.ndarray,
    mm_per_pixel: np.ndarray,
    groups: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    n_reps: int = DEFAULT_REPS,
) -> dict:
    """MED (px, mm), SDR@10 and per-organ MED/SDR over present organs.

    Returns a dict with ``med_px``, ``med_mm``, ``sdr10``, ``n`` (present organ
    instances), ``per_organ`` (name -> {med_px, med_mm, sdr10, n}) and, when
    ``groups`` is given, ``ci`` (metric -> [low, high]).
    """
    return localisation_metrics(pred, true, present, mm_per_pixel, IMAGE_SIZE, SDR_RADIUS_PX, LEVEL1_KEYS,
                                groups, rng, n_reps)  # fmt: skip


def localisation_metrics(
    pred: np.ndarray, true: np.ndarray, present: np.ndarray, mm_per_unit: np.ndarray,
    size: float | np.ndarray, radius: float, keys: tuple[str, str, str],
    groups: np.ndarray | None = None, rng: np.random.Generator | None = None, n_reps: int = DEFAULT_REPS,
) -> dict:
    """MED in frame units and mm, SDR within ``radius`` units, overall and per organ, under the
    names ``keys`` (``(med_units, med_mm, sdr)``): Level 1 (:func:`level1_metrics`: pixels of
    the 224 frame) and Level 4 (voxels of an S^3 volume, ``size`` S, ``mm_per_unit`` the
    item's ``mm_per_voxel``)."""
    k_med, k_mm, k_sdr = keys
    err = localisation_errors(pred, true, present, size)
    mm = err * np.asarray(mm_per_unit, dtype=np.float64)[:, None]
    hit = np.where(np.isfinite(err), (err <= radius).astype(np.float64), np.nan)
    out: dict = {
        k_med: _nanmean(err),
        k_mm: _nanmean(mm),
        k_sdr: _nanmean(hit),
        "n": int(np.isfinite(err).sum()),
        "per_organ": {},
    }
    for j, name in enumerate(ORGANS):
        out["per_organ"][name] = {
            k_med: _nanmean(err[:, j]),
            k_mm: _nanmean(mm[:, j]),
            k_sdr: _nanmean(hit[:, j]),
            "n": int(np.isfinite(err[:, j]).sum()),
        }
    if groups is not None:
        out["ci"] = _cis(
            {k_med: err, k_mm: mm, k_sdr: hit},
            lambda a, idx: _nanmean(a[idx]),
            groups,
            rng,
            n_reps,
        )
    return out


def atlas_predictions(train_centroid: np.ndarray, train_present: np.ndarray, n: int) -> np.ndarray:
    """The atlas baseline: every organ at its mean training centroid, for ``n`` samples.

    Any number of coordinates (Level 1 (x, y), Level 4 (x, y, z)); organs never present in
    training fall back to the frame's centre (0.5 on every axis).
    """
    c = np.where(np.asarray(train_present, bool)[..., None], train_centroid, np.nan)
    with np.errstate(invalid="ignore"):
        cnt = np.isfinite(c[..., 0]).sum(axis=0)
        mean = np.where(cnt[:, None] > 0, np.nansum(c, axis=0) / np.maximum(cnt, 1)[:, None], 0.5)
    return np.broadcast_to(mean, (n, *mean.shape)).astype(np.float32).copy()


# --------------------------------------------------------------------------- Level 2
def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau-a between two rankings of the same items (NaN for fewer than 2)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = a.size
    if n < 2:
        return float("nan")
    iu = np.triu_indices(n, k=1)
    s = np.sign(a[:, None] - a[None, :])[iu] * np.sign(b[:, None] - b[None, :])[iu]
    return float(s.sum() / iu[0].size)


def level2_item_scores(
    pred_slot: np.ndarray, target_slot: np.ndarray, present_pos: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-sample exact-match (0/1), per-tile accuracy and Kendall's tau (NaN if < 2 tiles)."""
    pred_slot = np.asarray(pred_slot)
    target_slot = np.asarray(target_slot)
    present_pos = np.asarray(present_pos, dtype=bool)
    _check("pred_slot", pred_slot, target_slot.shape)
    _check("present_pos", present_pos, target_slot.shape)
    n = pred_slot.shape[0]
    exact = np.full(n, np.nan)
    tile = np.full(n, np.nan)
    tau = np.full(n, np.nan)
    for i in range(n):
        m = present_pos[i]
        if not m.any():
            continue
        ok = pred_slot[i, m] == target_slot[i, m]
        exact[i] = float(ok.all())
        tile[i] = float(ok.mean())
        tau[i] = kendall_tau(pred_slot[i, m], target_slot[i, m])
    return {"exact": exact, "tile": tile, "tau": tau}


def level2_metrics(
    pred_slot: np.ndarray,
    target_slot: np.ndarray,
    present_pos: np.ndarray,
    groups: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    n_reps: int = DEFAULT_REPS,
    perm: np.ndarray | None = None,
) -> dict:
    """Exact permutation accuracy, per-tile accuracy (pooled over tiles) and mean tau.

    With ``perm`` ``(N, 16)`` (the organ shown at each mosaic position) the result also
    holds ``per_organ`` (name -> {tile_acc, n}): how often each organ's tile is put in
    its right slot.
    """
    s = level2_item_scores(pred_slot, target_slot, present_pos)
    ntile = np.asarray(present_pos, bool).sum(axis=1).astype(np.float64)
    correct = np.nan_to_num(s["tile"]) * ntile

    def tile_acc(idx: np.ndarray) -> float:
        d = ntile[idx].sum()
        return float(correct[idx].sum() / d) if d else float("nan")

    out = {
        "perm_acc": _nanmean(s["exact"]),
        "tile_acc": tile_acc(np.arange(ntile.size)),
        "kendall_tau": _nanmean(s["tau"]),
        "n": int(np.isfinite(s["exact"]).sum()),
    }
    out["by_k"] = _perm_acc_by_k(s["exact"], ntile)
    if perm is not None:
        out["per_organ"] = _tile_acc_per_organ(pred_slot, target_slot, present_pos, perm)
    if groups is not None:
        out["ci"] = _cis(
            {"perm_acc": s["exact"], "kendall_tau": s["tau"]},
            lambda a, idx: _nanmean(a[idx]),
            groups,
            rng,
            n_reps,
        )
        out["ci"]["tile_acc"] = list(bootstrap_ci(tile_acc, groups, _rng(rng), n_reps))
    return out


def _perm_acc_by_k(exact: np.ndarray, ntile: np.ndarray) -> dict[str, dict]:
    """Per number k of present tiles (str keys, ascending): items ``n``, their exact
    permutation accuracy ``perm_acc`` and its chance ``1/k!``."""

    out = {}
    for k in np.unique(ntile[np.isfinite(exact)]).astype(int).tolist():
        at = (ntile == k) & np.isfinite(exact)
        out[str(k)] = {"n": int(at.sum()), "perm_acc": float(exact[at].mean()),
                       "chance": 1.0 / factorial(k)}  # fmt: skip
    return out


def _tile_acc_per_organ(pred_slot, target_slot, present_pos, perm) -> dict[str, dict]:
    present = np.asarray(present_pos, bool)
    ok = (np.asarray(pred_slot) == np.asarray(target_slot)) & present
    organ = np.asarray(perm)
    out = {}
    for j, name in enumerate(ORGANS):
        at = present & (organ == j)
        n = int(at.sum())
        out[name] = {"tile_acc": float(ok[at].mean()) if n else float("nan"), "n": n}
    return out


# --------------------------------------------------------------------------- Level 3
def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int) -> float:
    """Macro-F1 over the classes that occur in ``y_true`` or ``y_pred`` (sklearn's rule).

    A prediction outside the classes (``< 0``: an MLLM's unparsed answer) is a miss: a false
    negative of the true class and no class's false positive.
    """
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    if y_true.size == 0:
        return float("nan")
    n = n_classes
    col = np.where(y_pred < 0, n, y_pred)  # column n: no answer
    cm = np.bincount(y_true * (n + 1) + col, minlength=n * (n + 1)).reshape(n, n + 1)
    tp = np.diag(cm[:, :n]).astype(np.float64)
    fp = cm[:, :n].sum(axis=0) - tp
    fn = cm.sum(axis=1) - tp
    used = (cm[:, :n].sum(axis=0) + cm.sum(axis=1)) > 0
    denom = 2 * tp + fp + fn
    f1 = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)
    return float(f1[used].mean())


def majority_class(y_train: np.ndarray, n_classes: int) -> int:
    """The most frequent training answer (ties: the smallest class index)."""
    return int(np.argmax(np.bincount(np.asarray(y_train, np.int64), minlength=n_classes)))


def level3_metrics(
    y_true: np.ndarray,
    y_pred: np.ndarray,
    n_classes: int,
    y_train: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    n_reps: int = DEFAULT_REPS,
) -> dict:
    """Accuracy, macro-F1, chance and (with ``y_train``) the majority-class rate."""
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    _check("y_pred", y_pred, y_true.shape)
    hit = (y_true == y_pred).astype(np.float64)
    out: dict = {
        "accuracy": _nanmean(hit),
        "macro_f1": macro_f1(y_true, y_pred, n_classes),
        "chance": 1.0 / n_classes,
        "n": int(y_true.size),
    }
    if y_train is not None and np.asarray(y_train).size:
        maj = majority_class(y_train, n_classes)
        out["majority_class"] = maj
        out["majority"] = _nanmean((y_true == maj).astype(np.float64))
    if groups is not None:
        out["ci"] = {
            "accuracy": list(bootstrap_ci(lambda i: _nanmean(hit[i]), groups, _rng(rng), n_reps)),
            "macro_f1": list(
                bootstrap_ci(
                    lambda i: macro_f1(y_true[i], y_pred[i], n_classes), groups, _rng(rng), n_reps
                )
            ),
        }
    return out


def by_axis(axis: np.ndarray, names: tuple[str, ...], score: Callable[[np.ndarray], dict | None]) -> dict:
    """``score(mask)`` of the items of each named axis (``axis == i`` is ``names[i]``), for
    the axes that have items: relative position's left/right and anterior/posterior."""
    axis = np.asarray(axis)
    return {name: score(axis == i) for i, name in enumerate(names) if (axis == i).any()}


def conflict_metrics(
    y_true: np.ndarray,
    y_pred: np.ndarray,
    y_prior: np.ndarray,
    groups: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    n_reps: int = DEFAULT_REPS,
) -> dict:
    """Scores on the conflict items: those whose answer in the image (``y_true``) differs
    from the prior's answer ``y_prior`` (canonical anatomy's, fitted on train).

    Returns ``n`` (conflict items), ``n_items``, ``share`` (n / n_items), ``accuracy`` (on
    the conflict items) and ``prior_agreement`` (how often ``y_pred`` gives the prior's answer
    there); with ``groups``, ``ci`` over patients. A prediction outside the classes (an
    MLLM's unparsed -1) counts wrong and not as the prior's answer. The prior itself scores
    0 and agrees 100 %; a model that recalls canonical anatomy tends to the same; one that
    reads the image scores as on any item.
    """
    y_true, y_pred, y_prior = (np.asarray(a, dtype=np.int64) for a in (y_true, y_pred, y_prior))
    _check("y_pred", y_pred, y_true.shape)
    _check("y_prior", y_prior, y_true.shape)
    c = y_true != y_prior
    hit = (y_pred[c] == y_true[c]).astype(np.float64)
    agree = (y_pred[c] == y_prior[c]).astype(np.float64)
    out: dict = {
        "n": int(c.sum()), "n_items": int(c.size), "share": _nanmean(c.astype(np.float64)),
        "accuracy": _nanmean(hit), "prior_agreement": _nanmean(agree),
    }  # fmt: skip
    if groups is not None and c.any():
        out["ci"] = _cis({"accuracy": hit, "prior_agreement": agree}, lambda a, idx: _nanmean(a[idx]),
                         np.asarray(groups)[c], rng, n_reps)  # fmt: skip
    return out


# --------------------------------------------------------------------------- helpers
def _rng(rng: np.random.Generator | None) -> np.random.Generator:
    if rng is None:
        raise ValueError("bootstrap CIs need an explicit seeded np.random.Generator (rng=...)")
    return rng


def _cis(
    arrays: dict[str, np.ndarray],
    fn: Callable[[np.ndarray, np.ndarray], float],
    groups: np.ndarray,
    rng: np.random.Generator | None,
    n_reps: int,
) -> dict[str, list[float]]:
    return {
        k: list(bootstrap_ci(lambda idx, a=a: fn(a, idx), groups, _rng(rng), n_reps))
        for k, a in arrays.items()
    }
