"""``--check`` of the calibration experiment (:mod:`.calibration`): does a rerun's
``calibration.json`` (another machine, the reference's command) reproduce the reference table
(``docs/calibration.json``, the tables of docs/RESULTS.md)?

* Untrained cells (the oracle, the blind rows) are computed, not trained: they must be the same
  on any machine, to the digit.
* A trained cell (recall, computation: the mean over the training seeds) must lie within the
  cross-machine tolerance of the reference's seed mean (:func:`tolerance`): a two-sample t
  interval over the seeds of both runs (another machine's floating point changes training the
  way another seed does: the same seed on two machines is two draws of training), combined in
  quadrature with the reference's patient-bootstrap half-width (the test set's resolution: a
  difference smaller than it means nothing, and it is the floor where the seeds happen to agree).
* Every conclusion of the reference must hold (:func:`conclusions`): on every probe and test
  layout, each pair of rows (trained model against trained model, against the oracle or a
  blind row) whose order is clear in the reference (their gap exceeds the two cells'
  tolerances combined) must keep that order in the rerun. A recall model suddenly at the
  computation model's level, or a flipped sign of recall against its blind baseline, fails,
  whatever the cells' tolerances.

docs/RESULTS.md ("A rerun on another machine") states the statistics and what a rerun reproduces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .calibration_tables import BLINDS, LAYOUTS, MODELS, value_scale

#: the rows trained per seed (their cells vary with training); the others are computed
TRAINED = ("recall", "computation")
#: the coverage of the tolerance's t interval (two-sided)
COVERAGE = 0.95

#: conditions a rerun may change and still be compared with the reference table (the machine's)
MACHINE_CONDITIONS = ("device", "jobs", "threads", "cpu_count", "load_average_at_end", "build_seconds", "wall_seconds")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _row_name(row: dict) -> str:
    """A row as the check names it: ``level3.size recall seed 0`` (untrained rows: no seed)."""
    return f"{row['probe']} {row['model']}" + ("" if row["seed"] is None else f" seed {row['seed']}")


def _cell_problem(cell: Any) -> str | None:
    """What is wrong with one cell of a row (``{"value": number | null, "ci": [lo, hi] | null, ...}``)."""
    if not isinstance(cell, dict):
        return "is not an object"
    if cell.get("value") is not None and not _is_number(cell["value"]):
        return f"value {json.dumps(cell['value'])[:40]} is not a number or null"
    ci = cell.get("ci")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(map(_is_number, ci))):
        return f"ci {json.dumps(ci)[:40]} is not [low, high]"
    return None


#: The fields of a row of calibration.json: (name, check, what it must be).
ROW_FIELDS = (("probe", lambda v: isinstance(v, str), "a string"),
              ("model", lambda v: isinstance(v, str), "a string"),
              ("seed", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
              ("cells", lambda v: isinstance(v, dict), "an object {layout: cell}"))


def _row_problem(row: Any) -> str | None:
    """What is wrong with one row (``{"probe": str, "model": str, "seed": int | null, "cells": {layout: cell}}``)."""
    if not isinstance(row, dict):
        return f"is {type(row).__name__} {json.dumps(row)[:40]}, not an object {{probe, model, seed, cells}}"
    for key, ok, what in ROW_FIELDS:
        if key not in row:
            return f"has no {key!r} ({what})"
        if not ok(row[key]):
            return f"{key!r} is {json.dumps(row[key])[:40]}, not {what}"
    for lay, cell in row["cells"].items():
        if (problem := _cell_problem(cell)) is not None:
            return f"({_row_name(row)}) cell {lay!r} {problem}"
    return None


def shape_problem(doc: Any) -> str | None:
    """What makes a parsed ``calibration.json`` unusable for ``--check``, in words (None: usable):
    ``{"conditions": {...}, "rows": [row, ...]}`` with every row as :func:`_row_problem` wants."""
    if not isinstance(doc, dict) or not {"conditions", "rows"} <= set(doc):
        return "not a calibration.json (needs 'conditions' and 'rows'): the --calibrate output"
    if not isinstance(doc["conditions"], dict):
        return "conditions is not an object"
    if not isinstance(doc["rows"], list):
        return f"rows is {type(doc['rows']).__name__}, not a list of rows"
    for i, row in enumerate(doc["rows"]):
        if (problem := _row_problem(row)) is not None:
            return f"rows[{i}] {problem}"
    return None


def _rows_by_key(rows: list[dict], name: str) -> tuple[dict[tuple, dict], list[str]]:
    """``({(probe, model, seed): row}, a line per row given twice)``."""
    by_key: dict[tuple, dict] = {}
    twice = []
    for r in rows:
        key = (r["probe"], r["model"], r["seed"])
        if key in by_key:
            twice.append(f"{name} has row {_row_name(r)} twice")
        by_key[key] = r
    return by_key, twice


def _has_value(cells: dict, lay: str) -> bool:
    return isinstance(cells.get(lay), dict) and cells[lay].get("value") is not None


def coverage_problems(reference: dict, rerun: dict) -> list[str]:
    """One line per row or cell that is in one of the two files and not the other (a cell without
    a value counts as absent), or given twice: the rerun must hold every row and cell of the
    reference, and no other, or its seed means are not the reference's."""
    ref, lines = _rows_by_key(reference["rows"], "the reference")
    new, twice = _rows_by_key(rerun["rows"], "the rerun")
    lines += twice
    lines += [f"the rerun has no row {_row_name(r)} (the reference has)" for k, r in ref.items() if k not in new]
    lines += [f"the rerun has an extra row {_row_name(r)} (not in the reference)" for k, r in new.items() if k not in ref]
    for key in (k for k in ref if k in new):
        a, b = ref[key]["cells"], new[key]["cells"]
        lays = list(dict.fromkeys([*a, *b]))
        lines += [f"the rerun's row {_row_name(new[key])} has no cell {lay!r} (the reference has)"
                  for lay in lays if _has_value(a, lay) and not _has_value(b, lay)]
        lines += [f"the rerun's row {_row_name(new[key])} has an extra cell {lay!r} (not in the reference)"
                  for lay in lays if _has_value(b, lay) and not _has_value(a, lay)]
    return lines


