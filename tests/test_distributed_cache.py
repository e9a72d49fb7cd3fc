"""A cache written by several ranks equals the one-process cache; a killed rank resumes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.errors import IntegrityError
from spar_bench.probes import cache as cache_mod
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.distributed import Ranks, all_parts
from spar_bench.probes.features import FeatureCache

OPTS = CacheOptions(dtype="fp32", compute="fp32", batch_size=3, device="cpu", loader_workers=0)


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return write_synthetic_build(tmp_path_factory.mktemp("dist") / "b", 26, shard_size=5)


@pytest.fixture(scope="module")
def single(build: Path, tmp_path_factory) -> Path:
    return write_cache("dummy", build, tmp_path_factory.mktemp("one") / "one.h5", OPTS, progress=False)


def content(path: Path) -> dict:
    """Every dataset and attribute of an HDF5 file, for equality checks."""
    found: dict = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        found["attrs"] = {k: (v if k != "versions" else None) for k, v in f.attrs.items()}
    return found


def assert_same(a: Path, b: Path) -> None:
    ca, cb = content(a), content(b)
    assert ca.keys() == cb.keys()
    assert ca.pop("attrs") == cb.pop("attrs")
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


def as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(cache_mod, "barrier", lambda ranks, timeout: None)  # ranks run in turn here


def test_batches_are_split_without_overlap() -> None:
    owners = [[r for r in range(3) if Ranks(r, 3, r).owns(b)] for b in range(10)]
    assert all(len(o) == 1 for o in owners)


def test_two_ranks_merge_to_the_single_process_cache(build, single, tmp_path, monkeypatch) -> None:
    out = tmp_path / "two.h5"
    as_rank(monkeypatch, 1, 2)
    write_cache("dummy", build, out, OPTS, progress=False)
    assert not out.exists() and all_parts(out, 2)[1].is_file()
    as_rank(monkeypatch, 0, 2)
    write_cache("dummy", build, out, OPTS, progress=False)
    assert not any(p.exists() for p in all_parts(out, 2))
    assert_same(out, single)
    FeatureCache(out).close()


def test_the_merge_refuses_while_another_process_writes_the_same_cache(build, single, tmp_path, monkeypatch) -> None:
    """Rank 0's merge writes OUT, so it takes OUT's lock: a one-process `cache` writing OUT
    (it holds that lock) makes the merge refuse in one line instead of clobbering its file."""
    from spar_bench.errors import ConfigError
    from spar_bench.locks import output_lock

    out = tmp_path / "shared.h5"
    as_rank(monkeypatch, 1, 2)
    write_cache("dummy", build, out, OPTS, progress=False)
    as_rank(monkeypatch, 0, 2)
    with output_lock(out, what="feature cache"), pytest.raises(ConfigError, match="is being written by another"):
        write_cache("dummy", build, out, OPTS, progress=False)
    assert not out.exists() and all(p.is_file() for p in all_parts(out, 2))  # parts kept for a rerun
    write_cache("dummy", build, out, OPTS, progress=False)  # the rerun merges
    assert_same(out, single)


def test_a_killed_rank_resumes_and_an_unfinished_part_blocks_the_merge(
    build, single, tmp_path, monkeypatch
) -> None:
    out = tmp_path / "killed.h5"
    as_rank(monkeypatch, 1, 2)

    def die(*_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_cache("dummy", build, out, OPTS, progress=False, on_batch=die)
    as_rank(monkeypatch, 0, 2)
    with pytest.raises(IntegrityError, match="part of rank 1 is unfinished"):
        write_cache("dummy", build, out, OPTS, progress=False)
    assert not out.exists()  # nothing that looks like a cache
    as_rank(monkeypatch, 1, 2)
    write_cache("dummy", build, out, OPTS, progress=False)  # resumes its own part
    as_rank(monkeypatch, 0, 2)
    write_cache("dummy", build, out, OPTS, progress=False)
    assert_same(out, single)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_cpu_processes(build, single, tmp_path) -> None:
    out = tmp_path / "torchrun.h5"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "spar_bench.probes.cli", "cache", "--encoder", "dummy", "--data", str(build),
           "--out", str(out), "--dtype", "fp32", "--compute", "fp32", "--batch", "3",
           "--device", "cpu", "--workers", "0"]
    r = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace", timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(out, single)


# -- one process per core on the CPU (CacheOptions.processes) -------------------------------
@pytest.mark.slow
def test_a_cpu_cache_is_the_same_bytes_from_one_or_two_processes(build, tmp_path, monkeypatch) -> None:
    """Two 1-thread processes (this one and a spawned one, alternate batches, written in order
    here) make the file of one process byte for byte; so does one process whatever torch's
    thread count (the forward runs at one thread)."""
    import hashlib

    import torch

    monkeypatch.setattr(cache_mod, "MIN_IMAGES_PER_PROCESS", 1)  # a small build: split it anyway
    seen, ahead = [], []
    monkeypatch.setattr(cache_mod, "_pooled", lambda *a, real=cache_mod._pooled: seen.append(a[3]) or real(*a))
    real_ahead = cache_mod._pool_ahead

    @contextlib.contextmanager
    def spy_ahead(*a):
        with real_ahead(*a) as pool:
            ahead.append(pool is not None)
            yield pool

    monkeypatch.setattr(cache_mod, "_pool_ahead", spy_ahead)
    sums, before = {}, torch.get_num_threads()
    try:
        for n, threads in ((1, 2), (2, 2), (1, 1)):
            torch.set_num_threads(threads)
            out = write_cache("timm:resnet10t", build, tmp_path / f"p{n}t{threads}.h5",
                              CacheOptions(dtype="fp32", compute="fp32", batch_size=3, device="cpu", processes=n,
                                           random_init=True), progress=False)
            sums[n, threads] = hashlib.sha256(out.read_bytes()).hexdigest()
            assert torch.get_num_threads() == threads  # restored after the cache
    finally:
        torch.set_num_threads(before)
    assert seen == [2]  # the 2-process run took the pooled path
    assert ahead == [False, True, False]  # its other process started before the encoder loaded
    assert len(set(sums.values())) == 1, sums


def test_how_many_processes_a_cpu_cache_takes(monkeypatch) -> None:
    from types import SimpleNamespace

    import torch

    from spar_bench.probes.cache import cpu_processes

    monkeypatch.setattr(cache_mod, "usable_cores", lambda: 4)
    cpu = SimpleNamespace(dev=torch.device("cpu"), ranks=Ranks(), rows=None, processes=None)
    items = [("level1", "train", lo, lo + 64) for lo in range(0, 64 * 16, 64)]  # 16 batches, 1,024 images
    assert cpu_processes(cpu, items) == 4  # a core each
    assert cpu_processes(cpu, items[:8]) == 2  # 512 images: 256 a process at least
    assert cpu_processes(cpu, items[:3]) == 1
    small = [("level3", "train", lo, lo + 40) for lo in range(0, 320, 40)]  # 8 batches, 320 images
    assert cpu_processes(cpu, small) == 2  # 160 a process: over MIN_IMAGES_PER_PROCESS
    assert cpu_processes(cpu, small[:7]) == 1  # 7 batches: under MIN_BATCHES_PER_PROCESS each
    assert cpu_processes(SimpleNamespace(**{**vars(cpu), "processes": 1}), items) == 1
    assert cpu_processes(SimpleNamespace(**{**vars(cpu), "ranks": Ranks(0, 2, 0)}), items) == 1  # torchrun: its ranks
    assert cpu_processes(SimpleNamespace(**{**vars(cpu), "dev": torch.device("cuda")}), items) == 1


def test_batches_go_to_whoever_is_free_and_come_out_in_order() -> None:
    """The pooled loop hands batches out from the front: while the next batch to write is still
    being encoded by a slow other process, this one encodes the following ones itself; the
    batches come out in order, each encoded once, and no more than the bound are held."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from spar_bench.probes.cache import _in_order

    items = [("level3", "train", lo, lo + 4) for lo in range(0, 40, 4)]
    here, there, gate = [], [], threading.Event()

    def slow(item):  # the other process: stuck until this one has encoded a few batches
        gate.wait(timeout=30)
        there.append(item)
        return {"from": item}

    def encoding(item):
        here.append(item)
        if len(here) >= 2:
            gate.set()
        return {"from": item}

    with ThreadPoolExecutor(max_workers=1) as pool:
        out = list(_in_order(items, encoding, lambda item: pool.submit(slow, item), 2, None))
    assert [item for item, _ in out] == items
    assert all(res == {"from": item} for item, res in out)
    assert sorted(here + there) == sorted(items) and not set(here) & set(there)
    assert len(here) >= 2 and there  # both encoded: this one helped while the other was stuck


