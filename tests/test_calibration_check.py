"""``spar-bench check`` (``spar_bench.experiments.calibration_check``) is strict (issue 39, item 7): a rerun that lacks
or adds rows or cells fails with a line naming them (a deleted row used to pass as "117 of 117
cells as the reference"), and a malformed file is one line naming the file and what is wrong,
never a traceback. Fast: no training, the reference is docs/calibration.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]



def _row(rows: list, probe: str, model: str, seed) -> dict:
    return next(r for r in rows if r["probe"] == probe and r["model"] == model and r["seed"] == seed)


def _check(bench_check, check, tmp_path: Path, doc, name: str = "rerun.json") -> str:
    """``spar-bench check`` of ``doc`` (JSON-dumped, or written as is when a str) against the
    reference, which must refuse it (exit 2): its one error line."""
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    code, out, err = bench_check(path, "--against", check.REFERENCE)
    assert code == 2 and not out, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_a_missing_row_fails_and_is_named(bench_check, check, reference, tmp_path: Path) -> None:
    rerun = copy.deepcopy(reference)
    rerun["rows"].remove(_row(rerun["rows"], "level3.size", "blind (random prior)", None))
    # was: exit 0, "117 of 117 cells as the reference"
    assert _check(bench_check, check, tmp_path, rerun) == ("error: the rerun has no row level3.size "
                                                           "blind (random prior) (the reference has)")
    seedless = copy.deepcopy(reference)  # a trained seed's row: its cells are still there (seed 0)
    seedless["rows"].remove(_row(seedless["rows"], "level3.orientation", "recall", 1))
    with pytest.raises(ConfigError, match=r"^the rerun has no row level3.orientation recall seed 1 "):
        check.check_rerun(reference, seedless)


def test_an_extra_row_fails_and_is_named(bench_check, check, reference, tmp_path: Path) -> None:
    rerun = copy.deepcopy(reference)
    rerun["rows"].append({**copy.deepcopy(_row(rerun["rows"], "level2.arrangement", "computation", 0)), "seed": 7})
    assert _check(bench_check, check, tmp_path, rerun) == ("error: the rerun has an extra row "
                                                           "level2.arrangement computation seed 7 (not in the reference)")


def test_a_missing_or_empty_cell_fails_and_is_named(bench_check, check, reference, tmp_path: Path) -> None:
    rerun = copy.deepcopy(reference)
    del _row(rerun["rows"], "level3.counting", "oracle", None)["cells"]["random"]  # was: KeyError
    assert _check(bench_check, check, tmp_path, rerun) == ("error: the rerun's row level3.counting oracle "
                                                           "has no cell 'random' (the reference has)")
    empty = copy.deepcopy(reference)  # a cell without a value was dropped from the seed mean silently
    _row(empty["rows"], "level1.localisation", "recall", 0)["cells"]["mirrored"]["value"] = None
    with pytest.raises(ConfigError, match="row level1.localisation recall seed 0 has no cell 'mirrored'"):
        check.check_rerun(reference, empty)


@pytest.mark.parametrize("case", ["not json", "rows not a list", "conditions not an object",
                                  "row not an object", "row without probe", "cell not an object",
                                  "value not a number", "ci not a pair"])
def test_a_malformed_file_is_one_line_naming_it(bench_check, check, reference, tmp_path: Path, case: str) -> None:
    doc = copy.deepcopy(reference)
    row = _row(doc["rows"], "level3.size", "recall", 1)
    want = {
        "not json": ("{", "not a readable calibration.json"),
        "rows not a list": ({"conditions": {}, "rows": {"a": 1}}, "rows is dict, not a list of rows"),
        "conditions not an object": ({"conditions": [], "rows": []}, "conditions is not an object"),
        "row not an object": ({**doc, "rows": [*doc["rows"], [1, 2]]}, "rows[56] is list [1, 2], not an object"),
        "row without probe": ({**doc, "rows": [{"model": "recall", "seed": 0, "cells": {}}]},
                              "rows[0] has no 'probe' (a string)"),
        "cell not an object": (lambda: row["cells"].update(random=[0.5]),
                               "(level3.size recall seed 1) cell 'random' is not an object"),
        "value not a number": (lambda: row["cells"]["random"].update(value="0.5"),
                               "(level3.size recall seed 1) cell 'random' value \"0.5\" is not a number or null"),
        "ci not a pair": (lambda: row["cells"]["canonical"].update(ci=0.4),
                          "(level3.size recall seed 1) cell 'canonical' ci 0.4 is not [low, high]"),
    }[case]
    content, message = want
    if callable(content):
        content()
        content = doc
    line = _check(bench_check, check, tmp_path, content, name="bad.json")
    assert line.startswith(f"error: {tmp_path / 'bad.json'}: ") and message in line, line
