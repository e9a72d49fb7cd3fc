"""``spar-probe cache``: encode every image of a build once and store its tokens (docs/FORMATS.md).

>>> from spar_bench.probes.cache import CacheOptions, write_cache
>>> write_cache("timm:resnet50", "shards/", "cache/resnet50.h5",
...             CacheOptions(weights="r50.safetensors", layers=(-1, -4), dtype="fp16"))

The cache is resumable: ``done`` marks the rows written, flushed after every batch. Rerun the
same command after an interruption and it continues where it stopped; other arguments on an
existing partial cache are refused. ``complete=True`` is written only after the last row, and
:class:`spar_bench.probes.features.FeatureCache` refuses anything else.

Compute: on CUDA, autocast bf16 (fp16 where bf16 is unsupported), workers reading shards
into pinned memory, the next batch's copy to the device and the last one's features back
to the host on side streams during the forward (:mod:`.streams`), and one writer thread
storing batches in order while the next ones are encoded (``CacheOptions.async_writes``;
off, the same file byte for byte). On CPU the same code (nothing pinned, nothing ahead);
``--compute auto`` picks bf16 autocast only where the CPU has native bf16
(:mod:`spar_bench.probes.hardware`), else fp32.
The compute dtype, the reason for it and the storage dtype are recorded in the cache.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import click
import numpy as np

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.fields import check_fields, limited
from spar_bench.procs import check_stop
from spar_bench.provenance import CACHE_PACKAGES, package_versions

from .distributed import Ranks, all_parts, barrier, merge_parts, part_path
from .features import STORAGE_FLOAT
from .hardware import COMPUTE_DTYPES, Precision, pick_compute, pick_device
from .stopwatch import Stopwatch, timed
from .token_storage import Moments, Projection, Reducer, TokenStorage, random_projection

CACHE_SCHEMA = "1.0"
#: storage name -> numpy dtype (one table, the reader's)
STORAGE_DTYPES = STORAGE_FLOAT
#: ``--tile-encoding``: a Level 1-2 mosaic encoded whole (``mosaic``), or each of its 16 tiles
#: resized to the encoder's input and encoded alone, the 16 token sets stacked (``per-tile``)
TILE_ENCODINGS = ("mosaic", "per-tile")
TILED_LEVELS = tuple(lv for lv, spec in LEVEL_SPECS.items() if spec.mosaic)


def tile_layout(spec) -> dict[str, Any]:
    """What a ``per-tile`` cache records of its Levels 1-2 features (``tile_layout`` attribute)."""
    from spar_bench.builder.schema import TILE_GRID, TILE_SIZE

    n = TILE_GRID * TILE_GRID
    return {"levels": list(TILED_LEVELS), "grid": [TILE_GRID, TILE_GRID], "tile_px": TILE_SIZE,
            "resize_to": list(spec.input_size), "tokens_per_tile": spec.n_tokens,
            "tokens": f"{n} tiles x tokens_per_tile, tile p (row p // {TILE_GRID}, column p % {TILE_GRID}) "
                      "at rows p * tokens_per_tile ...",
            "pooled": f"the {n} tiles' pooled vectors concatenated in tile order ({n} x dim)"}  # fmt: skip


def parse_layers(text: str | Sequence[int]) -> list[int]:
    """``"-1,-4"`` -> ``[-1, -4]``."""
    if not isinstance(text, str):
        return [int(v) for v in text]
    try:
        layers = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated integers like -1,-4; got {text!r}") from None
    if not layers:
        raise ConfigError("--layers is empty; use e.g. -1 or -1,-4")
    return layers


def _relative_dir(data: str | Path, out: Path) -> str:
    """The build folder as seen from the cache file's folder (``"../shards"``, POSIX) when it
    lies in the folder that holds that folder; else ``""`` (no local path is published: fit,
    eval and sweep then need ``--data``). The rule of the build manifest's paths."""
    from spar_bench.provenance import path_from_build

    return path_from_build(data, Path(out).resolve().parent) or ""


class _Batches:
    """Map-style dataset over the whole plan: item ``i`` = images of ``items[i] = (level, split, lo, hi)``.

    One dataset (and so one DataLoader with one set of workers) serves every level and
    split: starting workers once per split cost more than the encoder on a GPU.
    """

    def __init__(self, build, items: list[tuple[str, str, int, int]], timed: bool = False, rows: Any = None):
        # a copy without open HDF5 handles (Build.__getstate__): forked DataLoader workers
        # must not share the parent's HDF5 file ids
        self.build = pickle.loads(pickle.dumps(build))
        self.items = items
        self.timed = timed  # items carry (read s, collate s) for a Stopwatch
        self.rows = rows  # a question cache's rows (QuestionRows), or None: the level's rows

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        import torch

        level, split, lo, hi = self.items[i]
        t0 = time.perf_counter()
        images = _images(self.build, self.rows, level, split, lo, hi)
        t1 = time.perf_counter()
        x = torch.from_numpy(np.ascontiguousarray(images))
        return (i, x, (t1 - t0, time.perf_counter() - t1)) if self.timed else (i, x)


def _images(build, rows, level: str, split: str, lo: int, hi: int) -> np.ndarray:
    """The images of cache rows ``lo..hi-1``: the level's rows, or a question cache's
    (:class:`~.question_rows.QuestionRows`: each question's slice)."""
    if rows is None:
        return next(build.iter_images(level, split, hi - lo, start=lo))[1]
    return build.images(level, split, rows.slices[split][lo:hi])


def _count(build, rows, level: str, split: str) -> int:
    """The cache rows of a split: the level's rows, or a question cache's questions."""
    return build.count(level, split) if rows is None else rows.count(split)


def _texts(rows, item: Item) -> tuple[str, ...] | None:
    """A question cache's user messages of one batch (None for any other cache)."""
    return None if rows is None else rows.texts[item[1]][item[2]:item[3]]


def _attr(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, tuple)) else value


DIST_TIMEOUT_S = 3600.0


def _is_complete(out: Path, args: dict[str, Any]) -> bool:
    """Whether ``out`` is already a complete cache of ``args``."""
    import h5py

    if not out.is_file():
        return False
    with h5py.File(out, "r") as f:
        return bool(f.attrs.get("complete")) and json.loads(f.attrs.get("cache_args", "null")) == args


def _resumed_precision(out: Path, compute: str) -> Precision | None:
    """With ``--compute auto``, an interrupted cache keeps the precision it started with."""
    import h5py

    if compute != "auto" or not out.is_file():
        return None
    try:
        with h5py.File(out, "r") as f:
            args = json.loads(f.attrs["cache_args"])
            reason = str(f.attrs.get("compute_reason", "recorded"))
    except (OSError, KeyError, ValueError):
        return None
    return Precision(args["compute_dtype"], f"resumed a cache started with {reason}")


