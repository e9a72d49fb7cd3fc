"""Issue 44: each step kind is declared once (:mod:`spar_bench.experiments.steps`).

The plan, the value check and the runner name no step kind; a new kind is one
:class:`StepKind` plus one registry line, here registered by the test alone and run through
``spar-bench run`` on an experiment file, touching no other file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from spar_bench.clitools import run_cli
from spar_bench.errors import ConfigError
from spar_bench.experiments.cli import cli
from spar_bench.experiments.plan import Step
from spar_bench.experiments.steps import STEPS, StepKind, options, spec_fields
from spar_bench.fields import field_types

ROOT = Path(__file__).resolve().parents[1] / "experiments"
#: the names of the step kinds and of the specs' kinds
KIND_NAMES = {"phantom", "build", "cache", "sweep", "heads", "finetune", "train", "scratch", "eval", "vqa",
              "predict", "report"}  # fmt: skip
#: folder names that happen to be spelled as kinds (``{out}/cache``, ``{out}/report``)
FOLDERS = {"BUILDS", "CACHES", "RUNS", "REPORT", "PLAN"}


def _kind_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    folders = {id(c) for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Tuple) and {getattr(e, "id", "") for e in t.elts} <= FOLDERS
               for c in ast.walk(node.value)}  # fmt: skip
    return [f"{path.name}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in KIND_NAMES and id(n) not in folders]  # fmt: skip


@pytest.mark.parametrize("name", ["plan.py", "values.py", "runner.py"])
def test_the_plan_the_value_check_and_the_runner_name_no_step_kind(name):
    assert _kind_literals(ROOT / name) == []


def test_the_check_sees_a_kind_named_in_code(tmp_path):
    (tmp_path / "x.py").write_text('BUILDS, REPORT = "builds", "report"\nif kind == "sweep":\n    pass\n')
    assert _kind_literals(tmp_path / "x.py") == ["x.py:2: 'sweep'"]


def test_field_types_come_from_the_dataclasses_not_their_text():
    fields = spec_fields("finetune")
    assert fields["grad_clip"] is float and fields["max_epochs"] is int and fields["controls"] is bool
    assert spec_fields("sweep")["proj_dim"]("none") == "none"  # a converter, as the option declares
    assert "out" not in spec_fields("phantom")  # a field the step sets itself


def test_an_unknown_step_kind_says_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'sweep'"):
        STEPS.get("swep")


# --------------------------------------------------------------------------- a new kind, in this file only
@dataclass(frozen=True)
class Echo:
    """The config of the example kind: a text written ``times`` times."""

    out: str
    text: str = "spar"
    times: int = 1


def _echo(spec: dict, device: str | None) -> None:
    cfg = Echo(**spec)
    Path(cfg.out).write_text(cfg.text * cfg.times)


def _echo_steps(exp, steps: list[Step]) -> list[Step]:
    record = {"out": "{out}/echo.txt", **options("echo", {"times": "3"}, "echo", exp)}  # "3": the field's int
    return [Step("echo:one", "echo", (("echo", record),), outputs=("{out}/echo.txt",))]


ECHO = StepKind(_echo, fields=lambda: field_types(Echo), plan=_echo_steps, own=frozenset({"out"}), order=95)

FILE = """
experiment: t
out: {out}
builds:
  b: {{phantom: {{n: 2}}}}
encoders:
  e: {{spec: dummy}}
modes:
  frozen: {{encoders: [e], heads: [mlp]}}
probes: [level1.localisation]
"""


def test_a_new_step_kind_is_one_declaration_and_runs_through_spar_bench_run(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(FILE.format(out=tmp_path / "out"))
    with STEPS.registered("echo", ECHO):
        assert run_cli(cli, ["run", str(path), "--list"]) == 0
        assert "echo:one\ttodo" in capsys.readouterr().out
        assert run_cli(cli, ["run", str(path), "--only", "echo:one"]) == 0
        assert (tmp_path / "out" / "echo.txt").read_text() == "sparsparspar"
        assert run_cli(cli, ["run", str(path), "--list"]) == 0
        assert "echo:one\tdone" in capsys.readouterr().out
    assert "echo" not in STEPS
