"""Faults and careless input (issue 14): nothing lost, nothing stale, nothing silent.

Options that mean nothing, stray files in a build, stale or torn spills on --resume,
a full disk, two writers on one output, killed parallel builds.
"""

from __future__ import annotations

import pytest
from helpers import build_config
from spar_bench.builder.cli import cli

from spar_bench.clitools import run_cli

SMALL = ["--samples-per-case", "2", "--shard-size", "5", "--seed", "3", "--no-hf"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# -- options that mean nothing are errors, never silently replaced by defaults ---------------
@pytest.mark.parametrize("option, value, words", [
    ("--shard-size", "0", "--shard-size must be >= 1, got 0"),
    ("--workers", "0", "--workers must be >= 1, got 0"),
    ("--workers", "-1", "--workers must be >= 1, got -1"),
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


@pytest.mark.parametrize("kw, words", [({"batch": 0}, "--batch must be >= 1"),
                                        ({"workers": -1}, "--workers must be >= 0")])
def test_cache_refuses_meaningless_option_values(fake_root, tmp_path, kw, words):
    from spar_bench.builder.build import build
    from spar_bench.probes.cache import write_cache

    from spar_bench.errors import ConfigError

    out = build(build_config(fake_root, tmp_path / "b", hf=False), quiet=True)
    with pytest.raises(ConfigError, match=words):
        write_cache("dummy", out, tmp_path / "c.h5", device="cpu", progress=False, **kw)
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
    from test_build import make_case

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
        calls.append(job["ref"].case_id)
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
    loaded = []
    real_load = bb._samples_api().process_case

    def counting(case, *a, **k):
        loaded.append(case.case_id)
        return real_load(case, *a, **k)

    monkeypatch.setattr(bb._samples_api(), "process_case", counting)
    bb.build(word_config(root, out, resume=True), quiet=True)
    assert loaded == ["c4"]  # c1..c3 reused, not recomputed
