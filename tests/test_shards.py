"""spar_bench.builder.shards.Build on a tiny hand-written build (h5py directly, no builder)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from spar_bench.builder.shards import Build
from spar_bench.builder.writers.manifest import fingerprint, sha256_file, write_manifest
from spar_bench.errors import ConfigError, IntegrityError


def _str(f: h5py.File, name: str, values: list[str]) -> None:
    f.create_dataset(name, data=np.array([v.encode() for v in values], dtype="S"))


def _images(rows: np.ndarray) -> np.ndarray:
    """Image of global row r is filled with r (mod 256), with a marker pixel."""
    img = np.zeros((len(rows), 224, 224), np.uint8)
    for k, r in enumerate(rows):
        img[k] = r % 256
        img[k, 0, 0] = 255 - (r % 256)
    return img


def _write_l1(path: Path, rows: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        _str(f, "key", [f"phantom/c{r:03d}/level1/00000" for r in rows])
        f.create_dataset("image", data=_images(rows), chunks=(1, 224, 224))
        f.create_dataset("sample_index", data=rows.astype(np.int32))


def _write_l3(path: Path, slice_rows: np.ndarray, q_per_slice: int) -> int:
    n = len(slice_rows)
    with h5py.File(path, "w") as f:
        _str(f, "key", [f"phantom/c{r:03d}/level3/00000" for r in slice_rows])
        f.create_dataset("image", data=_images(slice_rows), chunks=(1, 224, 224))
        f.create_dataset("slice_index", data=slice_rows.astype(np.int32))
        q_slice = np.repeat(np.arange(n, dtype=np.int32), q_per_slice)
        f.create_dataset("q_slice", data=q_slice)
        f.create_dataset("q_answer", data=(q_slice % 2).astype(np.int8))
    return n * q_per_slice


@pytest.fixture()
def tiny_build(tmp_path: Path) -> Path:
    out = tmp_path / "build"
    shards: dict = {"level1": {}, "level3": {}}
    (out / "level1").mkdir(parents=True)
    (out / "level3").mkdir()
    entries = []
    for i, (lo, hi) in enumerate([(0, 5), (5, 7), (7, 12)]):
        p = out / "level1" / f"train-{i:05d}-of-00003.h5"
        _write_l1(p, np.arange(lo, hi))
        entries.append({"path": f"level1/train-{i:05d}-of-00003.h5", "sha256": sha256_file(p),
                        "rows": hi - lo, "questions": 0})
    shards["level1"]["train"] = entries
    entries = []
    for i, (lo, hi) in enumerate([(0, 3), (3, 7)]):
        p = out / "level3" / f"test-{i:05d}-of-00002.h5"
        q = _write_l3(p, np.arange(lo, hi), q_per_slice=2)
        entries.append({"path": f"level3/test-{i:05d}-of-00002.h5", "sha256": sha256_file(p),
                        "rows": hi - lo, "questions": q})
    shards["level3"]["test"] = entries
    write_manifest(out, {"schema_version": "1.0", "shards": shards, "hf": None})
    return out


def test_structure_and_counts(tiny_build: Path) -> None:
    b = Build(tiny_build)
    assert b.levels() == ["level1", "level3"]
    assert b.splits("level1") == ["train"]
    assert b.count("level1", "train") == 12
    assert b.count("level3", "test") == 7
    assert b.count_questions("level3", "test") == 14
    assert [p.name for p in b.shard_paths("level1", "train")] == [
        "train-00000-of-00003.h5", "train-00001-of-00003.h5", "train-00002-of-00003.h5"]
    assert len(b.fingerprint) == 64
    with pytest.raises(ConfigError, match="splits: train"):
        b.count("level1", "val")
    with pytest.raises(ConfigError, match="levels: level1, level3"):
        b.splits("level2")


def test_read_concatenates_in_order_and_rebases_q_slice(tiny_build: Path) -> None:
    b = Build(tiny_build)
    d = b.read("level1", "train", ["key", "sample_index"])
    np.testing.assert_array_equal(d["sample_index"], np.arange(12))
    assert d["key"].dtype.kind == "U" and d["key"][7] == "phantom/c007/level1/00000"
    q = b.read("level3", "test", ["q_slice", "q_answer"])
    # second shard's questions point at split rows 3..6, not shard rows 0..3
    np.testing.assert_array_equal(q["q_slice"], np.repeat(np.arange(7), 2))
    s = b.read("level3", "test", ["slice_index"])["slice_index"]
    np.testing.assert_array_equal(s[q["q_slice"]], np.repeat(np.arange(7), 2))
    with pytest.raises(ConfigError, match="no field 'nope'"):
        b.read("level1", "train", ["nope"])


def test_iter_images_spans_shards_and_resumes(tiny_build: Path) -> None:
    b = Build(tiny_build)
    batches = list(b.iter_images("level1", "train", batch_size=4))
    assert [o for o, _ in batches] == [0, 4, 8]
    allimg = np.concatenate([x for _, x in batches])
    assert allimg.shape == (12, 224, 224) and allimg.dtype == np.uint8
    np.testing.assert_array_equal(allimg[:, 1, 1], np.arange(12))
    resumed = list(b.iter_images("level1", "train", batch_size=5, start=6))
    assert [o for o, _ in resumed] == [6, 11]
    np.testing.assert_array_equal(np.concatenate([x for _, x in resumed])[:, 1, 1], np.arange(6, 12))
    with pytest.raises(IndexError):
        list(b.iter_images("level1", "train", batch_size=4, start=13))


def test_images_random_access_any_order(tiny_build: Path) -> None:
    b = Build(tiny_build)
    rows = np.array([11, 0, 5, 5, 6, 4])
    got = b.images("level1", "train", rows)
    np.testing.assert_array_equal(got, _images(rows))
    assert b.images("level1", "train", np.array([], dtype=int)).shape == (0, 224, 224)
    with pytest.raises(IndexError, match="row 12"):
        b.images("level1", "train", np.array([12]))
    b.close()


def test_missing_or_incomplete_manifest(tmp_path: Path, tiny_build: Path) -> None:
    with pytest.raises(ConfigError, match="no manifest.json"):
        Build(tmp_path)
    m = json.loads((tiny_build / "manifest.json").read_text())
    m["complete"] = False
    (tiny_build / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="incomplete"):
        Build(tiny_build)
    del m["fingerprint"]
    (tiny_build / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="missing fingerprint"):
        Build(tiny_build)


def test_edited_manifest_and_missing_shard(tiny_build: Path) -> None:
    m = json.loads((tiny_build / "manifest.json").read_text())
    m["shards"]["level1"]["train"][0]["sha256"] = "0" * 64
    (tiny_build / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="fingerprint"):
        Build(tiny_build)
    m["fingerprint"] = fingerprint([(e["path"], e["sha256"]) for s in m["shards"].values()
                                    for es in s.values() for e in es])
    (tiny_build / "manifest.json").write_text(json.dumps(m))
    (tiny_build / "level1" / "train-00001-of-00003.h5").unlink()
    with pytest.raises(IntegrityError, match="missing"):
        Build(tiny_build).shard_paths("level1", "train")
