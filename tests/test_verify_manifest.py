"""The manifest checks itself: ``field_sha256`` records the sha256 of every top-level field, so
``spar-build verify`` names a hand-edited ``config`` or ``thresholds`` (whose shards, and so
fingerprint, are unchanged), and ``--thresholds-from`` refuses such a manifest (issue 39, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from spar_bench.builder.cli import cli
from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.builder.writers.manifest import dumps
from spar_bench.errors import ConfigError

from helpers import build_config


def _edit(out: Path, change) -> None:
    """Apply ``change`` to OUT's manifest and write it back as the builder would (canonical JSON)."""
    m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    change(m)
    (out / "manifest.json").write_text(dumps(m), encoding="utf-8")


def _verify(out: Path) -> tuple[int, list[str]]:
    r = CliRunner().invoke(cli, ["verify", str(out)])
    return r.exit_code, r.output.splitlines()


@pytest.fixture()
def synthetic(tmp_path: Path) -> Path:
    return write_synthetic_build(tmp_path / "b", 4, levels=("level1",), shard_size=2)


def test_the_digests_cover_every_field_but_the_fingerprint(synthetic: Path) -> None:
    from spar_bench.builder.writers.manifest import field_digests

    m = json.loads((synthetic / "manifest.json").read_text(encoding="utf-8"))
    assert set(m["field_sha256"]) == set(m) - {"fingerprint", "field_sha256"}
    assert m["field_sha256"] == field_digests(m)
    assert _verify(synthetic)[0] == 0


def test_verify_names_an_edited_config(synthetic: Path) -> None:
    _edit(synthetic, lambda m: m["config"].update(shard_size=3))
    code, lines = _verify(synthetic)
    assert code != 0
    diffs = [ln for ln in lines if ln.startswith("DIFF ")]
    assert len(diffs) == 1 and diffs[0].startswith("DIFF manifest.json: field 'config' edited after the build")


def test_verify_names_added_removed_fields_and_an_old_manifest(synthetic: Path) -> None:
    def add_and_remove(m: dict) -> None:
        m["note"] = "mine"
        del m["seed"]

    _edit(synthetic, add_and_remove)
    code, lines = _verify(synthetic)
    assert code != 0
    assert "DIFF manifest.json: field 'note' added after the build (field_sha256 does not list it); remove it" in lines
    assert any(ln.startswith("DIFF manifest.json: field 'seed' removed after the build") for ln in lines)
    _edit(synthetic, lambda m: m.pop("field_sha256"))
    code, lines = _verify(synthetic)
    assert code != 0 and any(ln.startswith("DIFF manifest.json: no field_sha256") for ln in lines)


def test_edited_thresholds_fail_verify_and_thresholds_from(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    out = build(build_config(fake_root, tmp_path / "train"), quiet=True)
    th = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["thresholds"]["values"]
    assert th and _verify(out)[0] == 0

    def halve(values: dict) -> dict:  # every cut of the tertiles, wherever it is nested
        if isinstance(values, dict):
            return {k: halve(v) for k, v in values.items()}
        if isinstance(values, list):
            return [halve(v) for v in values]
        return values / 2 if isinstance(values, float) else values

    _edit(out, lambda m: m["thresholds"].update(values=halve(m["thresholds"]["values"])))
    code, lines = _verify(out)
    assert code != 0
    diffs = [ln for ln in lines if ln.startswith("DIFF ")]
    assert len(diffs) == 1 and diffs[0].startswith("DIFF manifest.json: field 'thresholds' edited after the build")
    with pytest.raises(ConfigError, match=r"--thresholds-from .*manifest.json: field 'thresholds' edited after "
                                          r"the build .*give an intact build") as e:
        build(build_config(fake_root, tmp_path / "moved", thresholds_from=str(out)), quiet=True)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "moved").exists() or not any((tmp_path / "moved").iterdir())
