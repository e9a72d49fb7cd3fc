"""Issue 34 item 4: an experiment's steps hold specs (library configs), not argv.

A step's hash is that of its specs, so renaming a CLI flag redoes nothing; the option keys of a
file are checked against the specs' fields; a folder finished with the argv hashes of 0.2 keeps
its steps (their markers are rewritten, nothing is redone). Plan-time and marker-level only:
the executors are replaced by a recorder, nothing is built or trained.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.experiments import runner
from spar_bench.experiments.config import load_experiment
from spar_bench.experiments.plan import make_plan
from spar_bench.experiments.steps import STEPS
from spar_bench.hashing import sha256_json

FILE = """
experiment: t
out: {out}
builds:
  b: {{phantom: {{n: 4, slices: 16}}, options: {{samples_per_case: 2, hf: false}}}}
encoders:
  e: {{spec: "timm:resnet10t", random_init: true}}
modes:
  frozen: {{encoders: [e], heads: [mlp], options: {{max_epochs: 2, bootstrap: 20}}}}
probes: [level1.localisation]
seeds: [0]
"""


def _plan(tmp_path: Path, text: str = FILE):
    path = tmp_path / "t.yaml"
    path.write_text(text.format(out=tmp_path / "out"))
    return make_plan(load_experiment(path)), path


def _old_ident(step_id: str, kind: str, commands: list, needs: dict[str, str], inputs=(), extra=()) -> str:
    """0.2's ``Step.ident`` (a copy): the sha256 of the step's argv, needs and inputs."""
    record = {"id": step_id, "kind": kind, "commands": [[p, list(a)] for p, a in commands],
              "needs": needs, "inputs": list(inputs), "extra": [[k, v] for k, v in extra]}  # fmt: skip
    return sha256_json(record, default=str)


def _old_hashes() -> dict[str, str]:
    """The hashes 0.2 gave :data:`FILE`'s steps, from the argv it compiled them to (written out)."""
    root = "{out}/builds/b-phantom"
    build = _old_ident("build:b", "build", [
        ("spar-build", ("phantom", "--out", root, "--n", "4", "--layout", "canonical", "--slices", "16")),
        ("spar-build", ("--source", "phantom", "--root", root, "--out", "{out}/builds/b", "--samples-per-case", "2",
                        "--no-hf"))], {})  # fmt: skip
    cache = _old_ident("cache:e@b", "cache", [("spar-probe", (
        "cache", "--encoder", "timm:resnet10t", "--random-init", "--data", "{out}/builds/b", "--out",
        "{out}/cache/e@b.h5"))], {"build:b": build})  # fmt: skip
    heads = _old_ident("heads:e", "heads", [("spar-probe", (
        "sweep", "--features", "{out}/cache/e@b.h5", "--head", "mlp", "--probe", "level1.localisation", "--seeds",
        "0", "--jobs", "1", "--out", "{out}/runs/frozen-e", "--max-epochs", "2", "--bootstrap", "20"))],
        {"cache:e@b": cache})  # fmt: skip
    report = _old_ident("report", "report", [("spar-probe", ("report", "{out}/runs", "--out", "{out}/report"))],
                        {"heads:e": heads}, extra=(("title", "t"),))
    return {"build:b": build, "cache:e@b": cache, "heads:e": heads, "report": report}


def _recorder(monkeypatch) -> list[str]:
    ran: list[str] = []
    for kind in STEPS.names():
        record = replace(STEPS.get(kind), call=lambda spec, device, kind=kind: ran.append(kind))
        monkeypatch.setitem(STEPS._entries, kind, record)
    return ran


def _mark(out: Path, step_id: str, digest: str) -> Path:
    m = runner.marker(out, step_id)
    m.parent.mkdir(parents=True, exist_ok=True)
    m.write_text(json.dumps({"id": step_id, "hash": digest, "outputs": []}))
    return m


def test_a_step_holds_the_library_configs_not_argv(tmp_path):
    plan, _ = _plan(tmp_path)
    kinds = {s.id: [k for k, _ in s.specs] for s in plan.steps}
    assert kinds == {"build:b": ["phantom", "build"], "cache:e@b": ["cache"], "heads:e": ["sweep"],
                     "report": ["report"]}  # fmt: skip
    (_, phantom), (_, build) = plan.step("build:b").specs
    assert phantom == {"out": "{out}/builds/b-phantom", "n": 4, "layout": "canonical", "n_slices": 16}
    assert build["options"] == {"samples_per_case": 2, "no_hf": True}  # hf: false, the library's spelling
    sweep = plan.step("heads:e").specs[0][1]
    assert sweep["options"] == {"max_epochs": 2, "n_boot": 20} and sweep["probes"] == ["level1.localisation"]
    json.dumps([s.specs for s in plan.steps])  # JSON-safe