def owned_cache(path: Path) -> set[str] | None:
    """``set()`` when ``path`` is a SPAR-Bench feature cache (complete or not, or a start killed
    while it wrote its header), else None."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            ours = "cache_args" in f.attrs or (not len(f.keys()) and "schema_version" in f.attrs)
            return set() if ours else None
    except OSError:
        return None


def _interrupted_header(f, header: Iterable[str]) -> bool:
    """A start killed while it wrote the header: no data yet, and only header attributes
    (``cache_args``, written last, marks the header whole)."""
    return not len(f.keys()) and set(f.attrs) <= set(header)


def _check_args(f, path: Path, args: dict[str, Any], header: Iterable[str]) -> bool:
    """True when ``f`` already holds a cache of ``args`` (resume); refuses a different one.
    An empty file, or one whose header write was interrupted, is False: the header is rewritten."""
    old = f.attrs.get("cache_args")
    if old is None:
        if not _interrupted_header(f, header):
            raise ConfigError(f"{path}: exists and is not a SPAR-Bench cache; choose another --out")
        return False
    old = json.loads(old)
    if old != args:
        diff = sorted(k for k in set(old) | set(args) if old.get(k) != args.get(k))
        state = "complete" if f.attrs.get("complete") else "partial"
        raise ConfigError(
            f"{path}: a {state} cache made with other arguments (differs in: {', '.join(diff)}); "
            "rerun with the original arguments to resume, pass --overwrite, or choose another --out"
        )
    return True


Item = tuple[str, str, int, int]  # (level, split, first row, end row) of one batch


def _plan(build, data, levels: Sequence[str] | None, splits: Sequence[str] | None) -> list[tuple[str, str]]:
    """The (level, split) pairs to cache, in the build's order."""
    levels = list(levels) if levels else build.levels()
    plan = []
    for lv in levels:
        have = build.splits(lv)  # raises ConfigError naming the build for an unknown level
        chosen = [s for s in have if s in splits] if splits else have
        if splits and not chosen:
            raise ConfigError(f"{data}: {lv} has none of the splits {', '.join(splits)}; it has {', '.join(have)}")
        plan += [(lv, s) for s in chosen]
    return plan


def match_plan(plan: list[tuple[str, str]], spec, data, explicit: bool) -> list[tuple[str, str]]:
    """The plan's levels the encoder can read: a 3-D encoder the volume levels (Level 4), a 2-D
    one the others. A level named with ``--levels`` that the encoder cannot read is a one-line
    error; without ``--levels`` the others are left out (a 2-D cache of a build with Level 4
    is the cache of its Levels 1-3)."""
    volume = bool(spec.volumetric)
    wrong = sorted({lv for lv, _ in plan if LEVEL_SPECS[lv].volume != volume})
    kind, other = ("3-D", "volumes (Level 4)") if volume else ("2-D", "images (Levels 1-3)")
    if wrong and explicit:
        raise ConfigError(f"{data}: encoder {spec.name} is {kind}: it encodes {other} only, not "
                          f"{', '.join(wrong)}; drop {', '.join(wrong)} from --levels")
    kept = [(lv, sp) for lv, sp in plan if LEVEL_SPECS[lv].volume == volume]
    if not kept:
        raise ConfigError(f"{data}: encoder {spec.name} is {kind}: it encodes {other} only, and the "
                          f"build has none ({', '.join(sorted({lv for lv, _ in plan}))})")
    return kept


def token_grid_record(spec, storage: TokenStorage, layers: list[int], plan) -> dict[str, Any]:
    """A 3-D encoder's cache attribute ``token_grid``: the (D', H', W') grid of every cached
    layer's patch tokens as STORED (after ``--token-grid``), what token heads build their 3-D
    position embeddings from (:meth:`~.features.FeatureCache.token_grid`)."""
    grids = {}
    for v in layers:
        g = spec.layer_grid(v)
        grids[str(v)] = [storage.grid] * 3 if storage.grid is not None else [int(x) for x in g]
    return {"levels": sorted({lv for lv, _ in plan}), "n_prefix": int(spec.n_prefix), "layers": grids,
            "order": "n_prefix tokens, then the grid (D', H', W') = (z, row, col) row-major, z slowest"}


def _pending_items(f, build, plan: list[tuple[str, str]], batch: int,
                   ranks: Ranks = Ranks(), rows: Any = None) -> list[Item]:
    """Create each split's ``key``/``done`` datasets once; this rank's batches still to encode.

    Batches are numbered over the whole plan, so which rank owns a batch never depends on
    what is already done.
    """
    import h5py

    items: list[Item] = []
    index = 0
    for lv, sp in plan:
        n = _count(build, rows, lv, sp)
        g = f.require_group(f"{lv}/{sp}")
        if "done" not in g:  # ``done`` is made last: a ``key`` without it is a killed start's
            if "key" in g:
                del g["key"]
            keys = build.read(lv, sp, ["key"])["key"] if rows is None else rows.keys[sp]
            g.create_dataset("key", data=np.asarray(keys, dtype=object), dtype=h5py.string_dtype())
            g.create_dataset("done", shape=(n,), dtype=bool, fillvalue=False)
        done = g["done"][()]
        for lo in range(0, n, batch):
            hi = min(lo + batch, n)
            if ranks.owns(index) and not done[lo:hi].all():
                items.append((lv, sp, lo, hi))
            index += 1
    return items


def _finish(f, path: Path, plan: list[tuple[str, str]], batch: int, ranks: Ranks) -> None:
    """Check every row this process owns is written, then mark the file complete."""
    owned = 0
    for lv, sp in plan:
        done = f[f"{lv}/{sp}/done"][()]
        for lo in range(0, len(done), batch):
            if ranks.owns(owned) and not done[lo:lo + batch].all():
                raise IntegrityError(f"{path}: {lv}/{sp} has unwritten rows after the run; rerun to resume")
            owned += 1
    if ranks.distributed:
        f.attrs["part_rank"], f.attrs["part_world"], f.attrs["part_complete"] = ranks.rank, ranks.world, True
    else:
        f.attrs["complete"] = True
    f.flush()


def _store_batch(f, item: Item, res: dict, *, dtype: str, where: str,
                 host: dict | None = None) -> None:
    """Check one batch's features in the storage dtype, write them, set ``done``, flush.

    ``res``: ``{layer: {"tokens", "pooled"[, "token_scale"]}}`` (:func:`_reduced`). ``host``:
    the same already on the host in the storage dtype (:class:`~.streams.HostCopy`); None:
    copied here (:func:`_to_host`). Float arrays are cast on the device (half the bytes to
    copy for fp16; IEEE rounding is the same as numpy's); int8 tokens and their float32
    scales are written as they are. ``done`` is set only after the features are written.
    """
    lv, sp, lo, hi = item
    g = f[f"{lv}/{sp}"]
    n = g["done"].shape[0]
    if host is None:
        host = {v: {k: _to_host(k, t, dtype) for k, t in arrays.items()} for v, arrays in res.items()}
    for v, arrays in res.items():
        if not all(np.isfinite(a).all() for a in host[v].values() if a.dtype.kind == "f"):
            _non_finite(arrays, where, v, item, dtype)
        name = f"layer{v}"
        if name not in g or any(k not in g[name] for k in host[v]):  # new, or a killed start's
            _create_layer(g.require_group(name), n, host[v])
        for k, a in host[v].items():
            g[name][k][lo:hi] = a
    g["done"][lo:hi] = True
    f.flush()


