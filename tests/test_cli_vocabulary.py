"""One vocabulary across ``spar-probe`` (docs/USAGE.md, "One vocabulary, exit codes").

``--probe``/``--head`` (repeatable or comma lists), ``--batch-size``, ``--jobs`` (processes),
``--loader-workers`` (DataLoader workers), ``--bootstrap N >= 1``; the spellings before 0.2
still work, hidden from ``--help``; both spellings at once is one error line. Exit codes: 1 a
run failed, 2 a usage or input error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from spar_bench.probes.cli import COMMANDS, cli

from helpers import run_cmd

FAST = ["--max-epochs", 1, "--bootstrap", 10, "--no-controls", "--jobs", 1]

#: command -> the options it must list under their 0.2 names
NEW = {
    "fit": ["--probe", "--head", "--batch-size", "--bootstrap"],
    "sweep": ["--probe", "--head", "--batch-size", "--bootstrap", "--jobs"],
    "eval": ["--bootstrap"],
    "cache": ["--batch-size", "--loader-workers"],
    "finetune": ["--probe", "--head", "--batch-size", "--loader-workers", "--bootstrap"],
    "vqa": ["--probe", "--batch-size", "--bootstrap"],
}
#: the old spellings, matched as whole options (``--batch`` is not ``--batch-size``)
OLD = {name: re.compile(rf"(?<![\w-]){name}(?![\w-])") for name in ("--probes", "--heads", "--batch", "--workers")}


def _help(command: str, capsys) -> str:
    capsys.readouterr()
    assert run_cmd(cli, [command, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_the_new_names_and_hides_the_old(command, capsys) -> None:
    text = _help(command, capsys)
    for name in NEW.get(command, []):
        assert re.search(rf"(?<![\w-]){name}(?![\w-])", text), (command, name, text)
    for name, pattern in OLD.items():
        assert not pattern.search(text), (command, name, text)


@pytest.mark.parametrize("command", ["fit", "sweep", "eval", "finetune", "vqa"])
def test_bootstrap_must_be_at_least_one(command, capsys) -> None:
    assert "N>=1" in _help(command, capsys).split("--bootstrap", 1)[1].split("\n  --")[0]


def _one_error_line(capsys, rc: int, want: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == want, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


def _listed(pipeline, capsys, *args) -> list[str]:
    capsys.readouterr()
    assert run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--seeds", "0,1", "--list",
                         "--out", "unused-runs", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


def test_sweep_old_spellings_plan_the_same_runs(pipeline, capsys) -> None:
    new = _listed(pipeline, capsys, "--head", "mlp", "--probe", "level3.size")
    assert len(new) == 2 and all("/level3.size/mlp/" in line for line in new), new
    assert _listed(pipeline, capsys, "--heads", "mlp", "--probes", "level3.size") == new
    both = _listed(pipeline, capsys, "--head", "mlp,linear", "--probe", "level3.size,level3.symmetry")
    assert len(both) == 8
    assert _listed(pipeline, capsys, "--head", "mlp", "--head", "linear", "--probe", "level3.size",
                   "--probe", "level3.symmetry") == both
    assert _listed(pipeline, capsys, "--heads", "mlp,linear", "--probes", "level3.size,level3.symmetry") == both


def test_an_old_spelling_counts_as_given_for_a_preset(pipeline, capsys) -> None:
    """``--preset paper`` fills the heads not given: ``--heads linear`` is given (not replaced
    by the paper's mlp,transformer)."""
    lines = _listed(pipeline, capsys, "--heads", "linear", "--probe", "level3.size", "--preset", "paper")
    assert lines and all("/level3.size/linear" in line for line in lines), lines


@pytest.mark.parametrize("args, words", [
    (["sweep", "--head", "mlp", "--heads", "linear"], "--heads and --head"),
    (["sweep", "--probe", "level3.size", "--probes", "level3.size"], "--probes and --probe"),
])
def test_both_spellings_are_one_error_line(pipeline, capsys, args, words) -> None:
    capsys.readouterr()
    rc = run_cmd(cli, [*args, "--features", pipeline["cache"], "--list", "--out", "unused-runs"])
    _one_error_line(capsys, rc, 2, words, "give --")


def _cache_call(monkeypatch, tmp_path, *args) -> tuple:
    """(exit status, the arguments ``spar-probe cache ARGS`` passes to ``write_cache``); not run."""
    import spar_bench.probes.cli.cache as cache_cli

    seen: list = []
    monkeypatch.setattr(cache_cli, "write_cache", lambda *a, **kw: seen.append((a, kw)) or Path("c.h5"))
    monkeypatch.setattr(cache_cli, "die_with_launcher", lambda: None)
    rc = run_cmd(cli, ["cache", "--encoder", "dummy", "--data", tmp_path, "--out", tmp_path / "c.h5", *args])
    return rc, seen


def test_cache_old_spellings_are_the_new_options(monkeypatch, tmp_path, capsys) -> None:
    default = _cache_call(monkeypatch, tmp_path)
    assert default[0] == 0 and len(default[1]) == 1
    batch = _cache_call(monkeypatch, tmp_path, "--batch-size", 8)
    workers = _cache_call(monkeypatch, tmp_path, "--loader-workers", 1)
    assert batch[0] == workers[0] == 0 and default != batch != workers != default
    assert _cache_call(monkeypatch, tmp_path, "--batch", 8) == batch
    assert _cache_call(monkeypatch, tmp_path, "--workers", 1) == workers
    both = _cache_call(monkeypatch, tmp_path, "--batch-size", 8, "--loader-workers", 1)
    assert _cache_call(monkeypatch, tmp_path, "--batch", 8, "--workers", 1) == both
    capsys.readouterr()
    rc, seen = _cache_call(monkeypatch, tmp_path, "--batch", 8, "--batch-size", 8)
    _one_error_line(capsys, rc, 2, "--batch and --batch-size")
    rc, seen = _cache_call(monkeypatch, tmp_path, "--workers", 0, "--loader-workers", 2)
    _one_error_line(capsys, rc, 2, "--workers and --loader-workers")
    assert not seen


def test_finetune_runs_each_head_and_takes_the_old_workers(monkeypatch, tmp_path, capsys) -> None:
    """One run per probe x head x seed; ``--workers`` is ``--loader-workers`` (runs faked)."""
    from spar_bench.probes.runs import session

    specs = []

    def fake_run(fs, out, **_kw):
        specs.append(fs)
        rd = Path(out) / f"{fs.probe}-{fs.head}-{fs.seed}"
        rd.mkdir(parents=True)
        (rd / "metrics.json").write_text(json.dumps({"headline": "accuracy", "test": {"accuracy": 0.5}}))
        return rd

    monkeypatch.setattr(session, "run", fake_run)  # the one loop, session.run_all, calls it
    base = ["finetune", "--encoder", "dummy", "--data", tmp_path, "--probe", "level3.size", "--seeds", "0,1"]
    out = lambda name: ["--out", tmp_path / name]  # noqa: E731
    assert run_cmd(cli, [*base, *out("a"), "--head", "linear,mlp", "--loader-workers", 3]) == 0
    assert [(s.head, s.seed) for s in specs] == [("linear", 0), ("linear", 1), ("mlp", 0), ("mlp", 1)]
    new, specs[:] = list(specs), []
    assert run_cmd(cli, [*base, *out("b"), "--head", "linear", "--head", "mlp", "--workers", 3]) == 0
    assert specs == new
    specs.clear()
    assert run_cmd(cli, [*base, *out("c"), "--head", "linear,mlp"]) == 0
    assert specs != new  # the loader workers are part of the run's config


def test_vqa_probe_is_repeatable_or_a_comma_list() -> None:
    from spar_bench.probes.cli.vqa import parse_question_probes

    want = ["level3.size", "level3.symmetry"]
    assert parse_question_probes(("size", "level3.symmetry")) == want
    assert parse_question_probes(("size,symmetry",)) == want
    assert parse_question_probes("size,symmetry,size") == want


def test_fit_runs_every_head(pipeline, tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    args = ["fit", "--features", pipeline["cache"], "--out", out, "--probe", "level3.size", "--seeds", "0",
            "--head", "linear,mlp", "--max-epochs", 1, "--bootstrap", 10, "--no-controls"]
    capsys.readouterr()
    assert run_cmd(cli, args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "level3.size linear seed0" in printed and "level3.size mlp seed0" in printed
    heads = sorted(p.parent.parent.name.split(",")[0] for p in out.glob("*/level3.size/*/seed0/metrics.json"))
    assert heads == ["linear", "mlp"]


# -- exit codes -------------------------------------------------------------------------------
def test_a_sweep_with_a_failed_run_exits_1(pipeline, tmp_path, monkeypatch, capsys) -> None:
    import spar_bench.probes.runs.session as session
    from spar_bench.errors import SparError

    def fail(run, *_a, **_kw):
        raise SparError(f"{run.head} could not train")

    monkeypatch.setattr(session, "run_fit", fail)
    capsys.readouterr()
    rc = run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--out", tmp_path / "runs", "--head", "linear",
                       "--probe", "level3.size", "--seeds", "0", *FAST])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert lines == ["error: 1 run(s) failed; first: level3.size/linear: linear could not train"], err
    assert not list((tmp_path / "runs").glob("**/metrics.json"))


def test_usage_and_input_errors_exit_2(pipeline, tmp_path, capsys) -> None:
    capsys.readouterr()
    assert run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--hedas", "mlp"]) == 2
    err = capsys.readouterr().err
    assert "No such option '--hedas'" in err and "'--head'" in err
    assert "'--heads'" not in err, err  # "did you mean" names no hidden old spelling
    rc = run_cmd(cli, ["fit", "--features", tmp_path / "missing.h5", "--probe", "level3.size"])
    _one_error_line(capsys, rc, 2, "missing.h5")
    rc = run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--head", "mlp", "--bootstrap", 0])
    assert rc == 2 and "--bootstrap" in capsys.readouterr().err


def test_spar_build_exits_through_the_same_codes(tmp_path, capsys) -> None:
    """``spar-build`` runs through the same :func:`~spar_bench.clitools.run_cli`: 2 for a mistyped
    option and for a missing input folder, 0 for ``--help``."""
    from spar_bench.builder.cli import cli as build_cli

    assert run_cmd(build_cli, ["--help"]) == 0
    capsys.readouterr()
    assert run_cmd(build_cli, ["--source", "phantom", "--root", tmp_path / "none", "--out", tmp_path / "o",
                               "--jbos", 2]) == 2
    assert "No such option '--jbos'" in capsys.readouterr().err
    rc = run_cmd(build_cli, ["--source", "phantom", "--root", tmp_path / "none", "--out", tmp_path / "o"])
    _one_error_line(capsys, rc, 2, "none")
    assert not (tmp_path / "o").exists()


def test_run_failed_maps_to_exit_1_and_other_errors_to_2(capsys) -> None:
    import click

    from spar_bench.clitools import run_cli
    from spar_bench.errors import ConfigError, RunFailed

    for err, want in ((RunFailed("2 run(s) failed"), 1), (ConfigError("--x: bad"), 2)):
        @click.command()
        def command(err=err):
            raise err

        assert run_cli(command, []) == want
        assert capsys.readouterr().err == f"error: {err}\n"


def test_probe_all_means_the_probes_of_the_inputs_levels():
    """``--probe all`` on a 2-D cache is Levels 1-3's probes; on a 3-D (volume) cache, Level 4's."""
    from spar_bench.probes.cli.options import parse_probes
    from spar_bench.probes.tasks import get_probe, probe_names

    two_d = parse_probes(("all",), ["level1", "level2", "level3"])
    assert two_d and {get_probe(p).level for p in two_d} == {"level1", "level2", "level3"}
    assert {get_probe(p).level for p in parse_probes("all", ["level4"])} == {"level4"}
    assert parse_probes("all") == probe_names()  # nothing known about the input: every probe
    assert parse_probes("level4.volume", ["level1"]) == ["level4.volume"]  # named: checked by the run
