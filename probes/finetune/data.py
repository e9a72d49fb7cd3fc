"""Images for encoder training: batches of build rows read by a torch DataLoader.

A batch is a sorted set of rows of one split (Level 1/2: mosaics; Level 3: slices,
each with ALL its questions of the probe, so every image is encoded once per batch).
The epoch's row order is drawn from ``(seed, epoch)`` alone, so a resumed run reads
exactly the batches an uninterrupted one reads; the checkpoint stores it as well.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import numpy as np

from spar_bench.procs import init_loader_worker
from spar_bench.seeding import derive_seed


def epoch_batches(rows: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The distinct ``rows`` in a seeded order for ``epoch``, cut into sorted batches."""
    uniq = np.unique(rows)
    order = np.random.default_rng(derive_seed(seed, "finetune-order", epoch)).permutation(uniq)
    return [np.sort(order[s : s + batch_size]) for s in range(0, order.size, batch_size)]


def items_of(t, batch_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, index)``: the items of ``t`` whose image is in sorted ``batch_rows``, and the
    position of each one's image in the batch."""
    pos = np.searchsorted(batch_rows, t.rows)
    hit = batch_rows[np.minimum(pos, batch_rows.size - 1)] == t.rows
    idx = np.flatnonzero(hit)
    return idx, pos[idx].astype(np.int64)


def remap(t, rows: np.ndarray):
    """``t`` with its rows re-expressed as positions in sorted ``rows`` (encoded features)."""
    out = t.subset(np.arange(len(t)))
    out.rows = np.searchsorted(rows, t.rows).astype(np.int64)
    return out


#: a run of consecutive rows at least this long is read as one slice (shorter ones row by row)
MIN_RUN = 8


def read_rows(build, level: str, split: str, rows: np.ndarray) -> np.ndarray:
    """``build.images(level, split, rows)``, with each run of at least :data:`MIN_RUN`
    consecutive rows of a strictly increasing ``rows`` read as one slice (one HDF5 read per
    shard instead of one per row: sorted validation batches are mostly such runs). The same
    array either way."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size < MIN_RUN or not (np.diff(rows) > 0).all():
        return build.images(level, split, rows)
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    if max(r.size for r in runs) < MIN_RUN:
        return build.images(level, split, rows)
    parts, short = [], []
    for r in runs:
        if r.size < MIN_RUN:
            short.append(r)
            continue
        if short:
            parts.append(build.images(level, split, np.concatenate(short)))
            short = []
        parts.append(next(build.iter_images(level, split, r.size, start=int(r[0])))[1])
    if short:
        parts.append(build.images(level, split, np.concatenate(short)))
    return np.concatenate(parts)


class RowBatches:
    """Map-style dataset: item ``i`` = ``(i, uint8 images (B, H, W))`` of ``batches[i]``;
    ``timed``: ``(i, images, (read s, collate s))`` for a :class:`~..stopwatch.Stopwatch`."""

    def __init__(self, build, level: str, split: str, batches: list[np.ndarray], timed: bool = False):
        # a copy without open HDF5 handles: forked workers must not share the parent's ids
        self.build = pickle.loads(pickle.dumps(build))
        self.level, self.split, self.batches, self.timed = level, split, batches, timed

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        import torch

        t0 = time.perf_counter()
        images = read_rows(self.build, self.level, self.split, self.batches[i])
        t1 = time.perf_counter()
        x = torch.from_numpy(np.ascontiguousarray(images))
        return (i, x, (t1 - t0, time.perf_counter() - t1)) if self.timed else (i, x)


@dataclass(frozen=True)
class Loading:
    """DataLoader settings: workers reading shards, pinned memory on CUDA."""

    workers: int = 0
    pin: bool = False

    def loader(self, dataset):
        import torch

        return torch.utils.data.DataLoader(
            dataset, batch_size=None, shuffle=False, num_workers=self.workers, pin_memory=self.pin,
            prefetch_factor=4 if self.workers else None, persistent_workers=False,
            worker_init_fn=init_loader_worker,  # readers leave signals to the run and die with it
            # its own generator: starting an iterator must not draw from torch's global RNG
            # (dropout's), or a resumed epoch would see other dropout masks
            generator=torch.Generator().manual_seed(0),
        )
