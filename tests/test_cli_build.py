"""spar-build root options: data-folder messages, refused OUT, resume, a phantom build."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli
from spar_bench.clitools import run_cli

from helpers import tree_hashes

SMALL = ["--samples-per-case", "2", "--shard-size", "5", "--seed", "3"]


def test_help_lists_options_without_importing_heavy_libraries() -> None:
    code = ("import sys\nfrom spar_bench.builder.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'h5py', 'datasets', 'SimpleITK', 'pyarrow') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, encoding="utf-8", errors="replace", timeout=120)
    assert r.returncode == 0, r.stderr
    for opt in ("--source", "--root", "--out", "--levels", "--jobs", "--counterfactual",
                "--thresholds-from", "--fit-thresholds-on", "--resume", "--overwrite",
                "--on-error", "--no-hf", "--shard-size", "--images", "--arrangement"):
        assert opt in r.stdout
    assert "--workers" not in r.stdout  # the old spelling of --jobs is hidden


def test_missing_data_dir_says_where_it_looked(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPAR_DATA_WORD", raising=False)
    assert run_cli(cli, ["--source", "word", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "data" / "word") in err and "--root DIR" in err and "SPAR_DATA_WORD" in err
    monkeypatch.setenv("SPAR_DATA_WORD", str(tmp_path / "elsewhere"))
    assert run_cli(cli, ["--source", "word", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "elsewhere") in err and "$SPAR_DATA_WORD" in err
    assert run_cli(cli, ["--source", "word", "--root", "nope", "--out", "out"]) == 2
    assert "looked at --root" in capsys.readouterr().err
    assert run_cli(cli, ["--source", "word"]) == 2
    assert "missing --out" in capsys.readouterr().err


def test_refuses_non_empty_out(fake_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep me")
    assert run_cli(cli, ["--source", "fake", "--root", str(fake_root), "--out", str(out), *SMALL]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "x").read_text() == "keep me"


@pytest.mark.slow
def test_cli_resume_after_interruption_equals_clean_build(
    fake_root: Path, tmp_path: Path, monkeypatch
) -> None:
    import spar_bench.builder.build as bb

    args = ["--source", "fake", "--root", str(fake_root), *SMALL, "--jobs", "2"]
    assert run_cli(cli, [*args, "--out", str(tmp_path / "clean")]) == 0
    clean = tree_hashes(tmp_path / "clean")

    real, n = bb.process_one, [0]

    def dies_on_fourth(job):
        n[0] += 1
        if n[0] == 4:
            raise RuntimeError("simulated crash")
        return real(job)

    monkeypatch.setattr(bb, "process_one", dies_on_fourth)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        run_cli(cli, [*args, "--jobs", "1", "--out", str(out)])
    monkeypatch.setattr(bb, "process_one", real)
    assert run_cli(cli, [*args, "--out", str(out)]) == 2  # interrupted work dir, no --resume
    assert run_cli(cli, [*args, "--out", str(out), "--resume"]) == 0
    assert tree_hashes(out) == clean
    assert run_cli(cli, [*args, "--out", str(out), "--resume"]) == 2  # already finished
    assert run_cli(cli, [*args, "--out", str(out), "--overwrite", "--no-hf"]) == 0
    assert not (out / "hf").exists()


@pytest.mark.slow
def test_phantom_build_end_to_end_and_verify(tmp_path: Path) -> None:
    from spar_bench.builder.phantom.generate import PhantomOptions, write_phantom_dataset
    from spar_bench.builder.shards import Build

    write_phantom_dataset(tmp_path / "ph", 4, PhantomOptions(layout="canonical", seed=1), progress=False)
    out = tmp_path / "out"
    assert run_cli(cli, ["--source", "phantom", "--root", str(tmp_path / "ph"), "--out", str(out),
                         "--samples-per-case", "3", "--counterfactual", "mirror",
                         "--jobs", "2"]) == 0
    b = Build(out)
    assert b.levels() == ["level1", "level2", "level3"]
    assert b.count("level1", "train") > 0 and b.count_questions("level3", "train") > 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"]["phantom"]["label_map"]
    assert all(len(c["provenance"]) > 0 for c in m["cases"])
    assert run_cli(cli, ["verify", str(out)]) == 0
    first = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert run_cli(cli, ["--source", "phantom", "--root", str(tmp_path / "ph"), "--out", str(out),
                         "--samples-per-case", "3", "--counterfactual", "mirror",
                         "--overwrite"]) == 0
    assert hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest() == first


@pytest.mark.slow
def test_workers_is_the_hidden_old_spelling_of_jobs(fake_root: Path, tmp_path: Path, capsys) -> None:
    """--workers (renamed --jobs in 0.2, removed in 0.3) still works, hidden; given with --jobs it is refused."""
    args = ["--source", "fake", "--root", str(fake_root), *SMALL, "--levels", "level1", "--no-hf"]
    assert run_cli(cli, [*args, "--jobs", "2", "--out", str(tmp_path / "new")]) == 0
    assert "--workers" not in capsys.readouterr().err
    assert run_cli(cli, [*args, "--workers", "2", "--out", str(tmp_path / "old")]) == 0
    capsys.readouterr()
    assert tree_hashes(tmp_path / "old") == tree_hashes(tmp_path / "new")
    assert run_cli(cli, [*args, "--workers", "2", "--jobs", "3", "--out", str(tmp_path / "both")]) == 2
    assert "give --jobs only" in capsys.readouterr().err and not (tmp_path / "both").exists()
    for sub in (["phantom", "--out", str(tmp_path / "ph"), "--n", "1"], ["merge", str(tmp_path / "p0"),
                                                                        "--out", str(tmp_path / "m")]):
        assert run_cli(cli, [*sub, "--workers", "0"]) == 2  # the alias is checked like --jobs
        assert "--workers" in capsys.readouterr().err
        assert run_cli(cli, [*sub, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--jobs" in out and "--workers" not in out
