"""Reliability round 4 (issue 47.2 and 47.3): one line, exit 2, never a traceback.

* a read-only output folder and a lock file that is a broken symlink, in all three tools;
* a plug-in run kind that raises on import, names a missing module, or has no ``fit``:
  ``spar-probe predict`` and an experiment's ``predictors:`` name the kind, its entry point
  and the error;
* ``vqa --answers``: a file that is not UTF-8, an answer over the stated length limit;
* ``spar-bench cancel`` on a mistyped folder, a folder that is no experiment, a damaged jobs.json;
* an encoder name with ``/`` and an unset ``${env:X}``: the message names the cause and the fix.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import signal
import subprocess
from importlib import metadata as md
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.experiments.cli import cli as bench_cli
from spar_bench.probes.cli import cli as probe_cli

from helpers import run_cmd

#: spar-bench run's progress line before each step ("[1/4] build:b"), not an error line
PROGRESS = re.compile(r"\[\d+/\d+\] \S+$")


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln and not PROGRESS.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


EXPERIMENT = """experiment: r4
out: {out}
builds:
  b: {{phantom: {{n: 4, in_plane: 64, slices: 16}}, options: {{levels: level1}}}}
encoders:
  {encoder}: {{spec: dummy}}
modes:
  frozen: {{encoders: [{encoder}], heads: [linear]}}
