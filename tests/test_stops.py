"""Every long loop honours a SIGTERM, however its SystemExit was swallowed (issue 39, item 3).

Python runs a signal handler at the next bytecode of the main thread, which may be inside a
finalizer (``__del__``, a weakref callback) that prints and drops the handler's SystemExit.
The handler records the signal (``procs.terminated``) and each loop calls ``procs.check_stop``
between its batches: the fixture ``swallow`` makes exactly that happen (a real SIGTERM,
handled by the real handler inside a finalizer), and each test below does it from a hook at
batch k, then checks the loop stopped before its next batch with ``SystemExit(143)``.

The last test runs ``spar-probe finetune --loader-workers 2`` for many epochs, SIGTERMs it once
its checkpoint shows training under way, five times (each time resuming the last one's
checkpoint): every run exits 143 and none trains on to its last epoch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from spar_bench import procs

from helpers import run_cmd

pytestmark = pytest.mark.skipif(not hasattr(signal, "raise_signal") or sys.platform == "win32",
                                reason="needs POSIX signals")


class _Finalized:
    def __del__(self):  # the SIGTERM's handler runs at the next bytecode, in here: its SystemExit is dropped
        signal.raise_signal(signal.SIGTERM)
        for _ in range(1000):
            pass


@pytest.fixture
def swallow(monkeypatch) -> Callable[[], None]:
    """``swallow()``: a SIGTERM to this process whose SystemExit a finalizer swallows (the
    handler of ``spar-probe``, :func:`procs.exit_on_sigterm`, installed for the test)."""
    assert threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(procs, "_TERMINATED", [])
    monkeypatch.setattr(procs, "_HANDLER_PID", [], raising=False)
    dropped: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    procs.exit_on_sigterm()

    def now() -> None:
        _Finalized()  # dropped at once: its finalizer runs here, in the main thread
        assert SystemExit in dropped and procs.terminated()  # swallowed, as Python does

    yield now
    signal.signal(signal.SIGTERM, old)


def _swallow_at(monkeypatch, owner, name: str, k: int, swallow) -> list[int]:
    """Wrap ``owner.name`` (called once per batch) to swallow a SIGTERM after its ``k``-th call;
    the calls, counted."""
    calls: list[int] = []
    inner = getattr(owner, name)

    def wrapped(*a, **kw):
        calls.append(1)
        out = inner(*a, **kw)
        if len(calls) == k:
            swallow()
        return out

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def _stops(run: Callable[[], object], calls: list[int], k: int) -> None:
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code == 128 + signal.SIGTERM
    assert len(calls) == k, f"went on for {len(calls) - k} batches after the SIGTERM"


# -- the helper itself and the pool's wait ------------------------------------------------------
def test_check_stop_raises_the_handlers_exit(swallow):
    procs.check_stop()  # nothing received: nothing happens
    swallow()
    with pytest.raises(SystemExit) as e:
        procs.check_stop()
    assert e.value.code == 143


def test_completed_stops_waiting(swallow):
    done, never = Future(), Future()
    done.set_result(1)
    waiting = procs.completed([done, never], poll_s=0.05)
    swallow()
    with pytest.raises(SystemExit):
        next(waiting)


def test_a_forked_child_leaves_the_sigterm_to_its_parent(swallow, tmp_path):
    """A DataLoader reader forked with the handler in place, before its worker_init_fn: a SIGTERM
    to the group must not end it (its loader would fail with 'worker exited unexpectedly')."""
    import multiprocessing

    def child(flag: str) -> None:
        signal.raise_signal(signal.SIGTERM)
        for _ in range(1000):
            pass
        Path(flag).touch()  # still running

    p = multiprocessing.get_context("fork").Process(target=child, args=(str(tmp_path / "alive"),))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and (tmp_path / "alive").is_file() and not procs.terminated()


# -- head training: one head, an ensemble ------------------------------------------------------
@pytest.mark.usefixtures("one_torch_thread")
def test_head_training_stops_between_batches(swallow, monkeypatch):
    from test_ensemble import _head, relative_position

    from spar_bench.probes import train
    from spar_bench.probes.train import TrainConfig

    feats, t = relative_position(40, 0, False)  # 240 items: 8 batches of 32 an epoch
    calls = _swallow_at(monkeypatch, train, "_run", 3, swallow)
    head = _head("mlp", feats, 0)
    _stops(lambda: train.train_head(head, (feats, t), (feats, t.subset(np.arange(0))),
                                    TrainConfig(max_epochs=5, batch_size=32), 0), calls, 3)


@pytest.mark.usefixtures("one_torch_thread")
def test_ensemble_training_stops_between_batches(swallow, monkeypatch):
    from test_ensemble import _head, relative_position

    from spar_bench.probes import ensemble
    from spar_bench.probes.train import TrainConfig

    feats, t = relative_position(40, 0, False)
    calls = _swallow_at(monkeypatch, ensemble, "_stacked_batch", 3, swallow)
    heads = [_head("mlp", feats, s) for s in (0, 1)]
    empty = t.subset(np.arange(0))
    _stops(lambda: ensemble.train_heads(heads, ([feats] * 2, t), ([feats] * 2, empty),
                                        [TrainConfig(max_epochs=5, batch_size=32)] * 2, [0, 1]), calls, 3)


# -- finetuning, organ-map pretraining ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_finetuning_stops_between_batches_and_resumes(pipeline, swallow, monkeypatch, tmp_path, workers):
    """Stopped after batch 2 of 3 (``checkpoint_every`` 1): the checkpoint is the one saved after
    batch 2, whole; the rerun with ``resume`` continues from it to the end (once: it takes time)."""
    from test_finetune import TINY_RESNET, _finetune

    from spar_bench.probes.finetune import loop

    kw = {"cfg": {"checkpoint_every": 1, "workers": workers, "max_epochs": 1}}
    calls = _swallow_at(monkeypatch, loop.Trainer, "batch_loss", 2, swallow)
    _stops(lambda: _finetune(pipeline, tmp_path, TINY_RESNET, "level1.localisation", **kw), calls, 2)
    (ckpt,) = tmp_path.rglob(loop.CHECKPOINT)
    assert loop.load_saved(ckpt, "checkpoint")["progress"]["batch"] == 2
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("metrics.json"))
    if workers:
        return
    monkeypatch.setattr(procs, "_TERMINATED", [])  # the next command
    rd = _finetune(pipeline, tmp_path, TINY_RESNET, "level1.localisation", resume=True, **kw)
    assert (rd / "metrics.json").is_file() and len(calls) > 2


def test_organ_map_pretraining_stops_between_batches(pipeline, swallow, monkeypatch, tmp_path):
    from test_organmaps import _pretrain

    from spar_bench.probes.finetune import organmaps

    calls = _swallow_at(monkeypatch, organmaps._Model, "loss", 1, swallow)
    _stops(lambda: _pretrain(pipeline, tmp_path / "om", epochs=3), calls, 1)
    assert not (tmp_path / "om" / organmaps.CHECKPOINT_FILE).exists()  # no epoch finished


# -- caching, asking an MLLM, building ---------------------------------------------------------
def test_caching_stops_between_batches_and_resumes(pipeline, swallow, monkeypatch, tmp_path):
    from spar_bench.probes import cache
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.features import FeatureCache

    opts = CacheOptions(levels=["level3"], splits=["train"], batch_size=4, dtype="fp32", compute="fp32",
                        device="cpu", loader_workers=0)
    calls = _swallow_at(monkeypatch, cache, "_encode", 2, swallow)
    out = tmp_path / "c.h5"
    _stops(lambda: write_cache("dummy", pipeline["shards"], out, opts, progress=False), calls, 2)
    monkeypatch.setattr(procs, "_TERMINATED", [])
    write_cache("dummy", pipeline["shards"], out, opts, progress=False)  # resumes
    FeatureCache(out).close()


def test_asking_an_mllm_stops_between_batches(pipeline, swallow, monkeypatch, tmp_path):
    from spar_bench.probes.cli import cli
    from spar_bench.probes.vqa.dummy import DummyBackend

    init = DummyBackend.__init__

    def small_batches(self, *a, **kw):
        init(self, *a, **kw)
        self.batch_size = 4

    monkeypatch.setattr(DummyBackend, "__init__", small_batches)
    calls = _swallow_at(monkeypatch, DummyBackend, "answer", 2, swallow)
    _stops(lambda: run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--out", tmp_path,
                                 "--probe", "symmetry", "--bootstrap", 10]), calls, 2)
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.slow
def test_building_stops_between_cases(swallow, monkeypatch, tmp_path):
    from spar_bench.builder.cli import cli
    from spar_bench.builder.sources.phantom import PhantomSource

    assert run_cmd(cli, ["phantom", "--out", tmp_path / "ph", "--n", 3]) == 0
    calls = _swallow_at(monkeypatch, PhantomSource, "load", 1, swallow)
    _stops(lambda: run_cmd(cli, ["--source", "phantom", "--root", tmp_path / "ph", "--out", tmp_path / "out",
                                 "--jobs", "1", "--samples-per-case", "1", "--no-hf"]), calls, 1)
    assert not (tmp_path / "out").exists()


# -- end to end: spar-probe finetune --loader-workers 2, SIGTERMed five times ------------------
WAIT_S = 300  # for a run to start training (imports, forks and a first step on a loaded 2-core machine)
STOP_S = 60  # for the run to stop after the SIGTERM (1000 epochs: it would not finish)


def _finetune_args(pipeline, out: Path, resume: bool) -> list[str]:
    return ["finetune", "--encoder", "timm:resnet10t", "--model-args",
            json.dumps({"pretrained_cfg_overlay": {"input_size": [3, 64, 64]}}), "--init", "scratch",
            "--data", str(pipeline["shards"]), "--probe", "level1.localisation", "--head", "mlp",
            "--out", str(out), "--batch-size", "4", "--max-epochs", "1000", "--patience", "1000",
            "--device", "cpu", "--compute", "fp32", "--loader-workers", "2", "--checkpoint-every", "1",
            "--threads", "1", "--no-controls", "--bootstrap", "10", *(["--resume"] if resume else [])]


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino  # each save replaces the file: a new inode
    except OSError:
        return None


def _stop_once(pipeline, out: Path, trial: int) -> None:
    from test_signals import _family, _poll

    from spar_bench.probes.finetune import loop

    ckpts = list(out.rglob(loop.CHECKPOINT))
    before = _inode(ckpts[0]) if ckpts else None
    err = out.parent / f"stderr-{trial}"
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "spar_bench.probes.cli", *_finetune_args(pipeline, out, trial > 0)],
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    try:
        def trained() -> bool:
            found = list(out.rglob(loop.CHECKPOINT))
            return bool(found) and _inode(found[0]) not in (None, before) or proc.poll() is not None

        assert _poll(trained, WAIT_S) and proc.poll() is None, err.read_text()[-3000:]
        seen = _family(proc.pid)
        assert seen, "no loader workers"
        os.killpg(proc.pid, signal.SIGTERM) if trial % 2 else proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"trial {trial}: still running {STOP_S}s after the SIGTERM")
        print(f"\ntrial {trial}: exit {rc} {time.monotonic() - t0:.2f}s after the signal")
        text = err.read_text(encoding="utf-8", errors="replace")
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert text.strip().splitlines()[-1] == "terminated (SIGTERM)", text[-3000:]
        assert _poll(lambda: not _family(proc.pid), STOP_S), "loader workers outlived the run"
    finally:
        for pid in _family(proc.pid) | {proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    (ckpt,) = out.rglob(loop.CHECKPOINT)
    assert loop.load_saved(ckpt, "checkpoint")["progress"]["epoch"] < 1000
    assert not list(out.rglob("metrics.json"))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_sigtermed_finetune_with_loader_workers_stops_every_time(pipeline, tmp_path):
    """Five runs, each resuming the last one's checkpoint, SIGTERMed (alone, then with its
    group) once its checkpoint changed: each exits 143 with its one line, its readers gone."""
    out = tmp_path / "runs"
    for trial in range(5):
        _stop_once(pipeline, out, trial)


def test_after_a_sigterm_a_helper_threads_report_is_dropped(capsys, monkeypatch) -> None:
    """CI: a DataLoader's fd-sharer thread (multiprocessing.resource_sharer) printed a traceback
    through sys.excepthook as its worker went with the stopped run; after a SIGTERM a helper
    thread's report is dropped, the main thread's still printed."""
    import threading

    from spar_bench import procs

    printed = []
    hook = procs._quiet_after_stop(lambda *exc: printed.append(threading.current_thread().name))
    monkeypatch.setattr(procs, "_TERMINATED", [])
    t = threading.Thread(target=lambda: hook(OSError, OSError("peer gone"), None), name="helper")
    t.start(), t.join()
    assert printed == ["helper"]  # no SIGTERM: reported as before
    monkeypatch.setattr(procs, "_TERMINATED", [15])
    t = threading.Thread(target=lambda: hook(OSError, OSError("peer gone"), None), name="helper")
    t.start(), t.join()
    hook(OSError, OSError("main"), None)
    assert printed == ["helper", "MainThread"]