def _storage_tensor(name: str, t, dtype: str):
    """One array of a batch, still where it is, in the dtype it is stored in."""
    import torch

    if t.dtype == torch.int8 or name == "token_scale":
        return t
    return t.to(torch.float16 if dtype == "fp16" else torch.float32)


def _to_host(name: str, t, dtype: str) -> np.ndarray:
    """One array of a batch on the host, in the dtype it is stored in."""
    return _storage_tensor(name, t, dtype).cpu().numpy()


def _non_finite(arrays: dict, where: str, v: int, item: Item, dtype: str) -> None:
    import torch

    lv, sp, lo, hi = item
    own = not all(bool(torch.isfinite(t).all()) for t in arrays.values() if t.is_floating_point())
    raise IntegrityError(
        f"{where} layer {v} gave non-finite features for {lv}/{sp} rows {lo}..{hi - 1}"
        + (" (the encoder itself output NaN or inf, before storage: check its weights and "
           "inputs, or --compute fp32)" if own else " (fp16 overflow of its finite output: use --dtype fp32)")
    )


def _create_layer(lg, n: int, host: dict[str, np.ndarray]) -> None:
    """A layer's datasets that ``lg`` lacks: tokens (and their int8 scales) one row per chunk;
    pooled ~1 MB chunks. Rows are written after, and marked in ``done`` last."""
    for k, a in host.items():
        if k in lg:
            continue
        if k == "pooled":
            rows_per_mb = max(1, (1 << 20) // (a.shape[1] * a.dtype.itemsize))
            lg.create_dataset(k, shape=(n, a.shape[1]), dtype=a.dtype, chunks=(min(n, rows_per_mb), a.shape[1]))
        else:
            lg.create_dataset(k, shape=(n, *a.shape[1:]), dtype=a.dtype, chunks=(1, *a.shape[1:]))


def check_space(path: Path, res: dict, item: Item, rows: int, dtype: str) -> None:
    """Refuse at once when the rows still to write certainly cannot fit on the disk of ``path``.

    The features are stored uncompressed, so the first batch gives their bytes per row:
    a lower bound of what the file grows by (HDF5 adds its chunk index and metadata, about
    20% for small features). A lower bound refuses only what cannot fit; a run that fails
    later for lack of space stops cleanly with the file as at its last batch
    (:func:`~spar_bench.h5files.open_h5`), and the rerun resumes.
    """
    import shutil

    import torch

    from spar_bench.outputs import DiskFullError

    floats = np.dtype(STORAGE_DTYPES[dtype]).itemsize
    n = max(item[3] - item[2], 1)
    per_row = sum(t.numel() * (1 if t.dtype == torch.int8 else 4 if k == "token_scale" else floats) / n
                  for arrays in res.values() for k, t in arrays.items())
    need, free = int(per_row * rows), shutil.disk_usage(path.parent).free
    if need > free:
        raise DiskFullError(
            f"{path}: the {rows} rows still to write need at least {_size(need)} but only "
            f"{_size(free)} are free on that disk; free space (or choose another --out) "
            "and rerun the same command (it resumes)"
        )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


#: batches handed to the writer thread that may wait for it (bounded: memory stays bounded)
WRITE_QUEUE = 2


class _Writer:
    """Stores batches in their order: in ONE background thread, at most :data:`WRITE_QUEUE`
    of them waiting (``background``), or at once in the calling thread. Nothing is stored
    after a failed store (queued batches are skipped, not raced against ``close``); it
    surfaces in the caller at its next :meth:`put` or at :meth:`drain`, the same exception.
    With a stopwatch: ``write`` is the store's own time, ``write wait`` the caller's wait for
    it (with no thread, both are the store's time)."""

    def __init__(self, store: Callable[[Item, Any], None], background: bool, stopwatch: Stopwatch | None):
        self.store, self.sw = store, stopwatch
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-writer") if background else None
        self.pending: deque = deque()
        self.failed = False  # set by the writer thread itself, before the next queued batch starts

    def _timed_store(self, item: Item, payload: Any) -> None:
        if self.failed:  # a batch after a failed one is never stored (the rerun redoes both)
            return
        t0 = time.perf_counter()  # no device sync here: HostCopy.wait waits for its batch alone
        try:
            self.store(item, payload)
        except BaseException:
            self.failed = True
            raise
        if self.sw is not None:
            self.sw.add("write", time.perf_counter() - t0)

    def put(self, item: Item, payload: Any) -> None:
        if self.pool is None:
            with timed(self.sw, "write wait"):
                self._timed_store(item, payload)
            return
        while self.pending and self.pending[0].done():  # surface a failed write at once
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._timed_store, item, payload))
        with timed(self.sw, "write wait"):
            while len(self.pending) > WRITE_QUEUE:
                self.pending.popleft().result()

    def drain(self) -> None:
        """Wait for every batch handed over (the first failure raised)."""
        if self.pool is None:
            return
        with timed(self.sw, "write wait"):
            while self.pending:
                self.pending.popleft().result()

    def close(self) -> None:
        """Drop the batches not yet started; wait for the one being written (the file stays
        as after whole batches: ``done`` is set after a batch's rows, flushed with them)."""
        for fut in self.pending:
            fut.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _encode_items(f, job: _Job, items: list[Item], reduce: Reducer) -> None:
    """Encode ``items`` and store them, reads, copies, compute and writes overlapping.

    One DataLoader (one set of reader workers) serves every level and split. On CUDA the
    next batch's images go to the device on a side stream during the current forward, and
    the features come back on another (:mod:`.streams`). One writer thread stores batch k
    while batch k+1 is encoded (``job.async_writes``; off: in this thread, the same bytes).
    """
    from tqdm.auto import tqdm

    from .streams import HostCopy, side_stream

    dev, sw = job.dev, job.stopwatch
    down = side_stream(dev)

    def store(item: Item, payload: tuple[dict, HostCopy]) -> None:
        res, copy = payload
        _store_batch(f, item, res, dtype=job.dtype, where=job.where, host=copy.wait())
        if job.on_batch is not None:
            job.on_batch(*item)

    def convert(name: str, t):
        return _storage_tensor(name, t, job.dtype)

    bar = tqdm(total=sum(hi - lo for _, _, lo, hi in items), desc=job.desc, unit="img",
               disable=not job.progress, dynamic_ncols=True)
    t0, seen = time.perf_counter(), 0
    writer = _Writer(store, job.async_writes, sw)
    n_procs = cpu_processes(job, items)
    try:
        for item, res in (_pooled(job, items, reduce, n_procs) if n_procs > 1 else _here(job, items, reduce)):
            check_stop()  # a swallowed SIGTERM: the file keeps the batches written (a rerun resumes)
            if not seen:
                check_space(Path(f.filename), res, item, sum(hi - lo for _, _, lo, hi in items), job.dtype)
            with timed(sw if down is not None else None, "d2h"):  # CUDA: the cast; the copy queued
                copy = HostCopy(res, convert, down)
            writer.put(item, (res, copy))
            seen += item[3] - item[2]
            bar.update(item[3] - item[2])
            bar.set_postfix_str(f"{seen / max(time.perf_counter() - t0, 1e-9):.1f} img/s")
        writer.drain()
    finally:
        writer.close()
        bar.close()


