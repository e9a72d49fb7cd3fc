"""HDF5 files that a full disk cannot tear: the way SPAR-Bench writes HDF5.

HDF5 writes through its own C driver. When a write fails for lack of space it goes on
writing (metadata at close), prints a traceback for every object it frees, and the
process can crash at exit (issue 19: exit 139 and 46 tracebacks from a build on a full
disk). So HDF5 never writes to a disk here:

* :func:`h5_image` builds a new file in memory (the ``core`` driver, no backing store)
  and gives its bytes, which the caller writes with plain Python I/O (a shard: the bytes
  are those h5py's default driver writes);
* :func:`open_h5` opens a file written in place and resumed (a feature cache; ``mode="w"``
  a new one written straight through, the merge of a distributed cache) through
  h5py's ``fileobj`` driver and :class:`_LatchedFile`: the writes made since the last
  ``flush()`` stay in memory and are applied at the flush (and at the close) after their
  space is reserved with ``posix_fallocate``. A full disk fails the reservation: the file
  on disk stays exactly as at its last flush (which HDF5 opens and resumes), every later
  write, flush and truncate is a no-op (HDF5 closes without another error and nothing
  more is written), and :func:`open_h5` raises that first error, an ``OSError`` naming the
  file, which :func:`spar_bench.outputs.disk_full_error` reports in one line. (On a
  copy-on-write file system, btrfs or ZFS, an overwrite can still fail after the
  reservation; the file is then as torn as HDF5 alone would leave it.)
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: errno values of a failed reservation that mean "no fallocate here", not "no space".
_NO_FALLOCATE = {"EINVAL", "EOPNOTSUPP", "ENOSYS", "ENOTSUP"}


class _LatchedFile(io.RawIOBase):
    """A binary file for h5py's ``fileobj`` driver: HDF5's writes wait in memory until its
    flush, which applies them all or none; after a failed flush nothing more is written."""

    def __init__(self, path: Path, fd: int, *, through: bool = False):
        super().__init__()
        self.path, self.fd, self.through = path, fd, through  # through: commit every write
        self.error: OSError | None = None
        self._pos = 0
        self._disk_size = os.fstat(self.fd).st_size  # what the disk holds (committed)
        self._size = self._disk_size  # what HDF5 sees
        self._pending: list[tuple[int, bytes]] = []
        self._released = self._reported = False

    def __repr__(self) -> str:  # h5py names the file by it (``File.filename``, its messages)
        return str(self.path)

    # -- the io interface h5py uses ------------------------------------------------------
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        got = os.preadv(self.fd, [view[:n]], self._pos) if n else 0
        view[got:n] = bytes(n - got)  # beyond the disk's end: not yet committed
        for off, data in self._pending:  # later writes win
            lo, hi = max(off, self._pos), min(off + len(data), self._pos + n)
            if lo < hi:
                view[lo - self._pos:hi - self._pos] = data[lo - off:hi - off]
        self._pos += n
        return n

    def write(self, buf: Any) -> int:
        data = bytes(buf)
        if self.error is None:
            self._pending.append((self._pos, data))
        self._pos += len(data)
        self._size = max(self._size, self._pos)
        if self.through and self.error is None:
            try:
                self._commit()
            except OSError as e:  # raised from HDF5's write callback, an error crashes HDF5:
                self._latch(e)  # it is raised at the next flush instead
        return len(data)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        self._size = size
        self._pending = [(o, d[:size - o]) for o, d in self._pending if o < size]
        return size

    def flush(self) -> None:
        if self._released:
            return
        if self.error is None:
            try:
                self._commit()
            except OSError as e:
                self._latch(e)
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error  # once: HDF5 survives an error from its flush, and closes

    def release(self) -> None:
        """Forget what is not committed; later flushes write nothing (the file is closed)."""
        self._pending, self._released = [], True
        self.close()

    # -- committing ----------------------------------------------------------------------
    def _latch(self, e: OSError) -> None:
        """The first failed commit: remembered (naming the file); nothing more is written."""
        self.error = OSError(e.errno, e.strerror, str(self.path))
        self._pending = []

    def _commit(self) -> None:
        """Reserve the space of the pending writes, then apply them (or leave the disk as it was)."""
        size = self._size
        try:
            self._reserve(size)
        except OSError:
            os.ftruncate(self.fd, self._disk_size)  # a partial reservation: give it back
            raise
        for off, data in self._pending:
            _pwrite_all(self.fd, data, off)
        if size < os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, size)
        self._pending, self._disk_size = [], size

    def _reserve(self, size: int) -> None:
        spans = sorted((o, o + len(d)) for o, d in self._pending if d)
        if size > self._disk_size:
            spans.append((self._disk_size, size))
        for lo, hi in _merged(spans):
            try:
                os.posix_fallocate(self.fd, lo, hi - lo)
            except OSError as e:
                if errno.errorcode.get(e.errno or 0) not in _NO_FALLOCATE:
                    raise


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a short write at a filling disk is continued,
    and the next one fails with ENOSPC)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _merged(spans: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Sorted ``[lo, hi)`` spans with overlapping and touching ones joined."""
    cur: list[int] | None = None
    for lo, hi in sorted(spans):
        if cur is not None and lo <= cur[1]:
            cur[1] = max(cur[1], hi)
            continue
        if cur is not None:
            yield cur[0], cur[1]
        cur = [lo, hi]
    if cur is not None:
        yield cur[0], cur[1]


def h5_image(fill: Callable[[Any], None], **kwargs: Any) -> bytes:
    """The bytes of a new HDF5 file: ``fill(f)`` writes into ``f``, an in-memory
    ``h5py.File(..., "w", **kwargs)``. They equal the file h5py's default driver writes."""
    import h5py

    with h5py.File("in-memory.h5", "w", driver="core", backing_store=False, **kwargs) as f:
        fill(f)
        f.flush()
        return f.id.get_file_image()


@contextmanager
def open_h5(path: str | Path, mode: str = "a", **kwargs: Any) -> Iterator[Any]:
    """``h5py.File(path, mode, **kwargs)`` whose flushes are applied whole or not at all.

    ``mode="w"`` starts a new file that is written through (each write applied at once,
    memory stays flat): one renamed into place when complete (a merge), for which a torn
    file is no loss.

    Raises:
        OSError: the first failed flush (errno set, ``filename`` the file), after HDF5
            closed the file without writing more; the file is as at its last good flush.
    """
    import h5py

    path = Path(path)
    new = mode == "w" or not path.exists() or path.stat().st_size == 0  # 0 bytes: a failed first flush
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if new else 0), 0o666)
    raw = _LatchedFile(path, fd, through=mode == "w")
    try:
        try:
            with h5py.File(raw, "w" if new else "a", **kwargs) as f:
                yield f
            raw.flush()  # the close's last writes (HDF5 writes the superblock after its flush)
        except Exception:
            if raw.error is not None:
                raise raw.error from None
            raise
    finally:
        raw.release()
        os.close(fd)
