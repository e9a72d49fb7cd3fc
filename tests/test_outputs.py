"""--overwrite never deletes what SPAR-Bench did not write (builds, phantoms, caches, runs, reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli
from spar_bench.clitools import run_cli
from spar_bench.errors import ConfigError
from spar_bench.outputs import check_target, claim

from helpers import tree_hashes


@pytest.fixture(scope="module")
def phantom_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ph") / "phantom"
    assert run_cli(cli, ["phantom", "--out", str(root), "--n", "4", "--seed", "1"]) == 0
    return root


def _build(root: Path, out: Path, *extra: str) -> int:
    return run_cli(cli, ["--source", "phantom", "--root", str(root), "--out", str(out),
                         "--samples-per-case", "1", "--levels", "level3", "--no-hf", *extra])


@pytest.mark.slow
def test_out_equal_to_root_survives_overwrite(phantom_root: Path, capsys) -> None:
    before = tree_hashes(phantom_root)
    assert _build(phantom_root, phantom_root, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "is the input" in err and err.count("\n") == 1
    assert tree_hashes(phantom_root) == before


def test_out_containing_or_inside_root_is_refused(phantom_root: Path, capsys) -> None:
    before = tree_hashes(phantom_root)
    assert _build(phantom_root, phantom_root.parent, "--overwrite") == 2
    assert "contains the input" in capsys.readouterr().err
    assert _build(phantom_root, phantom_root / "imagesTr" / "out", "--overwrite") == 2
    assert "lies inside the input" in capsys.readouterr().err
    assert tree_hashes(phantom_root) == before


def test_foreign_folder_survives_overwrite(phantom_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.docx").write_bytes(b"four years of work")
    assert _build(phantom_root, out, "--overwrite") == 2
    assert "not a SPAR-Bench build" in capsys.readouterr().err
    assert (out / "thesis.docx").read_bytes() == b"four years of work"
    assert not (tmp_path / "thesis.tmp").exists()


def test_out_that_is_a_file_is_refused(phantom_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert _build(phantom_root, out, "--overwrite") == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "keep me"


def test_overwrite_replaces_a_build_but_not_a_build_with_extra_files(
    phantom_root: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "b"
    assert _build(phantom_root, out) == 0
    first = tree_hashes(out)
    assert _build(phantom_root, out, "--overwrite") == 0
    assert tree_hashes(out) == first
    (out / "level3" / "my-notes.md").write_text("mine")
    capsys.readouterr()
    assert _build(phantom_root, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "did not write (level3/my-notes.md)" in err
    assert (out / "level3" / "my-notes.md").read_text() == "mine"
    assert (out / "manifest.json").is_file()


def test_foreign_work_folder_is_not_deleted(phantom_root: Path, tmp_path: Path, capsys) -> None:
    work = tmp_path / "b.tmp"
    work.mkdir()
    (work / "data.csv").write_text("1,2")
    assert _build(phantom_root, tmp_path / "b", "--overwrite") == 2
    assert "not a SPAR-Bench work folder" in capsys.readouterr().err
    assert (work / "data.csv").read_text() == "1,2"


@pytest.mark.slow
def test_phantom_overwrite_refuses_a_phantom_with_extra_files(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ph"
    assert run_cli(cli, ["phantom", "--out", str(out), "--n", "2"]) == 0
    (out / "README.txt").write_text("mine")
    assert run_cli(cli, ["phantom", "--out", str(out), "--n", "2", "--overwrite"]) == 2
    assert "README.txt" in capsys.readouterr().err
    assert (out / "README.txt").read_text() == "mine"
    (out / "README.txt").unlink()
    assert run_cli(cli, ["phantom", "--out", str(out), "--n", "3", "--overwrite"]) == 0
    assert len(json.loads((out / "phantom.json").read_text())["cases"]) == 3


def test_claim_rules(tmp_path: Path) -> None:
    def owned(p: Path):
        return {"a.txt"} if (p / "a.txt").exists() else None

    assert claim(tmp_path / "absent", overwrite=False, owned=owned, what="x") is False
    (tmp_path / "empty").mkdir()
    assert claim(tmp_path / "empty", overwrite=False, owned=owned, what="x") is False
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("1")
    with pytest.raises(ConfigError, match="pass --overwrite"):
        claim(d, overwrite=False, owned=owned, what="x")
    assert claim(d, overwrite=True, owned=owned, what="x") is True
    (d / "b.txt").write_text("2")
    with pytest.raises(ConfigError, match=r"did not write \(b.txt\)"):
        claim(d, overwrite=True, owned=owned, what="x")
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        check_target(d, folder=False)


def test_cache_overwrite_refuses_a_foreign_file(tmp_path: Path, capsys) -> None:
    from spar_bench.probes.cli import cli as probe_cli

    build = tmp_path / "b"
    build.mkdir()
    foreign = tmp_path / "results.h5"
    foreign.write_bytes(b"not a cache")
    code = run_cli(probe_cli, ["cache", "--encoder", "dummy", "--data", str(build),
                               "--out", str(foreign), "--overwrite"])
    assert code == 2 and "not a SPAR-Bench feature cache" in capsys.readouterr().err
    assert foreign.read_bytes() == b"not a cache"
    inside = build / "cache.h5"
    code = run_cli(probe_cli, ["cache", "--encoder", "dummy", "--data", str(build),
                               "--out", str(inside)])
    assert code == 2 and "lies inside the input" in capsys.readouterr().err


def test_report_refuses_a_foreign_folder(tmp_path: Path) -> None:
    from spar_bench.probes.runs.report import write_report

    out = tmp_path / "report"
    out.mkdir()
    (out / "paper.tex").write_text("mine")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="not a SPAR-Bench report folder"):
        write_report(tmp_path / "runs", out)
    assert (out / "paper.tex").read_text() == "mine"


def test_run_folder_with_foreign_files_is_refused(tmp_path: Path) -> None:
    import torch

    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.runs.store import HEAD_FILES, check_run_dir, save_head, write_run

    rd = tmp_path / "enc" / "level3.size" / "mlp" / "seed0"
    rd.mkdir(parents=True)
    (rd / "draft.txt").write_text("mine")
    model = torch.nn.Linear(2, 2)
    rec = RunRecord(kind="head", probe="level3.size", head="mlp", seed=0)
    files = {"head.pt": (lambda p: save_head(p, model, rec.to_dict()), True)}
    with pytest.raises(ConfigError, match="not a SPAR-Bench run folder"):
        check_run_dir(rd, HEAD_FILES)
    assert (rd / "draft.txt").read_text() == "mine"
    (rd / "draft.txt").unlink()
    check_run_dir(rd, HEAD_FILES)
    write_run(rd, rec, {}, files)
    check_run_dir(rd, HEAD_FILES)  # a run of its own: allowed
    write_run(rd, rec, {"x": 1}, files)
    assert json.loads((rd / "metrics.json").read_text()) == {"x": 1}
