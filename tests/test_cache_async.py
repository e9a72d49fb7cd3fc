"""The cache's writer thread and its copies on side streams (issue 25): the same bytes with the
writer on and off, whatever the reader workers; batches stored in order through a bounded
queue; a failed write or a stop surfaces in the loop and leaves a partial cache that resumes.
The CUDA paths are ``gpu`` tests (skipped without a device)."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_cache import exact, make_build

import spar_bench.probes.cache as pc
from spar_bench.errors import IntegrityError
from spar_bench.probes.cache import WRITE_QUEUE, write_cache
from spar_bench.probes.features import FeatureCache
from spar_bench.probes.stopwatch import Stopwatch
from spar_bench.probes.streams import HostCopy, device_batches
from spar_bench.probes.token_storage import TokenStorage


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("async") / "build")


def _arrays(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None)
    return out


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cache-writer")]


@pytest.mark.slow
@pytest.mark.parametrize("storage", [None, TokenStorage(grid=2, int8=True)], ids=["fp16", "grid2-int8"])
def test_writer_on_and_off_give_the_same_bytes_whatever_the_workers(storage, build: Path, tmp_path: Path) -> None:
    files = {}
    for workers in (0, 1):
        for background in (True, False):
            opts = exact(dtype="fp16", loader_workers=workers, async_writes=background, layers="-1,-2",
                         token_storage=storage)
            files[workers, background] = write_cache("dummy", build, tmp_path / f"{workers}-{background}.h5",
                                                     opts, progress=False).read_bytes()
    first = files[0, True]
    assert all(b == first for b in files.values())
    assert not _writer_threads()
    with FeatureCache(tmp_path / "0-True.h5") as fc:
        assert fc.meta["complete"] and fc.meta["dtype"] == "fp16"
        assert "async_writes" not in fc.meta["cache_args"]  # not an argument of the cache


def test_batches_are_written_in_order_through_a_bounded_queue(build: Path, tmp_path: Path, monkeypatch) -> None:
    real_store, real_encode = pc._store_batch, pc._encode
    encoded, stored, ahead = [], [], []
    release = threading.Event()

    def encode(*a, **k):
        encoded.append(1)
        if len(encoded) > 1 + WRITE_QUEUE:
            release.set()  # the loop ran further ahead than the queue allows
        return real_encode(*a, **k)

    def store(f, item, res, **k):
        assert threading.current_thread().name.startswith("cache-writer")
        if not stored:  # the first write is slow: the loop may run at most WRITE_QUEUE batches ahead
            release.wait(timeout=2.0)
            ahead.append(len(encoded))
        stored.append(item[:3])
        return real_store(f, item, res, **k)

    monkeypatch.setattr(pc, "_encode", encode)
    monkeypatch.setattr(pc, "_store_batch", store)
    write_cache("dummy", build, tmp_path / "c.h5", exact(), progress=False)
    assert 1 <= ahead[0] <= 1 + WRITE_QUEUE  # the first batch's write blocked the loop there
    order = [("level1", "train", 0), ("level1", "train", 4), ("level1", "train", 8), ("level1", "test", 0),
             ("level3", "test", 0), ("level3", "test", 4)]
    assert stored == order  # the build's order of levels, splits and rows


def test_no_batch_is_stored_after_a_failed_one_even_when_queued() -> None:
    """The race CI once hit: the writer thread picked the next queued batch up before close()
    could cancel it. Batches 2 and 3 are queued while batch 1 is still failing."""
    release, stored = threading.Event(), []

    def store(item, payload):
        if item == 1:
            release.wait(5)
            raise IntegrityError("broken on purpose")
        stored.append(item)

    w = pc._Writer(store, background=True, stopwatch=None)
    try:
        w.put(1, None)
        w.put(2, None)
        threading.Timer(0.2, release.set).start()
        with pytest.raises(IntegrityError, match="on purpose"):  # 2 and 3 queued behind batch 1
            w.put(3, None)  # the queue is over WRITE_QUEUE: this waits for batch 1, which fails
    finally:
        w.close()
    assert stored == [] and not _writer_threads()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_write_is_the_loops_error_and_the_rerun_resumes(background: bool, build: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    full = _arrays(write_cache("dummy", build, tmp_path / "full.h5", exact(), progress=False))
    real, n = pc._store_batch, []

    def store(f, item, res, **k):
        n.append(item)
        if len(n) == 3:
            raise IntegrityError(f"{f.filename}: broken on purpose")
        return real(f, item, res, **k)

    monkeypatch.setattr(pc, "_store_batch", store)
    out = tmp_path / "c.h5"
    with pytest.raises(IntegrityError, match="c.h5: broken on purpose"):
        write_cache("dummy", build, out, exact(async_writes=background), progress=False)
    assert len(n) == 3 and not _writer_threads()  # nothing written after the failure
    with pytest.raises(IntegrityError, match="incomplete"):
        FeatureCache(out)
    with h5py.File(out) as f:
        assert not f.attrs["complete"]
        done = f["level1/train/done"][()]  # the two batches before the failure, and no other
        assert done[:8].all() and not done[8:].any() and not f["level1/test/done"][()].any()
    monkeypatch.undo()
    write_cache("dummy", build, out, exact(async_writes=background), progress=False)
    got = _arrays(out)
    assert sorted(got) == sorted(full) and all(np.array_equal(got[k], full[k]) for k in full)


def test_a_failed_write_is_one_line_of_the_cli(build: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    def store(f, item, res, **k):
        raise IntegrityError(f"{f.filename}: broken on purpose")

    monkeypatch.setattr(pc, "_store_batch", store)
    out = tmp_path / "c.h5"
    rc = run_cmd(cli, ["cache", "--encoder", "dummy", "--data", build, "--out", out, "--device", "cpu",
                       "--batch-size", "4"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "img/s" not in ln and "img]" not in ln]  # no bar
    assert rc == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("c.h5: broken on purpose")


def test_a_stop_leaves_whole_batches_and_the_rerun_completes(build: Path, tmp_path: Path, monkeypatch) -> None:
    """A Ctrl-C in the loop (KeyboardInterrupt) while the writer holds batches: the writer
    finishes the batch it is writing, drops the rest, and ``done`` marks exactly what is written."""
    full = _arrays(write_cache("dummy", build, tmp_path / "full.h5", exact(), progress=False))
    real, calls = pc._encode, []

    def encode(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pc, "_encode", encode)
    out = tmp_path / "c.h5"
    with pytest.raises(KeyboardInterrupt):
        write_cache("dummy", build, out, exact(), progress=False)
    assert not _writer_threads()
    with h5py.File(out) as f:
        assert not f.attrs["complete"]
        for key in ("level1/test", "level1/train"):
            done = f[f"{key}/done"][()]
            if done.any():  # every row marked done holds its features
                tokens = f[f"{key}/layer-1/tokens"][()]
                assert np.array_equal(tokens[done], full[f"{key}/layer-1/tokens"][done])
    monkeypatch.undo()
    write_cache("dummy", build, out, exact(), progress=False)
    got = _arrays(out)
    assert all(np.array_equal(got[k], full[k]) for k in full)


def test_the_stopwatch_with_the_writer_off(build: Path, tmp_path: Path) -> None:
    sw = Stopwatch()
    write_cache("dummy", build, tmp_path / "c.h5", exact(async_writes=False), progress=False, stopwatch=sw)
    batches = 3 + 1 + 2
    assert sw.counts["write"] == sw.counts["write wait"] == batches  # the loop waits for each write
    assert sw.seconds["write wait"] >= sw.seconds["write"]


def test_device_batches_on_the_cpu_are_the_loaders_tensors_in_order() -> None:
    batches = [(i, torch.full((2, 3), i, dtype=torch.uint8), (0.0, 0.0)) for i in range(4)]
    sw = Stopwatch()
    got = list(device_batches(batches, torch.device("cpu"), sw))
    assert [g[0] for g, _ in got] == [0, 1, 2, 3] and all(x is g[1] for g, x in got)
    assert sw.counts["h2d"] == sw.counts["load wait"] == 4
    assert list(device_batches([], torch.device("cpu"))) == []


def test_host_copy_on_the_cpu_casts_when_waited_for() -> None:
    x = {-1: {"tokens": torch.randn(2, 3, 4), "token_scale": torch.rand(2, 4)}}
    copy = HostCopy(x, lambda k, t: t if k == "token_scale" else t.half())
    host = copy.wait()
    assert host[-1]["tokens"].dtype == np.float16 and host[-1]["token_scale"].dtype == np.float32
    assert np.array_equal(host[-1]["tokens"], x[-1]["tokens"].numpy().astype(np.float16))


# -- CUDA: pinned memory, side streams ---------------------------------------------------------
@pytest.mark.gpu
def test_device_batches_on_cuda_copy_ahead_the_same_images() -> None:
    dev = torch.device("cuda")
    batches = [(i, torch.randint(0, 256, (64, 224, 224), dtype=torch.uint8).pin_memory(), None)
               for i in range(5)]
    out = []
    for got, x in device_batches(batches, dev):
        assert x.device.type == "cuda"
        out.append((x.float() * 2).sum())  # work on the compute stream while the next copy runs
        assert torch.equal(x.cpu(), got[1])
    torch.cuda.synchronize()
    assert [float(o) for o in out] == [float(b[1].double().sum() * 2) for b in batches]


@pytest.mark.gpu
def test_host_copy_on_cuda_equals_a_plain_copy() -> None:
    from spar_bench.probes.streams import side_stream

    dev = torch.device("cuda")
    x = {-1: {"tokens": torch.randn(8, 50, 768, device=dev), "pooled": torch.randn(8, 768, device=dev)}}
    copy = HostCopy(x, lambda k, t: t.half(), side_stream(dev))
    host = copy.wait()
    for k, t in x[-1].items():
        assert np.array_equal(host[-1][k], t.half().cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_cache_is_the_same_bytes_with_the_writer_on_and_off(workers: int, build: Path, tmp_path: Path) -> None:
    files = []
    for background in (True, False):
        opts = exact(device="cuda", dtype="fp16", compute="fp32", loader_workers=workers, async_writes=background,
                     token_storage=TokenStorage(grid=2, int8=True) if workers else None)
        files.append(write_cache("dummy", build, tmp_path / f"{background}.h5", opts, progress=False).read_bytes())
    assert files[0] == files[1]
