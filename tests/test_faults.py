"""Faults and careless input (issue 14): nothing lost, nothing stale, nothing silent.

Options that mean nothing, stray files in a build, stale or torn spills on --resume,
a full disk, two writers on one output (stopped or killed parallel commands: test_signals.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli
from spar_bench.clitools import run_cli

from helpers import build_config, tree_hashes

SMALL = ["--samples-per-case", "2", "--shard-size", "5", "--seed", "3", "--no-hf"]


def one_error_line(capsys) -> str:
    """The one ``error:`` line on stderr (progress bars aside), and no traceback."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- options that mean nothing are errors, never silently replaced by defaults ---------------
@pytest.mark.parametrize("option, value, words", [
    ("--shard-size", "0", "--shard-size must be >= 1, got 0"),
    ("--jobs", "0", "--jobs must be >= 1, got 0"),
    ("--jobs", "-1", "--jobs must be >= 1, got -1"),
    ("--workers", "0", "--jobs must be >= 1, got 0"),  # the old spelling (renamed in 0.2)
    ("--samples-per-case", "0", "samples_per_case"),
])
def test_build_refuses_meaningless_option_values(fake_root, tmp_path, capsys, option, value, words):
    args = ["--source", "fake", "--root", str(fake_root), "--out", str(tmp_path / "o"), *SMALL, option, value]
    assert run_cli(cli, args) == 2
    assert words in one_error_line(capsys)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_phantom_n_zero_is_refused(tmp_path, capsys):
    assert run_cli(cli, ["phantom", "--out", str(tmp_path / "p"), "--n", "0"]) == 2
    assert "--n" in capsys.readouterr().err and not (tmp_path / "p").exists()


@pytest.mark.parametrize("kw, words", [({"batch_size": 0}, "--batch-size must be >= 1"),
                                        ({"loader_workers": -1}, "--loader-workers must be >= 0")])
def test_cache_refuses_meaningless_option_values(fake_root, tmp_path, kw, words):
    from spar_bench.builder.build import build
    from spar_bench.errors import ConfigError
    from spar_bench.probes.cache import CacheOptions, write_cache

    out = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    with pytest.raises(ConfigError, match=words):
        write_cache("dummy", out, tmp_path / "c.h5", CacheOptions(device="cpu", **kw), progress=False)
    assert not (tmp_path / "c.h5").exists()


# -- verify: a file the manifest does not list is a difference ----------------------------------
def test_verify_flags_unlisted_files(fake_root, tmp_path, capsys):
    from spar_bench.builder.build import build

    out = build(build_config(fake_root, tmp_path / "b"), quiet=True)
    assert run_cli(cli, ["verify", str(out)]) == 0
    capsys.readouterr()
    stray = sorted((out / "hf" / "level3").glob("*.parquet"))[0]
    (stray.parent / "train-00099-of-00100.parquet").write_bytes(stray.read_bytes())
    (out / "notes.txt").write_text("mine")
    assert run_cli(cli, ["verify", str(out)]) == 2
    captured = capsys.readouterr()
    assert "DIFF hf/level3/train-00099-of-00100.parquet: not listed in manifest.json" in captured.out
    assert "DIFF notes.txt: not listed" in captured.out
    assert "2 difference(s)" in captured.err


# -- resume reuses only what is still true ----------------------------------------------------

def write_word(root: Path, cases=(("c1", "Tr"), ("c2", "Tr"), ("c3", "Tr"), ("c4", "Ts"))) -> Path:
    """A tiny WORD-layout folder: test_build's synthetic abdomens as NIfTI (image + mask)."""
    import nibabel as nib
    import numpy as np

    from helpers import make_case

    affine = np.diag([-6.0, -6.0, 5.0, 1.0])  # (col, row, z) voxels: canonical = as drawn
    for cid, split in cases:
        case = make_case(cid, "train", int(cid[-1]))
        for kind, arr in (("images", case.image), ("labels", case.mask)):
            (root / f"{kind}{split}").mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(arr.transpose(2, 1, 0).copy(), affine), str(root / f"{kind}{split}" / f"{cid}.nii.gz"))
    return root


