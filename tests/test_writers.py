"""HDF5 shard layout, the Hugging Face folder (offline load_dataset parity) and push."""

from __future__ import annotations

import io
from pathlib import Path

import h5py
import numpy as np
import pytest

from spar_bench.builder.sources import SOURCES

from helpers import FakeSource, build_config


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    import json

    from spar_bench.builder.build import build

    root = tmp_path_factory.mktemp("data")
    (root / "cases.json").write_text(json.dumps([["c1", "train"], ["c2", "val"], ["c3", "test"],
                                                 ["c4", "test"]]))
    with SOURCES.registered("fake", FakeSource):
        yield build(build_config(root, root.parent / "out", sample={
            "samples_per_case": 2, "l3_stride": 3, "l3_questions_per_probe": 2,
            "counterfactual": "mirror", "l12_min_organs": 1}), quiet=True)


def test_hdf5_layout_and_attributes(built: Path) -> None:
    import hdf5plugin  # noqa: F401

    path = sorted((built / "level3").glob("test-*.h5"))[0]
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == "1.0" and f.attrs["level"] == "level3"
        assert f.attrs["split"] == "test" and f.attrs["shard"] == 0
        img = f["image"]
        assert img.dtype == np.uint8 and img.shape[1:] == (224, 224)
        assert img.chunks == (1, 224, 224)
        assert "32001" in img._filters  # blosc (hdf5plugin)
        q_slice = f["q_slice"][()]
        assert q_slice.min() >= 0 and q_slice.max() < len(img)  # this shard's own rows
        assert f["key"].asstr()[0].startswith("fake/c3/level3/")
    with h5py.File(sorted((built / "level2").glob("train-*.h5"))[0], "r") as f:
        assert f.attrs["arrangement"] == "rows-by-y"
        assert f["perm"].dtype == np.int16 and f["present"].shape[1:] == (16,)


def test_slices_and_their_questions_share_a_shard(built: Path) -> None:
    from spar_bench.builder.shards import Build

    b = Build(built)
    keys = b.read("level3", "test", ["key"])["key"]
    q = b.read("level3", "test", ["q_key", "q_slice"])
    for qk, s in zip(q["q_key"], q["q_slice"], strict=True):
        assert qk.rsplit("/q", 1)[0] == keys[s]
    mirror = b.read("level3", "test", ["is_mirror", "origin_key"])
    assert mirror["is_mirror"].any() and set(mirror["origin_key"][mirror["is_mirror"]]) <= set(keys)