def _here(job: _Job, items: list[Item], reduce: Reducer) -> Iterator[tuple[Item, dict]]:
    """``(item, features)`` of each batch, encoded in this process (on the CPU at one thread:
    the bits of a CPU cache do not depend on the machine's thread count)."""

    from .streams import device_batches

    dev, sw = job.dev, job.stopwatch
    with _one_thread(dev):
        for got, images in device_batches(_loader(job, items), dev, sw):
            if sw is not None:
                sw.add("read", got[2][0])
                sw.add("collate", got[2][1])
            item = items[int(got[0])]
            with timed(sw, "forward"):  # the encoder (under autocast) and the token reductions
                with _autocast(dev.type, job.comp):
                    res = _encode(job.enc, item[0], images, job.layers, job.tile_encoding, _texts(job.rows, item))
                res = reduce(item[0], res)
            yield item, res


@contextmanager
def _one_thread(dev) -> Iterator[None]:
    """On the CPU, torch at one thread for the block (its thread count restored after)."""
    import torch

    if getattr(dev, "type", "cpu") != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _autocast(device_type: str, comp: str):
    """The encoder's autocast for compute ``comp`` (``bf16``/``fp16``; ``fp32``: off): one rule for
    this process's batches, a pool process's and the PCA's sample, so all three are the same bits."""
    import torch

    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(comp)
    return torch.autocast(device_type, dtype=amp or torch.float32, enabled=amp is not None)


#: a CPU cache is split over processes only when each gets at least this many batches and
#: images: a process costs about 4 CPU-s to start (importing torch and timm, unpickling the
#: encoder), which :func:`_pool_ahead` overlaps with this process's load of the encoder, so on
#: idle cores it costs little wall time; on busy ones it is CPU the others lose
MIN_BATCHES_PER_PROCESS = 4
MIN_IMAGES_PER_PROCESS = 128
#: batches handed to the processes ahead of the one being written, per process
AHEAD_PER_PROCESS = 2
#: batches held encoded but not yet written, per process (memory: a batch of full tokens of a
#: ViT-B at 64 images is about 40 MB)
HELD_PER_PROCESS = 4


def usable_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_processes(job: _Job, items: list[Item]) -> int:
    """How many 1-thread processes encode this CPU cache: ``CacheOptions.processes`` (None: one
    per usable core), at most one per :data:`MIN_BATCHES_PER_PROCESS` batches and
    :data:`MIN_IMAGES_PER_PROCESS` images; 1 (this process)
    on CUDA, under torchrun and for a question cache (its encoder holds the questions)."""
    if job.dev.type != "cpu" or job.ranks.distributed or job.rows is not None:
        return 1
    return _processes_for(job.processes, sum(hi - lo for _, _, lo, hi in items), len(items))


