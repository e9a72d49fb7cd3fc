"""The left-right mirror counterfactual.

:func:`mirror_case` flips the column axis (patient's right <-> left) of the mask, image
and lesion; organ labels are NOT swapped (the organ called ``kidney_left`` now lies on
the patient's right). All sample labels of a mirrored case are then RECOMPUTED by the
same pipeline with the same seeds, never flipped by rule. What geometry implies, and
what the tests check:

* relative_position: left/right (axis 0) answers flip, anterior/posterior stay;
* orientation: ``d_left -> -d_left``, ``d_ant`` unchanged, so the angle ``t`` becomes
  ``pi - t`` and sector ``s -> (4 - s) mod 8`` (left <-> right, left-anterior <->
  right-anterior, anterior and posterior stay);
* symmetry: A is the member on the patient's left side, which is now the organ named
  ``*_right``; ``d -> -d``, so left_larger <-> right_larger, similar stays;
* size, distance and counting: unchanged;
* Level 1: ``x -> (223 - x_px) / 224`` for the same organ and slice, ``y`` unchanged;
  Level 2 arrangements are recomputed from the mirrored centroids.

:func:`flip_case` reverses the z axis (superior <-> inferior), the second, stronger
counterfactual of Level 4 (``counterfactual="mirror+flip"``). On Level 4 volumes the
mirror flips relative_position axis 0 answers and swaps symmetry left_larger <->
right_larger; the flip flips axis 2 (superior/inferior) answers; distance, volume,
adjacency, containment and counting are unchanged by both (docs/PROTOCOL.md "Level 4").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..case import Case


def mirror_case(case: Case) -> Case:
    """``case`` with its column axis reversed; ``provenance["mirror"] = True``; labels unchanged."""

    def flip(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, :, ::-1])

    return dataclasses.replace(
        case,
        mask=flip(case.mask),
        image=flip(case.image),
        lesion=flip(case.lesion),
        provenance={**case.provenance, "mirror": True},
    )


def flip_case(case: Case) -> Case:
    """``case`` with its z axis reversed (superior <-> inferior); ``provenance["flip"] = True``."""

    def flip(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[::-1])

    return dataclasses.replace(
        case,
        mask=flip(case.mask),
        image=flip(case.image),
        lesion=flip(case.lesion),
        provenance={**case.provenance, "flip": True},
    )
