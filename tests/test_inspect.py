"""``spar-build inspect`` on the real samples, through the real CLI entry point."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from spar_bench.builder.cli import cli
from spar_bench.builder.inspect import overlay_slice
from spar_bench.clitools import run_cli


def test_inspect_totalsegmentator_png_subprocess(totalseg_dir, tmp_path):
    png_dir = tmp_path / "png"
    proc = subprocess.run(
        [sys.executable, "-m", "spar_bench.builder.cli", "inspect", "--source", "totalsegmentator",
         "--root", str(totalseg_dir), "--png", str(png_dir)],
        capture_output=True, encoding="utf-8", errors="replace", timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "case s0001 (source totalsegmentator, split test)" in out
    assert "found RAS" in out and "(3.0, 3.0, 3.0)" in out and "shape: (30, 101, 122)" in out
    assert "not annotated by source: rectum" in out
    assert "liver=38634" in out  # voxel count of the real liver mask
    png = png_dir / "totalsegmentator_s0001.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_real_word_masks_only(word_labels_dir, monkeypatch, capsys, tmp_path):
    """A masks-only folder is inspected from its masks alone: no image asked for, none drawn."""
    png_dir = tmp_path / "png"
    code = run_cli(cli, ["inspect", "--source", "word", "--root", str(word_labels_dir), "--case", "word_0014",
                         "--png", str(png_dir)])
    out = capsys.readouterr().out
    assert code == 0
    assert "found LPS" in out and "spacing (z,row,col) mm:" in out and "present (16)" in out
    assert "image: none (masks only" in out and "problems: none" in out
    png = png_dir / "word_word_0014.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code = run_cli(cli, ["inspect", "--source", "word", "--root", str(word_labels_dir), "--case", "word_0014",
                         "--images", "require"])
    assert code == 2 and "--images synthesize" in capsys.readouterr().err

    from spar_bench.builder.synth import render

    monkeypatch.setattr(render, "render_pseudo_ct",
                        lambda mask, spacing, *, lesion=None, seed: np.zeros(mask.shape, np.int16))
    code = run_cli(cli, ["inspect", "--source", "word", "--root", str(word_labels_dir),
                         "--case", "word_0014", "--images", "synthesize"])
    out = capsys.readouterr().out
    assert code == 0
    assert "found LPS" in out and "pseudo-CT (synthesized)" in out
    assert "present (16)" in out and "1 case(s) read, 0 skipped" in out


def test_inspect_unknown_case_and_source(totalseg_dir, capsys):
    assert run_cli(cli, ["inspect", "--source", "totalsegmentator", "--root", str(totalseg_dir),
                         "--case", "s9999"]) == 2
    assert "s9999" in capsys.readouterr().err
    assert run_cli(cli, ["inspect", "--source", "wrod", "--root", str(totalseg_dir)]) == 2
    assert "did you mean 'word'" in capsys.readouterr().err.lower()


def test_overlay_slice_prefers_most_organs():
    mask = np.zeros((9, 4, 4), dtype=np.uint8)
    mask[1, 0, 0] = 1
    mask[6, 0, 0], mask[6, 1, 1], mask[6, 2, 2] = 1, 2, 3
    mask[7, 0, 0] = 4
    assert overlay_slice(mask) == 6
    assert overlay_slice(np.zeros((5, 2, 2), dtype=np.uint8)) == 2


def test_inspect_help_lists_options(capsys):
    assert run_cli(cli, ["inspect", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--source", "--root", "--case", "--images", "--png", "--on-error [fail|skip]"):
        assert opt in out
