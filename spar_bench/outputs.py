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
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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


class DiskFullError(SparError):
    """The disk filled up while writing an output (reported as one line; the run resumes)."""


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` is an OSError for a full disk or quota (h5py and pyarrow set errno too)."""
    return isinstance(err, OSError) and (
        err.errno in DISK_FULL_ERRNOS or "No space left on device" in str(err)
    )


@contextmanager
def disk_full_is_an_error(where: str | Path, *, rerun: str) -> Iterator[None]:
    """Turn a full-disk OSError inside the block into one :class:`DiskFullError` line.

    Args:
        where: the output being written (named when the error carries no file name).
        rerun: how to continue once space is freed, e.g. "rerun with --resume".
    """
    try:
        yield
    except OSError as e:
        if not is_disk_full(e):
            raise
        path = e.filename or where
        raise DiskFullError(
            f"no space left on the disk while writing {path}; free space (or write elsewhere) and {rerun}"
        ) from None
