"""The pure-move guard (issue 44): every shipped preset (``experiments/*.yaml``), planned with its
defaults and fixed variables, keeps its step ids and hashes, so an experiment folder finished
before a refactor keeps its finished steps. The plan is made as ``spar-bench run --dry-run``
makes it (values checked with ``here=False``).

A hash that must change is a migration: write the old hash into :mod:`.legacy` (or a marker
migration) and regenerate the fixture with ``python tests/test_step_hashes.py``, saying why in
the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from spar_bench.experiments.config import load_experiment
from spar_bench.experiments.plan import make_plan
from spar_bench.experiments.values import check_values

FIXTURE = Path(__file__).with_name("fixtures") / "step_hashes.json"
PRESETS = Path(__file__).resolve().parents[1] / "experiments"
#: relative folders (the test runs in an empty folder): no hash depends on where it runs, and
#: every outside input digests as "missing", or as an empty folder (mllm-stages' models)
VARS = {"OUT": "out", "DATA": "data", "WEIGHTS": "weights"}
#: the model folders mllm-stages probes (their stages must be local folders)
MODELS = ("Qwen2.5-VL-7B-Instruct", "llava-1.5-7b-hf", "InternVL3-8B-hf", "medgemma-4b-it")


def preset_hashes(path: Path) -> dict[str, str]:
    for m in MODELS:
        Path(VARS["WEIGHTS"], m).mkdir(parents=True, exist_ok=True)
    exp = load_experiment(path, VARS)
    check_values(exp, here=False)
    plan = make_plan(exp)
    return {s.id: plan.hashes[s.id] for s in plan.steps}


def all_hashes() -> dict[str, dict[str, str]]:
    return {p.stem: preset_hashes(p) for p in sorted(PRESETS.glob("*.yaml"))}


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_every_shipped_presets_step_hashes_are_unchanged(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = json.loads(FIXTURE.read_text())
    assert name in want, f"{name}.yaml is new: regenerate {FIXTURE.name} (python {Path(__file__).name})"
    assert preset_hashes(PRESETS / f"{name}.yaml") == want[name]


def test_the_fixture_holds_every_preset_and_a_real_plan():
    want = json.loads(FIXTURE.read_text())
    assert sorted(want) == sorted(p.stem for p in PRESETS.glob("*.yaml"))
    assert all(len(steps) >= 2 for steps in want.values())
    assert any(k.startswith("vqa:") for steps in want.values() for k in steps)
    assert any(k.startswith("finetune:") for steps in want.values() for k in steps)


def test_the_dry_run_lists_the_fixtures_steps(tmp_path, monkeypatch, capsys):
    """``spar-bench run demo --dry-run`` plans the steps the fixture holds (the CLI's door)."""
    from spar_bench.clitools import run_cli
    from spar_bench.experiments.cli import cli

    monkeypatch.chdir(tmp_path)
    assert run_cli(cli, ["run", str(PRESETS / "demo.yaml"), "--dry-run", "--set", "OUT=out"]) == 0
    listed = [ln.split("\t")[0] for ln in capsys.readouterr().out.splitlines() if "\t" in ln]
    assert sorted(listed) == sorted(json.loads(FIXTURE.read_text())["demo"])


if __name__ == "__main__":  # regenerate the fixture (only when a hash must change: say why)
    import os
    import tempfile

    FIXTURE.parent.mkdir(exist_ok=True)
    os.chdir(tempfile.mkdtemp())
    FIXTURE.write_text(json.dumps(all_hashes(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