def _seed_cells(rows: list[dict], probe: str, model: str, layout: str) -> tuple[list[float], list[list[float]]]:
    """The values and intervals of every seed's row of ``model`` on ``probe`` in ``layout``."""
    rs = [r["cells"].get(layout) or {} for r in rows if r["probe"] == probe and r["model"] == model]
    rs = [c for c in rs if c.get("value") is not None]
    return [c["value"] for c in rs], [c["ci"] for c in rs if c.get("ci")]


def tolerance(ref: list[float], new: list[float], cis: list[list[float]]) -> float:
    """How far the rerun's seed mean of a trained cell may lie from the reference's:
    ``sqrt((t * s_p * sqrt(1/n1 + 1/n2))**2 + h**2)``, with ``s_p`` the pooled standard deviation
    of both runs' seeds, ``t`` the two-sided :data:`COVERAGE` quantile of Student's t with
    ``n1 + n2 - 2`` degrees of freedom (with one seed in each run no seed term: ``h`` alone) and
    ``h`` the mean half-width of the reference seeds' 95 % patient-bootstrap intervals."""
    from scipy import stats

    h = float(np.mean([(hi - lo) / 2 for lo, hi in cis])) if cis else 0.0
    n1, n2 = len(ref), len(new)
    if n1 + n2 <= 2:
        return h
    pooled = ((n1 - 1) * np.var(ref, ddof=1 if n1 > 1 else 0) + (n2 - 1) * np.var(new, ddof=1 if n2 > 1 else 0)) \
        / (n1 + n2 - 2)
    t = float(stats.t.ppf(0.5 + COVERAGE / 2, n1 + n2 - 2))
    return float(np.hypot(t * np.sqrt(pooled * (1 / n1 + 1 / n2)), h))


def cell_means(reference: dict, rerun: dict) -> dict[tuple[str, str, str], tuple[float, float, float, float]]:
    """``{(probe, model, layout): (reference seed mean, rerun seed mean, tolerance, the reference's
    own tolerance)}`` of every cell both have: :func:`tolerance` with the rerun's seeds, and with
    the reference's in their place (what the reference alone says is clear: :func:`conclusions`).
    An untrained cell's tolerances are 0 (the same on any machine)."""
    out = {}
    for probe in dict.fromkeys(r["probe"] for r in reference["rows"]):
        for model in (*MODELS, *BLINDS):
            for lay in LAYOUTS:
                ref, cis = _seed_cells(reference["rows"], probe, model, lay)
                new, _ = _seed_cells(rerun["rows"], probe, model, lay)
                if ref and new:
                    tol, own = (tolerance(ref, new, cis), tolerance(ref, ref, cis)) if model in TRAINED else (0.0, 0.0)
                    out[probe, model, lay] = (float(np.mean(ref)), float(np.mean(new)), tol, own)
    return out


