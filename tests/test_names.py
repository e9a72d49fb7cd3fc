"""Names that become paths cannot leave OUT (issue 47.1).

Two defences, each tested alone: every name is checked where it is declared (one line with
``file:line: key`` and the allowed form), and every path a step writes is resolved and must lie
inside OUT (a symlinked folder inside OUT pointing elsewhere is never written through). Each
case snapshots the folder around OUT before and after: nothing outside OUT is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.experiments.cli import cli as bench_cli
from spar_bench.names import NAME_FORM, check_name, confined, name_problem

from helpers import run_cmd, tree_hashes

#: names that climb out, are absolute, hidden, empty, or look like a path in another alphabet
BAD = ["../../victim/cache/dum", "../victim", "/tmp/abs-name", ".hidden", "..", "", "a/b", "a\\b", "a@b", "x:y",
       "a\uff0fb",  # FULLWIDTH SOLIDUS
       "\u2024\u2024\uff0fvictim",  # ONE DOT LEADER x2 + fullwidth solidus
       "a\u2215b",  # DIVISION SLASH
       "-rf", "a" * 101, "e\n#SBATCH --x"]
GOOD = ["rad-dino", "qwen2.5-vl-7b", "b.v2", "e_1", "A9"]


def _yaml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def experiment(root: Path, names: dict[str, str]) -> Path:
    """A small experiment (phantom build, dummy encoder, a prior predictor, an MLLM) whose
    names are ``names``' (keys: experiment, build, encoder, mllm, predictor)."""
    n = {"experiment": "x", "build": "b", "encoder": "e", "mllm": "m", "predictor": "p", **names}
    q = {k: _yaml_str(v) for k, v in n.items()}
    text = f"""experiment: {q['experiment']}
out: {root / 'out'}
builds:
  {q['build']}: {{phantom: {{n: 4, in_plane: 64, slices: 16}}, options: {{levels: "level1,level3"}}}}
encoders:
  {q['encoder']}: {{spec: dummy}}
modes:
  frozen: {{encoders: [{q['encoder']}], heads: [linear]}}
mllms:
  {q['mllm']}: {{model: dummy}}
predictors:
  {q['predictor']}: {{kind: prior}}
probes: [level1.localisation]
seeds: [0]
"""
    path = root / "e.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture()
def around(tmp_path: Path):
    """``tmp_path/work`` (holding OUT and the file) beside a finished 'victim' folder: returns
    the work folder and a check that nothing outside OUT changed."""
    victim = tmp_path / "victim" / "cache"
    victim.mkdir(parents=True)
    (victim / "dum@b.h5").write_bytes(b"the victim's finished cache")
    work = tmp_path / "work"
    work.mkdir()

    def snapshot() -> dict[str, str]:
        files = tree_hashes(tmp_path)
        listing = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
        mine = ("work/out/", "work/out", "work/e.yaml")  # OUT and the experiment file
        return {**{k: v for k, v in files.items() if not k.startswith(mine)},
                "__names__": "|".join(x for x in listing if not x.startswith(mine))}

    before = snapshot()
    yield work, lambda: snapshot() == before


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# -- the name check --------------------------------------------------------------------
@pytest.mark.parametrize("bad", BAD)
def test_a_name_outside_the_form_is_refused(bad: str) -> None:
    assert name_problem(bad)
    with pytest.raises(ConfigError, match=re.escape(NAME_FORM)):
        check_name(bad, "f.yaml:3: builds.x")


@pytest.mark.parametrize("good", GOOD)
def test_a_name_of_the_form_passes(good: str) -> None:
    assert name_problem(good) is None and check_name(good, "-") == good


FIELDS = {"experiment": "experiment", "build": "builds", "encoder": "encoders", "mllm": "mllms",
          "predictor": "predictors"}


@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("bad", ["../../victim/cache/dum", "/tmp/abs-name", ".hidden", "", "a\uff0fb",
                                 "\u2024\u2024\uff0fvictim"])
