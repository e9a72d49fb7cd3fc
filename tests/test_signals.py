"""SIGTERM, SIGINT and SIGKILL stop every multi-process command promptly and cleanly.

`spar-build --jobs 2`, `spar-probe sweep --jobs 2` and `torchrun ... spar-probe cache` run
in a session of their own, through a wrapper script that makes each worker (or rank) drop a
marker file and hang mid-work (a case being loaded; a run folder with its config.json but no
metrics.json yet; a cache part with a batch written). Once every worker has its marker, the
test signals the process group (a Ctrl-C, ``scancel``) or the parent alone, then checks:
the command exits with 130 / 143 (SIGINT / SIGTERM) and one line, no process it started is
left (read from /proc), nothing that looks finished is left, and a rerun (``--resume`` for a
build) completes. A SIGKILL of the parent alone takes its workers (and the multiprocessing
resource tracker) with it. The workers hang for 10 minutes, so an unhonoured signal cannot
pass: every wait below is a bounded poll (30 s or more), never a timing assertion; the
seconds from signal to exit are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")

# Imported (as __mp_main__) by every spawn worker too, so the patches below reach the workers.
WRAPPER = '''
import json
import os
import signal
import sys
import time
from pathlib import Path

HANG = os.environ.get("SPAR_TEST_HANG")  # "case", "run" or "batch": where workers hang


def mark_and_hang(what: str) -> None:
    (Path(os.environ["SPAR_TEST_MARKERS"]) / f"{what}-{os.getpid()}").touch()
    time.sleep(600)


if HANG == "case":
    from spar_bench.builder.sources.phantom import PhantomSource

    PhantomSource.load = lambda self, ref: mark_and_hang("case")
elif HANG == "run":
    from spar_bench.probes.runs import session

    def write_config_and_hang(rd, record, *rest, **kw):  # session.write_run: config.json, then hang
        rd.mkdir(parents=True, exist_ok=True)
        record.write(rd)
        mark_and_hang("run")

    session.write_run = write_config_and_hang
elif HANG == "batch":
    from spar_bench.probes import cache

    encode, calls = cache._encode, []

    def encode_and_hang(*args, **kw):  # a rank's second batch: the first is being written
        calls.append(1)
        if len(calls) == 2:
            mark_and_hang("batch")
        return encode(*args, **kw)

    cache._encode = encode_and_hang

if __name__ == "__main__":
    # a test run started in the background inherits SIGINT ignored (POSIX); a terminal's
    # Ctrl-C reaches a process whose SIGINT is at its default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "build":
        from spar_bench.builder.cli import main
    else:
        from spar_bench.probes.cli import main
    main(sys.argv[2:])
'''

WAIT_S = 120  # for workers to start (spawn + imports on a loaded 2-core machine)
STOP_S = 30  # for the stop after the signal (the workers hang for 600 s)


# -- processes, read from /proc --------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _family(root: int) -> set[int]:
    """Live descendants of ``root`` and every live process of its session (orphans included)."""
    table = {}
    for d in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(d.name))
        if fields is not None and fields[0] != "Z":
            table[int(d.name)] = (int(fields[1]), int(fields[3]))  # ppid, session
    found = {pid for pid, (_, sid) in table.items() if sid == root and pid != root}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found - {root}


def _poll(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _markers(folder: Path, n: int) -> list[int]:
    """Wait until ``n`` workers left their marker; their pids."""
    assert _poll(lambda: len(list(folder.iterdir())) >= n, WAIT_S), f"no {n} markers in {WAIT_S}s"
    return [int(p.name.rsplit("-", 1)[1]) for p in folder.iterdir()]


class Command:
    """A wrapped command in a session of its own; :meth:`close` kills whatever is left."""

    def __init__(self, tmp: Path, argv: list[str], hang: str, launcher: tuple[str, ...] = ()):
        (tmp / "wrapper.py").write_text(WRAPPER)
        self.markers = tmp / f"markers-{time.monotonic_ns()}"
        self.markers.mkdir()
        env = {**os.environ, "SPAR_TEST_HANG": hang, "SPAR_TEST_MARKERS": str(self.markers)}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        self.stderr = self.markers.with_suffix(".stderr")  # a file: a pipe would wait for any orphan
        with self.stderr.open("wb") as err:
            self.proc = subprocess.Popen([sys.executable, *launcher, str(tmp / "wrapper.py"), *argv], env=env,
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.seen: set[int] = set()

    def signal(self, sig: signal.Signals, group: bool) -> float:
        """Send ``sig`` (to the group or the parent alone); return the monotonic time sent."""
        self.seen |= _family(self.proc.pid)
        t0 = time.monotonic()
        os.killpg(self.proc.pid, sig) if group else self.proc.send_signal(sig)
        return t0

    def wait_exit(self, t0: float, what: str) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what}: still running {STOP_S}s after the signal")
        print(f"\n{what}: exit {rc} {time.monotonic() - t0:.2f}s after the signal")
        return rc, self.stderr.read_text(encoding="utf-8", errors="replace")

    def assert_no_orphan(self, what: str) -> None:
        gone = _poll(lambda: not any(_alive(p) for p in self.seen | _family(self.proc.pid)), STOP_S)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in self.seen if _alive(p)}
        assert gone, f"{what}: processes outlived the command: {left}"

    def close(self) -> None:
        for pid in self.seen | _family(self.proc.pid) | {self.proc.pid}:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


def _check_stopped(rc: int, err: str, sig: signal.Signals) -> None:
    assert rc == 128 + sig, (rc, err)
    assert "Traceback" not in err, err
    word = "aborted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert err.strip().splitlines()[-1] == word, err


STOPS = [("SIGTERM", True), ("SIGTERM", False), ("SIGINT", True), ("SIGINT", False)]
STOP_IDS = [f"{s}-to-{'group' if g else 'parent'}" for s, g in STOPS]


# -- spar-build --jobs 2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def phantom(tmp_path_factory) -> Path:
    from spar_bench.builder.cli import cli

    from helpers import run_cmd

    root = tmp_path_factory.mktemp("signals") / "ph"
    assert run_cmd(cli, ["phantom", "--out", root, "--n", 4]) == 0
    return root


def _build_args(phantom: Path, out: Path) -> list[str]:
    return ["build", "--source", "phantom", "--root", str(phantom), "--out", str(out), "--jobs", "2",
            "--samples-per-case", "2", "--shard-size", "5", "--no-hf"]


def _resume_build(tmp_path: Path, phantom: Path, out: Path) -> None:
    from spar_bench.builder.cli import cli

    from helpers import run_cmd

    assert run_cmd(cli, [*_build_args(phantom, out)[1:], "--resume"]) == 0
    assert (out / "manifest.json").is_file() and not Path(f"{out}.tmp").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig,group", STOPS, ids=STOP_IDS)
def test_a_stopped_parallel_build_leaves_no_worker_and_resumes(phantom, tmp_path, sig, group):
    sig = getattr(signal, sig)
    out = tmp_path / "out"
    cmd = Command(tmp_path, _build_args(phantom, out), hang="case")
    try:
        _markers(cmd.markers, 2)
        rc, err = cmd.wait_exit(cmd.signal(sig, group), f"build --jobs 2, {sig.name}")
        _check_stopped(rc, err, sig)
        cmd.assert_no_orphan("build")
    finally:
        cmd.close()
    assert not out.exists() and (tmp_path / "out.tmp" / "config.json").is_file()
    _resume_build(tmp_path, phantom, out)


@pytest.mark.slow
def test_a_killed_parallel_build_takes_its_workers_along(phantom, tmp_path):
    out = tmp_path / "out"
    cmd = Command(tmp_path, _build_args(phantom, out), hang="case")
    try:
        _markers(cmd.markers, 2)
        cmd.wait_exit(cmd.signal(signal.SIGKILL, group=False), "build --jobs 2, SIGKILL")
        cmd.assert_no_orphan("build")  # workers and the resource tracker
    finally:
        cmd.close()
    assert not out.exists()
    _resume_build(tmp_path, phantom, out)


# -- spar-probe sweep --jobs 2 ---------------------------------------------------------------
def _sweep_args(pipeline, out: Path) -> list[str]:
    return ["probe", "sweep", "--features", str(pipeline["cache"]), "--head", "linear", "--probe",
            "level3.size,level3.distance", "--seeds", "0,1", "--out", str(out), "--jobs", "2", "--no-controls",
            "--bootstrap", "10", "--max-epochs", "2"]  # 4 runs: 2 hang in the workers, 2 wait


def _rerun_sweep(pipeline, out: Path) -> None:
    """Nothing stopped looks finished; a rerun completes every run."""
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    assert not list(out.rglob("metrics.json")) and list(out.rglob("config.json"))
    args = _sweep_args(pipeline, out)[1:]
    args[args.index("--jobs") + 1] = "1"  # the same runs, without a second pool (faster)
    assert run_cmd(cli, args) == 0
    runs = list(out.rglob("config.json"))
    assert runs and all((p.parent / "metrics.json").is_file() for p in runs)


@pytest.mark.slow
@pytest.mark.parametrize("sig,group", STOPS[:3], ids=STOP_IDS[:3])  # a Ctrl-C reaches the group
def test_a_stopped_sweep_stops_its_jobs_and_a_rerun_completes(pipeline, tmp_path, sig, group):
    sig = getattr(signal, sig)
    out = tmp_path / "runs"
    cmd = Command(tmp_path, _sweep_args(pipeline, out), hang="run")
    try:
        _markers(cmd.markers, 2)
        rc, err = cmd.wait_exit(cmd.signal(sig, group), f"sweep --jobs 2, {sig.name}")
        _check_stopped(rc, err, sig)
        cmd.assert_no_orphan("sweep")
    finally:
        cmd.close()
    _rerun_sweep(pipeline, out)


@pytest.mark.slow
def test_a_killed_sweep_takes_its_jobs_along(pipeline, tmp_path):
    out = tmp_path / "runs"
    cmd = Command(tmp_path, _sweep_args(pipeline, out), hang="run")
    try:
        _markers(cmd.markers, 2)
        cmd.wait_exit(cmd.signal(signal.SIGKILL, group=False), "sweep --jobs 2, SIGKILL")
        cmd.assert_no_orphan("sweep")
    finally:
        cmd.close()
    _rerun_sweep(pipeline, out)


# -- torchrun ranks of spar-probe cache ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun() -> tuple[str, ...]:
    return ("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port()))


def _cache_args(pipeline, out: Path) -> list[str]:
    return ["probe", "cache", "--encoder", "dummy", "--data", str(pipeline["shards"]), "--out", str(out),
            "--dtype", "fp32", "--compute", "fp32", "--batch", "3", "--device", "cpu", "--workers", "0"]


def _rerun_torchrun(pipeline, out: Path) -> None:
    """No OUT, only the ranks' parts; the same command again resumes them and merges."""
    assert not out.exists() and len(list(out.parent.glob(f"{out.name}.part-*-of-2"))) == 2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, *_torchrun(), "-m", "spar_bench.probes.cli", *_cache_args(pipeline, out)[1:]]
    r = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace", timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.is_file() and not list(out.parent.glob(f"{out.name}.part-*"))