def word_config(root: Path, out: Path, **kw):
    from spar_bench.builder.build import BuildConfig

    base = dict(sources=("word",), roots=(str(root),), out=str(out),
                sample={"samples_per_case": 2, "l3_stride": 4, "l3_questions_per_probe": 2},
                seed=5, shard_size=7, hf=False)
    base.update(kw)
    return BuildConfig(**base)


def interrupt_after(monkeypatch, n_cases: int):
    """Make process_one raise KeyboardInterrupt (a kill) before its case ``n_cases + 1``."""
    import spar_bench.builder.build as bb

    real, calls = bb.process_one, []

    def flaky(job):
        calls.append(job.ref.case_id)
        if len(calls) > n_cases:
            raise KeyboardInterrupt("simulated kill")
        return real(job)

    monkeypatch.setattr(bb, "process_one", flaky)
    return lambda: monkeypatch.setattr(bb, "process_one", real)


def edit_mask(path: Path) -> None:
    import nibabel as nib
    import numpy as np

    img = nib.load(str(path))
    data = np.asarray(img.dataobj).copy()
    data[data == 5] = 0  # the stomach is gone
    nib.save(nib.Nifti1Image(data, img.affine), str(path))


def test_resume_after_an_input_edit_equals_a_clean_build_of_the_edited_input(tmp_path, monkeypatch):
    from spar_bench.builder.build import build

    root = write_word(tmp_path / "word")
    out = tmp_path / "out"
    restore = interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        build(word_config(root, out), quiet=True)
    restore()
    assert len(list((tmp_path / "out.tmp" / "cases").glob("*.json"))) == 2
    edit_mask(root / "labelsTr" / "c1.nii.gz")  # c1 was spilled before the kill
    build(word_config(root, out, resume=True), quiet=True)
    clean = build(word_config(root, tmp_path / "clean"), quiet=True)
    assert tree_hashes(out) == tree_hashes(clean)
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["level3"]["train"]["classes"] == \
        json.loads((clean / "manifest.json").read_text())["counts"]["level3"]["train"]["classes"]


