"""Level 4 (volumes) in the build: storage, shards, verify, the synthetic build (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.schema import LEVEL4_N_CLASSES, LEVEL4_PROBES, N_ORGANS
from spar_bench.builder.shards import Build
from spar_bench.builder.synthetic import write_synthetic_build

ALL4 = ("level1", "level2", "level3", "level4")


# -- the synthetic build -----------------------------------------------------------------
def test_synthetic_level4_is_valid_and_leaves_levels_1_3_alone(tmp_path: Path) -> None:
    plain = write_synthetic_build(tmp_path / "a", 12, shard_size=5)
    four = write_synthetic_build(tmp_path / "b", 12, shard_size=5, levels=ALL4, n_volumes=5, volume_size=16)
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (plain, four))
    assert ma["shards"].items() <= mb["shards"].items()  # Levels 1-3: the same shards, same sha256
    assert mb["levels"] == list(ALL4) and mb["counts"]["level4"]["train"]["volumes"] == 5
    b = Build(four)
    rows = b.read("level4", "train")
    assert rows["image"].shape == (5, 16, 16, 16) and rows["image"].dtype == np.uint8
    assert rows["label"].max() <= N_ORGANS and set(np.unique(rows["lesion"])) <= {0, 1}
    assert rows["centroid"].shape == (5, N_ORGANS, 3)
    np.testing.assert_array_equal(np.isnan(rows["centroid"][..., 0]), ~rows["present"])
    assert (rows["origin_key"] == rows["key"]).all()
    q = {k: v for k, v in rows.items() if k.startswith("q_")}
    assert b.count_questions("level4", "train") == len(q["q_probe"]) == 5 * len(LEVEL4_PROBES)
    np.testing.assert_array_equal(q["q_volume"], np.repeat(np.arange(5), len(LEVEL4_PROBES)))
    for p, probe in enumerate(LEVEL4_PROBES):
        assert (q["q_answer"][q["q_probe"] == p] < LEVEL4_N_CLASSES[probe]).all()
    used = q["q_organ_a"] >= 0
    assert rows["present"][q["q_volume"][used], q["q_organ_a"][used]].all()


def test_synthetic_level4_is_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_build(tmp_path / "a", 0, levels=("level4",), n_volumes=3, volume_size=8, shard_size=2)
    b = write_synthetic_build(tmp_path / "b", 0, levels=("level4",), n_volumes=3, volume_size=8, shard_size=2)
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="volume_size"):
        write_synthetic_build(tmp_path / "c", 0, levels=("level4",), volume_size=4)


def test_verify_counts_level4_volumes_and_questions(tmp_path: Path) -> None:
    from spar_bench.builder.verify import verify_build

    out = write_synthetic_build(tmp_path / "b", 0, levels=("level4",), n_volumes=3, volume_size=8, shard_size=2)
    assert verify_build(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["counts"]["level4"]["train"]["questions"] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert any("level4/train" in p and "questions" in p for p in verify_build(out))


def test_volume_shards_are_chunked_one_volume_per_chunk(tmp_path: Path) -> None:
    from spar_bench.builder.shards import open_shard
    from spar_bench.builder.writers.hdf5 import volume_shard_rows

    out = write_synthetic_build(tmp_path / "b", 0, levels=("level4",), n_volumes=2, volume_size=16,
                                compression="blosc")
    with open_shard(out / "level4" / "train-00000-of-00001.h5") as f:
        for name in ("image", "label", "lesion"):
            assert f[name].chunks == (1, 16, 16, 16)
            assert f[name].id.get_create_plist().get_filter(0)[0] == 32001  # blosc, as the 2-D images
        assert f["centroid"].chunks is None
    assert volume_shard_rows(2000, 128) == 64 and volume_shard_rows(2000, 64) == 512
    assert volume_shard_rows(10, 16) == 10 and volume_shard_rows(2000, 1024) == 1


def test_hf_level4_is_array3d_and_reads_back(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from spar_bench.builder.writers.hf import convert_shard

    out = write_synthetic_build(tmp_path / "b", 0, levels=("level4",), n_volumes=3, volume_size=8, shard_size=2)
    b = Build(out)
    entry, features, _ = convert_shard((str(out), "level4", "level4/train-00000-of-00002.h5"))
    assert features["image"] == {"shape": (8, 8, 8), "dtype": "uint8", "_type": "Array3D"}
    table = pq.read_table(out / entry["path"])  # plain pyarrow: nested lists
    rows = b.read("level4", "train")
    got = np.array(table.column("label").to_pylist(), dtype=np.uint8)
    np.testing.assert_array_equal(got, rows["label"][:2])
    questions = table.column("questions").to_pylist()
    assert [len(q) for q in questions] == [len(LEVEL4_PROBES)] * 2
    assert questions[1][0]["organ_c"] == rows["q_organ_c"][len(LEVEL4_PROBES)]
    assert "volume" not in questions[0][0]  # the row pointer is the list's position
