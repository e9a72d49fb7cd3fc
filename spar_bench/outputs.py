"""What SPAR-Bench may write into, replace or delete: only what it wrote itself.

Every command that writes a folder or a file (a build and its ``OUT.tmp`` work folder, a
phantom dataset, a feature cache, a run folder, a report) asks here before it touches
anything:

* :func:`check_target` refuses an output that is a file where a folder is meant (or the
  reverse), or that is, contains or lies inside one of the command's inputs. It runs
  before any work starts.
* :func:`claim` decides whether an existing output may be replaced. An absent output or an
  empty folder is free. Anything else is replaced only with ``--overwrite`` *and* only when
  the ``owned`` test of its kind recognises it as SPAR-Bench's own output *and* every file
  in it is one that output lists. A folder with one extra file (``thesis.docx``) is refused,
  with the file named, and nothing is deleted.

A full disk while writing (ENOSPC, EDQUOT) becomes one :class:`DiskFullError` line through
:func:`disk_full_is_an_error`, naming the path and saying how to continue once space is
freed. Two writers on one output are kept apart by :mod:`spar_bench.locks`.

The ``owned`` tests live beside the outputs they recognise; each takes the output path and
returns the set of relative file paths that output accounts for, or ``None`` when the path
is not such an output.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from spar_bench.errors import ConfigError, SparError

#: ``owned(path)`` -> relative POSIX paths of the files that output accounts for, or None.
Owned = Callable[[Path], "set[str] | None"]


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser().resolve()))


def check_target(
    out: str | Path, *, inputs: Iterable[str | Path] = (), option: str = "--out", folder: bool = True
) -> None:
    """Refuse ``out`` when it has the wrong type or overlaps an input (ConfigError).

    Args:
        out: the output path.
        inputs: the command's input folders and files; ``out`` may not be one of them,
            contain one, or lie inside one.
        option: the option's name, for the message.
        folder: True when ``out`` is a folder, False when it is a file.
    """
    out_p = Path(out)
    if folder and out_p.exists() and not out_p.is_dir():
        raise ConfigError(f"{option} {out} is a file, not a folder; choose another {option}")
    if not folder and out_p.is_dir():
        raise ConfigError(f"{option} {out} is a folder, not a file; choose another {option}")
    target = _resolved(out_p)
    for inp in inputs:
        src = _resolved(inp)
        if target == src:
            raise ConfigError(f"{option} {out} is the input {inp}; write the output elsewhere")
        if src.is_relative_to(target):
            raise ConfigError(f"{option} {out} contains the input {inp}; write the output elsewhere")
        if target.is_relative_to(src) and src.is_dir():
            raise ConfigError(f"{option} {out} lies inside the input {inp}; write the output elsewhere")


def files_under(folder: Path) -> set[str]:
    """Relative POSIX paths of every file (and link) below ``folder``."""
    found = set()
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            found.add((Path(dirpath) / name).relative_to(folder).as_posix())
    return found


def _is_empty(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def claim(
    out: str | Path, *, overwrite: bool, owned: Owned, what: str, option: str = "--out",
    hint: str = "",
) -> bool:
    """May ``out`` be (re)written? True when it holds an earlier output that may be replaced.

    Returns False when ``out`` is absent or an empty folder (nothing to replace).

    Raises:
        ConfigError: ``out`` holds something and ``overwrite`` is False; or it is not a
            SPAR-Bench ``what``; or it holds files that output does not list.
    """
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return False
    if _is_empty(out):
        return False
    if not overwrite:
        raise ConfigError(
            f"{option} {out} exists and is not empty; pass --overwrite to replace it"
            f"{hint}, or choose another {option}"
        )
    listed = owned(out)
    if listed is None:
        raise ConfigError(
            f"{option} {out} is not a SPAR-Bench {what}; refusing to replace it (nothing was "
            f"deleted); choose another {option}"
        )
    if out.is_dir():
        strays = sorted(files_under(out) - listed)
        if strays:
            shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
            raise ConfigError(
                f"{option} {out} holds files SPAR-Bench did not write ({shown}); refusing to "
                f"replace it (nothing was deleted); move them or choose another {option}"
            )
    return True


def remove(path: Path) -> None:
    """Delete an output that :func:`claim` allowed to be replaced."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