@pytest.mark.parametrize("tear", ["npz", "json", "json-garbage"])
def test_torn_spill_files_are_rebuilt(tmp_path, monkeypatch, tear):
    from spar_bench.builder.build import build

    root = write_word(tmp_path / "word")
    clean = tree_hashes(build(word_config(root, tmp_path / "clean"), quiet=True))
    out = tmp_path / "out"
    restore = interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        build(word_config(root, out), quiet=True)
    restore()
    spill = tmp_path / "out.tmp" / "cases" / "word__c2"
    if tear == "npz":
        raw = spill.with_suffix(".npz").read_bytes()
        spill.with_suffix(".npz").write_bytes(raw[: len(raw) // 2])
    else:
        spill.with_suffix(".json").write_text('{"source": ' if tear == "json" else "[1, 2]")
    build(word_config(root, out, resume=True), quiet=True)
    assert tree_hashes(out) == clean


def test_resume_reuses_unchanged_spills(tmp_path, monkeypatch):
    import spar_bench.builder.build as bb

    root = write_word(tmp_path / "word")
    out = tmp_path / "out"
    restore = interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        bb.build(word_config(root, out), quiet=True)
    restore()
    import spar_bench.builder.samples as samples

    loaded = []
    real_process = samples.process_case

    def counting(case, *a, **k):
        loaded.append(case.case_id)
        return real_process(case, *a, **k)

    monkeypatch.setattr(samples, "process_case", counting)
    bb.build(word_config(root, out, resume=True), quiet=True)
    assert loaded == ["c4"]  # c1..c3 reused, not recomputed


# -- nothing dropped without a word: images without labels, labels without images -------------
FIVE = (("c1", "Tr"), ("c2", "Tr"), ("c3", "Tr"), ("c4", "Val"), ("c5", "Ts"))


def test_val_image_without_its_label_is_an_error_or_a_recorded_skip(tmp_path, capsys):
    root = write_word(tmp_path / "word", FIVE)
    (root / "labelsVal" / "c4.nii.gz").unlink()
    args = ["--source", "word", "--root", str(root), *SMALL]
    assert run_cli(cli, [*args, "--out", str(tmp_path / "o1")]) == 2
    line = one_error_line(capsys)
    assert "case c4:" in line and str(root / "imagesVal" / "c4.nii.gz") in line
    assert "image without its label: no labelsVal/c4.nii.gz" in line and "--on-error skip" in line
    assert run_cli(cli, [*args, "--out", str(tmp_path / "o2"), "--on-error", "skip"]) == 0
    m = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert [(s["case_id"], s["split"]) for s in m["skipped"]] == [("c4", "val")]
    assert "image without its label" in m["skipped"][0]["reason"]


def test_label_without_its_image_names_the_case(tmp_path):
    from spar_bench.builder.sources.word import WordSource
    from spar_bench.errors import CaseError

    root = write_word(tmp_path / "word")
    (root / "imagesTr" / "c2.nii.gz").unlink()
    src = WordSource(root)
    ref = next(r for r in src.find() if r.case_id == "c2")
    with pytest.raises(CaseError, match=r"case c2: .*labelsTr/c2.nii.gz: label without its image: no imagesTr/c2"):
        src.load(ref)
    # a masks-only folder is no problem with --images synthesize
    assert all(r.problem is None for r in WordSource(root, images="synthesize").find())


def test_nnunet_unlabelled_imagests_is_not_a_problem_but_a_missing_label_is(tmp_path):
    import nibabel as nib
    import numpy as np

    from spar_bench.builder.sources.nnunet import NnUNetSource

    (tmp_path / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "liver": 1}}))
    mask = np.zeros((6, 6, 4), np.uint8)
    mask[1:3, 1:3, 1:3] = 1

    def save(rel, arr):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(arr, np.eye(4)), str(tmp_path / rel))

    save("labelsTr/a_001.nii.gz", mask)
    save("imagesTr/a_001_0000.nii.gz", mask.astype(np.int16))
    save("imagesTr/a_001_0001.nii.gz", mask.astype(np.int16))  # a second channel: not a case
    save("imagesTs/a_009_0000.nii.gz", mask.astype(np.int16))  # no labelsTs at all: unused
    assert [(r.case_id, r.problem) for r in NnUNetSource(tmp_path).find()] == [("a_001", None)]
    save("imagesTr/a_002_0000.nii.gz", mask.astype(np.int16))
    refs = {r.case_id: r for r in NnUNetSource(tmp_path).find()}
    assert refs["a_002"].problem == "image without its label: no labelsTr/a_002.nii.gz"


def test_lits_volume_without_segmentation_is_a_case_with_a_problem(tmp_path):
    import nibabel as nib
    import numpy as np

    from spar_bench.builder.sources.lits import LitsSource
    from spar_bench.errors import CaseError

    arr = np.zeros((4, 4, 4), np.int16)
    for name in ("volume-1", "segmentation-1", "volume-2"):
        nib.save(nib.Nifti1Image(arr, np.eye(4)), str(tmp_path / f"{name}.nii"))
    refs = LitsSource(tmp_path).find()
    assert [r.case_id for r in refs] == ["lits_0001", "lits_0002"]
    with pytest.raises(CaseError, match="case lits_0002: .*volume-2.nii: image without its label"):
        LitsSource(tmp_path).load(refs[1])


