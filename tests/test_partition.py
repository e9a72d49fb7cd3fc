"""--partition I/N + merge gives the bytes of a one-machine build; bad merges are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli
from spar_bench.builder.partition import partition_of
from spar_bench.clitools import run_cli
from spar_bench.errors import ConfigError
from spar_bench.partitions import parse_partition

from helpers import tree_hashes

OPTS = ["--samples-per-case", "1", "--counterfactual", "mirror", "--shard-size", "7", "--seed", "4"]


@pytest.fixture(scope="module")
def phantom(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("part") / "ph"
    assert run_cli(cli, ["phantom", "--out", str(root), "--n", "7", "--seed", "5"]) == 0
    return root


@pytest.fixture(scope="module")
def single(phantom: Path) -> Path:
    out = phantom.parent / "single"
    assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(out), *OPTS]) == 0
    return out


def _partitions(phantom: Path, n: int, tag: str) -> list[Path]:
    parts = []
    for i in range(n):
        out = phantom.parent / f"{tag}-{i}"
        assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(out),
                             "--partition", f"{i}/{n}", *OPTS]) == 0
        parts.append(out)
    return parts


@pytest.mark.slow
def test_three_partitions_merge_to_the_single_build(phantom: Path, single: Path) -> None:
    parts = _partitions(phantom, 3, "p3")
    sizes = [len(json.loads((p / "partition.json").read_text())["records"]) for p in parts]
    assert sum(sizes) == 7 and all(s > 0 for s in sizes), sizes
    merged = phantom.parent / "merged"
    assert run_cli(cli, ["merge", *map(str, reversed(parts)), "--out", str(merged),
                         "--jobs", "2"]) == 0
    assert tree_hashes(merged) == tree_hashes(single)
    assert run_cli(cli, ["verify", str(merged)]) == 0


@pytest.mark.slow
def test_merge_refuses_missing_or_mismatched_partitions(phantom: Path, capsys) -> None:
    parts = _partitions(phantom, 2, "p2")
    out = phantom.parent / "bad"
    assert run_cli(cli, ["merge", str(parts[0]), "--out", str(out)]) == 2
    assert "missing [1]" in capsys.readouterr().err
    other = phantom.parent / "other-1"
    assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(other),
                         "--partition", "1/2", *OPTS[:-1], "9"]) == 0
    assert run_cli(cli, ["merge", str(parts[0]), str(other), "--out", str(out)]) == 2
    assert "config differs" in capsys.readouterr().err
    assert not out.exists()


def test_partition_rule_is_stable_and_parsed_strictly() -> None:
    assert partition_of("word", "word_0001", 4) == partition_of("word", "word_0001", 4)
    assert {partition_of("word", f"c{i}", 3) for i in range(50)} == {0, 1, 2}
    assert parse_partition("2/8") == (2, 8)
    for bad in ("8/8", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="--partition"):
            parse_partition(bad)
