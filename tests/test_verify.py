"""spar-build verify: an intact build passes; any changed byte, row or file is reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from spar_bench.builder.cli import cli

from helpers import build_config


@pytest.fixture()
def built(fake_root: Path, tmp_path: Path) -> Path:
    from spar_bench.builder.build import build

    return build(build_config(fake_root, tmp_path / "out"), quiet=True)


def run(out: Path):
    return CliRunner().invoke(cli, ["verify", str(out)])


def test_intact_build_is_ok(built: Path) -> None:
    r = run(built)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("OK ")


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_changed_byte_in_a_shard_is_caught(built: Path) -> None:
    shard = sorted((built / "level3").glob("train-*.h5"))[0]
    _flip_byte(shard, shard.stat().st_size // 2)
    r = run(built)
    assert r.exit_code != 0
    assert f"DIFF level3/{shard.name}: sha256" in r.output


def test_changed_parquet_and_card_and_missing_shard(built: Path) -> None:
    pq = sorted((built / "hf" / "level1").glob("*.parquet"))[0]
    _flip_byte(pq, 100)
    with open(built / "hf" / "README.md", "a") as f:
        f.write("edited\n")
    (built / "level2" / "val-00000-of-00001.h5").unlink()
    r = run(built)
    assert r.exit_code != 0
    assert f"hf/level1/{pq.name}: sha256" in r.output
    assert "hf/README.md: sha256" in r.output
    assert "level2/val-00000-of-00001.h5: missing" in r.output


def test_swapped_shard_with_matching_manifest_entry_is_counted(built: Path) -> None:
    # Replace a shard by another and fix ITS hash in the manifest: counts still disagree.
    m = json.loads((built / "manifest.json").read_text())
    a = built / "level1" / "train-00000-of-00002.h5"
    shutil.copy(built / "level1" / "train-00001-of-00002.h5", a)
    from spar_bench.builder.writers.manifest import dumps, fingerprint, sha256_file, shard_entries

    m["shards"]["level1"]["train"][0]["sha256"] = sha256_file(a)
    m["fingerprint"] = fingerprint(shard_entries(m))
    (built / "manifest.json").write_text(dumps(m))
    r = run(built)
    assert r.exit_code != 0
    assert "level1/train-00000-of-00002.h5: 1 rows" in r.output


def test_not_a_build() -> None:
    r = CliRunner().invoke(cli, ["verify", "/nonexistent/build"])
    assert r.exit_code != 0
