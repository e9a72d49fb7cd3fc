"""A sweep spread by --partition covers every run exactly once; --list and --only."""

from __future__ import annotations

from pathlib import Path

from spar_bench.probes.cli import cli
from spar_bench.probes.runs.inputs import encoder_slug, open_cache
from spar_bench.probes.runs.sweep import make_jobs, run_id, select_jobs

from helpers import run_cmd

PROBES = "level3.relative_position,level3.size"
FAST = ["--max-epochs", 1, "--bootstrap", 10, "--no-controls", "--jobs", 1]


def _sweep(pipeline, out: Path, *extra) -> int:
    return run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--heads", "mlp,linear",
                         "--probes", PROBES, "--seeds", "0,1", "--out", out, *FAST, *extra])


def test_partitions_cover_every_run_exactly_once(pipeline) -> None:
    jobs = make_jobs(str(pipeline["cache"]), ["mlp", "transformer", "linear"],
                     ["level1.localisation", "level3.size", "level3.counting"], [0, 1, 2],
                     {}, [{}, {"lr": 3e-4}], "runs")
    slug = encoder_slug(open_cache(pipeline["cache"]))
    for n in (1, 3, 7):
        parts = [select_jobs(jobs, slug, partition=(i, n)) for i in range(n)]
        ids = [run_id(j, slug) for p in parts for j in p]
        assert sorted(ids) == sorted(run_id(j, slug) for j in jobs)  # each once, none lost
    assert len({run_id(j, slug) for j in jobs}) == len(jobs) == 54


def test_list_only_and_partitions_run_into_one_folder(pipeline, tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    assert _sweep(pipeline, out, "--list") == 0
    listed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(listed) == 8 and all(state == "todo" for _, state in listed)
    first = listed[0][0]
    assert _sweep(pipeline, out, "--only", first) == 0
    assert [p.parent.relative_to(out).as_posix() for p in out.rglob("metrics.json")] == [first]
    capsys.readouterr()
    for i in range(2):
        assert _sweep(pipeline, out, "--partition", f"{i}/2") == 0
    done = sorted(p.parent.relative_to(out).as_posix() for p in out.rglob("metrics.json"))
    assert done == sorted(i for i, _ in listed)
    capsys.readouterr()
    assert _sweep(pipeline, out, "--list") == 0
    assert all(line.endswith("\tdone") for line in capsys.readouterr().out.splitlines())
    assert run_cmd(cli, ["report", out, "--out", tmp_path / "report"]) == 0


def test_only_with_an_unknown_id_says_did_you_mean(pipeline, tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    assert _sweep(pipeline, out, "--list") == 0
    first = capsys.readouterr().out.splitlines()[0].split("\t")[0]
    assert _sweep(pipeline, out, "--only", first.replace("seed", "sed")) == 2
    err = capsys.readouterr().err
    assert "no such run" in err and f"did you mean {first}" in err
    assert _sweep(pipeline, out, "--partition", "2/2") == 2
    assert "--partition" in capsys.readouterr().err


def test_a_finished_run_made_with_other_defaults_is_not_skipped_silently(pipeline, tmp_path, capsys) -> None:
    """A folder's name holds only non-default options: a run finished under other defaults
    (an older spar-bench) sits where the new run would write; the sweep names it."""
    import json

    out = tmp_path / "runs"
    args = ["--heads", "mlp", "--probes", "level3.size", "--seeds", "0"]
    sweep = lambda *extra: run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--out", out,  # noqa: E731
                                         *FAST, *args, *extra])
    assert sweep() == 0
    (cfg_file,) = out.glob("*/level3.size/mlp*/seed0/config.json")
    capsys.readouterr()
    assert sweep() == 0 and "0 run(s) done" in capsys.readouterr().out  # finished: skipped
    cfg = json.loads(cfg_file.read_text())
    cfg["options"]["head_defaults"]["hidden"] = 256  # as if the default width had been 256 then
    cfg_file.write_text(json.dumps(cfg))
    for extra in ((), ("--list",)):
        assert sweep(*extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(cfg_file.parent) in err
        assert "hidden=256 (now 512)" in err and "new --out" in err
    # the same encoder's run on another build (another cache) is not this run either
    cfg["options"]["head_defaults"]["hidden"], cfg["build_fingerprint"] = 512, "0" * 64
    cfg_file.write_text(json.dumps(cfg))
    assert sweep() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "finished on a feature cache of another build" in err and str(cfg_file.parent) in err