def test_a_broken_pool_stops_the_pooled_loop_with_its_error() -> None:
    """A pool that breaks (a worker killed: submit raises) stops the loop with that error at this
    process's next batch, instead of hanging or writing on without the others' batches."""
    import time
    from concurrent.futures.process import BrokenProcessPool

    from spar_bench.probes.cache import _in_order

    items = [("level3", "train", lo, lo + 4) for lo in range(0, 40, 4)]

    def broken(item):
        raise BrokenProcessPool("a worker died")

    def encoding(item):
        time.sleep(0.05)
        return {"from": item}

    with pytest.raises(BrokenProcessPool):
        list(_in_order(items, encoding, broken, 2, None))


def test_an_encoder_that_cannot_leave_its_process_is_cached_here(build, tmp_path, monkeypatch) -> None:
    """An encoder that pickle refuses (a transformers model's hooks are local functions) is not
    sent to the other processes: the whole cache is encoded here, the same bytes as 1 process."""
    import hashlib

    from spar_bench.probes.encoders import load_encoder

    monkeypatch.setattr(cache_mod, "MIN_IMAGES_PER_PROCESS", 1)  # a small build: split it anyway
    opts = {"dtype": "fp32", "compute": "fp32", "batch_size": 3, "device": "cpu", "random_init": True}
    sums = []
    for n in (1, 2):
        enc = load_encoder("timm:resnet10t", random_init=True)
        enc.hook = lambda: None  # a local function: pickle refuses it, as it refuses those hooks
        out = write_cache("timm:resnet10t", build, tmp_path / f"p{n}.h5", CacheOptions(**opts, processes=n),
                          progress=False, encoder_obj=enc)
        sums.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert sums[0] == sums[1]