def check_cells(means: dict) -> tuple[list[str], list[str]]:
    """``(table lines, misses)``: every cell against the reference (:func:`cell_means`)."""
    lines = ["| probe | model | layout | reference [interval] | rerun | within |", "|---|---|---|---|---|---|"]
    misses = []
    for (probe, model, lay), (m_ref, m_new, tol, _) in means.items():
        k = value_scale(probe)
        if model in TRAINED:
            ok, span = abs(m_new - m_ref) <= tol + 1e-9, f"[{k * (m_ref - tol):.1f}, {k * (m_ref + tol):.1f}]"
        else:  # computed, not trained: the same on any machine
            ok, span = abs(m_new - m_ref) <= 1e-9, "(the same)"
        lines.append(f"| {probe} | {model} | {lay} | {k * m_ref:.1f} {span} | {k * m_new:.1f} | "
                     f"{'yes' if ok else '**no**'} |")
        if not ok:
            misses.append(f"{probe} {model} {lay}: {k * m_new:.1f} against {k * m_ref:.1f} {span}")
    return lines, misses


def conclusions(means: dict) -> tuple[int, list[str]]:
    """``(conclusions of the reference, those the rerun changed)``: every pair of rows on one probe
    and layout, at least one of them trained, whose gap in the reference exceeds the two cells'
    own tolerances (the reference's seeds alone) combined in quadrature; the rerun must keep the
    sign of that gap. Which gaps are conclusions depends on the reference alone."""
    n, changed = 0, []
    names = (*MODELS, *BLINDS)
    for (probe, a, lay), (ra, na, _, ta) in means.items():
        k = value_scale(probe)
        for b in names[names.index(a) + 1:]:
            if (probe, b, lay) not in means or not {a, b} & set(TRAINED):
                continue
            rb, nb, _, tb = means[probe, b, lay]
            if abs(ra - rb) <= np.hypot(ta, tb):
                continue  # no clear order in the reference: nothing to reproduce
            n += 1
            if np.sign(na - nb) != np.sign(ra - rb):
                sign = "<" if ra < rb else ">"
                changed.append(f"{probe} {lay}: {a} {sign} {b} in the reference ({k * ra:.1f} {sign} {k * rb:.1f}), "
                               f"not in the rerun ({k * na:.1f} against {k * nb:.1f})")
    return n, changed


class Refused(SystemExit):
    """Input that cannot be compared (unreadable, malformed, of other conditions, other rows):
    its line(s) as ``str``, exit status 2 (an input error), not 1 (a comparison that failed);
    ``scripts/recall_vs_computation.py`` prints it."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def check_rerun(reference: dict, rerun: dict) -> tuple[list[str], list[str]]:
    """``(table lines, misses)``: every cell of the rerun against the reference (untrained: the
    same; trained: within :func:`tolerance`), then every conclusion of the reference that the
    rerun changed (:func:`conclusions`). The two runs must share every condition but the
    machine's, and the same rows and cells (:func:`coverage_problems`); both must have
    :func:`shape_problem`'s shape."""
    for name, doc in (("the reference", reference), ("the rerun", rerun)):
        if (problem := shape_problem(doc)) is not None:
            raise Refused(f"error: {name}: {problem}")
    had, got = (dict(d["conditions"]) for d in (reference, rerun))
    diff = sorted(k for k in set(had) | set(got) if k not in MACHINE_CONDITIONS and had.get(k) != got.get(k))
    if diff:
        raise Refused(f"error: the rerun was made with other conditions than the reference ({', '.join(diff)}); "
                         "rerun with the reference's command (its conditions are in its JSON)")
    problems = coverage_problems(reference, rerun)
    if problems:
        raise Refused("\n".join(f"error: {p}" for p in problems))
    means = cell_means(reference, rerun)
    lines, misses = check_cells(means)
    n, changed = conclusions(means)
    lines += ["", f"{n - len(changed)} of {n} conclusions of the reference hold"]
    return lines, misses + [f"conclusion changed: {c}" for c in changed]


def check_command(path: Path, reference: Path) -> int:
    """``--check``: print the comparison of a rerun's ``calibration.json`` with ``reference``;
    exit status 1 when a cell is outside its interval or a conclusion changed."""
    docs = []
    for f in (reference, path):
        try:
            docs.append(json.loads(Path(f).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise Refused(f"error: {f}: not a readable calibration.json ({e})") from None
        if (problem := shape_problem(docs[-1])) is not None:
            raise Refused(f"error: {f}: {problem}")
    lines, misses = check_rerun(*docs)
    print("\n".join(lines))
    n = sum(1 for line in lines if line.startswith("| ") and not line.startswith("| probe "))
    cells = [m for m in misses if not m.startswith("conclusion changed: ")]
    print(f"\n{n - len(cells)} of {n} cells as the reference" + ("" if not misses else ":"))
    for m in misses:
        print(f"  {'outside: ' + m if m in cells else m}")
    return 1 if misses else 0