@pytest.mark.slow
@pytest.mark.parametrize("sig,group", [("SIGTERM", False), ("SIGINT", True), ("SIGKILL", False)],
                         ids=["SIGTERM-to-torchrun", "SIGINT-to-group", "SIGKILL-to-torchrun"])
def test_stopped_or_killed_torchrun_takes_its_ranks_along(pipeline, tmp_path, sig, group):
    """torchrun starts each rank in a session of its own and passes a SIGTERM or SIGINT on (each
    rank stops with its one line, exit 143 / 130; torchrun itself exits 1 with its own traceback);
    a SIGKILL of torchrun takes the ranks along (parent-death signal)."""
    sig = getattr(signal, sig)
    out = tmp_path / "c.h5"
    cmd = Command(tmp_path, _cache_args(pipeline, out), hang="batch", launcher=_torchrun())
    try:
        ranks = _markers(cmd.markers, 2)
        assert set(ranks) <= _family(cmd.proc.pid)
        rc, err = cmd.wait_exit(cmd.signal(sig, group), f"torchrun cache, 2 ranks, {sig.name}")
        assert rc != 0
        if sig != signal.SIGKILL:  # each rank stopped with its one line
            word = "aborted" if sig == signal.SIGINT else "terminated (SIGTERM)"
            assert [line.strip() for line in err.splitlines()].count(word) == 2, err[-3000:]
        cmd.assert_no_orphan("torchrun")
    finally:
        cmd.close()
    _rerun_torchrun(pipeline, out)


