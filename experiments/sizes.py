"""How big a build will be before it exists: its cases (the build's own selection), images and
questions per case (a measured table, per source), and the seconds building it takes.

* cases: the cases its sources list on disk when their roots exist, else the sources' public
  sizes (:data:`PUBLIC_SPLITS`), through the builder's own selection (``--cases``, ``--limit``,
  ``--split-ratio``: :func:`spar_bench.builder.selection.select`) with a ``preset``'s options
  filled in as ``spar-build`` fills them; a phantom's ``n`` split as the generator splits it;
* per case: ``sizes.json`` (package data), measured by ``bench/estimate.py --write`` on real
  small builds: Level 1-2 mosaics kept of those drawn, Level 3 slices, Level 3 and Level 4
  questions per probe, and build seconds (one process), per source; counterfactual copies
  multiply them (``mirror`` x2 Levels 1-3, Level 4 x2 with ``mirror``, x3 with ``mirror+flip``).

A source the table has no row for takes WORD's row (said in :func:`per_case`'s ``note``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from spar_bench.builder.build import BUILD_OPTIONS, choice_options, open_source
from spar_bench.builder.case import CaseRef
from spar_bench.builder.phantom.generate import split_counts
from spar_bench.builder.selection import select
from spar_bench.builder.sources import SOURCES
from spar_bench.errors import SparError
from spar_bench.presets import apply_build_preset

#: the measured table (package data), written by ``bench/estimate.py --write``
TABLE = Path(__file__).with_name("sizes.json")
#: cases per split (train, val, test) of each public source, used when its root is not on
#: disk: WORD's official split; LiTS's 131 labelled volumes (its source puts them in test
#: unless --split-ratio); TotalSegmentator v2's 1,228 subjects (the meta.csv split: an
#: approximation, see docs/EXPERIMENTS.md); nnU-Net: a typical task
PUBLIC_SPLITS: dict[str, tuple[int, int, int]] = {
    "word": (100, 20, 30), "lits": (0, 0, 131), "totalsegmentator": (1082, 57, 89), "nnunet": (100, 0, 0),
}  # fmt: skip
SPLITS = ("train", "val", "test")
L123 = ("level1", "level2", "level3")


@lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    """``sizes.json``: ``{"measured": how/when, "sources": {source: row}}``."""
    return json.loads(TABLE.read_text())


def per_case(source: str) -> dict[str, Any]:
    """The measured row of ``source`` (WORD's, with a ``note``, for a source not measured)."""
    rows = table()["sources"]
    if source in rows:
        return rows[source]
    return {**rows["word"], "note": f"{source} not measured: WORD's row"}


def level_questions(source: str, level: str) -> float:
    """Questions per case of ``level`` (all its probes) of ``source``; a level measured only
    on the phantom (Level 4: volumes of real maps are not built by ``--write``) takes its row."""
    for row in (per_case(source), per_case("phantom")):
        found = [v for p, v in row["questions"].items() if p.startswith(level + ".")]
        if found:
            return float(sum(found))
    return 0.0


@dataclass(frozen=True)
class Choice:
    """What a build makes: its sources with their roots, options (``spar-build``'s names,
    a preset filled in) and levels."""

    sources: tuple[str, ...]
    roots: tuple[str, ...]
    options: dict[str, Any]
    levels: tuple[str, ...]
    phantom_n: int | None = None

    @property
    def counterfactual(self) -> str | None:
        return self.options.get("counterfactual")


def with_preset(options: dict[str, Any], sources: tuple[str, ...]) -> dict[str, Any]:
    """A build's options (``spar-build``'s names) with its ``preset``'s filled in, as
    ``spar-build --preset`` fills them (an option given wins; ``limit`` merges per source)."""

    opts = {k: None for k in BUILD_OPTIONS} | {k: _per_source(k, v) for k, v in options.items()}
    opts["source"] = sources
    if opts.get("preset"):
        opts, _ = apply_build_preset(opts["preset"], opts, {k for k, v in opts.items() if v is not None})
    return {k: v for k, v in opts.items() if v is not None}


def _per_source(key: str, value: Any) -> Any:
    if key in ("cases", "limit", "split_ratio"):  # one entry or a list, as the runner passes them
        return (value,) if isinstance(value, str) else tuple(value)
    return value


def split_cases(choice: Choice) -> dict[str, dict[str, int]]:
    """Cases per source and split that the build will have."""
    if choice.phantom_n is not None:
        return {"phantom": dict(split_counts(choice.phantom_n))}

    roots = (*choice.roots, *([None] * (len(choice.sources) - len(choice.roots))))
    found = {s: _listed(s, r) for s, r in zip(choice.sources, roots, strict=True)}
    config = SimpleNamespace(seed=int(choice.options.get("seed", 0)), **choice_options(choice.options, choice.sources))
    refs, _ = select(config, found, {s: "" for s in found})
    out = {s: dict.fromkeys(SPLITS, 0) for s in choice.sources}
    for r in refs:
        out[r.source][r.split] = out[r.source].get(r.split, 0) + 1
    return out


def _listed(source: str, root: str | None) -> list:
    """The cases ``source`` lists under ``root`` when it is there, else its public split sizes."""

    if root and Path(root).is_dir():
        try:
            return open_source(SOURCES.get(source), root, images="synthesize", seed=0).find()
        except (SparError, OSError, TypeError):
            pass
    sizes = PUBLIC_SPLITS.get(source, (100, 0, 0))
    return [CaseRef(source, f"{source}_{split}_{i:05d}", split, {})
            for split, n in zip(SPLITS, sizes, strict=True) for i in range(n)]  # fmt: skip


def images(choice: Choice, volumes: bool = False) -> float:
    """Images of the build (``volumes``: its Level 4 volumes), counterfactual copies included."""
    cases = split_cases(choice)
    cf = choice.counterfactual
    if volumes:
        n = sum(sum(c.values()) for c in cases.values())
        return float(n * {"mirror": 2, "mirror+flip": 3}.get(cf, 1)) if "level4" in choice.levels else 0.0
    spc = int(choice.options.get("samples_per_case", 32))
    total = 0.0
    for source, by_split in cases.items():
        row, n = per_case(source), sum(by_split.values())
        l12 = sum(lv in choice.levels for lv in ("level1", "level2")) * spc * row["l12_kept"]
        total += n * (l12 + ("level3" in choice.levels) * row["level3_slices"])
    return total * (2 if cf in ("mirror", "mirror+flip") else 1)


def train_items(choice: Choice, volumes: bool = False) -> float:
    """What a computation model trains its organ maps on: the training split's Level 4 original
    volumes (``volumes``), or its Level 3 slices with their mirrored copies."""
    cases = split_cases(choice)
    if volumes:
        return float(sum(c.get("train", 0) for c in cases.values())) if "level4" in choice.levels else 0.0
    if "level3" not in choice.levels:
        return 0.0
    mirrored = 2 if choice.counterfactual in ("mirror", "mirror+flip") else 1
    return float(sum(c.get("train", 0) * per_case(s)["level3_slices"] for s, c in cases.items()) * mirrored)


def questions(choice: Choice, splits: tuple[str, ...] = ("test",)) -> float:
    """Level 3 (and Level 4) questions of the build's ``splits`` (what ``spar-probe vqa`` asks
    by default), counterfactual copies included."""
    cf = choice.counterfactual
    mult = {"level3": 2 if cf in ("mirror", "mirror+flip") else 1, "level4": {"mirror": 2, "mirror+flip": 3}.get(cf, 1)}
    total = 0.0
    for source, by_split in split_cases(choice).items():
        n = sum(by_split.get(s, 0) for s in splits)
        for level in ("level3", "level4"):
            if level in choice.levels:
                total += n * mult[level] * level_questions(source, level)
    return total


def build_seconds(choice: Choice) -> float:
    """Seconds of one process building it (a phantom's generation included)."""
    return float(sum(sum(c.values()) * per_case(s)["build_seconds"] for s, c in split_cases(choice).items()))


def case_total(choice: Choice) -> int:
    return int(sum(sum(c.values()) for c in split_cases(choice).values()))