def _processes_for(asked: int | None, images: int, batches: int) -> int:
    """1-thread CPU processes for ``images`` in ``batches``: ``asked`` (None: a core each), at most
    one per :data:`MIN_BATCHES_PER_PROCESS` batches and :data:`MIN_IMAGES_PER_PROCESS` images."""
    asked = asked if asked is not None else usable_cores()
    return max(1, min(asked, batches // MIN_BATCHES_PER_PROCESS, images // max(MIN_IMAGES_PER_PROCESS, 1)))


@contextmanager
def _pool_ahead(data: str | Path, opts: CacheOptions) -> Iterator[Any]:
    """The CPU cache's other 1-thread processes (a :func:`~spar_bench.procs.process_pool`),
    started before this process loads the encoder, so that their start (an interpreter, torch,
    the encoders' modules: 1-2 s each) overlaps the load instead of the first batches; ``None``
    where the build's plan (before a resume's done rows are known) runs in this process alone:
    on CUDA, under torchrun, for a question cache, or too few images (:func:`_processes_for`)."""
    from spar_bench.builder.shards import Build
    from spar_bench.procs import process_pool

    n = 1
    if opts.probe is None and not Ranks.from_env().distributed and pick_device(opts.device).type == "cpu":
        build = Build(data)
        counts = [_count(build, None, lv, sp) for lv, sp in _plan(build, data, opts.levels, opts.splits)]
        n = _processes_for(opts.processes, sum(counts), sum(-(-c // opts.batch_size) for c in counts))
    if n < 2:
        yield None
        return
    with process_pool(n - 1, stateless=True) as pool:
        for _ in range(n - 1):  # each submit starts one process
            pool.submit(_warm_worker)
        yield pool


def _warm_worker() -> None:
    """A pool process's start, while the parent loads the encoder: torch at one thread and the
    encoders' modules imported (what unpickling the encoder needs)."""
    import timm  # noqa: F401  (a core dependency; 1-2 s to import)
    import torch

    from . import encoders  # noqa: F401

    torch.set_num_threads(1)


def _pooled(job: _Job, items: list[Item], reduce: Reducer, n_procs: int) -> Iterator[tuple[Item, dict]]:
    """``(item, features)`` of each batch in order, encoded by ``n_procs`` processes at one
    thread each: this one and ``n_procs - 1`` others (``job.pool``, started ahead, or a pool of
    its own). Batches are handed out from the front (:func:`_in_order`), so a process that
    starts late or a small batch balances itself. Each process reads its own batches, so
    reading overlaps the others' forwards. The features are the same bits whoever encodes
    them (:class:`_Encoding`, one function for all), so the file is the same bytes."""
    import os
    import tempfile

    from spar_bench.procs import process_pool

    encoding = _Encoding(job.enc, job.build, job.layers, job.tile_encoding, reduce, job.comp)
    fd, payload = tempfile.mkstemp(prefix="spar-cache-", suffix=".pkl")
    try:
        try:
            with os.fdopen(fd, "wb") as fh:
                pickle.dump(encoding, fh)
        except (pickle.PicklingError, AttributeError, TypeError):  # an encoder that cannot leave this
            yield from _here(job, items, reduce)  # process (hooks of a transformers model): the same bytes here
            return
        with (nullcontext(job.pool) if job.pool is not None else process_pool(n_procs - 1, stateless=True)) as pool, \
                _one_thread(job.dev):
            yield from _in_order(items, encoding, partial(pool.submit, _encode_in_worker, payload), n_procs,
                                 job.stopwatch)
    finally:
        os.unlink(payload)


def _in_order(items: list[Item], encoding: _Encoding, submit: Callable[[Item], Future], n_procs: int,
              sw: Stopwatch | None) -> Iterator[tuple[Item, dict]]:
    """``(item, features)`` in order, the batches handed out by a :class:`_Dispatch`: to the other
    processes (``submit``) by its thread, and to this process while the next batch to yield is
    still being encoded elsewhere."""
    with _Dispatch(items, submit, AHEAD_PER_PROCESS * (n_procs - 1), HELD_PER_PROCESS * n_procs) as plan:
        for i, item in enumerate(items):
            while (j := plan.mine(i)) is not None:  # the next batch is not ready: encode the front one here
                with timed(sw, "forward"):
                    plan.put(j, encoding(items[j]))
                check_stop()  # a swallowed SIGTERM: stop after this batch, as the one-process loop does
            got = plan.take(i)
            if isinstance(got, Future):
                with timed(sw, "forward"):  # the wait for another process
                    got = got.result()
            yield item, got


class _Dispatch:
    """Which process encodes which batch of a pooled CPU cache: batches go from the front of
    ``items``, to the other processes by a thread of this one (so their queues refill at once,
    also while this process encodes a batch), ``window`` in flight, and to this process
    (:meth:`mine`) when the batch it must write next is not ready. At most ``bound`` batches
    are held encoded or in flight but not yet written (memory). Who encodes a batch does not
    change its bits (:class:`_Encoding`)."""

    def __init__(self, items: list[Item], submit: Callable[[Item], Future], window: int, bound: int) -> None:
        self.items, self.submit, self.window, self.bound = items, submit, window, bound
        self.todo: deque[int] = deque(range(len(items)))
        self.held: dict[int, Any] = {}  # index -> a Future, None (being encoded here), or features
        self.flying: set[Future] = set()
        self.cond = threading.Condition()
        self.stopped, self.error = False, None
        self.thread = threading.Thread(target=self._run, name="cache-dispatch", daemon=True)

    def __enter__(self) -> _Dispatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.flying = {f for f in self.flying if not f.done()}
                    while (not self.stopped and self.todo and len(self.flying) < self.window
                           and len(self.held) < self.bound):
                        j = self.todo.popleft()
                        self.held[j] = fut = self.submit(self.items[j])
                        self.flying.add(fut)
                    if self.stopped or not (self.todo or self.flying):
                        return
                    flying = set(self.flying)
                    if not flying:  # everything held: wait for a batch to be written
                        self.cond.wait(0.2)
                        continue
                wait(flying, timeout=0.2, return_when=FIRST_COMPLETED)
        except BaseException as e:  # the pool broke: this process reports it, at its next batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def mine(self, i: int) -> int | None:
        """The index of a batch for this process to encode now, or None: batch ``i`` is ready, or
        nothing more may be taken."""
        with self.cond:
            if self.error is not None:
                raise self.error
            got = self.held.get(i, ...)
            busy = isinstance(got, Future) and not got.done()
            if (got is ... or busy) and self.todo and len(self.held) < self.bound:
                j = self.todo.popleft()  # i itself when it was not handed out yet
                self.held[j] = None
                return j
            return None

    def put(self, j: int, features: dict) -> None:
        with self.cond:
            self.held[j] = features

    def take(self, i: int) -> Any:
        """Batch ``i``: its features, or the Future that will hold them."""
        with self.cond:
            while i not in self.held:  # every slot held: the thread hands it out after this take
                if self.error is not None:
                    raise self.error
                self.cond.wait(0.2)
            got = self.held.pop(i)
            self.cond.notify_all()
            return got


class _Encoding(NamedTuple):
    """What encoding one CPU batch needs, pickled once for the pool's processes; calling it
    encodes a batch (this process's and theirs: one function, the same bits)."""

    enc: Any
    build: Any
    layers: list[int]
    tile_encoding: str
    reduce: Reducer
    comp: str

    def __call__(self, item: Item) -> dict:
        import torch

        lv, sp, lo, hi = item
        images = torch.from_numpy(np.ascontiguousarray(_images(self.build, None, lv, sp, lo, hi)))
        with torch.no_grad(), _autocast("cpu", self.comp):
            return self.reduce(lv, _encode(self.enc, lv, images, self.layers, self.tile_encoding))


_WORKER: dict[str, Any] = {}  # a pool process's _Encoding, loaded once from the payload


def _encode_in_worker(payload: str, item: Item) -> dict:
    """One batch's reduced features in a pool process (:func:`_pooled`), at one thread."""
    import torch

    if _WORKER.get("payload") != payload:
        torch.set_num_threads(1)
        with open(payload, "rb") as fh:
            _WORKER.update(payload=payload, encoding=pickle.load(fh))
    return _WORKER["encoding"](item)


def _loader(job: _Job, items: list[Item]):
    """The one DataLoader of the run: reader workers, pinned memory on CUDA."""
    import torch

    from spar_bench.procs import init_loader_worker

    return torch.utils.data.DataLoader(
        _Batches(job.build, items, timed=job.stopwatch is not None, rows=job.rows), batch_size=None, shuffle=False,
        num_workers=job.workers, pin_memory=job.dev.type == "cuda", prefetch_factor=4 if job.workers else None,
        worker_init_fn=init_loader_worker,
    )


def _encode(enc, level: str, images, layers: list[int], tile_encoding: str,
            texts: tuple[str, ...] | None = None) -> dict:
    """``{layer: (tokens, pooled)}`` of one batch; ``per-tile`` encodes Levels 1-2 tile by tile;
    ``texts``: a question cache's user messages, one per image (:meth:`MllmEncoder.asking`)."""
    if texts is not None:
        with enc.asking(texts):
            return enc(images, layers)
    if tile_encoding == "per-tile" and level in TILED_LEVELS:
        from spar_bench.builder.schema import TILE_GRID

        from .encoders.base import encode_tiles

        return encode_tiles(enc, images, layers, TILE_GRID)
    return enc(images, layers)


@dataclass(frozen=True)
class CacheOptions:
    """What a user chooses for one cache: ``spar-probe cache``'s options, checked on construction
    (the one-line ConfigErrors of :func:`_check_options`, ``--tile-encoding`` and ``--layers``).

    ``levels``/``splits``: None (or empty) for all of the build's. ``layers``: ints or the CLI's
    ``"-1,-4"`` (kept as a tuple of ints). ``loader_workers``: DataLoader workers (None: 2 on
    CUDA, 0 on the CPU). ``token_storage``: the reductions of the stored tokens
    (:mod:`.token_storage`; None: full tokens). ``tile_encoding``: :data:`TILE_ENCODINGS`.
    ``async_writes``: batches stored by one writer thread while the next are encoded (default),
    or in the encoding loop; the file is the same byte for byte (not recorded, not in
    ``cache_args``: a cache resumes either way). ``probe``: the one probe a question stage
    (``mllm:DIR@llm:N+q``) is cached for, a row per question (:mod:`.question_rows`; recorded
    through the encoder's spec); refused for any other encoder.

    ``weights``, ``random_init`` and ``revision`` are how :func:`~.encoders.load_encoder` loads
    the encoder (unused when the caller passes an ``encoder_obj``). They stay here rather than in
    a record of their own: they are chosen on the same command line as the rest, what they
    loaded is recorded through the encoder's spec (not as options), and a second record would be
    one more parameter of :func:`write_cache` for three fields.
    """

    levels: Sequence[str] | None = None
    splits: Sequence[str] | None = None
    layers: tuple[int, ...] | Sequence[int] | str = (-1,)  # a tuple of ints once constructed
    device: str = "auto"
    batch_size: int = 64
    dtype: str = "fp16"
    compute: str = limited("auto", choices=COMPUTE_DTYPES)
    loader_workers: int | None = limited(None, lo=0, flag="--loader-workers")
    tile_encoding: str = "mosaic"
    token_storage: TokenStorage | None = None
    overwrite: bool = False
    weights: str | None = None
    random_init: bool = False
    revision: str | None = None
    model_args: dict[str, Any] | None = None  # --model-args: the constructor's (timm:, monai:)
    async_writes: bool = True  # one writer thread; False: writes in the loop (the same bytes)
    probe: str | None = None  # --probe: the probe whose questions a question stage (llm:N+q) reads
    processes: int | None = limited(None, lo=1, flag="processes")  # CPU: 1-thread processes (None: a core each)

    def __post_init__(self) -> None:
        _check_options(self.dtype, self.batch_size, self.loader_workers)
        check_fields(self)
        if self.tile_encoding not in TILE_ENCODINGS:
            raise ConfigError(f"--tile-encoding must be one of {', '.join(TILE_ENCODINGS)}; "
                              f"got {self.tile_encoding!r}")
        object.__setattr__(self, "layers", tuple(parse_layers(self.layers)))
        for name in ("levels", "splits"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))


def cache_options(*, levels: str | Sequence[str] | None = None, splits: str | Sequence[str] | None = None,
                  model_args: str | dict[str, Any] | None = None, token_grid: int | None = None,
                  token_proj: str | None = None, token_int8: bool = False, **fields: Any) -> CacheOptions:
    """:class:`CacheOptions` from ``spar-probe cache``'s values, as the CLI and an experiment give
    them: ``levels``/``splits`` comma lists or lists, ``model_args`` JSON text or a mapping (kept
    with sorted keys), the token reductions as three values (:meth:`TokenStorage.parse`), and
    every other :class:`CacheOptions` field by name."""
    from .finetune.encoding import parse_model_args

    def names(v: str | Sequence[str] | None) -> list[str] | None:
        items = v.split(",") if isinstance(v, str) else list(v or ())
        return [x.strip() for x in items if str(x).strip()] or None

    if isinstance(model_args, dict):
        model_args = json.dumps(model_args, sort_keys=True)
    if isinstance(fields.get("layers"), int):  # one layer, as a number
        fields["layers"] = (fields["layers"],)
    return CacheOptions(levels=names(levels), splits=names(splits), model_args=parse_model_args(model_args),
                        token_storage=TokenStorage.parse(token_grid, token_proj, token_int8), **fields)


@dataclass(frozen=True)
class _Job:
    """One process's resolved cache run, what every stage reads: the build and its plan, the
    encoder on its device, the checked layers, the compute precision, the DataLoader workers,
    the file this process writes (``target``: a part under torchrun) and how it reports."""

    build: Any
    plan: list[tuple[str, str]]
    enc: Any
    layers: list[int]
    dev: Any  # torch.device
    precision: Precision
    dtype: str
    workers: int
    batch: int
    tile_encoding: str
    storage: TokenStorage
    ranks: Ranks
    target: Path
    progress: bool = True
    on_batch: Callable[[str, str, int, int], None] | None = None
    stopwatch: Stopwatch | None = None  # times the stages of the encoding loop (bench/cache.py)
    async_writes: bool = True  # CacheOptions.async_writes
    rows: Any = None  # a question cache's rows (:class:`~.question_rows.QuestionRows`), else None
    processes: int | None = None  # CacheOptions.processes
    pool: Any = None  # the other CPU processes, started before the encoder loaded (:func:`_pool_ahead`)

    @property
    def comp(self) -> str:
        return self.precision.dtype

    @property
    def where(self) -> str:
        return f"{self.target}: {self.enc.spec.name}"

    @property
    def desc(self) -> str:
        return self.enc.spec.name

    def cache_args(self) -> dict[str, Any]:
        """The recorded ``cache_args``: what a resumed run must match."""
        spec = self.enc.spec
        args = {
            "encoder": spec.name, "encoder_config": spec.to_dict(), "layers": self.layers,
            "dtype": self.dtype, "compute_dtype": self.comp, "dataset_fingerprint": self.build.fingerprint,
            "plan": [list(p) for p in self.plan],
        }
        if self.tile_encoding == "per-tile":  # recorded only when asked: older mosaic caches still resume
            args["tile_encoding"] = self.tile_encoding
        if not self.storage.identity:  # likewise: full-token caches keep their arguments
            args["token_storage"] = self.storage.to_dict()
        return args


def write_cache(
    encoder: str,
    data: str | Path,
    out: str | Path,
    options: CacheOptions | None = None,
    *,
    progress: bool = True,
    encoder_obj: Any = None,
    on_batch: Callable[[str, str, int, int], None] | None = None,
    stopwatch: Stopwatch | None = None,
) -> Path:
    """Write (or resume) the feature cache of ``encoder`` over the build ``data`` at ``out``.

    ``options``: :class:`CacheOptions` (default: all of them at their defaults). ``encoder_obj``
    lets a caller pass an already-built :class:`spar_bench.probes.encoders.base.Encoder` (its
    spec is what gets recorded). ``on_batch(level, split, lo, hi)`` is called after each batch
    is flushed. ``stopwatch`` (:class:`~.stopwatch.Stopwatch`) adds the seconds of each stage of
    the encoding loop to it; the cache is the same with or without. Returns ``out``.
    """
    from spar_bench.locks import output_lock
    from spar_bench.outputs import check_target, claim, disk_full_is_an_error, remove

    from .encoders import check_encoder_name

    opts = options if options is not None else CacheOptions()
    if encoder_obj is None:
        check_encoder_name(encoder)  # names first: a typo is named before any file is read
    out = Path(out)
    check_target(out, inputs=[data], folder=False)  # before any work
    if opts.overwrite and out.exists():
        claim(out, overwrite=True, owned=owned_cache, what="feature cache")
    with _pool_ahead(data, opts) as pool:  # its start overlaps the encoder's load
        job = replace(_start(encoder, data, out, opts, encoder_obj, progress, on_batch), stopwatch=stopwatch,
                      pool=pool)
        with disk_full_is_an_error(job.target, rerun="rerun the same command (it resumes)"), \
                output_lock(job.target, what="feature cache (spar-probe cache)"):
            if opts.overwrite and claim(out, overwrite=True, owned=owned_cache, what="feature cache"):
                remove(out)  # checked again under the lock: another writer may have changed it
            out.parent.mkdir(parents=True, exist_ok=True)
            _write_locked(out, job, data)
    return out


def _start(encoder: str, data: str | Path, out: Path, opts: CacheOptions, encoder_obj: Any,
           progress: bool, on_batch: Callable[[str, str, int, int], None] | None) -> _Job:
    """The build, its plan and the encoder on its device: the run resolved, before any write."""
    from spar_bench.builder.shards import Build

    from .encoders import load_encoder, takes_model_args

    build = Build(data)
    plan = _plan(build, data, opts.levels, opts.splits)
    if opts.probe is not None:  # named before the encoder loads
        from .question_rows import question_probe

        question_probe(opts.probe)
    if opts.model_args and encoder_obj is None and not takes_model_args(encoder):
        raise ConfigError(f"encoder {encoder}: --model-args apply to timm: and monai: encoders (and astra-ct) only")
    enc = encoder_obj if encoder_obj is not None else load_encoder(
        encoder, weights=opts.weights, random_init=opts.random_init, revision=opts.revision,
        **({"model_kwargs": dict(opts.model_args)} if opts.model_args else {}))
    plan = match_plan(plan, enc.spec, data, explicit=bool(opts.levels))
    rows, plan = _question_plan(enc, build, plan, opts.probe, data)
    layers = enc.check_layers(list(opts.layers))
    ranks = Ranks.from_env()
    storage = opts.token_storage or TokenStorage()
    if ranks.distributed and storage.proj is not None:
        raise ConfigError("--token-proj is not supported under torchrun yet (each rank would fit its own "
                          "map); make the cache in one process, or use --token-grid/--token-int8")
    dev, workers = _place(enc, opts.device, ranks, opts.loader_workers)
    target = part_path(out, ranks) if ranks.distributed else out  # the file this process writes
    # a resumed file keeps its precision; --overwrite starts over, so it chooses afresh
    precision = (not opts.overwrite and _resumed_precision(target, opts.compute)) or pick_compute(opts.compute, dev)
    spec = enc.spec
    storage.check_encoder(spec.n_prefix, spec.grid, spec.dim or 0, f"{out}: {spec.name}")
    return _Job(build=build, plan=plan, enc=enc, layers=layers, dev=dev, precision=precision,
                dtype=opts.dtype, workers=workers, batch=opts.batch_size, tile_encoding=opts.tile_encoding,
                storage=storage, ranks=ranks, target=target, progress=progress, on_batch=on_batch,
                async_writes=opts.async_writes, rows=rows, processes=opts.processes)


def _question_plan(enc, build, plan: list[tuple[str, str]], probe: str | None, data) -> tuple[Any, list]:
    """``(rows, plan)``: an encoder that reads each image's question (``mllm:DIR@llm:N+q``) is
    cached for one probe (``--probe``), a row per question of its level's splits in ``plan``
    (:mod:`.question_rows`; recorded in its spec); any other encoder ``(None, plan)``."""
    if not getattr(enc, "asks", False):
        if probe is not None:
            raise ConfigError(f"encoder {enc.spec.name}: --probe applies to the question stages "
                              "(mllm:DIR@llm:N+q) only; drop it")
        return None, plan
    if probe is None:
        raise ConfigError(f"encoder {enc.spec.name}: a question stage is cached for one probe's questions; "
                          "pass --probe (e.g. --probe level3.size)")
    from .question_rows import question_probe, question_rows

    level = question_probe(probe).level
    kept = [(lv, sp) for lv, sp in plan if lv == level]
    if not kept:
        raise ConfigError(f"{data}: --probe {probe} asks about {level}, which this cache would not hold "
                          f"(levels: {', '.join(sorted({lv for lv, _ in plan}))})")
    rows = question_rows(build, probe, [sp for _, sp in kept])
    enc.ask(rows)
    return rows, [(lv, sp) for lv, sp in kept if sp in rows.keys]


def _check_options(dtype: str, batch_size: int, loader_workers: int | None) -> None:
    """One-line errors for ``--dtype``, ``--batch-size`` and ``--loader-workers``, before any work."""
    if dtype not in STORAGE_DTYPES:
        raise ConfigError(f"--dtype must be fp16 or fp32; got {dtype!r}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1; got {batch_size}")
    if loader_workers is not None and loader_workers < 0:
        raise ConfigError(f"--loader-workers must be >= 0 (0 reads shards in the main process); got {loader_workers}")


def _place(enc, device: str, ranks: Ranks, workers: int | None):
    """``(device, workers)``: the encoder moved to its device (``cuda:LOCAL_RANK`` under torchrun;
    CNNs of timm and open_clip in channels-last) and the DataLoader workers (default: 2 on
    CUDA, 0 on the CPU)."""
    import torch

    dev = pick_device(device)
    if dev.type == "cuda" and ranks.distributed and dev.index is None:
        dev = torch.device("cuda", ranks.local_rank)
    enc.prefer_channels_last().to(dev)
    return dev, (2 if dev.type == "cuda" else 0) if workers is None else workers


def _meta(job: _Job, args: dict[str, Any], dataset_dir: str) -> dict[str, Any]:
    """The cache file's attributes, written once when it is created (docs/FORMATS.md)."""
    spec = job.enc.spec
    meta = {
        "schema_version": CACHE_SCHEMA, "encoder": spec.name,
        "encoder_config": dict(spec.to_dict(), preprocessing=spec.preprocessing()),
        "weights": spec.weights, "random_init": bool(spec.random_init), "dtype": job.dtype,
        "compute_dtype": job.comp, "compute_reason": job.precision.reason,
        "versions": package_versions(CACHE_PACKAGES),
        "dataset_fingerprint": job.build.fingerprint, "dataset_dir": dataset_dir,
        "layers": job.layers, "cache_args": json.dumps(args, sort_keys=True), "complete": False,
        "tile_encoding": job.tile_encoding, "token_storage": job.storage.to_dict(),
    }
    if job.tile_encoding == "per-tile":
        meta["tile_layout"] = tile_layout(spec)
    if spec.volumetric:
        meta["token_grid"] = token_grid_record(spec, job.storage, job.layers, job.plan)
    return meta


def _write_locked(out: Path, job: _Job, data: str | Path) -> None:
    """Fill ``job.target`` (this process's file) and, under torchrun, merge the parts into ``out``."""
    args, ranks = job.cache_args(), job.ranks
    if ranks.distributed and _is_complete(out, args):
        return  # every rank sees the same finished file
    _fill(job, args, _meta(job, args, _relative_dir(data, out)))
    if ranks.distributed:
        barrier(ranks, DIST_TIMEOUT_S)
        if ranks.rank == 0:
            from spar_bench.locks import output_lock

            # the merge writes OUT: it holds OUT's lock, as a one-process writer of OUT does
            with output_lock(out, what="feature cache (spar-probe cache)"):
                merge_parts(out, all_parts(out, ranks.world))
        barrier(ranks, DIST_TIMEOUT_S)


@contextmanager
def _open_cache(target: Path) -> Iterator[Any]:
    """``target`` open to append (:func:`~spar_bench.h5files.open_h5`: a full disk leaves it as
    at its last flush, which a rerun resumes); a file HDF5 cannot open is a ConfigError."""
    from spar_bench.h5files import open_h5
    from spar_bench.outputs import is_disk_full

    opened = False
    try:
        with open_h5(target) as f:
            opened = True
            yield f
    except OSError as e:
        if opened or is_disk_full(e):
            raise
        raise ConfigError(
            f"{target}: cannot open ({e}); if a run was killed while writing, delete it and rerun"
        ) from None


def _fill(job: _Job, args: dict[str, Any], meta: dict[str, Any]) -> None:
    """Open (or resume) ``job.target``, encode this process's pending batches, mark it finished."""
    target = job.target
    with _open_cache(target) as f:
        resumed = _check_args(f, target, args, meta)
        if resumed and (f.attrs.get("complete") or f.attrs.get("part_complete")):
            if job.progress:
                click.echo(f"{target}: already complete", err=True)
            return
        if not resumed:
            _write_header(f, meta)
        items = _pending_items(f, job.build, job.plan, job.batch, job.ranks, job.rows)
        if items:
            reducer = _reducer(job.enc, job.storage, job.tile_encoding)
            if job.storage.proj is not None:
                reducer.projections = _projections(f, job, reducer)
            _encode_items(f, job, items, reducer)
        _finish(f, target, job.plan, job.batch, job.ranks)


def _write_header(f, meta: dict[str, Any]) -> None:
    """The file's attributes, ``cache_args`` last: a file without it is a header still being
    written, which a rerun rewrites (:func:`_interrupted_header`)."""
    for k, v in meta.items():
        if k != "cache_args":
            f.attrs[k] = _attr(v)
    f.attrs["cache_args"] = meta["cache_args"]
    f.flush()


def _reducer(enc, storage: TokenStorage, tile_encoding: str) -> Reducer:
    from spar_bench.builder.schema import TILE_GRID

    tiled = TILED_LEVELS if tile_encoding == "per-tile" else ()
    return Reducer(storage, enc.spec.n_prefix, enc.spec.grid, None, tiled, TILE_GRID * TILE_GRID)


#: training images encoded to fit a PCA token projection (evenly spaced blocks of each train split)
PCA_FIT_IMAGES = 512


def _projections(f, job: _Job, reducer: Reducer) -> dict[int, Projection]:
    """``{layer: Projection}``: read from the file when a run already fitted them, else fitted
    (PCA: on training images only; random: from the encoder's name and the layer) and stored
    under ``/token_projection/layer<L>`` before the first token is written. A layer's
    ``fitted_on`` attribute, written after its arrays, marks it whole; a store killed before
    every layer had it is fitted again (no token was written with it)."""
    if "token_projection" in f:
        g = f["token_projection"]
        if all(f"layer{v}" in g and "fitted_on" in g[f"layer{v}"].attrs for v in job.layers):
            return {v: Projection(g[f"layer{v}/mean"][()], g[f"layer{v}/components"][()]) for v in job.layers}
        del f["token_projection"]
    storage, k = reducer.storage, reducer.storage.proj_dim
    if storage.proj_kind == "random":
        from spar_bench.seeding import derive_seed

        dims = {v: _layer_dim(job.enc, v, job.dev) for v in job.layers}
        name = job.enc.spec.name
        fitted = {v: Projection(*random_projection(dims[v], k, derive_seed(0, "token-projection", name, v)))
                  for v in job.layers}
    else:
        fitted = _fit_pca(job, reducer)
    for v, proj in fitted.items():
        if proj.components.shape[1] != k:
            raise ConfigError(f"{f.filename}: --token-proj {storage.proj}: layer {v} has only "
                              f"{proj.components.shape[0]} dimensions")
        g = f.require_group(f"token_projection/layer{v}")
        g.create_dataset("mean", data=proj.mean)
        g.create_dataset("components", data=proj.components)
        g.attrs["fitted_on"] = "train" if storage.proj_kind == "pca" else "seed"
    return fitted


def _layer_dim(enc, layer: int, dev) -> int:
    """The token width of ``layer`` (one forward of a blank image when the spec does not say it)."""
    import torch

    if layer == -1 and enc.spec.dim:
        return int(enc.spec.dim)
    with torch.no_grad():
        toks, _ = enc(enc.blank(1, dev), [layer])[layer]
    return int(toks.shape[-1])


def _fit_pca(job: _Job, reducer: Reducer) -> dict[int, Projection]:
    """PCA of grid-pooled tokens of about :data:`PCA_FIT_IMAGES` training images per layer."""

    build, dev = job.build, job.dev
    train = [(lv, sp) for lv, sp in job.plan if sp == "train"]
    if not train:
        raise ConfigError("--token-proj pca: the cache's plan has no train split to fit it on; "
                          "add the train split (--splits) or use random:K")
    counts = [_count(build, job.rows, lv, sp) for lv, sp in train]
    items = _sample_blocks(train, counts, job.batch, PCA_FIT_IMAGES // len(train))
    moments: dict[int, Moments] = {v: Moments() for v in job.layers}
    with _one_thread(dev):
        _pca_moments(job, reducer, items, moments)
    return {v: m.pca(reducer.storage.proj_dim) for v, m in moments.items()}


def _pca_moments(job: _Job, reducer: Reducer, items: list[Item], moments: dict[int, Moments]) -> None:
    import torch

    build, dev = job.build, job.dev
    for lv, sp, lo, hi in items:
        images = _images(build, job.rows, lv, sp, lo, hi)
        with torch.no_grad(), _autocast(dev.type, job.comp):
            res = _encode(job.enc, lv, torch.from_numpy(np.ascontiguousarray(images)).to(dev),
                          job.layers, job.tile_encoding, _texts(job.rows, (lv, sp, lo, hi)))
        for v, (toks, _) in res.items():
            moments[v].update(reducer.pool(lv, toks))


def _sample_blocks(pairs: list[tuple[str, str]], counts: list[int], batch: int, per_split: int) -> list[Item]:
    """About ``per_split`` rows of each (level, split) (``counts``: its rows), as evenly spaced
    blocks of ``batch`` rows."""
    items: list[Item] = []
    for (lv, sp), n in zip(pairs, counts, strict=True):
        blocks = max(1, min(n // max(batch, 1), -(-per_split // max(batch, 1))))
        starts = np.linspace(0, max(n - batch, 0), blocks).round().astype(int) if n else []
        items += [(lv, sp, int(lo), int(min(lo + batch, n))) for lo in sorted(set(starts))]
    return items