def test_renaming_a_cli_flag_changes_no_step_hash(tmp_path, monkeypatch):
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.cli.sweep import sweep_command

    before = _plan(tmp_path)[0].hashes
    for cmd, name, new in ((sweep_command, "max_epochs", "--epochs-max"), (build_cli, "no_hf", "--skip-hf"),
                           (sweep_command, "n_boot", "--boot")):  # fmt: skip
        p = next(p for p in cmd.params if p.name == name)
        monkeypatch.setattr(p, "opts", [new])
    assert _plan(tmp_path)[0].hashes == before


@pytest.mark.parametrize("key, want", [("max_epoch", "did you mean 'max_epochs'?"),
                                       ("bootstrp", "did you mean 'bootstrap'?")])
def test_an_option_that_is_no_spec_field_is_one_line_naming_file_line_and_key(tmp_path, key, want):
    text = FILE.replace("options: {{max_epochs: 2", f"options: {{{{{key}: 2")
    with pytest.raises(ConfigError) as err:
        _plan(tmp_path, text)
    message = str(err.value)
    path = tmp_path / "t.yaml"
    line = path.read_text().splitlines().index(next(x for x in path.read_text().splitlines() if key in x)) + 1
    assert message.startswith(f"{path}:{line}: modes.frozen.options.{key}: ") and want in message
    assert "\n" not in message


def test_a_number_yaml_reads_as_text_is_the_fields_number(tmp_path):
    plan, _ = _plan(tmp_path, FILE.replace("max_epochs: 2,", "max_epochs: 2, lr: 1e-3,"))
    assert plan.step("heads:e").specs[0][1]["options"]["lr"] == 0.001  # YAML reads 1e-3 as a string
    with pytest.raises(ConfigError, match="modes.frozen.options.lr: expected a number, got 'fast'"):
        _plan(tmp_path, FILE.replace("max_epochs: 2,", "max_epochs: 2, lr: fast,"))


def test_steps_finished_with_the_argv_hashes_of_0_2_are_kept_not_redone(tmp_path, monkeypatch):
    plan, _ = _plan(tmp_path)
    out, old = plan.experiment.out, _old_hashes()
    assert all(old[s.id] != plan.hashes[s.id] for s in plan.steps)  # the scheme changed
    for step_id, digest in old.items():
        _mark(out, step_id, digest)
    assert [runner.status(plan, s) for s in plan.steps] == ["done"] * 4  # --list / --dry-run, nothing written
    ran = _recorder(monkeypatch)
    counts = runner.run_steps(plan, plan.steps, progress=False)
    assert ran == [] and counts == {"skipped": 4, "ran": 0, "redone": 0}
    for s in plan.steps:  # rewritten with today's hash, logged
        assert json.loads(runner.marker(out, s.id).read_text())["hash"] == plan.hashes[s.id]
    log = [json.loads(x) for x in (out / ".plan" / "log.jsonl").read_text().splitlines()]
    assert [(e["event"], e["was"]) for e in log if e["event"] == "migrate"] == [("migrate", old[s.id]) for s in plan.steps]


def test_a_marker_of_another_hash_is_still_changed_and_redone(tmp_path, monkeypatch):
    plan, _ = _plan(tmp_path)
    out, old = plan.experiment.out, _old_hashes()
    _mark(out, "build:b", old["build:b"])
    _mark(out, "cache:e@b", "0" * 64)  # finished with other options
    ran = _recorder(monkeypatch)
    counts = runner.run_steps(plan, plan.steps[:2], progress=False)
    assert ran == ["cache"] and counts == {"skipped": 1, "ran": 0, "redone": 1}


def test_a_value_is_read_as_the_command_line_read_it(tmp_path):
    """The types a flag's value took (so a run's name and record are those of 0.2): an integer
    where a float is taken is the float, a number where text is taken the text."""
    text = FILE.replace("max_epochs: 2,", "max_epochs: 2, lr: 1, proj_dim: 0,").replace(
        "probes: [level1.localisation]", "probes: [level1.localisation]\nmllms:\n  m: {{model: dummy, "
        "options: {{image_size: 448, timeout: 5}}}}")
    plan, _ = _plan(tmp_path, text)
    sweep = plan.step("heads:e").specs[0][1]["options"]
    assert sweep["lr"] == 1.0 and isinstance(sweep["lr"], float) and sweep["proj_dim"] == "none"
    vqa = plan.step("vqa:m@b").specs[0][1]["options"]
    assert vqa == {"image_size": "448", "timeout": 5.0} and isinstance(vqa["timeout"], float)
