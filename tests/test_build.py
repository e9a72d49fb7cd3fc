"""spar_bench.builder.build end to end on tiny synthetic cases (fake source + the real samplers)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from spar_bench.builder.case import Case, CaseRef
from spar_bench.builder.schema import ORGAN_ID
from spar_bench.builder.sources import SOURCES
from spar_bench.builder.sources.base import Source

from spar_bench.errors import CaseError, ConfigError

SMALL_SAMPLE = {"samples_per_case": 2, "l3_stride": 4, "l3_questions_per_probe": 2}


def make_case(case_id: str, split: str, seed: int) -> Case:
    """A 16-slice 48x48 'abdomen': body ellipse, liver right, spleen left, two kidneys."""
    rng = np.random.default_rng(seed)
    z, r, c = np.mgrid[0:16, 0:48, 0:48]
    body = ((r - 24) / 20.0) ** 2 + ((c - 24) / 22.0) ** 2 <= 1.0
    mask = np.zeros((16, 48, 48), np.uint8)
    jit = int(rng.integers(0, 3))

    def box(name, rows, cols, zs=(2, 14)):
        mask[zs[0]:zs[1], rows[0]:rows[1], cols[0] + jit:cols[1] + jit] = ORGAN_ID[name]

    box("liver", (10, 26), (6, 18))
    box("spleen", (14, 24), (32, 40))
    box("kidney_right", (28, 36), (12, 18), zs=(1, 10))
    box("kidney_left", (28, 36), (30, 36), zs=(1, 10))
    box("stomach", (10, 18), (24, 31), zs=(6, 15))
    image = np.where(body, 40, -1000).astype(np.int16)
    image[mask > 0] = 60 + 5 * mask[mask > 0]
    lesion = np.zeros_like(mask)
    lesion[5:7, 14:17, 10:13] = 1
    return Case(source="fake", case_id=case_id, split=split, mask=mask, image=image,
                lesion=lesion, spacing=(5.0, 6.0, 6.0), patient_id=f"p{case_id}",
                provenance={"files": {"mask": f"{case_id}.nii.gz"}, "sha256": {"mask": "0" * 64}})


class FakeSource(Source):
    """``root/cases.json`` lists ``[case_id, split]``; a case id containing 'bad' fails."""

    name = "fake"
    needs = "cases.json listing [case_id, split]"
    has_lesions = True

    def find(self) -> list[CaseRef]:
        listing = json.loads((self.root / "cases.json").read_text())
        return sorted((CaseRef("fake", cid, split, {"mask": self.root / f"{cid}.nii.gz"})
                       for cid, split in listing), key=lambda r: r.case_id)

    def load(self, ref: CaseRef) -> Case:
        if "bad" in ref.case_id:
            raise CaseError(ref.case_id, ref.files["mask"], "labels outside 0..16 (value 99)")
        return make_case(ref.case_id, ref.split, int(ref.case_id[-1]))

    def label_map(self) -> dict:
        return {"1": "liver"}


@pytest.fixture()
def fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    cases = [["c1", "train"], ["c2", "train"], ["c3", "train"], ["c4", "val"], ["c5", "test"]]
    (root / "cases.json").write_text(json.dumps(cases))
    with SOURCES.registered("fake", FakeSource):
        yield root


def config(root: Path, out: Path, **kw):
    from spar_bench.builder.build import BuildConfig

    base = dict(sources=("fake",), roots=(str(root),), out=str(out), sample=dict(SMALL_SAMPLE),
                seed=7, shard_size=5)
    base.update(kw)
    return BuildConfig(**base)


def tree_hashes(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_build_end_to_end(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build
    from spar_bench.builder.shards import Build

    out = build(config(fake_root, tmp_path / "out"), quiet=True)
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


def test_build_is_byte_identical_across_runs_and_workers(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    a = tree_hashes(build(config(fake_root, tmp_path / "a", workers=1), quiet=True))
    b = tree_hashes(build(config(fake_root, tmp_path / "b", workers=2), quiet=True))
    assert len(a) > 10
    assert a == b  # every shard, every Parquet file, the card AND the manifest
    c = tree_hashes(build(config(fake_root, tmp_path / "c", seed=8), quiet=True))
    assert c["level1/train-00000-of-00002.h5"] != a["level1/train-00000-of-00002.h5"]


def test_refuses_non_empty_out(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty; pass --overwrite"):
        build(config(fake_root, out), quiet=True)
    with pytest.raises(ConfigError, match="not a SPAR-Bench build"):
        build(config(fake_root, out, resume=True), quiet=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_after_interruption_equals_clean_build(fake_root: Path, tmp_path: Path, monkeypatch) -> None:
    import spar_bench.builder.build as bb

    clean = tree_hashes(bb.build(config(fake_root, tmp_path / "clean"), quiet=True))
    real = bb.process_one
    calls = []

    def flaky(job):
        calls.append(job["ref"].case_id)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(job)

    monkeypatch.setattr(bb, "process_one", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        bb.build(config(fake_root, out), quiet=True)
    assert not out.exists() and len(list((tmp_path / "out.tmp" / "cases").glob("*.json"))) == 2
    with pytest.raises(ConfigError, match="--resume"):
        bb.build(config(fake_root, out), quiet=True)
    monkeypatch.setattr(bb, "process_one", real)
    calls.clear()
    with pytest.raises(ConfigError, match="other options"):
        bb.build(config(fake_root, out, resume=True, seed=99), quiet=True)
    bb.build(config(fake_root, out, resume=True), quiet=True)
    assert tree_hashes(out) == clean


def test_on_error_fail_and_skip(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build
    from spar_bench.builder.shards import Build

    listing = json.loads((fake_root / "cases.json").read_text()) + [["c9bad", "train"]]
    (fake_root / "cases.json").write_text(json.dumps(listing))
    with pytest.raises(CaseError, match="c9bad.*value 99.*--on-error skip"):
        build(config(fake_root, tmp_path / "o1"), quiet=True)
    out = build(config(fake_root, tmp_path / "o2", on_error="skip"), quiet=True)
    skipped = Build(out).manifest["skipped"]
    assert [s["case_id"] for s in skipped] == ["c9bad"] and "value 99" in skipped[0]["reason"]


def test_thresholds_without_train_split(fake_root: Path, tmp_path: Path) -> None:
    from spar_bench.builder.build import build

    (fake_root / "cases.json").write_text(json.dumps([["c1", "test"], ["c2", "test"]]))
    with pytest.raises(ConfigError, match="--thresholds-from.*--fit-thresholds-on"):
        build(config(fake_root, tmp_path / "o1"), quiet=True)
    out = build(config(fake_root, tmp_path / "o2", fit_thresholds_on="test"), quiet=True)
    m = json.loads((out / "manifest.json").read_text())
    out3 = build(config(fake_root, tmp_path / "o3", thresholds_from=str(out)), quiet=True)
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