probes: [level1.localisation]
seeds: [0]
{extra}"""


def experiment(tmp_path: Path, out: Path | str | None = None, encoder: str = "e", extra: str = "") -> Path:
    path = tmp_path / "e.yaml"
    path.write_text(EXPERIMENT.format(out=out or tmp_path / "out", encoder=encoder, extra=extra))
    return path


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return write_synthetic_build(tmp_path_factory.mktemp("r4") / "b", 8, split="test", levels=("level1", "level3"))


# -- read-only output folders and broken lock files ------------------------------------------
def _read_only(monkeypatch, folder: Path, code: int = errno.EROFS) -> None:
    """Writes under ``folder`` fail as on a read-only mount (EROFS; or ``code``: EACCES, a folder
    without write permission, which root never meets): os.open, os.mkdir, open()."""
    real_open, real_mkdir, real_builtin = os.open, os.mkdir, builtins.open
    root = str(folder)

    def under(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)).startswith(root)

    def refuse(path):
        raise OSError(code, os.strerror(code), os.fsdecode(path))

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path, mode=0o777, *, dir_fd=None):
        if under(path):
            refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def fake_builtin(file, mode="r", *args, **kw):
        if under(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_builtin(file, mode, *args, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(builtins, "open", fake_builtin)


def _three_tools(tmp_path: Path, build: Path, where: Path) -> list[tuple]:
    return [(build_cli, ["phantom", "--out", where / "ph", "--n", 2]),
            (probe_cli, ["predict", "--kind", "prior", "--data", build, "--out", where / "runs", "--bootstrap", 10,
                         "--probe", "level1.localisation"]),
            (bench_cli, ["run", experiment(tmp_path, where / "exp")]),
            (bench_cli, ["run", experiment(tmp_path, where / "exp"), "--dry-run"])]  # fmt: skip


def test_a_read_only_output_folder_is_one_line_in_every_tool(tmp_path: Path, build: Path, monkeypatch, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    calls = _three_tools(tmp_path, build, ro)
    _read_only(monkeypatch, ro)
    for group, argv in calls:
        assert run_cmd(group, argv) == 2, argv
        line = one_line(capsys)
        assert "Read-only file system" in line and "write elsewhere" in line and str(ro) in line, line
    assert not any(ro.iterdir())


def test_a_folder_without_write_permission_is_one_line_in_every_tool(tmp_path: Path, build: Path, monkeypatch,
                                                                     capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    calls = _three_tools(tmp_path, build, locked)
    _read_only(monkeypatch, locked, errno.EACCES)
    for group, argv in calls:
        assert run_cmd(group, argv) == 2, argv
        line = one_line(capsys)
        assert "Permission denied" in line and str(locked) in line, line


def test_a_read_only_mount_is_one_line_in_every_tool(tmp_path: Path, build: Path, capsys) -> None:
    """The same on a real read-only mount, where this machine lets the tests mount one."""
    ro = tmp_path / "mnt"
    ro.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip("this machine does not let the tests mount a read-only file system")
    try:
        for group, argv in _three_tools(tmp_path, build, ro):
            assert run_cmd(group, argv) == 2, argv
            assert "Read-only file system" in one_line(capsys)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True, timeout=30)


def test_a_lock_file_that_is_a_broken_symlink_is_one_line(tmp_path: Path, build: Path, capsys) -> None:
    away = tmp_path / "no-such-folder" / "x"
    calls = _three_tools(tmp_path, build, tmp_path)
    (tmp_path / "ph.lock").symlink_to(away)
    (tmp_path / "runs.lock").symlink_to(away)
    step_lock = tmp_path / "exp" / ".plan" / "steps" / "build_b.json.lock"
    step_lock.parent.mkdir(parents=True)
    step_lock.symlink_to(away)
    for group, argv in calls[:3]:
        assert run_cmd(group, argv) == 2, argv
        line = one_line(capsys)
        assert "is a symbolic link" in line and "remove it" in line, line
    assert not away.parent.exists()


# -- plug-in run kinds -------------------------------------------------------------------
PLUGINS = {
    "r4_raises.py": "raise RuntimeError('the plug-in fails at import')\n",
    "r4_nofit.py": ("class NoFit:\n    @classmethod\n    def on_build(cls, spec, build):\n        return cls()\n\n"
                    "    def predict(self, t, split='test'):\n        return None\n"),
}  # fmt: skip
KINDS = {"boom": "r4_raises:Kind", "gone": "r4_no_such_module:Kind", "nofit": "r4_nofit:NoFit",
         "../up": "r4_nofit:NoFit"}  # the last: a name that would climb out of --out
WORDS = {"boom": "RuntimeError: the plug-in fails at import", "gone": "ModuleNotFoundError",
         "nofit": "NoFit has no fit", "../up": "its name '../up' has a '/'"}  # fmt: skip


@pytest.fixture()
def plugins(tmp_path: Path, monkeypatch):
    """Three broken plug-in run kinds, registered through entry points only."""
    from spar_bench.probes import kinds

    site = tmp_path / "site"
    site.mkdir()
    for name, text in PLUGINS.items():
        (site / name).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    eps = [md.EntryPoint(k, v, kinds.ENTRY_POINT_GROUP) for k, v in KINDS.items()]
    monkeypatch.setattr(md, "entry_points", lambda group=None, **kw: eps if group == kinds.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(kinds, "_entry_points_loaded", False)
    yield
    for k in KINDS:
        if k in kinds.RUN_KINDS:
            kinds.RUN_KINDS.unregister(k)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_broken_plugin_kind_in_predict_is_one_line(plugins, tmp_path: Path, capsys, kind: str) -> None:
    assert run_cmd(probe_cli, ["predict", "--kind", kind, "--data", tmp_path / "b", "--out", tmp_path / "r"]) == 2
    line = one_line(capsys)
    assert f"run kind '{kind}'" in line and f"entry point {KINDS[kind]}" in line and WORDS[kind] in line, line


@pytest.mark.parametrize("kind", [k for k in KINDS if "/" not in k])  # a key with '/' is refused as a name
def test_a_broken_plugin_kind_in_predictors_is_one_line(plugins, tmp_path: Path, capsys, kind: str) -> None:
    path = experiment(tmp_path, extra=f"predictors:\n  {kind}: {{}}\n")
    assert run_cmd(bench_cli, ["run", path, "--dry-run"]) == 2
    line = one_line(capsys)
    assert f"{path}:" in line and f"predictors.{kind}" in line and f"entry point {KINDS[kind]}" in line, line
    assert WORDS[kind] in line, line


# -- vqa --answers -------------------------------------------------------------------------
def _answers(tmp_path: Path, build: Path, path: Path) -> int:
    return run_cmd(probe_cli, ["vqa", "--answers", path, "--data", build, "--out", tmp_path / "runs", "--bootstrap", 10])


@pytest.mark.parametrize("suffix", [".jsonl", ".tsv", ".csv"])
def test_answers_that_are_not_utf8_are_one_line(tmp_path: Path, build: Path, capsys, suffix: str) -> None:
    path = tmp_path / f"a{suffix}"
    path.write_bytes(b'{"spar_accuracy": {"prediction": "caf\xe9"}}\n' if suffix == ".jsonl" else b"spar_key\tx\n\xff\xfe\n")
    assert _answers(tmp_path, build, path) == 2
    line = one_line(capsys)
    assert "not UTF-8" in line and str(path) in line, line


def test_a_damaged_xlsx_is_one_line(tmp_path: Path, build: Path, capsys) -> None:
    pytest.importorskip("openpyxl")
    path = tmp_path / "a.xlsx"
    path.write_bytes(b"PK\x03\x04 not a whole workbook")
    assert _answers(tmp_path, build, path) == 2
    line = one_line(capsys)
    assert "not a readable .xlsx workbook" in line and str(path) in line, line


def test_an_oversized_answer_is_refused_at_the_stated_limit(tmp_path: Path, build: Path, capsys) -> None:
    from spar_bench.probes.vqa.answers import MAX_ANSWER_CHARS, REQUIRED

    row = {c: "x" for c in REQUIRED}
    path = tmp_path / "a.jsonl"
    for size, refused in ((MAX_ANSWER_CHARS, False), (MAX_ANSWER_CHARS + 1, True)):
        path.write_text(json.dumps({"spar_accuracy": {**row, "prediction": "a" * size}}) + "\n")
        assert _answers(tmp_path, build, path) == 2  # the row is no exported question either
        line = one_line(capsys)
        assert (f"over the limit of {MAX_ANSWER_CHARS:,}" in line) == refused, line


# -- spar-bench cancel ---------------------------------------------------------------------
def test_cancel_on_what_is_not_a_submitted_experiment(tmp_path: Path, capsys) -> None:
    assert run_cmd(bench_cli, ["cancel", tmp_path / "mistyped"]) == 2
    assert "no such folder" in one_line(capsys)
    assert run_cmd(bench_cli, ["cancel", tmp_path]) == 2
    assert "is not an experiment's folder" in one_line(capsys)
    plan = tmp_path / ".plan"
    plan.mkdir()
    (plan / "plan.json").write_text(json.dumps({"steps": [{"id": "report", "hash": "h", "needs": []}]}))
    assert run_cmd(bench_cli, ["cancel", tmp_path]) == 0
    assert "nothing to cancel" in capsys.readouterr().out
    (plan / "slurm").mkdir()
    for damaged in ("{not json", '{"steps": [1, 2]}', '{"steps": {"report": {"job": "rm -rf"}}}', "[]"):
        (plan / "slurm" / "jobs.json").write_text(damaged)
        for command in ("cancel", "status"):  # status said every step "todo"
            assert run_cmd(bench_cli, [command, tmp_path]) == 2, (command, damaged)
            line = one_line(capsys)
            assert "jobs.json: damaged" in line and "scancel" in line, line


# -- messages that name the cause --------------------------------------------------------
def test_an_encoder_name_with_a_slash_is_named(tmp_path: Path, capsys) -> None:
    path = experiment(tmp_path, encoder='"ns/enc"')
    assert run_cmd(bench_cli, ["run", path, "--dry-run"]) == 2
    line = one_line(capsys)
    assert f"{path}:6: encoders.ns/enc: 'ns/enc' has a '/'" in line, line


def test_an_unset_env_variable_says_to_set_it(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("SPAR_R4_UNSET", raising=False)
    path = experiment(tmp_path, out="${env:SPAR_R4_UNSET}")
    assert run_cmd(bench_cli, ["run", path, "--dry-run"]) == 2
    line = one_line(capsys)
    assert f"{path}:2: out:" in line and "set the environment variable SPAR_R4_UNSET" in line, line
    assert "--set SPAR_R4_UNSET" not in line, line


# -- handled cases made clean (issue 47.3) ---------------------------------------------------
def test_an_empty_partition_says_so_in_one_line(tmp_path: Path, capsys) -> None:
    path = experiment(tmp_path)
    assert run_cmd(bench_cli, ["run", path, "--list"]) == 0
    n = len(capsys.readouterr().out.splitlines())
    for args in ([], ["--list"], ["--dry-run"]):
        assert run_cmd(bench_cli, ["run", path, "--partition", f"0/{4 * n}", *args]) == 0  # step 1 lies in 1/4n
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and "no step in this partition" in err[0] and f"{n} step(s)" in err[0], err
    assert not (tmp_path / "out").exists()


def test_mirror_flip_without_level4_is_noted(tmp_path: Path, capsys) -> None:
    ph = tmp_path / "ph"
    assert run_cmd(build_cli, ["phantom", "--out", ph, "--n", 2, "--in-plane", 64, "--slices", 16]) == 0
    capsys.readouterr()
    assert run_cmd(build_cli, ["--source", "phantom", "--root", ph, "--out", tmp_path / "b", "--levels", "level3",
                               "--counterfactual", "mirror+flip", "--no-hf", "--compression", "gzip"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "mirror+flip" in notes[0] and "mirrored copies only" in notes[0], notes


def test_probe_all_on_a_2d_input_names_the_skipped_level4_probes(capsys) -> None:
    from spar_bench.probes.names import parse_probes
    from spar_bench.probes.tasks import get_probe, probe_names

    got = parse_probes(("all",), ["level1", "level2", "level3"])
    assert got and all(get_probe(p).level != "level4" for p in got)
    n4 = sum(get_probe(p).level == "level4" for p in probe_names())
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"--probe all: {n4} probe(s) of level4 skipped; this input holds level1, level2, level3"], err
    parse_probes(("all",), ["level1", "level2", "level3", "level4"])  # nothing skipped: nothing said
    assert capsys.readouterr().err == ""


def test_calibration_check_exits_2_on_unreadable_input(bench_check, check, tmp_path: Path) -> None:
    for bad in (tmp_path / "missing.json", tmp_path):  # no such file; a folder
        code, out, err = bench_check(bad, "--against", check.REFERENCE)  # spar-bench check
        assert (code, out) == (2, ""), (code, out, err)  # was 1, the status of a failed comparison
        assert err.count("\n") == 1 and str(bad) in err and "not a readable calibration.json" in err, err


def test_after_a_failed_build_its_hint_is_a_command_that_works(tmp_path: Path, capsys) -> None:
    """The failed case's line names the command that finishes the build; it is not refused."""
    from test_bad_input import make_case

    root = tmp_path / "word"
    make_case(root, "a_good")
    _, bad = make_case(root, "b_bad")
    bad.write_bytes(b"not a NIfTI file")
    args = ["--source", "word", "--root", root, "--levels", "level1", "--no-hf", "--out", tmp_path / "out"]
    assert run_cmd(build_cli, args) == 2
    hint = re.search(r"rerun with ((?:--\S+ ?(?:skip)? ?)+)to leave", one_line(capsys))
    assert hint, "the line names no command"
    assert run_cmd(build_cli, [*args, *hint.group(1).split()]) == 0  # was: refused (other options)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["case_id"] for s in manifest["skipped"]] == ["b_bad"]


