"""A full disk at any write (issue 19): one line naming the path, exit 2, and the rerun
(``--resume`` for a build) finishes with the bytes of an uninterrupted run.

:class:`DiskFills` counts every write a command makes under the test's folder (files opened
for writing, renames, parquet files, torch.save, the feature cache's reserved flushes) and
makes the k-th fail with ENOSPC, after writing half of it where a real disk would. Each
test first runs the command once to list its write sites, then fails it at the first
write of every site (and at the last write), frees the space and reruns. A test on a small
tmpfs (root only) checks the same with a real full disk and the real HDF5.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spar_bench.clitools import run_cli

from helpers import tree_hashes

BUILD_ARGS = ["--samples-per-case", "2", "--shard-size", "5", "--seed", "3"]


def _enospc(path: object = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(path)] if path else []))


class _FullFile:
    """A file opened for writing whose first write stores half its bytes and fails."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, data):
        self._fh.write(data[: len(data) // 2])
        raise _enospc()  # as Python's own write: no file name

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def __iter__(self):
        return iter(self._fh)


class DiskFills:
    """Count the writes under ``root``; with ``fail_at=k`` the k-th write fails with ENOSPC.

    ``events`` lists ``(site, path relative to root)`` in order; a site is the kind of write
    and the file's name, numbers and splits aside (``open:manifest.json``,
    ``rename:fake__cN.npz``, ``parquet:SPLIT-N-of-N.parquet``, ``h5-flush:c.h5``, ...).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, fail_at: int | None = None):
        self.root, self.fail_at = Path(os.path.abspath(root)), fail_at
        self.events: list[tuple[str, str]] = []
        self.failed: tuple[str, str] | None = None
        self._patch(monkeypatch)

    def _hit(self, kind: str, path: object) -> bool:
        """Record one write; True when it is the one to fail."""
        try:
            p = Path(os.path.abspath(os.fsdecode(path)))
        except TypeError:  # a file descriptor or a file object: not a path we watch
            return False
        if not p.is_relative_to(self.root):
            return False
        name = re.sub(r"^(train|val|test)-", "SPLIT-", re.sub(r"[0-9]+(?=.*[.])", "N", p.name))
        site = f"{kind}:{name}"  # shard and case numbers, and splits, aside
        self.events.append((site, p.relative_to(self.root).as_posix()))
        if len(self.events) - 1 == self.fail_at:
            self.failed = self.events[-1]
            return True
        return False

    def _patch(self, mp: pytest.MonkeyPatch) -> None:
        real_open, real_replace, real_rename = io.open, os.replace, os.rename

        def fake_open(file, mode="r", *a, **k):
            fh = real_open(file, mode, *a, **k)
            if any(c in mode for c in "wax+") and self._hit("open", file):
                return _FullFile(fh)
            return fh

        def renamer(real, kind):
            def fake(src, dst, *a, **k):
                if self._hit(kind, dst):
                    raise _enospc(dst)
                return real(src, dst, *a, **k)
            return fake

        mp.setattr(builtins, "open", fake_open)
        mp.setattr(io, "open", fake_open)
        mp.setattr(os, "replace", renamer(real_replace, "rename"))
        mp.setattr(os, "rename", renamer(real_rename, "rename"))
        self._patch_libraries(mp)

    def _patch_libraries(self, mp: pytest.MonkeyPatch) -> None:
        import spar_bench.h5files as h5files

        real_commit = h5files._LatchedFile._commit

        def commit(raw):  # the feature cache's HDF5 writes: one reserved flush
            if self._hit("h5-flush", raw.path):
                raise _enospc()  # the reservation fails: nothing of this flush is written
            return real_commit(raw)

        mp.setattr(h5files._LatchedFile, "_commit", commit)
        self._patch_torch(mp)
        self._patch_sqlite(mp)
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return
        real_table = pq.write_table

        def write_table(table, where, *a, **k):
            if self._hit("parquet", where):
                Path(where).write_bytes(b"PAR1")  # torn
                raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
            return real_table(table, where, *a, **k)

        mp.setattr(pq, "write_table", write_table)

    def _patch_torch(self, mp: pytest.MonkeyPatch) -> None:
        import torch

        real_save = torch.save

        def save(obj, f, *a, **k):
            if isinstance(f, (str, os.PathLike)) and self._hit("torch.save", f):
                Path(f).write_bytes(b"PK")  # torn; torch's own writer drops the errno:
                mp.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            return real_save(obj, f, *a, **k)

        mp.setattr(torch, "save", save)
        try:
            import safetensors.torch as st
        except ImportError:
            return
        real_save_file = st.save_file

        def save_file(tensors, filename, *a, **k):
            if self._hit("safetensors", filename):
                Path(filename).write_bytes(b"{")  # torn
                raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save_file(tensors, filename, *a, **k)

        mp.setattr(st, "save_file", save_file)

    def _patch_sqlite(self, mp: pytest.MonkeyPatch) -> None:
        import sqlite3

        real_connect, fills = sqlite3.connect, self

        class Connection:  # a write that finds the disk full is rolled back, as SQLite does
            def __init__(self, path, *a, **k):
                self._db, self._path = real_connect(path, *a, **k), path

            def executemany(self, sql, rows):
                if fills._hit("sqlite", self._path):
                    raise sqlite3.OperationalError("database or disk is full")
                return self._db.executemany(sql, rows)

            def __getattr__(self, name):
                return getattr(self._db, name)

            def __enter__(self):
                return self._db.__enter__()

            def __exit__(self, *exc):
                return self._db.__exit__(*exc)

        mp.setattr(sqlite3, "connect", Connection)

    def sites(self) -> list[int]:
        """The first write of every site, one in the middle and the last write."""
        first: dict[str, int] = {}
        for i, (site, _) in enumerate(self.events):
            first.setdefault(site, i)
        return sorted({*first.values(), len(self.events) // 2, len(self.events) - 1})


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _fail_each_site(monkeypatch, capsys, root: Path, run, clean: dict[str, str], result: Path,
                    rerun, names: tuple[str, ...]) -> list[str]:
    """Fail ``run`` at each write site in turn; each time one line naming a path, then
    ``rerun`` (space freed) must leave ``result`` with the bytes ``clean``."""
    with monkeypatch.context() as mp:
        counter = DiskFills(mp, root)
        assert run() == 0
    capsys.readouterr()
    remove_tree(result)
    tried = []
    for k in counter.sites():
        with monkeypatch.context() as mp:
            fault = DiskFills(mp, root, fail_at=k)
            code = run()
        assert fault.failed is not None and code == 2, (k, fault.failed, code)
        line = one_error_line(capsys)
        assert "free space" in line and any(n in line for n in names), line
        assert rerun() == 0, (fault.failed, capsys.readouterr().err)
        capsys.readouterr()
        assert _hashes(result) == clean, fault.failed
        tried.append(fault.failed[0])
        remove_tree(result)
    return tried


def _hashes(out: Path) -> dict[str, str]:
    """sha256 of every file of ``out`` (a file or a folder) but a finetune's ``timing.json`` (its
    measured throughput: a time, different in every run)."""
    if not out.is_dir():
        return {out.name: _sha(out)}
    return {k: v for k, v in tree_hashes(out).items() if not k.endswith("/timing.json")}


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def remove_tree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# -- the build: spills, shards, parquet, card, manifest, renames ------------------------------
@pytest.mark.slow
def test_a_full_disk_at_every_build_write_is_one_line_and_resume_gives_the_same_build(
        fake_root, tmp_path, monkeypatch, capsys):
    from spar_bench.builder.cli import cli

    work = tmp_path / "w"
    work.mkdir()
    out = work / "out"
    args = ["--source", "fake", "--root", str(fake_root), "--out", str(out), *BUILD_ARGS]
    assert run_cli(cli, args) == 0
    clean = tree_hashes(out)
    remove_tree(out)
    capsys.readouterr()
    tried = _fail_each_site(monkeypatch, capsys, work, lambda: run_cli(cli, args), clean, out,
                            lambda: run_cli(cli, [*args, "--resume"]), names=(str(out),))
    assert {"open:config.part.json", "open:fake__cN.part.npz", "rename:fake__cN.npz", "open:fake__cN.part.json",
            "open:SPLIT-N-of-N.h5", "parquet:SPLIT-N-of-N.parquet", "open:README.md", "open:manifest.json",
            "rename:out"} <= set(tried), tried
    assert not (work / "out.lock").exists()


# -- the feature cache: its HDF5 flushes ----------------------------------------------------
def test_a_full_disk_at_every_cache_write_is_one_line_and_the_rerun_gives_the_same_cache(
        fake_root, tmp_path, monkeypatch, capsys):
    from spar_bench.builder.build import build
    from spar_bench.probes.cli import cli

    from helpers import build_config

    data = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    work = tmp_path / "w"
    work.mkdir()
    out = work / "c.h5"
    args = ["cache", "--encoder", "dummy", "--data", str(data), "--out", str(out), "--device", "cpu",
            "--batch", "4", "--levels", "level1,level3"]
    assert run_cli(cli, args) == 0
    clean = {out.name: _sha(out)}
    remove_tree(out)
    capsys.readouterr()
    tried = _fail_each_site(monkeypatch, capsys, work, lambda: run_cli(cli, args), clean, out,
                            lambda: run_cli(cli, args), names=(str(out),))
    assert tried.count("h5-flush:c.h5") >= 3, tried  # the first batch, one in the middle, the close
    assert not (work / "c.h5.lock").exists()


# -- a sweep of probe heads: config.json, head.pt (torch.save), metrics.json and its rename -----
@pytest.mark.slow
def test_a_full_disk_at_every_sweep_write_is_one_line_and_the_rerun_gives_the_same_runs(
        fake_root, tmp_path, monkeypatch, capsys, one_torch_thread):
    from spar_bench.builder.build import build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.cli import cli

    from helpers import build_config

    data = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    cache = write_cache("dummy", data, tmp_path / "c.h5", CacheOptions(device="cpu", levels=["level3"]), progress=False)
    work = tmp_path / "w"
    work.mkdir()
    out = work / "runs"
    args = ["sweep", "--features", str(cache), "--heads", "linear,mlp", "--probes", "level3.symmetry",
            "--seeds", "0", "--jobs", "1", "--bootstrap", "20", "--max-epochs", "2", "--out", str(out)]
    assert run_cli(cli, args) == 0
    clean = tree_hashes(out)
    remove_tree(out)
    capsys.readouterr()
    tried = _fail_each_site(monkeypatch, capsys, work, lambda: run_cli(cli, args), clean, out,
                            lambda: run_cli(cli, args), names=(str(out),))
    assert {"open:config.json", "torch.save:head.pt", "open:metrics.json.tmp", "rename:metrics.json"} <= set(tried), tried


# -- a vqa run: the response cache (SQLite), config.json, answers.jsonl, metrics.json ------------
@pytest.mark.slow
def test_a_full_disk_at_every_vqa_write_is_one_line_and_the_rerun_gives_the_same_run(
        fake_root, tmp_path, monkeypatch, capsys):
    from spar_bench.builder.build import build
    from spar_bench.probes.cli import cli

    from helpers import build_config

    data = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    work = tmp_path / "w"
    work.mkdir()
    out = work / "runs"
    args = ["vqa", "--model", "dummy", "--data", str(data), "--out", str(out), "--bootstrap", "20"]
    assert run_cli(cli, args) == 0
    clean = tree_hashes(out)
    remove_tree(out)
    capsys.readouterr()
    tried = _fail_each_site(monkeypatch, capsys, work, lambda: run_cli(cli, args), clean, out,
                            lambda: run_cli(cli, args), names=(str(out),))
    assert {"sqlite:dummy.sqlite", "open:config.json", "open:answers.jsonl", "rename:metrics.json"} <= set(tried), tried


# -- a finetune run: checkpoints (torch.save), encoder.safetensors, head.pt, config, metrics -----
@pytest.mark.slow
def test_a_full_disk_at_every_finetune_write_is_one_line_and_resume_gives_the_same_run(
        fake_root, tmp_path, monkeypatch, capsys, one_torch_thread):
    import json

    from spar_bench.builder.build import build
    from spar_bench.probes.cli import cli

    from helpers import build_config

    data = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    work = tmp_path / "w"
    work.mkdir()
    out = work / "runs"
    args = ["finetune", "--encoder", "timm:vit_tiny_patch16_224", "--init", "scratch", "--model-args",
            json.dumps({"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64}), "--data", str(data),
            "--probe", "level1.localisation", "--out", str(out), "--batch-size", "16", "--max-epochs", "2",
            "--device", "cpu", "--compute", "fp32", "--bootstrap", "20", "--no-controls"]
    assert run_cli(cli, args) == 0
    clean = _hashes(out)
    remove_tree(out)
    capsys.readouterr()
    tried = _fail_each_site(monkeypatch, capsys, work, lambda: run_cli(cli, args), clean, out,
                            lambda: run_cli(cli, [*args, "--resume"]), names=(str(out),))
    assert {"torch.save:checkpoint.pt.tmp", "safetensors:encoder.safetensors.tmp", "torch.save:head.pt",
            "open:config.json", "rename:metrics.json"} <= set(tried), tried


# -- a real full disk: a small tmpfs (root only), the real HDF5, every size ------------------
@pytest.fixture()
def small_disk(tmp_path):
    """A 64 MB tmpfs at ``tmp_path/disk`` (skipped where mounting one is not allowed)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=60)


