"""Level 4 (volumes) in the build: storage, shards, verify, the synthetic build (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli
from spar_bench.builder.schema import LEVEL4_N_CLASSES, LEVEL4_PROBES, N_ORGANS, ORGAN_ID
from spar_bench.builder.shards import Build
from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.clitools import run_cli

from helpers import tree_hashes

ALL4 = ("level1", "level2", "level3", "level4")
#: a small Level 4 build: volumes of 20^3 with both counterfactual copies, 2 volumes a shard
OPTS = ["--levels", "level4", "--volume-size", "20", "--counterfactual", "mirror+flip",
        "--shard-size", "2", "--seed", "4"]


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


# -- real builds: the phantom and the WORD label maps -----------------------------------
@pytest.fixture(scope="module")
def phantom(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("l4") / "ph"
    assert run_cli(cli, ["phantom", "--out", str(root), "--n", "3", "--seed", "5"]) == 0
    return root


@pytest.fixture(scope="module")
def single(phantom: Path) -> Path:
    out = phantom.parent / "single"
    assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(out), *OPTS]) == 0
    return out


def _check_volumes(b: Build, split: str, side: int) -> dict[str, np.ndarray]:
    """The split's Level 4 rows as the contract has them; returned for more checks."""
    rows = b.read("level4", split)
    n = b.count("level4", split)
    assert rows["image"].shape == rows["label"].shape == rows["lesion"].shape == (n, side, side, side)
    assert rows["image"].dtype == rows["label"].dtype == np.uint8 and rows["centroid"].shape == (n, N_ORGANS, 3)
    originals = ~rows["is_mirror"] & ~rows["is_flipped"]
    assert n == 3 * originals.sum()  # original, mirror, flip
    copies = sorted(k.rsplit("/", 1)[-1] for k in rows["key"][~originals])
    assert copies == sorted(["flip", "mirror"] * int(originals.sum()))
    assert set(rows["origin_key"]) == set(rows["key"][originals])
    np.testing.assert_array_equal(rows["label"][rows["is_mirror"]], rows["label"][originals][..., ::-1])
    present = np.stack([[np.isin(np.arange(1, N_ORGANS + 1), np.unique(v)) for v in rows["label"]]])[0]
    np.testing.assert_array_equal(present, rows["present"])  # measured on the stored label
    q = b.read("level4", split, ["q_volume", "q_probe", "q_answer"])
    assert len(q["q_volume"]) == b.count_questions("level4", split) > 0
    assert q["q_volume"].min() >= 0 and q["q_volume"].max() < n  # re-based across shards
    return rows


@pytest.mark.slow
def test_phantom_level4_build_verifies_and_reads_back(single: Path) -> None:
    b = Build(single)
    assert b.levels() == ["level4"] and b.manifest["sample_config"]["volume_size"] == 20
    assert run_cli(cli, ["verify", str(single)]) == 0
    for split in b.splits("level4"):
        rows = _check_volumes(b, split, 20)
    counts = b.manifest["counts"]["level4"]["test"]
    assert counts["volumes"] == 3 and len(counts["classes"]["present"]) == N_ORGANS
    assert len(b.shard_paths("level4", "test")) == 2  # --shard-size 2: 3 volumes in 2 shards
    liver, spleen = ORGAN_ID["liver"] - 1, ORGAN_ID["spleen"] - 1
    x = rows["centroid"][~rows["is_mirror"], :, 0]
    assert (x[:, liver] < x[:, spleen]).all()  # the liver on the patient's right: smaller x


