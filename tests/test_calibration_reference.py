"""The calibration tables of docs/RESULTS.md and their reference (``docs/calibration.json``), and
``spar-bench check``, which tells whether a rerun on another machine
reproduces them (fast: no training; the cross-machine criterion itself:
tests/test_calibration_crossmachine.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]



def test_the_results_tables_are_the_reference_written_out(reference) -> None:
    """Every probe's table in docs/RESULTS.md is what the experiment prints from the reference."""
    from spar_bench.experiments.calibration_tables import calibration_table

    results = (REPO / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    probes = list(dict.fromkeys(r["probe"] for r in reference["rows"]))
    assert len(probes) == 8
    for probe in probes:
        assert calibration_table(reference["rows"], probe) in results, probe


def _row(rows: list, probe: str, model: str, seed) -> dict:
    return next(r for r in rows if r["probe"] == probe and r["model"] == model and r["seed"] == seed)


def test_check_passes_the_reference_and_names_a_cell_that_moved(check, reference) -> None:
    lines, misses = check.check_rerun(reference, reference)
    assert not misses and len(lines) > 100
    rerun = copy.deepcopy(reference)
    rerun["conditions"].update(threads=1, wall_seconds=1.0, cpu_count=64)  # the machine's: allowed
    _, _, _, tol = check.cell_means(reference, reference)["level3.relative_position", "computation", "random"]
    for seed in (0, 1):  # the seed mean falls below the tolerance (the seeds' spread kept)
        cell = _row(rerun["rows"], "level3.relative_position", "computation", seed)["cells"]["random"]
        cell["value"] -= 1.5 * tol
    _, misses = check.check_rerun(reference, rerun)
    assert len(misses) == 1 and misses[0].startswith("level3.relative_position computation random:")
    untrained = copy.deepcopy(reference)
    _row(untrained["rows"], "level3.orientation", "oracle", None)["cells"]["mirrored"]["value"] += 1e-6
    _, misses = check.check_rerun(reference, untrained)
    assert misses == [next(m for m in misses if m.startswith("level3.orientation oracle mirrored"))]


def test_check_refuses_a_rerun_of_other_conditions_and_reports_by_exit_status(bench_check, check, reference,
                                                                              tmp_path) -> None:
    other = copy.deepcopy(reference)
    other["conditions"]["seeds"] = [0]
    with pytest.raises(ConfigError, match=r"other conditions than the reference \(seeds\)"):
        check.check_rerun(reference, other)
    same, moved = tmp_path / "same.json", tmp_path / "moved.json"
    same.write_text(json.dumps(reference))
    code, out, _ = bench_check(same)
    assert code == 0
    assert "120 of 120 cells as the reference" in out and "118 of 118 conclusions of the reference hold" in out
    for r in (m := copy.deepcopy(reference))["rows"]:
        if r["model"] == "recall" and r["probe"] == "level3.orientation":
            r["cells"]["canonical"]["value"] = 0.5
    moved.write_text(json.dumps(m))
    code, out, _ = bench_check(moved, "--against", same)
    assert code == 1
    assert "outside: level3.orientation recall canonical: 50.0 against 80.8 [79.9, 81.7]" in out
    assert ("conclusion changed: level3.orientation canonical: recall > computation in the reference (80.8 > 69.2), "
            "not in the rerun (50.0 against 69.2)") in out
    (tmp_path / "bad.json").write_text("[]")
    code, out, err = bench_check(tmp_path / "bad.json")
    assert (code, out) == (2, "") and err.startswith(f"error: {tmp_path / 'bad.json'}: not a calibration.json (") and err.count("\n") == 1, err


def test_the_preset_reproduces_the_reference_conditions(check, reference, tmp_path) -> None:
    """``spar-bench run recall-vs-computation`` plans the calibration step with the reference's
    conditions (all but the machine's): its rerun is what ``spar-bench check`` compares."""
    from spar_bench.experiments import preset_path
    from spar_bench.experiments.calibration import CalibrationConfig, conditions, configs
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    plan = make_plan(load_experiment(preset_path("recall-vs-computation"), {"OUT": str(tmp_path)}))
    ((kind, record),) = plan.step("calibration").specs
    cfg = CalibrationConfig(**record)
    assert kind == "calibration" and cfg.out == "{out}/calibration"
    got = conditions(cfg, configs(cfg)[1][0], 0.0, 0.0)
    want = reference["conditions"]
    assert {k: v for k, v in got.items() if k not in check.MACHINE_CONDITIONS} == \
        {k: v for k, v in want.items() if k not in check.MACHINE_CONDITIONS}
