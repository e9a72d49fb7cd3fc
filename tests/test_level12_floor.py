"""No free Level 1-2 items: a mosaic needs ``l12_min_organs`` present organs (issue 21, item 1).

A mosaic of k present tiles has exact-permutation chance 1/k!: a one-tile mosaic (a LiTS
case, liver only) is always an exact permutation. With the floor (default 8) such a source
gives no Level 1-2 items, the manifest says so per source, and a random predictor's exact
permutation accuracy on a WORD + liver-only build is at its chance (negligible), while the
old rule (floor 1) hands it the liver-only items for free.
"""

from __future__ import annotations

import json
from math import factorial
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.builder.samples import SampleConfig, process_case
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.probes.metrics import level2_metrics

from helpers import make_case, run_cmd
from lesion_folders import make_lits_folder


def test_floor_is_a_validated_recorded_option():
    assert SampleConfig().l12_min_organs == 8
    assert SampleConfig.from_dict(SampleConfig(l12_min_organs=3).to_dict()).l12_min_organs == 3
    for bad in (0, 17, 2.5):
        with pytest.raises(ConfigError, match="l12_min_organs"):
            SampleConfig(l12_min_organs=bad)


def test_a_case_below_the_floor_gives_no_mosaics():
    case = make_case("c1", "train", 1)  # liver, spleen, both kidneys, stomach: 5 organs
    below = process_case(case, SampleConfig(levels=("level1", "level2"), samples_per_case=3), 0)
    assert len(below["level1"]["key"]) == 0 and len(below["level2"]["key"]) == 0
    at = process_case(case, SampleConfig(levels=("level1", "level2"), samples_per_case=3,
                                         l12_min_organs=5), 0)
    assert len(at["level2"]["key"]) == 3 and (at["level2"]["present_pos"].sum(axis=1) == 5).all()


def random_slots(present_pos: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random assignment of the present tiles to slots 0..k-1 (-1 elsewhere)."""
    pred = np.full(present_pos.shape, -1, np.int64)
    for i, m in enumerate(present_pos):
        pred[i, m] = rng.permutation(int(m.sum()))
    return pred


def random_predictor(out: Path) -> dict:
    """Level 2 metrics of a random predictor (averaged over 50 draws) and the items' chance."""
    d = Build(out).read("level2", "test", ["target_slot", "present_pos"])
    pos, target = d["present_pos"].astype(bool), d["target_slot"].astype(np.int64)
    rng = np.random.default_rng(0)
    runs = [level2_metrics(random_slots(pos, rng), target, pos) for _ in range(50)]
    k = pos.sum(axis=1)
    return {"perm_acc": float(np.mean([r["perm_acc"] for r in runs])), "n": len(k), "k": k,
            "chance": float(np.mean([1.0 / factorial(int(v)) for v in k])), "by_k": runs[0]["by_k"]}


@pytest.fixture(scope="module")
def lits_root(tmp_path_factory) -> Path:
    return make_lits_folder(tmp_path_factory.mktemp("lits"), 2)


@pytest.mark.slow
def test_word_plus_liver_only_source_has_no_free_items(word_labels_dir, lits_root, tmp_path):
    out = tmp_path / "out"
    assert run_cmd(build_cli, ["--source", "word", "--root", word_labels_dir, "--source", "lits",
                               "--root", lits_root, "--images", "synthesize", "--cases", "word=word_0016",
                               "--levels", "level1,level2", "--samples-per-case", 4, "--no-hf",
                               "--out", out]) == 0  # fmt: skip
    m = json.loads((out / "manifest.json").read_text())
    lits, word = m["sources"]["lits"]["level12"], m["sources"]["word"]["level12"]
    assert lits["reachable"] is False and lits["cases_with_samples"] == 0 and lits["cases_without"] == 2
    assert "no Level 1-2 samples" in lits["note"] and lits["min_present_organs"] == 8
    assert word["reachable"] is True and word["cases_with_samples"] == 1 and word["cases_without"] == 0
    assert m["sample_config"]["l12_min_organs"] == 8
    for c in m["cases"]:
        assert (c["rows"]["level1"] > 0) == (c["source"] == "word")
    r = random_predictor(out)
    assert r["n"] == 4 and (r["k"] >= 8).all() and set(r["by_k"]) == {"16"}
    assert r["chance"] < 1e-4  # 1/16!: negligible
    # at its chance, not above it: no exact permutation by luck on 4 x 50 draws
    assert r["perm_acc"] <= r["chance"] + 1e-12
    assert r["by_k"]["16"]["chance"] == pytest.approx(1 / factorial(16))


def test_the_old_rule_gave_liver_only_items_for_free(lits_root, tmp_path):
    """Floor 1 (the rule before): every liver-only mosaic is an exact permutation whatever the
    prediction; the same random predictor scores 100 % on them."""
    out = tmp_path / "old"
    assert run_cmd(build_cli, ["--source", "lits", "--root", lits_root, "--levels", "level2",
                               "--samples-per-case", 4, "--l12-min-organs", 1, "--no-hf",
                               "--out", out]) == 0  # fmt: skip
    r = random_predictor(out)
    assert r["n"] == 8 and (r["k"] == 1).all()
    assert r["perm_acc"] == 1.0 and r["chance"] == 1.0 and r["by_k"]["1"]["n"] == 8
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"]["lits"]["level12"]["reachable"] is True


def test_cli_refuses_a_meaningless_floor(lits_root, tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cmd(build_cli, ["--source", "lits", "--root", lits_root, "--l12-min-organs", 0,
                               "--out", out]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "l12_min_organs must be an integer >= 1" in err[0]
    assert not out.exists()


def test_a_liver_only_build_publishes_no_empty_level12_files(lits_root, tmp_path):
    """Level 1-2 of a liver-only build have no rows: no Parquet file (datasets cannot read a
    0-row file) and no card config for them; the build verifies."""
    from spar_bench.builder.verify import verify_build

    out = tmp_path / "lits-only"
    assert run_cmd(build_cli, ["--source", "lits", "--root", lits_root, "--samples-per-case", 2,
                               "--out", out]) == 0  # fmt: skip
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["level1"]["test"]["samples"] == 0 and m["counts"]["level3"]["test"]["slices"] > 0
    assert {Path(e["path"]).parts[1] for e in m["hf"]["files"]} == {"level3"}
    card = (out / "hf" / "README.md").read_text()
    assert "config_name: level3" in card and "config_name: level1" not in card
    assert verify_build(out) == []
