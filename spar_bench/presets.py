"""Named presets of builder and probe options: ``spar-build --preset paper``,
``spar-probe fit/sweep --preset paper`` (docs/PROTOCOL.md §12).

A preset is a frozen table. It fills the options the command line leaves out; an option
given explicitly wins, and the record says so: the build manifest's ``config.preset`` and
each run's ``config.json`` (``run.preset``) hold ``{"name", "options", "overridden"}``.

``paper`` follows the seed documents where they fix a choice (WORD's official 100/20/30
split plus 20 LiTS volumes; 4x4 tiles of 56 px on a 224 frame; MLP and Transformer heads;
3 seeds; TotalSegmentator zero-shot, no retraining) and makes a documented choice where
they are silent (:data:`PAPER` ``choices``); the protocol's constants that are no option
(orientation sectors, size/distance tertiles, TotalSegmentator substitutes) are listed
in ``pinned`` and a test holds the code to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from click.core import ParameterSource

from spar_bench.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One preset.

    Attributes:
        name: its ``--preset`` name.
        build: ``spar-build`` options (click parameter names; per-source options as
            ``{source: value}``, applied to the sources the build has).
        probe: ``spar-probe fit`` / ``sweep`` options (click parameter names).
        pinned: protocol constants that are no option, as the preset assumes them.
        choices: where the paper is silent: the choice and why.
    """

    name: str
    build: dict[str, Any]
    probe: dict[str, Any]
    pinned: dict[str, Any] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)


PAPER = Preset(
    name="paper",
    build={
        "seed": 0,
        "samples_per_case": 32,
        "l12_min_organs": 8,
        "arrangement": "rows-by-y",
        "counterfactual": "mirror",
        "limit": {"lits": 20},
        "split_ratio": {"lits": "0.7,0.1,0.2"},
    },
    probe={
        "seeds": "0,1,2",
        "heads": "mlp,transformer",
        "lr": 1e-3,
        "weight_decay": 0.01,
        "batch_size": 256,
        "patience": 8,
    },
    pinned={
        "orientation": "8 sectors of 45 degrees centred on left, left-anterior, anterior, right-anterior, "
                       "right, right-posterior, posterior, left-posterior",
        "orientation_classes": 8,
        "size_bins": "tertiles of the area (mm^2) per organ, fitted on the training split's original "
                     "questions; global tertiles for organs with < 30 training questions",
        "distance_bins": "tertiles of the centroid distance (mm) per organ pair, fitted likewise",
        "threshold_min_n": 30,
        "symmetry_band": 0.15,
        "totalsegmentator": {
            "head_of_femur_left": "femur_left", "head_of_femur_right": "femur_right",
            "adrenal": ["adrenal_gland_left", "adrenal_gland_right"], "intestine": "small_bowel",
            "bladder": "urinary_bladder", "unannotated": ["rectum"]},
        "totalsegmentator_split_scored": "test",
    },
    choices={
        "samples_per_case": "32 mosaics per case (the paper gives no number): 3,200 training mosaics "
                            "from WORD's 100 training volumes",
        "l12_min_organs": "a Level 1-2 mosaic needs 8 present organs (half the canonical set): exact "
                          "permutation by chance 1/8! = 2.5e-5, so no free items (LiTS, liver only, "
                          "gives none; docs/PROTOCOL.md 4)",
        "arrangement": "rows-by-y: the centroid-based reading order (4 rows by y, then x), the "
                       "arrangement closest to 'the centroid-based spatial arrangement'",
        "counterfactual": "mirror: the control that separates recall from computation; it adds "
                          "samples and leaves every original sample unchanged",
        "lits": "20 LiTS volumes (the paper's count) chosen by a seeded patient-level draw, split "
                "0.7/0.1/0.2 by patient (14/2/4); LiTS gives counting questions only",
        "orientation": "8 compass sectors of 45 degrees in the patient frame",
        "size_distance_bins": "3 classes, tertiles fixed on the training split per organ (size) and "
                              "organ pair (distance), reused unchanged for every split and source",
        "totalsegmentator": "femur_left/right stand for the femoral heads (whole proximal femur: an "
                            "approximation), the adrenal is the union of left and right, rectum has no "
                            "class (unannotated, never zero-filled)",
        "totalsegmentator_split": "the test split of TotalSegmentator's meta.csv is scored (its own "
                                  "held-out split; zero-shot, so no split is trained on, and the "
                                  "held-out split keeps the numbers comparable with other work on it); "
                                  "thresholds come from the training build (--thresholds-from)",
        "heads": "MLP (pooled vector) and Transformer (full token set), the paper's 2x2 heads",
        "seeds": "3 seeds (0, 1, 2), as in the paper",
        "training": "AdamW lr 1e-3, weight decay 0.01, batch 256, early stopping with patience 8 "
                    "on the validation split (the paper gives no training details)",
    },
)