#: errno values that mean "the disk (or the quota) is full".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: how libraries that drop the errno say it: HDF5 (h5py's RuntimeError at a close), safetensors,
#: pyarrow, sqlite3 (SQLITE_FULL).
_DISK_FULL_TEXTS = (
    "No space left on device", "Disk quota exceeded", f"errno = {errno.ENOSPC},",
    f"errno = {errno.EDQUOT},", "database or disk is full",
)


class DiskFullError(SparError):
    """The disk filled up while writing an output (reported as one line; the run resumes)."""


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from or during (torch.save keeps the
    OSError only as the context of its own RuntimeError)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) says the disk or the quota is full."""
    return any(
        (isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS)
        or any(text in str(e) for text in _DISK_FULL_TEXTS)
        for e in _causes(err)
        if not isinstance(e, DiskFullError)
    )


def _failed_path(err: BaseException) -> str | None:
    """The file a full-disk error names: an OSError's ``filename``, or HDF5's ``filename = '...'``."""
    for e in _causes(err):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
        if m := re.search(r"filename = '([^']+)'", str(e)):
            return m.group(1)
    return None


#: how to go on after a full disk, when a command runs inside another (:func:`rerun_as`)
_RERUN: ContextVar[str | None] = ContextVar("spar_bench_rerun", default=None)


@contextmanager
def rerun_as(text: str) -> Iterator[None]:
    """Inside the block, a full disk says ``text`` as how to go on, in place of the command's
    own advice: a step of ``spar-bench run`` is resumed by rerunning ``spar-bench run``, not
    by rerunning its ``spar-build`` command with ``--resume``."""
    token = _RERUN.set(text)
    try:
        yield
    finally:
        _RERUN.reset(token)


def disk_full_error(err: BaseException, where: str | Path | None = None,
                    rerun: str = "rerun the same command") -> DiskFullError:
    """The one line of a full disk: the file that failed (else ``where``) and how to go on
    (``rerun``, or the text of an enclosing :func:`rerun_as`).

    The one place a full disk becomes a message; :func:`disk_full_is_an_error` and the
    console scripts (:func:`spar_bench.clitools.run_cli`) both use it.
    """
    path = _failed_path(err) or (str(where) if where is not None else "an output")
    return DiskFullError(
        f"no space left on the disk while writing {path}; free space (or write elsewhere) and "
        f"{_RERUN.get() or rerun}"
    )


@contextmanager
def disk_full_is_an_error(where: str | Path, *, rerun: str) -> Iterator[None]:
    """Turn a full-disk error inside the block into one :class:`DiskFullError` line.

    Args:
        where: the output being written (named when the error carries no file name).
        rerun: how to continue once space is freed, e.g. "rerun with --resume".
    """
    try:
        yield
    except Exception as e:
        if isinstance(e, DiskFullError) or not is_disk_full(e):
            raise
        raise disk_full_error(e, where, rerun) from None


def write_bytes(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` (str: UTF-8) to ``path``, all of it or no file: a failure (a full disk)
    removes what was written and is an ``OSError`` naming ``path``. A torn file would look
    like an output of another kind to the rerun (a run folder whose config.json is cut)."""
    path = Path(path)
    try:
        with open(path, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        path.unlink(missing_ok=True)
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


#: a failed ``torch.save`` with less than this left on its disk is taken for a full disk
_NEARLY_FULL = 1 << 20


def save_torch(obj: object, path: str | Path) -> None:
    """``torch.save(obj, path)`` (the same bytes), all of it or no file (as :func:`write_bytes`);
    a full disk is an ``OSError`` naming ``path``.

    torch's own file writer drops the errno ("unexpected pos 576 vs 534"): a failed save
    that leaves less than 1 MiB free on the disk of ``path`` is reported as a full disk.
    """
    import torch

    path = Path(path)
    try:
        torch.save(obj, path)
    except (RuntimeError, OSError) as e:
        path.unlink(missing_ok=True)
        if is_disk_full(e) or shutil.disk_usage(path.parent).free < _NEARLY_FULL:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise
