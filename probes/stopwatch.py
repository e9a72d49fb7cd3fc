"""Where a run's time goes: seconds per stage, summed over its batches (issue 25).

An optional hook of the cache writer (:func:`spar_bench.probes.cache.write_cache`'s
``stopwatch``) and of the finetune loop (``Trainer.stopwatch``); ``bench/cache.py`` and
``bench/finetune.py`` print its table. Without one (the default, ``None``) nothing is timed
and nothing changes; with one, no output changes either: it only reads clocks.

Stages run in three places, and the table says which (``where``):

* ``main``: the process's loop (waiting for the next batch, the host-to-device copy, the
  forward, ...). These add up to at most the wall time; what they leave is ``other``.
* ``reader``: DataLoader workers (shard read and decompression, collation). Summed over
  the workers, so with several of them it can exceed the wall time; with ``workers=0`` it
  runs inside the main loop's ``load wait``.
* ``writer``: the cache's writer thread (its wait for the batch's copy to the host, the
  cast to the storage dtype on the CPU, checks and HDF5 writes), which overlaps the next
  batch's compute: its busy time, reported apart. What it costs the run is the main loop's
  ``write wait`` (waiting while the queue is full, and for the last batches at the end).
  With the writer thread off (``CacheOptions.async_writes=False``) both are the time of the
  writes made in the loop.

On CUDA the copies run on side streams (:mod:`.streams`): ``h2d`` is the next batch's copy
to the device (issued one batch ahead), ``d2h`` the cast of a batch's features and the
queueing of their copy back to the host.

On CUDA the device is synchronised at the end of every main-loop stage, so a stage's kernels
are counted in it and not in the next one that waits for them. That serialises copies and
compute that overlap in an untimed run: a timed run is slower, and its shares say where the
time of a batch goes, not the untimed throughput (the benches time both).
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

#: stage -> where it runs (``main``, ``reader`` or ``writer``), in the order the table shows them
STAGES: dict[str, str] = {
    "read": "reader", "collate": "reader", "load wait": "main", "host prep": "main", "h2d": "main",
    "forward": "main", "backward": "main", "step": "main", "d2h": "main", "write": "writer",
    "write wait": "main",
}


class Stopwatch:
    """Seconds and counts per stage; thread-safe (the cache's writer thread adds to it)."""

    def __init__(self, device: Any = None) -> None:
        self.device = device if getattr(device, "type", None) == "cuda" else None
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + float(seconds)
            self.counts[stage] = self.counts.get(stage, 0) + 1

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA only)."""
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block; on CUDA, its queued kernels too."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.add(name, time.perf_counter() - t0)

    def iterate(self, items: Iterable[Any], name: str = "load wait") -> Iterator[Any]:
        """``items`` one by one, the time spent waiting for each added to ``name``."""
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.add(name, time.perf_counter() - t0)
            yield item

    def rows(self, wall: float) -> list[tuple[str, str, float, float]]:
        """``(stage, where, seconds, share of wall)`` in :data:`STAGES` order, then ``other``:
        the wall time the main-loop stages do not cover."""
        out = [(s, STAGES.get(s, "main"), self.seconds[s], self.seconds[s] / wall if wall else 0.0)
               for s in [*STAGES, *sorted(set(self.seconds) - set(STAGES))] if s in self.seconds]
        main = sum(sec for _, where, sec, _ in out if where == "main")
        rest = max(wall - main, 0.0)
        return [*out, ("other", "main", rest, rest / wall if wall else 0.0)]

    def table(self, wall: float, title: str = "") -> str:
        """The rows as a Markdown table, with the wall time and the peak memory under it."""
        lines = [f"| {title or 'stage'} | where | s | share of wall |", "|---|---|---|---|"]
        lines += [f"| {s} | {w} | {sec:.3f} | {100 * share:.1f} % |" for s, w, sec, share in self.rows(wall)]
        mem = peak_memory(self.device)
        lines.append(f"wall {wall:.3f} s; " + "; ".join(f"{k} {v:.0f} MiB" for k, v in mem.items()))
        return "\n".join(lines)


def timed(stopwatch: Stopwatch | None, name: str) -> AbstractContextManager[Any]:
    """``stopwatch.stage(name)``, or a no-op without a stopwatch."""
    return stopwatch.stage(name) if stopwatch is not None else nullcontext()


def reset_peak_memory(device: Any = None) -> bool:
    """Start the peaks of :func:`peak_memory` afresh (Linux: ``/proc/self/clear_refs``; CUDA:
    torch's counters), so one process can measure runs one after another. False where the
    RSS peak cannot be reset (it then keeps the process's peak so far)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: Any = None) -> dict[str, float]:
    """The process's peak RSS and, on CUDA, the peak memory torch allocated, in MiB."""

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == "darwin" else 1 << 10)
    try:  # the peak since reset_peak_memory (getrusage keeps the process's whole life)
        status = Path("/proc/self/status").read_text()
        rss = float(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM:"))) / 1024
    except (OSError, StopIteration, ValueError):
        pass
    out = {"peak RSS": float(rss)}
    if getattr(device, "type", None) == "cuda":
        import torch

        out["peak CUDA allocated"] = torch.cuda.max_memory_allocated(device) / (1 << 20)
    return out