# -- a SIGINT that lands in a finalizer ---------------------------------------------------
class _SigintWhenCollected:
    """Sends SIGINT to this process from its ``__del__``: Python runs the handler at the next
    bytecode, inside the finalizer, whose KeyboardInterrupt is printed and swallowed (the window
    where a Ctrl-C had no effect: garbage collected objects, h5py, tqdm, a pool's weakrefs)."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):  # the handler runs here, in the finalizer
            pass


@pytest.fixture()
def cli_signals(monkeypatch):
    """The console script's signal handling (run_main installs it), undone after the test."""
    import sys

    from spar_bench import procs

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    for name in ("_INTERRUPTED", "_TERMINATED", "_HANDLER_PID"):
        monkeypatch.setattr(procs, name, [], raising=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it (xdist may not)
    yield procs
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt
def test_a_sigint_swallowed_by_a_finalizer_still_stops_the_sweep(cli_signals, monkeypatch) -> None:
    from spar_bench.probes.runs import sweep

    ran: list[int] = []

    def run_batch(unit, prune_at=0):
        ran.append(unit[0])
        if unit[0] == 1:
            _SigintWhenCollected()  # collected at once: the signal lands in its finalizer
        return []

    class Bar:
        n = 0

        def update(self, k: int) -> None:
            self.n += k

    monkeypatch.setattr(sweep, "run_batch", run_batch)
    cli_signals.exit_on_sigterm()
    with pytest.raises(KeyboardInterrupt):
        sweep._run_units([[1], [2], [3]], 1, 0, [], Bar())
    assert ran == [1]  # was [1, 2, 3]: every run made, exit 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigint_swallowed_by_a_finalizer_exits_130(cli_signals, capsys) -> None:
    import click

    from spar_bench.clitools import run_main

    @click.command()
    def finishes() -> None:
        _SigintWhenCollected()
        click.echo("finished")

    with pytest.raises(SystemExit) as e:
        run_main(finishes, [])
    assert e.value.code == 130  # was 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == "aborted"
