"""spar_bench.builder.build end to end on tiny synthetic cases (fake source + the real samplers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.errors import CaseError, ConfigError

from helpers import build_config, tree_hashes


@pytest.mark.slow
def test_build_end_to_end(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build
    from spar_bench.builder.shards import Build

    out = build(build_config(fake_root, tmp_path / "out"), quiet=True)
    assert not (tmp_path / "out.tmp").exists()
    b = Build(out)
    assert b.levels() == ["level1", "level2", "level3"]
    assert b.splits("level1") == ["train", "val", "test"]
    assert b.count("level1", "train") == 6  # 3 cases x 2 samples
    keys = b.read("level1", "train", ["key", "case_id"])
    assert list(keys["key"]) == sorted(keys["key"])  # ordered by (source, case_id)
    n3 = b.count("level3", "train")
    assert n3 > 5 and len(b.shard_paths("level3", "train")) == -(-n3 // 5)
    q = b.read("level3", "train", ["q_slice", "q_probe", "q_answer", "q_key"])
    sk = b.read("level3", "train", ["key"])["key"]
    assert all(qk.startswith(sk[s] + "/q") for qk, s in zip(q["q_key"], q["q_slice"], strict=True))
    assert (q["q_answer"] >= 0).all()  # thresholds applied (size/distance no longer -1)
    m = b.manifest
    assert m["thresholds"]["origin"].startswith("fitted on split 'train'")
    assert "workers" not in m["config"] and m["seed"] == 7
    assert m["sources"]["fake"]["label_map"] == {"1": "liver"}
    assert [c["case_id"] for c in m["cases"]] == ["c1", "c2", "c3", "c4", "c5"]
    assert m["counts"]["level1"]["train"]["samples"] == 6
    assert len(m["hf"]["files"]) == sum(len(s) for lv in m["shards"].values() for s in lv.values())
    _check_level_specs(b)


def _check_level_specs(b) -> None:
    """What schema.LEVEL_SPECS declares per level is what the build wrote."""
    from spar_bench.builder.schema import LEVEL_SPECS
    from spar_bench.builder.shards import open_shard

    assert b.levels() == ["level1", "level2", "level3"]  # Level 4 (volumes) is opt-in
    for level in b.levels():
        spec = LEVEL_SPECS[level]
        fields = set(b.fields(level, "train"))
        assert set(b.manifest["counts"][level]["train"]) == {spec.unit, "questions", "classes"}
        assert ("present" in fields) == spec.mosaic and ("perm" in fields) == spec.shuffled
        assert ("q_probe" in fields) == bool(spec.questions) == (b.count_questions(level, "train") > 0)
        with open_shard(b.shard_paths(level, "train")[0]) as f:
            assert ("arrangement" in f.attrs) == spec.shuffled


@pytest.mark.slow
def test_build_is_byte_identical_across_runs_and_workers(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    a = tree_hashes(build(build_config(fake_root, tmp_path / "a", workers=1), quiet=True))
    b = tree_hashes(build(build_config(fake_root, tmp_path / "b", workers=2), quiet=True))
    assert len(a) > 10
    assert a == b  # every shard, every Parquet file, the card AND the manifest
    c = tree_hashes(build(build_config(fake_root, tmp_path / "c", seed=8), quiet=True))
    assert c["level1/train-00000-of-00002.h5"] != a["level1/train-00000-of-00002.h5"]


def test_refuses_non_empty_out(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty; pass --overwrite"):
        build(build_config(fake_root, out), quiet=True)
    with pytest.raises(ConfigError, match="not a SPAR-Bench build"):
        build(build_config(fake_root, out, resume=True), quiet=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_resume_after_interruption_equals_clean_build(fake_root: Path, tmp_path: Path, monkeypatch) -> None:
    import spar_bench.builder.build as bb

    clean = tree_hashes(bb.build(build_config(fake_root, tmp_path / "clean"), quiet=True))
    real = bb.process_one
    calls = []

    def flaky(job):
        calls.append(job.ref.case_id)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(job)

    monkeypatch.setattr(bb, "process_one", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        bb.build(build_config(fake_root, out), quiet=True)
    assert not out.exists() and len(list((tmp_path / "out.tmp" / "cases").glob("*.json"))) == 2
    with pytest.raises(ConfigError, match="--resume"):
        bb.build(build_config(fake_root, out), quiet=True)
    monkeypatch.setattr(bb, "process_one", real)
    calls.clear()
    with pytest.raises(ConfigError, match="other options"):
        bb.build(build_config(fake_root, out, resume=True, seed=99), quiet=True)
    bb.build(build_config(fake_root, out, resume=True), quiet=True)
    assert tree_hashes(out) == clean


def test_on_error_fail_and_skip(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build
    from spar_bench.builder.shards import Build

    listing = json.loads((fake_root / "cases.json").read_text()) + [["c9bad", "train"]]
    (fake_root / "cases.json").write_text(json.dumps(listing))
    with pytest.raises(CaseError, match="c9bad.*value 99.*--on-error skip"):
        build(build_config(fake_root, tmp_path / "o1"), quiet=True)
    out = build(build_config(fake_root, tmp_path / "o2", on_error="skip"), quiet=True)
    skipped = Build(out).manifest["skipped"]
    assert [s["case_id"] for s in skipped] == ["c9bad"] and "value 99" in skipped[0]["reason"]


def test_thresholds_without_train_split(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    (fake_root / "cases.json").write_text(json.dumps([["c1", "test"], ["c2", "test"]]))
    with pytest.raises(ConfigError, match="--thresholds-from.*--fit-thresholds-on"):
        build(build_config(fake_root, tmp_path / "o1"), quiet=True)
    out = build(build_config(fake_root, tmp_path / "o2", fit_thresholds_on="test"), quiet=True)
    m = json.loads((out / "manifest.json").read_text())
    out3 = build(build_config(fake_root, tmp_path / "o3", thresholds_from=str(out)), quiet=True)
    m3 = json.loads((out3 / "manifest.json").read_text())
    assert m3["thresholds"]["values"] == m["thresholds"]["values"]
    assert m3["thresholds"]["origin"] == f"from build {m['fingerprint']} (../o2)"


@pytest.mark.slow
def test_real_word_masks_build_identical_across_workers(word_labels_dir: Path, tmp_path: Path) -> None:
    """Two real WORD label maps (pseudo-CT rendered): workers 1 and 2 give the same bytes."""
    from spar_bench.builder.build import BuildConfig, build
    from spar_bench.builder.shards import Build

    sub = tmp_path / "word" / "labelsTs"
    sub.mkdir(parents=True)
    for f in sorted((word_labels_dir / "labelsTs").glob("*.nii.gz"))[:2]:
        (sub / f.name).symlink_to(f.resolve())
    hashes = []
    for w in (1, 2):
        cfg = BuildConfig(sources=("word",), roots=(str(tmp_path / "word"),), out=str(tmp_path / f"o{w}"),
                          sample={"samples_per_case": 2}, images="synthesize", workers=w,
                          fit_thresholds_on="test", shard_size=50)
        hashes.append(tree_hashes(build(cfg, quiet=True)))
    assert hashes[0] == hashes[1]
    b = Build(tmp_path / "o1")
    assert b.splits("level3") == ["test"] and b.count_questions("level3", "test") > 50
    assert all(c["image_synthesized"] for c in b.manifest["cases"])


def test_build_names_no_probe() -> None:
    """The orchestrator knows levels, not probes: the open answers are finished by the level's
    hooks (samples/levels.py), so build.py holds no probe name and no threshold rule."""
    import ast

    from spar_bench.builder import build as build_module
    from spar_bench.builder.schema import LEVEL3_PROBES, PROBES

    tree = ast.parse(Path(build_module.__file__).read_text(encoding="utf-8"))
    names = set(LEVEL3_PROBES) | set(PROBES)
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not found, f"build.py names the probe(s) {found}"
    assert not used & {"apply_thresholds", "fit_thresholds", "original_questions"}
    assert not [n for n in used if n.startswith("LEVEL3_")]  # a level's probes: LevelSpec.probes
