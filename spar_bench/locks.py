"""One writer per output: ``OUT.lock`` beside an output folder, ``CACHE.h5.lock`` beside a cache.

>>> with output_lock("shards/", what="build"):
...     ...  # a second build to shards/ is refused while this one runs

Every writer holds the lock of its output while it writes: a build and ``spar-build merge``
(the build folder), ``spar-probe cache`` (the cache file), ``fit``, ``sweep``, ``finetune`` and
``vqa`` (their ``--out``), ``eval`` (the run folder it adds to) and each step of ``spar-bench
run`` (``OUT/.plan/steps/<step>.json.lock``: the partitions of one experiment write one OUT
side by side, so the runner locks the steps it runs, and each step's command locks its own
output as above). Readers (``report``, ``--list``, ``--dry-run``) never take a lock.

The lock is an ``flock`` on the file ``<output>.lock`` (a sibling, so replacing the output
never touches it); it holds ``pid host since command`` of its holder, for the one-line
refusal (:class:`OutputBusy`: "runs is being written by another spar-probe fit, pid 1234
since 2026-01-05T09:12:40Z; wait for it, or pass --wait"). ``--wait [SECONDS]``
(:func:`spar_bench.clitools.wait_option`, :func:`waiting`) waits instead, polling at most
every half second, and says once that it waits. The kernel releases an ``flock`` when its process dies, so the lock of a
killed run (a stale file) is simply taken over. Where ``fcntl`` is missing (Windows) the
file is created exclusively instead, and a file whose pid no longer runs is taken over.

Locks are not re-entrant: each output is locked at one level only (the runner a step; a
command its own output, where the command's library function does not: ``build``,
``merge`` and ``write_cache`` lock theirs), and a second lock of an output this process
already holds is refused at once, never waited for.

A ``shared`` lock (``sweep --partition``/``--only``: the partitions of one sweep write one runs
folder side by side) admits other shared holders and refuses an exclusive one (a whole sweep,
a ``fit``), and the reverse; such a sweep also holds ``RUNS.partition-I-of-N.lock`` or each
named run's lock alone.

A forked child (a DataLoader reader, a build worker) would share the holder's ``flock``
and keep it after the holder is killed, so every process forked while a lock is held
closes its copy at once (``os.register_at_fork``): only the holder holds the lock, and it
goes the moment the holder dies.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from spar_bench.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class OutputBusy(ConfigError):
    """Another process is writing the output (one line naming its pid; exit status 2)."""


#: The lock files this process holds: fd -> the holder's pid (see :func:`_drop_in_child`).
_HELD: dict[int, int] = {}
#: ... and their paths (a second lock of one of them is refused at once, never waited for).
_HELD_PATHS: dict[Path, int] = {}
#: How long :func:`output_lock` waits for another writer by default (``--wait``; 0: refuse at once).
_WAIT: ContextVar[float] = ContextVar("spar_lock_wait", default=0.0)
#: The longest pause between two looks at a busy lock while waiting.
_POLL_MAX_S = 0.5


def _drop_in_child() -> None:
    """In a freshly forked child: close the inherited lock fds, so the lock dies with its holder."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _HELD_PATHS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


@contextmanager
def waiting(seconds: float | None) -> Iterator[None]:
    """Within the block, :func:`output_lock` waits up to ``seconds`` (``math.inf``: as long as it
    takes) for another writer instead of refusing at once; None changes nothing."""
    token = _WAIT.set(seconds) if seconds is not None else None
    try:
        yield
    finally:
        if token is not None:
            _WAIT.reset(token)


def wait_seconds() -> float:
    """How long a lock waits for another writer here (0 outside :func:`waiting`)."""
    return _WAIT.get()


def lock_path(output: str | Path) -> Path:
    """``OUT`` -> ``OUT.lock`` (beside it; a trailing slash is ignored)."""
    p = Path(os.path.abspath(output))
    return p.parent / f"{p.name}.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, under another user
        return True
    return True