def test_every_name_field_is_checked_where_it_is_declared(around, capsys, field: str, bad: str) -> None:
    work, unchanged = around
    path = experiment(work, {field: bad})
    for args in ([], ["--dry-run"]):
        assert run_cmd(bench_cli, ["run", path, *args]) == 2
        line = _one_line(capsys)
        section = FIELDS[field]
        at = re.escape(f"{path}:") + r"\d+: " + re.escape(section if field == "experiment" else f"{section}.{bad}")
        assert re.search(at, line), line
        assert NAME_FORM in line, line
    assert unchanged() and not (work / "out").exists()


def test_a_set_value_that_becomes_a_name_is_checked(around, capsys) -> None:
    work, unchanged = around
    path = experiment(work, {})
    path.write_text(path.read_text().replace('experiment: "x"', "vars: {NAME: ok}\nexperiment: ${NAME}"))
    assert run_cmd(bench_cli, ["run", path, "--dry-run", "--set", "NAME=../../victim"]) == 2
    line = _one_line(capsys)
    assert "experiment (the value of ${NAME})" in line and "has a '/'" in line, line
    assert unchanged()


def test_dotted_names_plan(around, capsys) -> None:
    """``b.v2`` is a name everywhere: the plan check (values.py) reads its options (was a KeyError)."""
    work, _ = around
    path = experiment(work, {"build": "b.v2", "encoder": "e.1", "mllm": "qwen2.5", "predictor": "p.1"})
    text = path.read_text().replace("options: {", "options: {samples_per_case: 2, ")
    path.write_text(text)
    assert run_cmd(bench_cli, ["run", path, "--list"]) == 0
    ids = capsys.readouterr().out
    for step in ("build:b.v2", "cache:e.1@b.v2", "heads:e.1", "vqa:qwen2.5@b.v2", "predict:p.1@b.v2"):
        assert step in ids, ids


# -- the second defence: paths resolved inside OUT ---------------------------------------
def test_confined_refuses_climbing_absolute_and_symlinked_paths(tmp_path: Path) -> None:
    out, away = tmp_path / "out", tmp_path / "away"
    (out / "cache").mkdir(parents=True)
    away.mkdir()
    (out / "link").symlink_to(away, target_is_directory=True)
    assert confined(out / "cache" / "x.h5", out) == out / "cache" / "x.h5"
    for p in (out / ".." / "away" / "x", Path("/tmp/x"), out / "link" / "x.h5", out / "link"):
        with pytest.raises(ConfigError, match="lies outside"):
            confined(p, out)


@pytest.mark.parametrize("field", ["build", "encoder", "mllm", "predictor"])
def test_without_the_name_check_no_step_writes_outside_out(around, capsys, monkeypatch, field: str) -> None:
    """The name check switched off: the plan's paths still may not leave OUT (one line, exit 2)."""
    import spar_bench.names as names

    monkeypatch.setattr(names, "check_name", lambda value, where: value)
    work, unchanged = around
    path = experiment(work, {field: "x/../../../../victim/cache/dum"})  # climbs out of every folder
    assert run_cmd(bench_cli, ["run", path]) == 2
    assert "lies outside" in _one_line(capsys)
    assert unchanged()


def test_the_runner_checks_every_step_itself(around, monkeypatch) -> None:
    """run_steps (the SLURM worker's way in too) refuses a step writing outside OUT before any step runs."""
    import spar_bench.names as names
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan
    from spar_bench.experiments.runner import run_steps

    monkeypatch.setattr(names, "check_name", lambda value, where: value)
    work, unchanged = around
    plan = make_plan(load_experiment(experiment(work, {"encoder": "x/../../../../victim/cache/dum"})))
    with pytest.raises(ConfigError, match="lies outside"):
        run_steps(plan, plan.steps, progress=False)
    assert unchanged() and not (work / "out" / "builds").exists()