def test_hf_folder_loads_offline_and_matches_hdf5(built: Path, monkeypatch) -> None:
    import datasets
    from PIL import Image

    from spar_bench.builder.shards import Build

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    warned: list[str] = []  # the card's dataset_info must parse whole (splits with num_bytes)
    monkeypatch.setattr(datasets.info.logger, "warning", lambda msg, *a, **k: warned.append(str(msg)))
    b = Build(built)
    ds = datasets.load_dataset(str(built / "hf"), "level3", split="test",
                               cache_dir=str(built.parent / "hfcache"))
    ref = b.read("level3", "test", ["key", "mm_per_pixel", "image", "label"])
    q = b.read("level3", "test", ["q_key", "q_slice", "q_answer", "q_probe"])
    assert len(ds) == b.count("level3", "test") and ds["key"] == list(ref["key"])
    for i in [0, len(ds) // 2, len(ds) - 1]:
        row = ds[i]
        assert isinstance(row["image"], Image.Image)
        np.testing.assert_array_equal(np.asarray(row["image"]), ref["image"][i])
        np.testing.assert_array_equal(np.asarray(row["label"]), ref["label"][i])
        assert row["mm_per_pixel"] == pytest.approx(float(ref["mm_per_pixel"][i]))
        mine = q["q_slice"] == i
        assert [x["key"] for x in row["questions"]] == list(q["q_key"][mine])
        assert [x["answer"] for x in row["questions"]] == q["q_answer"][mine].tolist()
    l1 = datasets.load_dataset(str(built / "hf"), "level1", split="train",
                               cache_dir=str(built.parent / "hfcache"))
    ref1 = b.read("level1", "train", ["key", "centroid", "present"])
    assert l1["key"] == list(ref1["key"])
    np.testing.assert_array_equal(np.array(l1[0]["present"]), ref1["present"][0])
    np.testing.assert_allclose(np.array(l1[0]["centroid"], dtype=np.float32), ref1["centroid"][0])
    assert warned == []


def test_card_and_manifest_publish_no_local_path(built: Path) -> None:
    """The build read absolute folders under /tmp; nothing publishable names them."""
    import json

    assert built.is_absolute()
    for rel in ("manifest.json", "hf/README.md"):
        text = (built / rel).read_text(encoding="utf-8")
        for local in (str(built.parent), str(built.parent.resolve()), "/home", "/root", "/tmp"):
            assert local not in text, (rel, local)
    m = json.loads((built / "manifest.json").read_text())
    src = m["sources"]["fake"]
    assert src["root"] == "../data0" and m["config"]["roots"] == ["../data0"]
    assert len(src["inputs_sha256"]) == 64 and src["n_inputs"] == 4
    assert all("/" not in f for c in m["cases"] for f in c["provenance"]["files"].values())


def test_dataset_card(built: Path) -> None:
    import yaml

    text = (built / "hf" / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert [c["config_name"] for c in front["configs"]] == ["level1", "level2", "level3"]
    l3 = front["configs"][2]["data_files"]
    assert [d["split"] for d in l3] == ["train", "val", "test"]
    assert l3[0]["path"] == "level3/train-*.parquet"
    assert {f["name"] for f in front["dataset_info"][2]["features"]} >= {"image", "label", "questions"}
    splits = front["dataset_info"][0]["splits"]
    assert [s["name"] for s in splits] == ["train", "val", "test"]
    assert all(s["num_bytes"] > 0 and s["num_examples"] > 0 for s in splits)
    assert front["dataset_info"][0]["dataset_size"] == sum(s["num_bytes"] for s in splits)
    assert "patient's RIGHT" in text.replace("PATIENT'S RIGHT", "patient's RIGHT")
    assert "- fake: unknown: check the source" in text


def test_card_lists_source_licences(built: Path) -> None:
    import yaml

    from spar_bench.builder.build import BuildConfig
    from spar_bench.builder.writers.hf import dataset_card

    cfg = BuildConfig(sources=("word", "phantom"), roots=("a", "b"), out="o")
    text = dataset_card({}, {}, config=cfg, sample_config={}, sources={"word": {}, "phantom": {}})
    assert "- word: GPL-3.0" in text and "- phantom: Apache-2.0" in text
    assert yaml.safe_load(text.split("---\n")[1])["license"] == "other"
    one = dataset_card({}, {}, config=cfg, sample_config={}, sources={"lits": {}})
    assert yaml.safe_load(one.split("---\n")[1])["license"] == "cc-by-nc-sa-4.0"


def test_push_calls_hub_api(built: Path, monkeypatch) -> None:
    import huggingface_hub
    from click.testing import CliRunner

    from spar_bench.builder.cli import cli

    calls = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def create_branch(self, **kw):
            calls.append(("create_branch", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    r = CliRunner().invoke(cli, ["push", str(built), "--repo", "org/spar", "--private",
                                 "--revision", "v1"])
    assert r.exit_code == 0, r.output
    names = [c[0] for c in calls]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    assert calls[0][1] == {"repo_id": "org/spar", "repo_type": "dataset", "private": True,
                           "exist_ok": True}
    up = calls[2][1]
    assert up["folder_path"] == str(built / "hf") and up["revision"] == "v1"
    assert up["repo_type"] == "dataset"
    calls.clear()
    r = CliRunner().invoke(cli, ["push", str(built), "--repo", "nameonly"])
    assert r.exit_code != 0 and not calls


def test_png_roundtrip_is_lossless() -> None:
    from PIL import Image

    from spar_bench.builder.writers.hf import _png

    a = np.random.default_rng(0).integers(0, 256, (224, 224), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(_png(a)))), a)


def _case_rows(case: int, n: int, nq_per: int):
    keys = np.array([f"s/c{case}/level3/{i:05d}" for i in range(n)], dtype=object)
    rows = {"key": keys, "image": np.full((n, 224, 224), case, np.uint8),
            "slice_index": np.arange(n, dtype=np.int32)}
    qs = {"q_key": np.array([f"{k}/q{j:03d}" for k in keys for j in range(nq_per)], dtype=object),
          "q_slice": np.repeat(np.arange(n, dtype=np.int32), nq_per)}
    return rows, qs


def test_shard_sink_keeps_questions_with_their_slices(tmp_path: Path) -> None:
    import hdf5plugin  # noqa: F401

    from spar_bench.builder.writers.hdf5 import ShardSink

    sizes = [3, 0, 5, 1]  # 9 slices, shard size 4 -> 3 shards; case 2 straddles two shards
    sink = ShardSink(tmp_path, "level3", "test", sum(sizes), 4, {"schema_version": "1.0"})
    for c, n in enumerate(sizes):
        sink.add(*_case_rows(c, n, 2))
    entries = sink.close()
    assert [e["rows"] for e in entries] == [4, 4, 1]
    assert [e["questions"] for e in entries] == [8, 8, 2]
    for e in entries:
        with h5py.File(tmp_path / e["path"], "r") as f:
            keys = f["key"].asstr()[()]
            for qk, s in zip(f["q_key"].asstr()[()], f["q_slice"][()], strict=True):
                assert qk.rsplit("/q", 1)[0] == keys[s]
            assert f.attrs["n_shards"] == 3


def test_shard_sink_empty_split_and_count_mismatch(tmp_path: Path) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.builder.writers.hdf5 import ShardSink
    from spar_bench.builder.writers.manifest import write_manifest
    from spar_bench.errors import SparError

    sink = ShardSink(tmp_path, "level3", "val", 0, 4, {})
    sink.add(*_case_rows(0, 0, 2))
    entries = sink.close()
    assert [e["rows"] for e in entries] == [0] and entries[0]["path"] == "level3/val-00000-of-00001.h5"
    write_manifest(tmp_path, {"schema_version": "1.0", "shards": {"level3": {"val": entries}}})
    b = Build(tmp_path)
    assert b.count("level3", "val") == 0
    assert b.read("level3", "val", ["q_slice"])["q_slice"].shape == (0,)
    assert list(b.iter_images("level3", "val", 8)) == []
    bad = ShardSink(tmp_path / "x", "level3", "val", 5, 4, {})
    bad.add(*_case_rows(0, 3, 1))
    with pytest.raises(SparError, match="announced 5"):
        bad.close()
