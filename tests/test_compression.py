"""Shards readable without hdf5plugin (--compression) and the numpy-only synthetic build."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli
from spar_bench.builder.shards import Build
from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.clitools import run_cli
from spar_bench.errors import ConfigError


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("compression")
    assert run_cli(cli, ["phantom", "--out", str(tmp / "ph"), "--n", "3", "--seed", "2"]) == 0
    out = {}
    for comp in ("blosc", "gzip", "none"):
        out[comp] = tmp / comp
        assert run_cli(cli, ["--source", "phantom", "--root", str(tmp / "ph"), "--out", str(out[comp]),
                             "--samples-per-case", "1", "--no-hf", "--compression", comp]) == 0
    return out


def _all_arrays(root: Path) -> dict[str, np.ndarray]:
    b = Build(root)
    return {f"{lv}/{sp}/{k}": v for lv in b.levels() for sp in b.splits(lv)
            for k, v in b.read(lv, sp).items()}


def test_compressions_hold_the_same_arrays(builds: dict[str, Path]) -> None:
    ref = _all_arrays(builds["blosc"])
    for comp in ("gzip", "none"):
        got = _all_arrays(builds[comp])
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{comp}: {k}")


def test_gzip_shards_read_without_hdf5plugin(builds: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "hdf5plugin", None)  # import hdf5plugin -> ImportError
    b = Build(builds["gzip"])
    assert b.images("level3", "train", np.array([0])).shape == (1, 224, 224)
    with pytest.raises(ConfigError, match="blosc-compressed and hdf5plugin is not installed"):
        Build(builds["blosc"]).images("level3", "train", np.array([0]))


def test_unknown_compression_is_one_line(builds: dict[str, Path], capsys) -> None:
    root = builds["gzip"].parent / "ph"
    assert run_cli(cli, ["--source", "phantom", "--root", str(root), "--out",
                         str(root.parent / "x"), "--compression", "zip"]) == 2
    assert "zip" in capsys.readouterr().err


def test_synthetic_build_is_a_valid_deterministic_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "hdf5plugin", None)
    a = write_synthetic_build(tmp_path / "a", 40, shard_size=8, seed=3)
    b = write_synthetic_build(tmp_path / "b", 40, shard_size=8, seed=3)
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    build = Build(a)
    assert build.manifest["synthetic"] is True
    assert sum(build.count(lv, "train") for lv in build.levels()) == 40
    keys = build.read("level3", "train", ["key"])["key"]
    assert len(set(keys)) == len(keys) == 20
    img = build.images("level3", "train", np.arange(3))
    assert img.dtype == np.uint8 and img.std() > 10  # a body with organs, not a blank frame
