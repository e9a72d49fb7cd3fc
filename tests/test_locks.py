"""One writer per output (spar_bench.locks): two writers at once, a killed holder, --wait, readers.

Two writers are started together by events or pipes, never by sleeps: exactly one proceeds,
the other is refused in one line naming the holder's pid (exit status 2, no traceback), or
with ``--wait`` waits and then proceeds; the output of the one that ran is whole.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import run_cmd

PROBE = "level3.relative_position"

HOLDER = """
import sys
from spar_bench.locks import output_lock

with output_lock(sys.argv[1], what=sys.argv[2], shared=sys.argv[3] == "shared"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


@contextmanager
def held_elsewhere(output: Path, what: str = "writer", shared: bool = False):
    """``output``'s lock held by another process for the block (that process is yielded)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(output), what, "shared" if shared else "x"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, encoding="utf-8")  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- the primitive ---------------------------------------------------------------------------
def _racer(out: str, go, release, results) -> None:
    from spar_bench.locks import OutputBusy, output_lock

    go.wait()
    try:
        with output_lock(out, what="writer"):
            Path(out).write_text(f"{os.getpid()}\n" * 1000)  # written whole by the one holder
            results.put(("wrote", os.getpid(), ""))
            release.wait()
    except OutputBusy as e:
        results.put(("refused", os.getpid(), str(e)))


@pytest.mark.slow
def test_two_writers_started_at_once_exactly_one_proceeds_20_times(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for i in range(20):
        out = tmp_path / f"out{i}"
        go, release, results = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_racer, args=(str(out), go, release, results)) for _ in range(2)]
        for p in procs:
            p.start()
        go.set()
        got = sorted([results.get(timeout=60), results.get(timeout=60)])
        release.set()
        for p in procs:
            p.join(timeout=60)
        (refused, _, msg), (wrote, winner, _) = got
        assert (refused, wrote) == ("refused", "wrote"), got
        assert f"{out} is being written by another writer, pid {winner} since " in msg, msg
        assert msg.endswith("wait for it, or pass --wait") and "\n" not in msg
        assert out.read_text() == f"{winner}\n" * 1000
        assert not Path(f"{out}.lock").exists()


def test_a_killed_holder_is_taken_over(tmp_path):
    from spar_bench.locks import output_lock

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "writer", "x"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, encoding="utf-8")  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    lock = tmp_path / "out.lock"
    assert lock.read_text().startswith(f"{holder.pid} ")  # the stale file stays ...
    with output_lock(out, what="writer"):  # ... and never blocks
        assert lock.read_text().startswith(f"{os.getpid()} ")
    assert not lock.exists()


WAITER = """
import sys
from spar_bench.locks import output_lock, waiting

with waiting(float("inf")), output_lock(sys.argv[1], what="writer"):
    print("got it", flush=True)
"""


def test_wait_waits_for_the_holder_then_proceeds(tmp_path):
    """The waiter says once that it waits; once the holder lets go, it proceeds."""
    from spar_bench.locks import output_lock

    out = tmp_path / "out"
    with output_lock(out, what="fit"):
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(out)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, encoding="utf-8")  # fmt: skip
        said = waiter.stderr.readline()  # it waits: we still hold the lock
        assert said.startswith(f"{out} is being written by another fit, pid {os.getpid()} since ")
        assert said.rstrip().endswith("; waiting for it")
    stdout, stderr = waiter.communicate(timeout=60)
    assert (waiter.returncode, stdout, stderr) == (0, "got it\n", "")


def test_wait_seconds_that_run_out_is_one_line(tmp_path):
    from spar_bench.locks import OutputBusy, output_lock, waiting

    out = tmp_path / "out"
    with held_elsewhere(out, what="spar-probe fit") as holder:
        with waiting(0.05), pytest.raises(OutputBusy) as e:
            with output_lock(out, what="spar-probe sweep"):
                pass
    since = str(e.value).split(" since ")[1].split()[0]
    assert str(e.value) == (f"{out} is still being written by another spar-probe fit, pid {holder.pid} since {since} "
                            "after waiting 0.05 s; wait longer (--wait), or write elsewhere")  # fmt: skip


def test_one_process_locking_its_output_twice_is_refused_at_once(tmp_path):
    from spar_bench.locks import OutputBusy, output_lock, waiting

    with output_lock(tmp_path / "out", what="writer"), waiting(float("inf")):
        with pytest.raises(OutputBusy, match=rf"pid {os.getpid()} \(this process\)"):
            with output_lock(tmp_path / "out", what="writer"):
                pass


def test_shared_holders_admit_each_other_and_refuse_an_exclusive_one(tmp_path):
    from spar_bench.locks import OutputBusy, output_lock

    out = tmp_path / "runs"
    with held_elsewhere(out, what="sweep", shared=True) as part:
        with held_elsewhere(out, what="sweep", shared=True):  # another partition
            with pytest.raises(OutputBusy, match=rf"another sweep, pid {part.pid} since \S+ \(and 1 more\)"):
                with output_lock(out, what="fit"):
                    pass
        assert (tmp_path / "runs.lock").exists()  # the first partition still holds it
        with output_lock(out, what="sweep", shared=True):  # a third one
            pass
        assert (tmp_path / "runs.lock").exists()
    with held_elsewhere(out, what="fit"):
        with pytest.raises(OutputBusy, match="another fit"):
            with output_lock(out, what="sweep", shared=True):
                pass
    assert not (tmp_path / "runs.lock").exists()


# -- every writer's command: refused in one line while another process writes its output ----
def _commands(pipeline, tmp_path: Path) -> dict[str, tuple[str, list, Path]]:
    """command -> (console script, argv, the output it locks)."""
    cache, shards, out = pipeline["cache"], pipeline["shards"], tmp_path / "out"
    fit = ["--features", cache, "--probe", PROBE, "--head", "linear", "--seeds", "0", "--bootstrap", 10]
    return {
        "fit": ("spar-probe", ["fit", *fit, "--out", out], out),
        "sweep": ("spar-probe", ["sweep", *fit, "--jobs", 1, "--out", out], out),
        "finetune": ("spar-probe", ["finetune", "--encoder", "dummy", "--data", shards, "--probe", PROBE,
                                    "--out", out], out),  # fmt: skip
        "vqa": ("spar-probe", ["vqa", "--model", "dummy", "--data", shards, "--probe", "relative_position",
                               "--out", out], out),  # fmt: skip
        "eval": ("spar-probe", ["eval", "--run", out / "run", "--features", cache], out / "run"),
        "cache": ("spar-probe", ["cache", "--encoder", "dummy", "--data", shards, "--out", tmp_path / "c.h5"],
                  tmp_path / "c.h5"),  # fmt: skip
        "build": ("spar-build", ["--source", "phantom", "--root", pipeline["root"] / "ph", "--out", out,
                                 "--no-hf"], out),  # fmt: skip
        "phantom": ("spar-build", ["phantom", "--out", out, "--n", 2], out),
    }


def _group(script: str):
    if script == "spar-build":
        from spar_bench.builder.cli import cli
    elif script == "spar-bench":
        from spar_bench.experiments.cli import cli
    else:
        from spar_bench.probes.cli import cli
    return cli


@pytest.mark.parametrize("command", ["fit", "sweep", "finetune", "vqa", "eval", "cache", "build", "phantom"])
def test_every_writer_is_refused_in_one_line_while_its_output_is_written(pipeline, tmp_path, capsys, command):
    script, argv, locked = _commands(pipeline, tmp_path)[command]
    if command == "eval":
        locked.mkdir(parents=True)  # the run folder an evaluation is added to
    with held_elsewhere(locked, what="writer") as holder:
        capsys.readouterr()
        assert run_cmd(_group(script), argv) == 2
        line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {locked} is being written by another writer, pid {holder.pid} since ")
    assert line.endswith("; wait for it, or pass --wait")
    assert not Path(locked).exists() or not any(Path(locked).iterdir())  # nothing was written


def test_a_sweep_partition_runs_beside_another_but_not_beside_a_whole_sweep(pipeline, tmp_path, capsys):
    _, argv, out = _commands(pipeline, tmp_path)["sweep"]
    with held_elsewhere(out, what="spar-probe sweep", shared=True):
        assert run_cmd(_group("spar-probe"), [*argv, "--partition", "0/1"]) == 0
        assert len(list(out.rglob("metrics.json"))) == 1
        capsys.readouterr()
        assert run_cmd(_group("spar-probe"), argv) == 2
        assert "is being written by another spar-probe sweep" in _one_line(capsys.readouterr().err)


def test_one_partition_or_named_run_of_a_sweep_is_written_by_one_sweep(pipeline, tmp_path, capsys):
    _, argv, out = _commands(pipeline, tmp_path)["sweep"]
    with held_elsewhere(Path(f"{out}.partition-0-of-2"), what="spar-probe sweep"):
        capsys.readouterr()
        assert run_cmd(_group("spar-probe"), [*argv, "--partition", "0/2"]) == 2
        assert f"{out} partition 0/2 is being written by another spar-probe sweep" in _one_line(capsys.readouterr().err)
    capsys.readouterr()
    assert run_cmd(_group("spar-probe"), [*argv, "--list"]) == 0  # a reader: no lock taken
    (rid,) = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    with held_elsewhere(out / rid, what="spar-probe eval"):
        capsys.readouterr()
        assert run_cmd(_group("spar-probe"), [*argv, "--only", rid]) == 2
        assert f"{out} run {rid} is being written by another spar-probe eval" in _one_line(capsys.readouterr().err)
    assert not list(out.rglob("metrics.json"))


@pytest.mark.slow
def test_a_report_reads_runs_while_they_are_written(pipeline, tmp_path):
    _, argv, out = _commands(pipeline, tmp_path)["fit"]
    assert run_cmd(_group("spar-probe"), argv) == 0
    with held_elsewhere(out, what="spar-probe sweep"):
        assert run_cmd(_group("spar-probe"), ["report", out, "--out", tmp_path / "report"]) == 0
    assert any((tmp_path / "report").iterdir())


EXPERIMENT = """
experiment: one
out: {out}
builds:
  a: {{phantom: {{n: 4}}, options: {{samples_per_case: 1, hf: false, levels: level3}}}}
"""


def test_a_second_experiment_run_is_refused_at_the_step_the_first_is_running(tmp_path, capsys):
    from spar_bench.experiments.runner import marker

    path, out = tmp_path / "one.yaml", tmp_path / "exp"
    path.write_text(EXPERIMENT.format(out=out))
    with held_elsewhere(marker(out, "build:a"), what="spar-bench run") as holder:
        capsys.readouterr()
        assert run_cmd(_group("spar-bench"), ["run", path]) == 2
        line = _one_line(capsys.readouterr().err.replace("[1/1] build:a\n", ""))
    assert line.startswith(f"error: step build:a of {out} is being written by another spar-bench run, pid {holder.pid} ")
    assert not (out / "builds").exists()


# -- real commands racing: both end well, nothing lost ----------------------------------------
RACER = """
import sys
from spar_bench.clitools import run_main
from spar_bench.experiments.cli import cli as bench
from spar_bench.probes.cli import cli as probe
import torch  # imported before the start, as the command would
print("ready", flush=True)
sys.stdin.readline()  # both start on the test's word
run_main(bench if sys.argv[1] == "spar-bench" else probe, sys.argv[2:])
"""


def _race(argv: list, n: int = 2, script: str = "spar-probe") -> list[subprocess.CompletedProcess]:
    """Start ``n`` copies of ``SCRIPT ARGV`` at once; their exit status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, script, *map(str, argv)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", env=env)
             for _ in range(n)]  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def _whole_runs(out: Path, n: int) -> None:
    from spar_bench.probes.runs.store import owned_run

    runs = sorted(m.parent for m in out.rglob("metrics.json"))
    assert len(runs) == n, runs
    for rd in runs:
        listed = owned_run(rd)
        assert listed is not None and {"config.json", "metrics.json", "head.pt"} <= {p.name for p in rd.iterdir()}
        json.loads((rd / "metrics.json").read_text())
        assert not (rd / "metrics.json.tmp").exists()


