"""One writer per output: ``OUT.lock`` beside a build, ``CACHE.lock`` beside a cache.

>>> with output_lock("shards/", what="build"):
...     ...  # a second build to shards/ is refused while this one runs

The lock is an ``flock`` on the file ``<output>.lock`` (a sibling, so replacing the output
never touches it), which holds the holder's pid for the message. The kernel releases an
``flock`` when its process dies, so the lock of a killed run (a stale file with a dead
pid) is simply taken over. Where ``fcntl`` is missing (Windows) the file is created
exclusively instead, and a file whose pid no longer runs is taken over.

A forked child (a DataLoader reader, a build worker) would share the holder's ``flock``
and keep it after the holder is killed, so every process forked while a lock is held
closes its copy at once (``os.register_at_fork``): only the holder holds the lock, and it
goes the moment the holder dies.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spar_bench.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


#: The lock files this process holds: fd -> the holder's pid (see :func:`_drop_in_child`).
_HELD: dict[int, int] = {}


def _drop_in_child() -> None:
    """In a freshly forked child: close the inherited lock fds, so the lock dies with its holder."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


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


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that has not written its pid yet"


def _refuse(output: Path, lock: Path, what: str) -> ConfigError:
    return ConfigError(
        f"{output} is being written by another {what} ({_holder(lock)}, lock {lock}); wait for it "
        f"to finish or stop it, or write elsewhere"
    )


def _open(output: Path, lock: Path, flags: int) -> int:
    """``os.open`` of the lock file; a folder (or anything else) in its place is one line."""
    try:
        return os.open(lock, flags, 0o644)
    except (IsADirectoryError, PermissionError, NotADirectoryError) as e:
        what = "is a folder" if lock.is_dir() else f"cannot be created ({e.strerror})"
        raise ConfigError(f"{lock}, the lock file of {output}, {what}; move it away (it is not "
                          "SPAR-Bench's), or write elsewhere") from None  # fmt: skip


def _acquire_flock(output: Path, lock: Path, what: str) -> int:
    while True:
        fd = _open(output, lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refuse(output, lock, what) from None
        try:  # the holder before us may have removed the file after we opened it: retry
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _acquire_exclusive(output: Path, lock: Path, what: str) -> int:  # pragma: no cover - Windows
    while True:
        try:
            return _open(output, lock, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            text = lock.read_text(encoding="utf-8").strip() if lock.exists() else ""
            if text.isdigit() and _pid_alive(int(text)):
                raise _refuse(output, lock, what) from None
            lock.unlink(missing_ok=True)  # a stale lock of a dead process


@contextmanager
def output_lock(output: str | Path, *, what: str) -> Iterator[Path]:
    """Hold ``<output>.lock`` while writing ``output``; ConfigError naming the holder's pid if taken.

    Args:
        output: the build folder or cache file about to be written.
        what: the kind of writer, for the message ("build", "feature cache").
    """
    output = Path(output)
    lock = lock_path(output)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise ConfigError(f"{lock.parent}: cannot hold {output} and its lock file ({e.strerror}); write elsewhere") from None
    fd = (_acquire_flock if fcntl is not None else _acquire_exclusive)(output, lock, what)
    _HELD[fd] = os.getpid()
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield lock
    finally:
        if _HELD.pop(fd, None) == os.getpid():  # a forked child leaving the block owns nothing
            lock.unlink(missing_ok=True)
            os.close(fd)
