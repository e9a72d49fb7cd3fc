"""Worker processes that never outlive the command that started them.

:func:`process_pool` is the one way SPAR-Bench runs work in other processes (the build's
cases, the Parquet conversion, the sweep's runs). Its workers start with ``spawn`` (a forked
child deadlocks on thread pools, torch or BLAS, that the parent already started), ignore
SIGINT and SIGTERM (a Ctrl-C or ``scancel`` reaches the whole process group: the parent
alone decides, so it never sees a worker vanish first) and die with the parent
(:func:`die_with_parent`: even a SIGKILL of the parent takes them along). When the parent
leaves the pool by any exception (KeyboardInterrupt from SIGINT, SystemExit from SIGTERM,
an error), pending work is cancelled and every worker is killed before the exception goes
on. :func:`init_loader_worker` sets up a DataLoader's reader workers (``spar-probe cache
--loader-workers``, finetune) the same way. :func:`completed` waits for futures in
slices, so a signal is handled within a fraction of a second whichever thread the kernel
gave it to.

:func:`exit_on_sigterm` turns SIGTERM into ``SystemExit(143)`` in the main thread, so
``finally`` blocks and this pool's cleanup run instead of the process vanishing and
leaving its workers hung under PID 1. Python may run that handler inside a finalizer, which
swallows the SystemExit: the handler also records the signal, and every long loop calls
:func:`check_stop` between its steps (:func:`completed` while it waits), which raises it again.
A SIGINT's ``KeyboardInterrupt`` is recorded and raised again the same way (it once went
unnoticed: a sweep run to the end and exit 0 after a Ctrl-C).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before Python 3.11
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from spar_bench.errors import SparError

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_pdeathsig(sig: int) -> bool:
    """Linux: the kernel sends ``sig`` to this process when its parent exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, interval_s: float = 0.5) -> None:
    """Where no prctl exists: a daemon thread that ends the process when ``parent`` is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="spar-parent-watchdog", daemon=True).start()


def die_with_parent(parent: int | None = None) -> None:
    """Make this process die (SIGKILL) when its parent ``parent`` (default: the present one) does.

    On Linux the kernel does it (``PR_SET_PDEATHSIG``; it fires when the parent *thread* that
    started us ends, so start workers from a thread that outlives them, as the main thread
    does); elsewhere a watchdog thread polls the parent pid. A parent already gone: exit now.
    """
    parent = os.getppid() if parent is None else parent
    if not _set_pdeathsig(signal.SIGKILL):
        _watch_parent(parent)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(128 + signal.SIGKILL)


def init_loader_worker(_worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: a reader worker is set up as the pool's are. It leaves
    SIGINT and SIGTERM to its process (a worker killed by a ``scancel`` of the group would
    make torch raise 'DataLoader worker is killed' instead of the stop's one line) and dies
    with it at once (torch's own check notices a dead parent only every 5 s)."""
    _init_worker(os.getppid())


def _thread_lock_for_tqdm() -> None:
    """tqdm's first bar in a process makes a multiprocessing lock, a named semaphore that a
    worker killed at a stop leaves for the resource tracker to remove (with a warning on the
    user's terminal). In a spawn worker no other process shares it: a thread lock does."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _init_worker(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent)
    _thread_lock_for_tqdm()
    sys.excepthook = _quiet_lost_parent(sys.excepthook)


def _quiet_lost_parent(previous):
    """A worker's ``sys.excepthook`` that drops a helper thread's lost connection. A worker hands
    its batches' shared memory to the parent through multiprocessing's fd sharer, a thread of
    the *worker* the parent connects to; a parent that stops (SIGTERM) mid-handshake resets
    that connection, and the worker, which ignores the signal, would print the sharer's
    traceback after the run's one line. Whatever the parent lost, it reports itself."""

    def hook(tp, value, tb) -> None:
        if issubclass(tp, (ConnectionError, EOFError)) and threading.current_thread() is not threading.main_thread():
            return
        previous(tp, value, tb)

    return hook


def _terminate(pool: ProcessPoolExecutor) -> None:
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # they ignore SIGTERM: their work is lost anyway, so SIGKILL
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


@contextmanager
def process_pool(workers: int, stateless: bool = False) -> Iterator[ProcessPoolExecutor]:
    """A ``spawn`` ProcessPoolExecutor of ``workers`` processes that die with this one, killed on
    any exception; a worker killed from outside (out of memory) is one :class:`SparError` line.
    ``stateless``: the workers write nothing and hold nothing once their results are in, so at a
    normal exit they are killed too, not waited for (an interpreter with torch takes about a
    second to finish; the results are all received when the block ends)."""
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(os.getpid(),))
    try:
        yield pool
    except BrokenProcessPool:
        _terminate(pool)
        raise SparError("a worker process died (killed from outside, e.g. out of memory); rerun the "
                        "command to continue (a build with --resume)") from None
    except BaseException:
        _terminate(pool)
        raise
    if stateless:
        _terminate(pool)
    else:
        pool.shutdown(wait=True)


