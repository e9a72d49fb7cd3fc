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