def test_totalsegmentator_meta_row_without_its_folder(totalseg_dir, tmp_path):
    import shutil

    from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource
    from spar_bench.errors import CaseError

    root = tmp_path / "ts"
    (root / "s0001" / "segmentations").mkdir(parents=True)
    shutil.copy(totalseg_dir / "s0001" / "ct.nii.gz", root / "s0001" / "ct.nii.gz")
    shutil.copy(totalseg_dir / "s0001" / "segmentations" / "liver.nii.gz", root / "s0001" / "segmentations")
    (root / "s0003").mkdir()  # a folder without segmentations/
    (root / "meta.csv").write_text("image_id;split\ns0001;train\ns0002;train\ns0003;val\n")
    src = TotalSegmentatorSource(root)
    refs = {r.case_id: r for r in src.find()}
    assert sorted(refs) == ["s0001", "s0002", "s0003"] and refs["s0001"].problem is None
    with pytest.raises(CaseError, match="case s0002: .*meta.csv: listed in meta.csv but there is no case folder"):
        src.load(refs["s0002"])
    with pytest.raises(CaseError, match="case s0003: .*has no segmentations/ folder"):
        src.load(refs["s0003"])


# -- a full disk is one line, and --resume continues once space is freed ----------------------
def _enospc(path="x"):
    import errno

    return OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("stage", ["spill", "manifest"])
def test_full_disk_during_a_build_is_one_error_and_resume_continues(tmp_path, monkeypatch, stage):
    import numpy as np

    import spar_bench.builder.writers.manifest as wm
    from spar_bench.builder.build import build
    from spar_bench.outputs import DiskFullError

    root = write_word(tmp_path / "word")
    clean = tree_hashes(build(word_config(root, tmp_path / "clean"), quiet=True))
    out = tmp_path / "out"
    if stage == "spill":
        real, calls = np.savez, []

        def savez(path, **arrays):
            calls.append(path)
            if len(calls) == 3:
                raise _enospc(path)
            return real(path, **arrays)

        monkeypatch.setattr(np, "savez", savez)
    else:
        monkeypatch.setattr(wm, "write_manifest", lambda out_dir, m: (_ for _ in ()).throw(_enospc()))
    with pytest.raises(DiskFullError) as e:
        build(word_config(root, out), quiet=True)
    msg = str(e.value)
    assert msg.startswith("no space left on the disk while writing ") and "--resume" in msg and "\n" not in msg
    if stage == "spill":
        assert "out.tmp/cases/word__c3.part.npz" in msg
    assert not out.exists() and not (tmp_path / "out.lock").exists()
    monkeypatch.undo()  # space freed
    build(word_config(root, out, resume=True), quiet=True)
    assert tree_hashes(out) == clean


@pytest.mark.slow
def test_full_disk_in_a_real_process_is_one_line_then_resume(tmp_path):
    import subprocess
    import sys

    root = write_word(tmp_path / "word")
    args = ["--source", "word", "--root", str(root), "--out", str(tmp_path / "out"), *SMALL]
    inject = ("import errno, numpy as np, sys\nreal = np.savez\nn = [0]\n"
              "def savez(p, **a):\n    n[0] += 1\n    if n[0] == 2:\n"
              "        raise OSError(errno.ENOSPC, 'No space left on device', str(p))\n    return real(p, **a)\n"
              "np.savez = savez\nfrom spar_bench.builder.cli import main\nmain(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", inject, *args], capture_output=True, encoding="utf-8", errors="replace", timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "no space left on the disk" in errors[0] and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "spar_bench.builder.cli", *args, "--resume"],
                       capture_output=True, encoding="utf-8", errors="replace", timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "manifest.json").is_file() and not (tmp_path / "out.tmp").exists()


def _small_cache_build(fake_root, tmp_path):  # noqa: F811
    from spar_bench.builder.build import build

    return build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)