def _holder_line(what: str) -> bytes:
    """The lock file's line of this holder: ``pid host since what``."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{os.getpid()} {socket.gethostname()} {since} {what}\n".encode()


def _describe(line: str) -> tuple[str, str] | None:
    """A lock file's line ``pid host since what`` (or a bare pid, as written before) -> (what,
    "pid 1234, since ..."); None for a holder of this host that no longer runs (a stale line)."""
    parts = line.split(maxsplit=3)
    if not parts or not parts[0].isdigit():
        return None
    pid, host, since = int(parts[0]), (parts[1] if len(parts) > 1 else ""), " ".join(parts[2:3])
    here = host in ("", socket.gethostname())
    if here and not _pid_alive(pid):
        return None
    where = "" if here else f" on {host}"
    return " ".join(parts[3:4]), f"pid {pid}{where}" + (f" since {since}" if since else "")


def _holder(path: Path, what: str) -> str:
    """"another spar-probe fit, pid 1234 since ...": who holds the lock ``path`` (``what``: its kind
    when the file does not say)."""
    found: list = []
    for _ in range(100):  # the holder writes its line just after it takes the lock: up to 1 s for it
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        found = [d for d in map(_describe, lines) if d]
        if found:
            break
        time.sleep(0.01)
    if not found:
        return f"another {what}, a process that has not written its pid yet"
    (kind, first), more = found[0], len(found) - 1
    return f"another {kind or what}, {first}" + (f" (and {more} more)" if more else "")


def _refuse(label: str, lock: Path, what: str, waited: float) -> OutputBusy:
    if waited > 0:
        return OutputBusy(f"{label} is still being written by {_holder(lock, what)} after waiting "
                          f"{waited:g} s; wait longer (--wait), or write elsewhere")  # fmt: skip
    return OutputBusy(f"{label} is being written by {_holder(lock, what)}; wait for it, or pass --wait")


def _open(output: Path, lock: Path, flags: int) -> int:
    """``os.open`` of the lock file; a folder (or anything else) in its place is one line."""
    if lock.is_symlink():  # a broken one would be followed (created where it points) or fail
        raise ConfigError(f"{lock}, the lock file of {output}, is a symbolic link (to {os.readlink(lock)}); "
                          "remove it (SPAR-Bench writes none), or write elsewhere")  # fmt: skip
    try:
        return os.open(lock, flags | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:  # a folder in its place, a read-only file system, no permission ...
        what = "is a folder" if lock.is_dir() else f"cannot be created ({e.strerror or e})"
        away = "move it away (it is not SPAR-Bench's), or " if lock.exists() or lock.is_symlink() else ""
        raise ConfigError(f"{lock}, the lock file of {output}, {what}; {away}write elsewhere") from None


def _try_flock(output: Path, lock: Path, shared: bool) -> int | None:
    """The locked fd of ``lock``, or None while another process holds it."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = _open(output, lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the holder before us may have removed the file after we opened it: retry
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _try_exclusive(output: Path, lock: Path, shared: bool) -> int | None:  # pragma: no cover - Windows
    while True:
        try:
            return _open(output, lock, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            text = lock.read_text(encoding="utf-8").strip() if lock.exists() else ""
            if text and _describe(text.splitlines()[0]):  # its holder runs
                return None
            lock.unlink(missing_ok=True)  # a stale lock of a dead process


def _acquire(output: Path, lock: Path, what: str, label: str, shared: bool) -> int:
    """Lock ``lock``, waiting up to :func:`wait_seconds` (polling, said once) for its holder."""
    wait = wait_seconds()
    deadline, pause, told = time.monotonic() + wait, 0.02, False
    attempt = _try_flock if fcntl is not None else _try_exclusive
    while (fd := attempt(output, lock, shared)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _refuse(label, lock, what, wait)
        if not told:
            until = "" if math.isinf(wait) else f" (up to {wait:g} s)"
            print(f"{label} is being written by {_holder(lock, what)}; waiting for it{until}",
                  file=sys.stderr, flush=True)  # fmt: skip
            told = True
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX_S)
    return fd


def _release(fd: int, lock: Path, shared: bool) -> None:
    """Unlock: the file goes with the last holder (a shared one first checks it is the last)."""
    last = True
    if shared and fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            last = False
    if last:
        lock.unlink(missing_ok=True)
    os.close(fd)


def _check_parent(output: Path, lock: Path) -> None:
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, a read-only file system, no permission
        raise ConfigError(f"{lock.parent}: cannot hold {output} and its lock file ({e.strerror}); write elsewhere") from None


@contextmanager
def output_lock(output: str | Path, *, what: str, shared: bool = False, name: str | None = None) -> Iterator[Path]:
    """Hold ``<output>.lock`` while writing ``output``; :class:`OutputBusy` naming the holder's pid
    when another process holds it (after waiting, inside :func:`waiting`).

    Args:
        output: the output folder or file about to be written.
        what: the kind of writer, for the message ("build", "feature cache (spar-probe cache)").
        shared: admit other shared holders (the partitions of one sweep), refuse exclusive ones.
        name: how the message names the output (default: its path).
    """
    output = Path(output)
    lock, label = lock_path(output), name or str(output)
    _check_parent(output, lock)
    if lock in _HELD_PATHS:  # this process writes it already: waiting would never end
        raise OutputBusy(f"{label} is being written by another {what}, pid {os.getpid()} (this process); "
                         "one writer per output")  # fmt: skip
    fd = _acquire(output, lock, what, label, shared)
    _HELD[fd] = os.getpid()
    _HELD_PATHS[lock] = fd
    try:
        if not shared:
            os.ftruncate(fd, 0)
        os.write(fd, _holder_line(what))
        yield lock
    finally:
        if _HELD.pop(fd, None) == os.getpid():  # a forked child leaving the block owns nothing
            _HELD_PATHS.pop(lock, None)
            _release(fd, lock, shared)