def completed(futures: Iterable[Future], poll_s: float = 0.5) -> Iterator[Future]:
    """``as_completed``, but the main thread wakes at least every ``poll_s`` so that a signal
    the kernel gave another thread (a pool's manager or feeder) is still handled at once, and
    a SIGTERM whose SystemExit was swallowed stops it (:func:`check_stop`)."""
    pending = set(futures)
    while pending:
        check_stop()  # a SIGTERM whose SystemExit a finalizer swallowed: stop waiting
        try:
            for f in as_completed(pending, timeout=poll_s):
                check_stop()
                pending.discard(f)
                yield f
        except FuturesTimeout:
            continue


_TERMINATED: list[int] = []  # the SIGTERMs received (see terminated())
_HANDLER_PID: list[int] = []  # the process that installed the handler (exit_on_sigterm)


def _raise_exit(signum: int, _frame) -> None:
    if _HANDLER_PID and os.getpid() != _HANDLER_PID[-1]:
        return  # a forked child (a DataLoader reader) before its worker_init_fn: the parent decides
    _TERMINATED.append(signum)
    raise SystemExit(128 + signum)


def _quiet_after_stop(previous):
    """``sys.excepthook`` that, once a SIGTERM stops the run, drops what a helper thread reports
    (multiprocessing's fd sharer of a DataLoader, losing its worker while the process exits,
    prints a traceback through it): the run's one line is ``terminated (SIGTERM)``."""

    def hook(tp, value, tb) -> None:
        if _TERMINATED and threading.current_thread() is not threading.main_thread():
            return
        previous(tp, value, tb)

    hook.spar_quiet = True
    return hook


_INTERRUPTED: list[int] = []  # the SIGINTs received (see interrupted())


def _raise_interrupt(signum: int, _frame) -> None:
    """Python's own SIGINT handler, which also records the signal: a KeyboardInterrupt raised
    inside a finalizer (``__del__``, a weakref callback) is printed and swallowed, and the run
    would go on to exit 0 as if never stopped; :func:`check_stop` raises it again."""
    if _HANDLER_PID and os.getpid() != _HANDLER_PID[-1]:
        return  # a forked child (a DataLoader reader) before its worker_init_fn: the parent decides
    _INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def exit_on_sigterm() -> None:
    """SIGTERM -> ``SystemExit(143)``, and SIGINT (where it is not ignored, as in a job started
    in the background) recorded before its ``KeyboardInterrupt`` (main thread only; elsewhere a
    no-op). A child forked with the handlers in place (a DataLoader's reader worker, before its
    ``worker_init_fn``) ignores the signals: the parent alone decides, as in :func:`process_pool`."""
    if threading.current_thread() is threading.main_thread():
        _HANDLER_PID.append(os.getpid())
        signal.signal(signal.SIGTERM, _raise_exit)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _raise_interrupt)
        if not getattr(sys.excepthook, "spar_quiet", False):
            sys.excepthook = _quiet_after_stop(sys.excepthook)


def terminated() -> bool:
    """Whether a SIGTERM reached :func:`exit_on_sigterm`'s handler. Python runs a signal handler
    at the next bytecode of the main thread, which may be inside a finalizer (``__del__``, a
    weakref callback) that prints and swallows the SystemExit; a long run checks this between
    its steps (:func:`check_stop`), and the command's exit status says 143 all the same
    (:func:`~.clitools.run_main`)."""
    return bool(_TERMINATED)


def interrupted() -> bool:
    """Whether a SIGINT reached :func:`exit_on_sigterm`'s handler (see :func:`terminated`)."""
    return bool(_INTERRUPTED)


def check_stop() -> None:
    """Raise the SIGTERM's ``SystemExit(143)`` (or the SIGINT's ``KeyboardInterrupt``) again when
    one was received: every long loop (training batches and epochs, cache batches, MLLM question
    batches, build cases, a sweep's runs, an experiment's steps) calls this between two of its
    steps, so a stop a finalizer swallowed still stops the run within a step, where a stop is
    safe (no checkpoint half written)."""
    if _TERMINATED:
        raise SystemExit(128 + _TERMINATED[0])
    if _INTERRUPTED:
        raise KeyboardInterrupt