def test_full_disk_during_a_cache_is_one_error_and_the_rerun_resumes(fake_root, tmp_path, monkeypatch):  # noqa: F811
    import shutil

    import h5py
    import numpy as np

    import spar_bench.probes.cache as pc
    from spar_bench.outputs import DiskFullError

    data = _small_cache_build(fake_root, tmp_path)
    opts = pc.CacheOptions(device="cpu", batch_size=4, dtype="fp32", compute="fp32", levels=["level1"])
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    out = tmp_path / "c.h5"
    with pytest.raises(DiskFullError, match=r"c.h5: the \d+ rows still to write need at least .* but only 10 bytes are free"):
        pc.write_cache("dummy", data, out, opts, progress=False)
    monkeypatch.undo()
    real, n = pc._store_batch, []

    def store(f, item, res, **k):
        n.append(item)
        if len(n) == 2:
            raise _enospc(out)
        return real(f, item, res, **k)

    monkeypatch.setattr(pc, "_store_batch", store)
    with pytest.raises(DiskFullError, match="no space left on the disk while writing .*c.h5.*rerun the same command"):
        pc.write_cache("dummy", data, out, opts, progress=False)
    monkeypatch.undo()
    pc.write_cache("dummy", data, out, opts, progress=False)
    full = pc.write_cache("dummy", data, tmp_path / "full.h5", opts, progress=False)
    with h5py.File(out) as a, h5py.File(full) as b:
        assert a.attrs["complete"] and not (tmp_path / "c.h5.lock").exists()
        for split in ("train", "val", "test"):
            assert np.array_equal(a[f"level1/{split}/layer-1/pooled"][()], b[f"level1/{split}/layer-1/pooled"][()])


# -- one writer per output: OUT.lock / CACHE.lock --------------------------------------------
def test_a_second_build_or_cache_to_one_output_is_refused_naming_the_holder(fake_root, tmp_path):  # noqa: F811
    import os
    import subprocess
    import sys

    from spar_bench.builder.build import build
    from spar_bench.errors import ConfigError
    from spar_bench.locks import output_lock
    from spar_bench.probes.cache import CacheOptions, write_cache

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom spar_bench.locks import output_lock\n"
         "with output_lock(sys.argv[1], what='build'):\n    print('held', flush=True)\n    time.sleep(120)\n",
         str(out)], stdout=subprocess.PIPE, encoding="utf-8", errors="replace")
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"{out} is being written by another build.*pid {holder.pid}"):
            build(build_config(fake_root, out, overwrite=True), quiet=True)
        assert not out.exists() and not (tmp_path / "out.tmp").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its stale lock (dead pid) is taken over
    (tmp_path / "out.lock").write_text(f"{holder.pid}\n")
    build(build_config(fake_root, out, hf=False), quiet=True)
    assert not (tmp_path / "out.lock").exists()
    cache = tmp_path / "c.h5"
    with output_lock(cache, what="feature cache"):
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()}"):
            write_cache("dummy", out, cache, CacheOptions(device="cpu"), progress=False)
    assert not cache.exists()


FORKING_HOLDER = """
import os, sys, time
from spar_bench.locks import output_lock

with output_lock(sys.argv[1], what="feature cache"):
    ready_r, ready_w = os.pipe()
    child = os.fork()  # a reader worker: it must not keep the lock after its holder dies
    if child == 0:  # the fork hooks have run by now (they run before fork() returns here)
        os.write(ready_w, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(ready_r, 1)  # killed before the child first ran, the child would still hold the fd
    print(child, flush=True)
    time.sleep(120)
"""


def test_a_killed_holders_forked_children_do_not_keep_its_lock(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from spar_bench.locks import output_lock

    out = tmp_path / "c.h5"
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(out)], stdout=subprocess.PIPE,
                              encoding="utf-8", errors="replace")
    child = None
    try:
        child = int(holder.stdout.readline())
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        os.kill(child, 0)  # the forked child still runs ...
        with output_lock(out, what="feature cache"):  # ... and the lock is free at once
            pass
    finally:
        holder.kill()
        holder.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- a stopped or killed parallel build, sweep or torchrun: tests/test_signals.py ----------------


def test_merge_to_an_output_being_written_is_refused(tmp_path):
    import os

    from spar_bench.builder.merge import merge
    from spar_bench.errors import ConfigError
    from spar_bench.locks import output_lock

    out = tmp_path / "merged"
    with output_lock(out, what="build"):
        with pytest.raises(ConfigError, match=rf"being written by another build.*pid {os.getpid()}"):
            merge([tmp_path / "p0"], out)
    with pytest.raises(ConfigError, match="partition"):  # lock free again: the usual checks run
        merge([tmp_path / "p0"], out)
    assert not (tmp_path / "merged.lock").exists()