def _leave_free(disk: Path, nbytes: int) -> Path:
    """Fill ``disk`` until about ``nbytes`` are free; the filler file (delete it to free space)."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(st.f_bavail * st.f_frsize - nbytes, 1))
    finally:
        os.close(fd)
    return filler


def _cli(module: str, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          encoding="utf-8", errors="replace", timeout=600)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _fill_and_resume(disk: Path, out: Path, full: int, run, resume, clean) -> list[int]:
    """Run with ~5%..95% of ``full`` bytes free; each run ends 0 or with one line and exit 2
    (never a crash), and the resumed output has the clean bytes. Returns the exit codes."""
    codes = []
    for fraction in (0.05, 0.35, 0.7, 0.95):
        filler = _leave_free(disk, int(full * fraction))
        r = run()
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        assert r.returncode in (0, 2) and "Traceback" not in r.stderr, (fraction, r.returncode, r.stderr[-3000:])
        if r.returncode == 2:
            assert len(errors) == 1 and str(out) in errors[0] and "free space" in errors[0], r.stderr[-2000:]
        codes.append(r.returncode)
        filler.unlink()
        r = resume()
        assert r.returncode == 0 and clean(), (fraction, r.stderr[-2000:])
        remove_tree(out)
    return codes


@pytest.mark.slow
def test_a_real_full_disk_under_a_build_and_a_cache_is_one_line_and_resumes(tmp_path, small_disk):
    ph = tmp_path / "ph"
    assert _cli("spar_bench.builder.cli", "phantom", "--out", ph, "--n", "2", "--in-plane", "96", "--slices", "16").returncode == 0
    out = small_disk / "out"
    build = ["--source", "phantom", "--root", ph, "--out", out, "--samples-per-case", "2"]
    assert _cli("spar_bench.builder.cli", *build).returncode == 0
    clean, full = tree_hashes(out), _size(out)
    data = tmp_path / "data"
    shutil.move(out, data)
    codes = _fill_and_resume(small_disk, out, full, lambda: _cli("spar_bench.builder.cli", *build),
                             lambda: _cli("spar_bench.builder.cli", *build, "--resume"),
                             lambda: tree_hashes(out) == clean)
    assert codes.count(2) >= 3, codes

    cache = small_disk / "c.h5"
    args = ["cache", "--encoder", "dummy", "--data", data, "--out", cache, "--device", "cpu", "--batch", "8"]
    assert _cli("spar_bench.probes.cli", *args).returncode == 0
    clean_cache, full = _sha(cache), _size(cache)
    cache.unlink()
    codes = _fill_and_resume(small_disk, cache, full, lambda: _cli("spar_bench.probes.cli", *args),
                             lambda: _cli("spar_bench.probes.cli", *args), lambda: _sha(cache) == clean_cache)
    assert codes.count(2) >= 3, codes


# -- the one translation: what every library says, and the line it becomes -------------------
def _torch_error_with_context() -> RuntimeError:
    try:
        try:
            raise _enospc()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("err, path", [
    (_enospc("out/a.json"), "out/a.json"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "OUT"),
    (RuntimeError("Disable slist on flush dest failure failed (file write failed: time = Mon Nov 30 2026\n"
                  ", filename = 'out.tmp/out/level3/test-00000-of-00001.h5', file descriptor = 4, errno = 28, "
                  "error message = 'No space left on device', buf = 0x5, total write size = 3680)"),
     "out.tmp/out/level3/test-00000-of-00001.h5"),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), "OUT"),
    (OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device"), "OUT"),
    (__import__("sqlite3").OperationalError("database or disk is full"), "OUT"),
    (_torch_error_with_context(), "OUT"),
])
def test_every_library_s_full_disk_is_one_line_naming_the_path(err, path):
    from spar_bench.outputs import disk_full_error, is_disk_full

    assert is_disk_full(err)
    line = str(disk_full_error(err, "OUT", "rerun"))
    assert line == f"no space left on the disk while writing {path}; free space (or write elsewhere) and rerun"


@pytest.mark.parametrize("err", [OSError(errno.EACCES, "Permission denied", "x"), RuntimeError("unexpected pos 5 vs 3"),
                                 ValueError("no space left in the grid")])
def test_other_errors_are_not_a_full_disk(err):
    from spar_bench.outputs import is_disk_full

    assert not is_disk_full(err)


def test_a_full_disk_no_command_caught_is_one_line_naming_its_out(tmp_path, capsys):
    import click

    @click.command()
    @click.option("--out")
    def writer(out):
        Path(out).write_text("x")
        raise _enospc()

    assert run_cli(writer, ["--out", str(tmp_path / "o.txt")]) == 2
    assert one_error_line(capsys) == (f"error: no space left on the disk while writing {tmp_path / 'o.txt'}; "
                                      "free space (or write elsewhere) and rerun the same command")


def test_save_torch_and_write_bytes_leave_no_torn_file_and_name_it(tmp_path, monkeypatch):
    import torch

    from spar_bench.outputs import save_torch, write_bytes

    for sub in ("ours", "torch"):
        (tmp_path / sub).mkdir()
    save_torch({"a": torch.arange(3)}, tmp_path / "ours" / "head.pt")
    torch.save({"a": torch.arange(3)}, tmp_path / "torch" / "head.pt")
    assert (tmp_path / "ours" / "head.pt").read_bytes() == (tmp_path / "torch" / "head.pt").read_bytes()
    with monkeypatch.context() as mp:
        DiskFills(mp, tmp_path, fail_at=0)
        with pytest.raises(OSError) as e:
            write_bytes(tmp_path / "c.json", "{}" * 100)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()
    with monkeypatch.context() as mp:
        DiskFills(mp, tmp_path, fail_at=0)
        with pytest.raises(OSError) as e:
            save_torch({"a": torch.arange(3)}, tmp_path / "head.pt")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "head.pt")


# -- HDF5 written through open_h5: a flush is applied whole or not at all -----------------------
def test_open_h5_keeps_the_last_flush_and_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    import h5py
    import numpy as np

    from spar_bench.h5files import h5_image, open_h5

    def fill(path: Path, rows: range) -> None:
        with open_h5(path) as f:
            if "x" not in f:
                f.create_dataset("x", shape=(6, 300), dtype="f4", chunks=(1, 300))
                f.create_dataset("done", shape=(6,), dtype=bool)
            for i in rows:
                if not f["done"][i]:
                    f["x"][i] = i
                    f["done"][i] = True
                    f.flush()

    fill(tmp_path / "clean.h5", range(6))
    for k in range(7):  # every flush, the close's included
        path = tmp_path / f"c{k}.h5"
        with monkeypatch.context() as mp:
            faults = DiskFills(mp, tmp_path, fail_at=k)
            with pytest.raises(OSError) as e:
                fill(path, range(6))
        assert faults.failed == ("h5-flush:cN.h5", path.name) and e.value.filename == str(path)
        if path.stat().st_size:  # as at the last good flush: every row marked done is written
            with h5py.File(path) as f:
                done = f["done"][()]
                assert done.sum() == min(k, 6) and all((f["x"][i] == i).all() for i in np.flatnonzero(done))
        fill(path, range(6))  # space freed
        assert path.read_bytes() == (tmp_path / "clean.h5").read_bytes(), k
    # a new file built in memory has the bytes h5py's own driver writes
    with h5py.File(tmp_path / "plain.h5", "w", libver=("earliest", "v110")) as f:
        f.create_dataset("x", data=np.arange(10), track_times=False)
    image = h5_image(lambda f: f.create_dataset("x", data=np.arange(10), track_times=False),
                     libver=("earliest", "v110"))
    assert image == (tmp_path / "plain.h5").read_bytes()


def test_a_full_disk_opening_the_vqa_response_cache_says_free_space_not_delete_it(tmp_path, monkeypatch):
    import sqlite3

    from spar_bench.errors import ConfigError
    from spar_bench.probes.vqa.cache import ResponseCache

    def full(*a, **k):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sqlite3, "connect", full)
    with pytest.raises(ConfigError) as e:
        ResponseCache(tmp_path / "c.sqlite")
    assert "free space and rerun" in str(e.value) and "delete" not in str(e.value)


def test_a_full_disk_in_the_merge_of_a_distributed_cache_is_one_error_and_the_rerun_merges(
        tmp_path, monkeypatch):
    """Rank 0 merges the parts into OUT.merging with every HDF5 write applied at once: a full
    disk there is an OSError naming that file (no HDF5 crash), the parts stay, a rerun merges."""
    import h5py
    import numpy as np

    from spar_bench.builder.synthetic import write_synthetic_build
    from spar_bench.probes import cache as cache_mod
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.distributed import all_parts, merge_parts

    opts = CacheOptions(dtype="fp32", compute="fp32", batch_size=3, device="cpu", loader_workers=0)
    data = write_synthetic_build(tmp_path / "b", 12, shard_size=5)
    single = write_cache("dummy", data, tmp_path / "one.h5", opts, progress=False)
    made = tmp_path / "parts" / "two.h5"
    made.parent.mkdir()
    monkeypatch.setattr(cache_mod, "barrier", lambda ranks, timeout: None)  # ranks run in turn
    monkeypatch.setattr(cache_mod, "merge_parts", lambda out, parts: None)  # parts only
    for rank in (1, 0):
        for var in ("RANK", "LOCAL_RANK"):
            monkeypatch.setenv(var, str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        write_cache("dummy", data, made, opts, progress=False)

    def merge(folder: str, fail_at: int | None = None) -> list[tuple[str, str]]:
        out = tmp_path / folder / "two.h5"
        if not out.parent.exists():
            out.parent.mkdir()
            for p in all_parts(made, 2):
                shutil.copy(p, out.parent / p.name)
        with monkeypatch.context() as mp:
            fills = DiskFills(mp, out.parent, fail_at=fail_at)
            merge_parts(out, all_parts(out, 2))
        return fills.events

    writes = [i for i, (site, p) in enumerate(merge("count")) if site.startswith("h5-flush") and p == "two.h5.merging"]
    assert len(writes) > 3
    for k in (writes[0], writes[len(writes) // 2], writes[-1]):
        with pytest.raises(OSError) as e:
            merge(f"fail{k}", fail_at=k)
        out = tmp_path / f"fail{k}" / "two.h5"
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(out) + ".merging"
        assert not out.exists() and all(p.is_file() for p in all_parts(out, 2))  # kept for a rerun
        merge(f"fail{k}")  # space freed: the rerun merges
        with h5py.File(out) as a, h5py.File(single) as b:
            assert a.attrs["complete"]
            for lv in b:
                for sp in b[lv]:
                    assert np.array_equal(a[f"{lv}/{sp}/layer-1/tokens"][()], b[f"{lv}/{sp}/layer-1/tokens"][()])
