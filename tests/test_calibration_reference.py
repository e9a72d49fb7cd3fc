"""The calibration tables of docs/RESULTS.md and their reference (``docs/calibration.json``), and
``scripts/recall_vs_computation.py --check``, which tells whether a rerun on another machine
stays within the table's intervals (fast: no training)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]



def test_the_results_tables_are_the_reference_written_out(rvc, reference) -> None:
    """Every probe's table in docs/RESULTS.md is what the script prints from the reference."""
    results = (REPO / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    probes = list(dict.fromkeys(r["probe"] for r in reference["rows"]))
    assert len(probes) == 8
    for probe in probes:
        assert rvc.calibration_table(reference["rows"], probe) in results, probe


def _row(rows: list, probe: str, model: str, seed) -> dict:
    return next(r for r in rows if r["probe"] == probe and r["model"] == model and r["seed"] == seed)


def test_check_passes_the_reference_and_names_a_cell_that_moved(rvc, reference) -> None:
    lines, misses = rvc.check_rerun(reference, reference)
    assert not misses and len(lines) > 100
    rerun = copy.deepcopy(reference)
    rerun["conditions"].update(threads=1, wall_seconds=1.0, cpu_count=64)  # the machine's: allowed
    cell = _row(rerun["rows"], "level3.relative_position", "computation", 1)["cells"]["random"]
    lo = _row(reference["rows"], "level3.relative_position", "computation", 0)["cells"]["random"]["ci"][0]
    cell["value"] = lo - 0.05  # the seed mean falls below the interval
    _, misses = rvc.check_rerun(reference, rerun)
    assert len(misses) == 1 and misses[0].startswith("level3.relative_position computation random:")
    untrained = copy.deepcopy(reference)
    _row(untrained["rows"], "level3.orientation", "oracle", None)["cells"]["mirrored"]["value"] += 1e-6
    _, misses = rvc.check_rerun(reference, untrained)
    assert misses == [next(m for m in misses if m.startswith("level3.orientation oracle mirrored"))]


def test_check_refuses_a_rerun_of_other_conditions_and_reports_by_exit_status(rvc, reference, tmp_path,
                                                                              capsys) -> None:
    other = copy.deepcopy(reference)
    other["conditions"]["seeds"] = [0]
    with pytest.raises(SystemExit, match=r"other conditions than the reference \(seeds\)"):
        rvc.check_rerun(reference, other)
    same, moved = tmp_path / "same.json", tmp_path / "moved.json"
    same.write_text(json.dumps(reference))
    assert rvc.main(["--check", str(same)]) == 0
    assert "120 of 120 cells as the reference" in capsys.readouterr().out
    for r in (m := copy.deepcopy(reference))["rows"]:
        if r["model"] == "recall" and r["probe"] == "level3.orientation":
            r["cells"]["canonical"]["value"] = 0.5
    moved.write_text(json.dumps(m))
    assert rvc.main(["--check", str(moved), "--against", str(same)]) == 1
    assert "outside: level3.orientation recall canonical: 50.0 against 80.8 [80.0, 81.7]" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit, match="bad.json: not a calibration.json"):
        rvc.main(["--check", str(tmp_path / "bad.json")])
