"""Heads do not trust what they are given (issue 14, item 4): one-line refusals, no run left.

A NaN cache, a shard edited after the build, option values that mean nothing and a
corrupt ``head.pt`` each end in one line naming the file and the problem (exit 2), and
leave no ``metrics.json`` that would look like a result.
"""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from helpers import run_cmd

PROBE = "level3.relative_position"


def _fit(cache, out, *extra) -> int:
    from spar_bench.probes.cli import cli

    return run_cmd(cli, ["fit", "--features", cache, "--out", out, "--bootstrap", 20, "--probe", PROBE,
                      "--max-epochs", 1, "--no-controls", *extra])  # fmt: skip


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("head", ["mlp", "transformer"])
def test_a_nan_cache_is_refused_naming_cache_level_and_layer(pipeline, tmp_path, capsys, head):
    cache = tmp_path / "nan.h5"
    shutil.copy(pipeline["cache"], cache)
    with h5py.File(cache, "r+") as f:
        g = f["level3/train/layer-1"]
        g["pooled"][...] = np.nan
        g["tokens"][...] = np.nan
    assert _fit(cache, tmp_path / "runs", "--head", head, "--data", pipeline["shards"]) == 2
    err = _one_line(capsys)
    assert str(cache) in err and "level3/train layer -1" in err and "non-finite" in err
    assert not list((tmp_path / "runs").rglob("metrics.json"))


def test_fit_rehashes_the_shards_it_reads_against_the_manifest(pipeline, tmp_path, capsys):
    build = tmp_path / "shards"
    shutil.copytree(pipeline["shards"], build)
    shard = sorted((build / "level3").glob("train-*.h5"))[0]
    with h5py.File(shard, "r+") as f:  # edit one answer: the manifest (and fingerprint) stay
        a = f["q_answer"][...]
        a[0] = 1 - a[0]
        f["q_answer"][...] = a
    assert _fit(pipeline["cache"], tmp_path / "runs", "--data", build) == 2
    err = _one_line(capsys)
    assert str(shard) in err and "sha256 differs" in err
    assert not list((tmp_path / "runs").rglob("metrics.json"))


@pytest.mark.parametrize("flag,value,message", [
    ("--max-epochs", 0, "--max-epochs must be at least 1, got 0"),
    ("--batch-size", 0, "--batch-size must be at least 1, got 0"),
    ("--lr", -1, "--lr must be > 0, got -1.0"),
    ("--bootstrap", 0, "--bootstrap must be at least 1, got 0"),
])  # fmt: skip
def test_option_values_that_mean_nothing_are_one_line_errors(pipeline, tmp_path, capsys, flag, value, message):
    assert _fit(pipeline["cache"], tmp_path, flag, value) == 2
    assert message in _one_line(capsys)
    assert not list(tmp_path.rglob("metrics.json"))


def test_eval_on_a_corrupt_head_is_one_line(pipeline, tmp_path, capsys):
    from spar_bench.probes.cli import cli

    assert _fit(pipeline["cache"], tmp_path) == 0
    (head,) = tmp_path.rglob("head.pt")
    head.write_bytes(head.read_bytes()[:200])
    capsys.readouterr()
    assert run_cmd(cli, ["eval", "--run", head.parent, "--features", pipeline["cache"]]) == 2
    err = _one_line(capsys)
    assert str(head) in err and "unreadable trained head" in err