@pytest.mark.parametrize("folder", ["cache", "builds", "runs", ".plan", "report"])
def test_a_symlinked_folder_inside_out_is_not_written_through(around, capsys, folder: str) -> None:
    work, unchanged = around
    path = experiment(work, {})
    (work / "out").mkdir()
    away = work.parent / "victim" / "cache"
    (work / "out" / folder).symlink_to(away, target_is_directory=True)
    before = unchanged()
    assert before
    for args in ([], ["--dry-run"]):
        assert run_cmd(bench_cli, ["run", path, *args]) == 2
        line = _one_line(capsys)
        assert "lies outside" in line and "symbolic link" in line, line
    assert unchanged()


@pytest.mark.parametrize("parts", [("..", "level3.size", "mlp"), ("enc", "level3.size", "../../x"),
                                   ("a/b", "level3.size", "mlp"), ("enc", "", "mlp"), ("enc", "p", "h\\x")])
def test_a_run_folder_stays_inside_out(tmp_path: Path, parts) -> None:
    """A run folder's parts come from a plug-in's or a cache's names: none climbs out of OUT."""
    from spar_bench.probes.runs.store import run_folder

    assert run_folder(tmp_path, "enc", "level3.size", "mlp", "lr=0.1", 0) == tmp_path / "enc/level3.size/mlp,lr=0.1/seed0"
    with pytest.raises(ConfigError, match="a run folder's"):
        run_folder(tmp_path, *parts, "", 0)


@pytest.mark.slow
def test_dotted_names_run_end_to_end(tmp_path: Path) -> None:
    """``b.v2``/``e.1`` through every step kind the file has: build, cache, heads, report."""
    path = tmp_path / "d.yaml"
    path.write_text(f"""experiment: dotted.v1
out: {tmp_path / 'out'}
builds:
  b.v2: {{phantom: {{n: 4, in_plane: 64, slices: 16}}, options: {{levels: level1, samples_per_case: 2}}}}
encoders:
  e.1: {{spec: dummy}}
modes:
  frozen: {{encoders: [e.1], heads: [linear]}}
probes: [level1.localisation]
seeds: [0]
""")
    assert run_cmd(bench_cli, ["run", path]) == 0
    out = tmp_path / "out"
    assert (out / "cache" / "e.1@b.v2.h5").is_file() and (out / "builds" / "b.v2" / "manifest.json").is_file()
    assert list((out / "runs" / "frozen-e.1").rglob("metrics.json")) and (out / "report").is_dir()
    assert run_cmd(bench_cli, ["run", path]) == 0  # and a rerun finds every step done


def test_a_symlink_inside_a_step_folder_is_not_written_through(tmp_path: Path, capsys) -> None:
    """Before a step runs, a link already inside its folders (``runs/predict-p/prior -> elsewhere``,
    where the runs of kind prior go) is refused: the runs are not written through it."""
    from spar_bench.builder.cli import cli as build_cli

    build = tmp_path / "b"
    assert run_cmd(build_cli, ["phantom", "--out", tmp_path / "ph", "--n", 4, "--in-plane", 64, "--slices", 16]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", tmp_path / "ph", "--out", build, "--levels", "level1",
                               "--samples-per-case", 2, "--no-hf", "--compression", "gzip"]) == 0  # fmt: skip
    capsys.readouterr()
    victim = tmp_path / "victim"
    victim.mkdir()
    path = tmp_path / "e.yaml"
    path.write_text(f"""experiment: x
out: {tmp_path / 'out'}
builds:
  b: {{path: "{build}"}}
predictors:
  p: {{kind: prior, bootstrap: 10}}
probes: [level1.localisation]
seeds: [0]
""")
    runs = tmp_path / "out" / "runs" / "predict-p"
    runs.mkdir(parents=True)
    (runs / "prior").symlink_to(victim, target_is_directory=True)
    assert run_cmd(bench_cli, ["run", path, "--only", "predict:p@b"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and ln != "[1/1] predict:p@b"]
    assert len(lines) == 1 and "lies outside" in lines[0] and "prior" in lines[0] and "Traceback" not in err, err
    assert not any(victim.iterdir())