PRESETS: dict[str, Preset] = {PAPER.name: PAPER}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name}: unknown preset; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def _per_source(table: dict[str, Any], sources: tuple[str, ...], given: tuple[str, ...]) -> tuple[tuple, list]:
    """A per-source option (``{source: value}``) merged into the entries ``given`` on the
    command line (``("word=5",)``): the preset's entry of each built source that no given
    entry names (an entry without ``SOURCE=`` names every source). Returns (the merged
    entries, the sources whose preset entry was overridden)."""
    named = {g.split("=", 1)[0] for g in given if "=" in g}
    every = any("=" not in g for g in given)
    mine = [(src, v) for src, v in table.items() if src in sources]
    add = tuple(f"{src}={v}" for src, v in mine if not every and src not in named)
    return tuple(given) + add, [src for src, _ in mine if every or src in named]


def _fill(table: dict[str, Any], options: dict[str, Any], explicit: set[str]) -> tuple[dict, dict, list]:
    """``(options with the table's values where not given explicitly, the values used, the
    keys given explicitly instead)``; keys the command does not have are left out."""
    out, used, overridden = dict(options), {}, []
    for key, value in table.items():
        if key not in options:
            continue  # an option this command does not have (fit has no --heads)
        if key in explicit:
            overridden.append(key)
            continue
        out[key] = used[key] = value
    return out, used, overridden


def apply_build_preset(name: str, options: dict[str, Any], explicit: set[str]) -> tuple[dict[str, Any], dict]:
    """``spar-build`` options with the preset's filled in where not given explicitly, and the
    record (``{"name", "options", "overridden"}``) the manifest keeps. A per-source option
    (``--limit``) is merged per source: ``--limit word=5`` keeps the preset's ``lits=20``."""
    preset = get_preset(name)
    sources = tuple(options.get("source") or ())
    per_source = {k: v for k, v in preset.build.items() if isinstance(v, dict)}
    scalars = {k: v for k, v in preset.build.items() if k not in per_source}
    out, used, overridden = _fill(scalars, options, explicit)
    for key, value in per_source.items():
        given = tuple(options.get(key) or ()) if key in explicit else ()
        merged, lost = _per_source(value, sources, given)
        overridden += [f"{key}[{src}]" for src in lost]
        if merged[len(given):]:
            out[key], used[key] = merged, list(merged[len(given):])
    return out, {"name": preset.name, "options": used, "overridden": sorted(overridden)}


def apply_probe_preset(name: str, options: dict[str, Any], explicit: set[str]) -> tuple[dict[str, Any], dict]:
    """``spar-probe fit``/``sweep`` options (click names; run options included) with the
    preset's filled in where not given explicitly, and the record each run keeps."""
    preset = get_preset(name)
    out, used, overridden = _fill(preset.probe, options, explicit)
    return out, {"name": preset.name, "options": used, "overridden": sorted(overridden)}


def explicit_options(ctx) -> set[str]:
    """The parameters of a click context given on the command line (not defaults)."""

    return {k for k in ctx.params if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