# -- spar-probe cache --workers 2 (DataLoader reader workers) --------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_stopped_cache_stops_its_reader_workers_and_a_rerun_completes(pipeline, tmp_path, sig):
    """SIGTERM to the group (``scancel``) reaches the readers too: still one line and 143. A SIGKILL
    of the command takes them along at once (torch's own check would take 5 s)."""
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    sig = getattr(signal, sig)
    out = tmp_path / "c.h5"
    args = _cache_args(pipeline, out)
    args[args.index("--workers") + 1] = "2"
    cmd = Command(tmp_path, args, hang="batch")
    try:
        _markers(cmd.markers, 1)
        assert len(_family(cmd.proc.pid)) >= 2  # the reader workers
        rc, err = cmd.wait_exit(cmd.signal(sig, group=sig != signal.SIGKILL), f"cache --workers 2, {sig.name}")
        if sig != signal.SIGKILL:
            _check_stopped(rc, err, sig)
        cmd.assert_no_orphan("cache")
    finally:
        cmd.close()
    # at once: the readers forked while the lock was held closed their copy of it (locks.py)
    assert run_cmd(cli, args[1:]) == 0  # resumes the batches written before the stop
    from spar_bench.probes.features import FeatureCache

    FeatureCache(out).close()


# -- the mechanism itself ----------------------------------------------------------------------
ORPHAN = '''
import os, subprocess, sys, time
import spar_bench.procs as procs

if sys.argv[1] == "parent":  # start a child, wait for its pid file, then die abruptly
    subprocess.Popen([sys.executable, __file__, "child", sys.argv[2], sys.argv[3]])
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.05)
    os._exit(0)
if sys.argv[2] == "watchdog":  # the fallback where no prctl exists
    procs._set_pdeathsig = lambda sig: False
procs.die_with_parent()
with open(sys.argv[3] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
time.sleep(600)
'''