def _ended_well(done: list[subprocess.CompletedProcess], what: str) -> None:
    assert [d.returncode for d in done].count(0) >= 1, [d.stderr[-2000:] for d in done]
    for d in done:
        if d.returncode != 0:
            assert d.returncode == 2, d.stderr[-2000:]
            assert f"is being written by another {what}" in _one_line(d.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["fit", "sweep"])
def test_two_real_writers_into_one_out_both_end_well(pipeline, tmp_path, command):
    for i in range(2):
        out = tmp_path / f"out{i}"
        argv = [*_commands(pipeline, tmp_path)[command][1][:-1], out]
        _ended_well(_race(argv), f"spar-probe {command}")
        _whole_runs(out, 1)
    out = tmp_path / "waited"
    done = _race([*_commands(pipeline, tmp_path)[command][1][:-1], out, "--wait"])
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    _whole_runs(out, 1)


@pytest.mark.slow
def test_two_experiment_runs_into_one_out_both_end_well(tmp_path):
    """Each step is run once: by the first run; the second is refused there, or waits and skips it."""
    path, out = tmp_path / "one.yaml", tmp_path / "exp"
    path.write_text(EXPERIMENT.format(out=out))
    done = _race(["run", path], script="spar-bench")
    assert [d.returncode for d in done].count(0) >= 1, [d.stderr[-2000:] for d in done]
    for d in done:
        if d.returncode != 0:
            assert d.returncode == 2 and "is being written by another spar-bench run" in d.stderr.splitlines()[-1]
            assert "Traceback" not in d.stderr, d.stderr
    path.write_text(EXPERIMENT.format(out=tmp_path / "waited"))
    done = _race(["run", path, "--wait"], script="spar-bench")
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    for o in (out, tmp_path / "waited"):
        log = [json.loads(line) for line in (o / ".plan" / "log.jsonl").read_text().splitlines()]
        assert [e["event"] for e in log if e["step"] == "build:a"].count("finish") == 1, log
        assert (o / "builds" / "a" / "manifest.json").is_file()
