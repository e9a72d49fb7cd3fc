"""Worker processes that never outlive the command that started them.

:func:`process_pool` is the one way SPAR-Bench runs work in other processes (the build's
cases, the Parquet conversion). Its workers start with ``spawn`` (a forked child deadlocks
on thread pools, torch or BLAS, that the parent already started) and ignore SIGINT, so a
Ctrl-C reaches the parent only; when the parent leaves the pool by any exception
(KeyboardInterrupt from SIGINT, SystemExit from SIGTERM, an error), pending work is
cancelled and every worker is terminated before the exception goes on.

:func:`exit_on_sigterm` turns SIGTERM into ``SystemExit(143)`` in the main thread, so
``finally`` blocks and this pool's cleanup run instead of the process vanishing and
leaving its workers hung under PID 1.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _terminate(pool: ProcessPoolExecutor) -> None:
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A ``spawn`` ProcessPoolExecutor of ``workers`` processes, terminated on any exception."""
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_ignore_sigint)
    try:
        yield pool
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown(wait=True)


def _raise_exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM -> ``SystemExit(143)`` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)