@pytest.mark.parametrize("how", ["prctl", "watchdog"])
def test_die_with_parent_ends_a_child_whose_parent_died(tmp_path, how):
    (tmp_path / "orphan.py").write_text(ORPHAN)
    pid_file = tmp_path / "child.pid"
    parent = subprocess.run([sys.executable, str(tmp_path / "orphan.py"), "parent", how, str(pid_file)],
                            timeout=WAIT_S, capture_output=True, encoding="utf-8", errors="replace")
    assert parent.returncode == 0, parent.stderr
    child = int(pid_file.read_text())
    try:
        assert _poll(lambda: not _alive(child), STOP_S), f"{how}: the child outlived its parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _die_by_sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_from_outside_is_one_error_line():
    from spar_bench.errors import SparError
    from spar_bench.procs import completed, process_pool

    with pytest.raises(SparError, match="a worker process died"):
        with process_pool(1) as pool:
            for f in completed([pool.submit(_die_by_sigkill)]):
                f.result()


SWALLOWED = """
import os, signal, sys
import click
from spar_bench.clitools import run_main

class Finalized:
    def __del__(self):  # the SIGTERM's handler runs here, at the next bytecode: Python swallows its SystemExit
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):
            pass

@click.command()
def cmd():
    Finalized()  # dropped at once: its finalizer runs in the main thread
    click.echo("went on")

run_main(cmd, [])
"""


def test_a_sigterm_a_finalizer_swallowed_still_exits_143(tmp_path):
    """Python runs a signal handler inside whatever the main thread executes, a ``__del__`` too,
    where its SystemExit is printed and dropped: the command still ends with 143, and a long run
    (``spar-bench run``) stops before its next step (``procs.terminated``)."""
    script = tmp_path / "swallowed.py"
    script.write_text(SWALLOWED, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "Exception ignored" in r.stderr and "went on" in r.stdout  # swallowed, as Python does
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert r.stderr.rstrip().endswith("terminated (SIGTERM)")


SHARER = """
import os, socket, sys, threading, time
from multiprocessing import resource_sharer
import spar_bench.procs as procs

procs._init_worker(os.getppid())  # as a DataLoader reader starts
r, w = os.pipe()
df = resource_sharer.DupFd(r)  # a batch's fd on offer: the sharer thread listens
address = df._id[0]
s = socket.socket(socket.AF_UNIX)
s.connect(address)
s.close()  # the parent stopped mid-handshake: the sharer loses its connection
time.sleep(1)
t = threading.Thread(target=lambda: sys.excepthook(*_raise()))
def _raise():
    try:
        raise ValueError("a helper thread's real error")
    except ValueError:
        return sys.exc_info()
t.start(); t.join()
print("done", flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the fd sharer listens on a Unix socket")
def test_a_reader_worker_keeps_quiet_when_its_parent_drops_the_fd_sharer(tmp_path):
    """A reader worker hands batches to its parent through multiprocessing's fd sharer thread; a
    parent stopped mid-handshake resets it and the worker would print the sharer's traceback
    after the run's one line (CI saw it). A helper thread's other errors still print."""
    script = tmp_path / "sharer.py"
    script.write_text(SHARER, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "resource_sharer" not in r.stderr and "EOFError" not in r.stderr, r.stderr
    assert "a helper thread's real error" in r.stderr
