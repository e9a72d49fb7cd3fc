"""Samples of every level (1-4): pure functions from a canonical :class:`~spar_bench.builder.case.Case`.

``process_case(case, config, global_seed)`` returns every sample of one case as arrays in
the field layout of docs/FORMATS.md; the build concatenates them per split in case
order. Nothing here depends on processing order or global random state: every draw comes
from ``np.random.default_rng(derive_seed(global_seed, source, case_id, level, index))``.

Pipeline per case (one pass over the volume): native per-slice organ statistics
(bincounts, :mod:`.frame224`), the case's square 224 frame,
the plan of Level 1/2 tile slices (:mod:`.level12`) and of Level 3 slices
(:mod:`.level3`), ONE resampling of all needed slices, then the arrays. With
``counterfactual="mirror"`` the same pipeline runs again on :func:`mirror_case` (same
seeds) and its rows are appended (:mod:`.mirror`). Size and distance answers are -1
until :func:`apply_thresholds` (:mod:`.thresholds`); the build calls it through the level's
hooks (:mod:`.levels`). Level 4 (opt-in) resamples the case once more, into its isotropic
cube (:mod:`.volume`), and asks its questions of the stored cube (:mod:`.level4`); its
counterfactual copies are that cube reversed (``"mirror"``: col; ``"mirror+flip"``: col,
and z in a second copy), every label recomputed with the same seed.
"""

from __future__ import annotations

import numpy as np

from ..case import Case
from ..schema import LEVEL_SPECS
from .config import SampleConfig
from .mirror import flip_case, mirror_case
from .thresholds import apply_thresholds, fit_thresholds, original_questions

__all__ = [
    "SampleConfig",
    "apply_thresholds",
    "fit_thresholds",
    "flip_case",
    "mirror_case",
    "original_questions",
    "process_case",
]


def _process_one(
    case: Case, config: SampleConfig, global_seed: int, is_mirror: bool
) -> dict[str, dict[str, np.ndarray]]:
    from .frame224 import frame_for_case, resample_case, slice_stats
    from .level3 import build_level3, plan_level3
    from .level12 import build_level12, plan_level12

    if all(LEVEL_SPECS[lv].volume for lv in config.levels):  # Level 4 only: no slice levels
        return {}
    stats = slice_stats(case)
    frame = frame_for_case(case, config.fov_margin_mm)
    want12 = any(LEVEL_SPECS[lv].mosaic for lv in config.levels)
    draws = (
        plan_level12(case, stats, config, global_seed) if want12 else np.empty((0, 16), np.int64)
    )
    zs3 = (
        plan_level3(stats, case.spacing, config, case.lesion)
        if "level3" in config.levels
        else np.empty(0, np.int64)
    )
    needed = np.union1d(draws[draws >= 0].ravel(), zs3)
    slices = resample_case(case, frame, needed, config.window_level, config.window_width)
    out: dict[str, dict[str, np.ndarray]] = {}
    if want12:
        out.update(
            build_level12(
                case, draws, frame, stats, slices, config, global_seed, is_mirror=is_mirror
            )
        )
    if "level3" in config.levels:
        out["level3"], out["level3_questions"] = build_level3(
            case, zs3, frame, stats, slices, config, global_seed, is_mirror=is_mirror
        )
    return out


def process_case(
    case: Case, config: SampleConfig, global_seed: int
) -> dict[str, dict[str, np.ndarray]]:
    """All samples of one case.

    Returns a dict with keys among ``"level1"``, ``"level2"``, ``"level3"`` (slices),
    ``"level3_questions"``, ``"level4"`` (volumes) and ``"level4_questions"`` (as requested by
    ``config.levels``). Each maps a docs/FORMATS.md
    field name to an array with one row per sample / slice / question (strings as object
    arrays). ``level3_questions["q_slice"]`` indexes rows of THIS case's ``level3`` arrays.
    Size and distance questions have ``q_answer == -1`` until :func:`apply_thresholds`.
    With ``config.counterfactual == "mirror"`` the mirrored copies (``is_mirror`` True,
    key + ``"/mirror"``, ``origin_key`` = the original's key) are appended after the
    originals, computed by the same pipeline on :func:`mirror_case` with the same seeds.
    ``"mirror+flip"`` does the same for Levels 1-3; Level 4 appends the mirrored then the
    flipped copy of its volume (``level4_questions["q_volume"]`` indexes THIS case's
    ``level4`` rows: 0 the original, then the copies).

    Raises:
        CaseError: the case has no image, no body, or labels outside 0..16.
    """
    from .level4 import case_level4

    out = _process_one(case, config, global_seed, is_mirror=False)
    slice_levels = any(not LEVEL_SPECS[lv].volume for lv in config.levels)
    if slice_levels and config.counterfactual in ("mirror", "mirror+flip"):
        mirrored = _process_one(mirror_case(case), config, global_seed, is_mirror=True)
        n_slices = len(out["level3"]["key"]) if "level3" in out else 0
        if "level3_questions" in mirrored:
            mirrored["level3_questions"]["q_slice"] = mirrored["level3_questions"][
                "q_slice"
            ] + np.int32(n_slices)
        for level, arrays in mirrored.items():
            out[level] = {
                name: np.concatenate([out[level][name], arr]) for name, arr in arrays.items()
            }
    if "level4" in config.levels:
        out["level4"], out["level4_questions"] = case_level4(case, config, global_seed)
    return out