@pytest.mark.slow
def test_phantom_level4_hf_folder_loads_with_datasets(single: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset(str(single / "hf"), "level4", split="test").with_format("numpy")
    rows = Build(single).read("level4", "test")
    assert ds.features["image"].shape == (20, 20, 20)
    np.testing.assert_array_equal(np.stack(ds["label"]).astype(np.uint8), rows["label"])
    assert list(ds["key"]) == list(rows["key"])
    assert sum(len(q) for q in ds["questions"]) == Build(single).count_questions("level4", "test")
    card = (single / "hf" / "README.md").read_text(encoding="utf-8")
    assert "## Level 4 (`level4` config)" in card and "holds whole CT volumes" in card
    assert "## Columns" not in card  # a Level 4-only build: no 2-D column list


@pytest.mark.slow
def test_phantom_level4_identical_across_jobs_and_partitions(phantom: Path, single: Path) -> None:
    jobs2 = phantom.parent / "jobs2"
    assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(jobs2), *OPTS,
                         "--jobs", "2"]) == 0
    assert tree_hashes(jobs2) == tree_hashes(single)
    parts = []
    for i in range(2):
        parts.append(phantom.parent / f"part-{i}")
        assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(parts[-1]),
                             "--partition", f"{i}/2", *OPTS]) == 0
    merged = phantom.parent / "merged"
    assert run_cli(cli, ["merge", *map(str, parts), "--out", str(merged)]) == 0
    assert tree_hashes(merged) == tree_hashes(single)


def test_synthetic_level4_has_the_real_builds_fields(single: Path, tmp_path: Path) -> None:
    """Code tested on the synthetic build reads the same fields, dtypes and shapes as a real one."""
    synthetic = write_synthetic_build(tmp_path / "s", 0, levels=("level4",), n_volumes=2, volume_size=20)

    def layout(root: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
        b = Build(root)
        rows = b.read("level4", b.splits("level4")[0])
        return {k: (v.dtype.kind, v.shape[1:]) for k, v in rows.items()}

    assert layout(synthetic) == layout(single)


def test_inspect_shows_the_level4_cube_the_build_cut(phantom: Path, single: Path, capsys) -> None:
    assert run_cli(cli, ["inspect", "--source", "phantom", "--root", str(phantom), "--volume-size", "20"]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if "level4 cube:" in line]
    b = Build(single)
    built = []
    for split in b.splits("level4"):
        rows = b.read("level4", split, ["mm_per_voxel", "is_mirror", "is_flipped"])
        originals = ~rows["is_mirror"] & ~rows["is_flipped"]
        built += [f"{v:.2f} mm/voxel" for v in rows["mm_per_voxel"][originals]]
    assert len(shown) == 3 and sorted(line.split("; ")[1].split(" at")[0] for line in shown) == sorted(built)


@pytest.mark.parametrize("argv, needle", [
    (["--levels", "level4,level9"], "level9"),
    (["--levels", "level4", "--volume-size", "4"], "volume_size"),
    (["--levels", "level4", "--counterfactual", "flip"], "counterfactual"),
])
def test_bad_level4_options_are_one_line(phantom: Path, argv: list[str], needle: str, capsys) -> None:
    out = phantom.parent / "bad"
    assert run_cli(cli, ["--source", "phantom", "--root", str(phantom), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_real_word_masks_give_level4_shards(word_labels_dir: Path, tmp_path: Path) -> None:
    """Two real WORD label maps, pseudo-CT rendered from the masks: Level 4 shards that verify."""
    sub = tmp_path / "word" / "labelsTs"
    sub.mkdir(parents=True)
    for f in sorted((word_labels_dir / "labelsTs").glob("*.nii.gz"))[:2]:
        (sub / f.name).symlink_to(f.resolve())
    out = tmp_path / "b"
    assert run_cli(cli, ["--source", "word", "--root", str(tmp_path / "word"), "--out", str(out),
                         "--images", "synthesize", "--no-hf", *OPTS]) == 0
    assert run_cli(cli, ["verify", str(out)]) == 0
    b = Build(out)
    assert all(c["image_synthesized"] for c in b.manifest["cases"])
    rows = _check_volumes(b, "test", 20)
    assert rows["present"].sum(axis=1).min() >= 12  # WORD's abdomen: most of the 16 organs
    mm = rows["mm_per_voxel"]
    assert (mm > 5).all() and (mm < 40).all()  # a 20^3 cube over a whole abdomen
    liver, spleen = ORGAN_ID["liver"] - 1, ORGAN_ID["spleen"] - 1
    x = rows["centroid"][~rows["is_mirror"], :, 0]
    assert (x[:, liver] < x[:, spleen]).all()
