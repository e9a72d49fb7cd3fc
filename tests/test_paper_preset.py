"""The ``paper`` preset (docs/PROTOCOL.md §12): its table, the constants it assumes, and how
builds and runs record it (explicit options win and the record says so)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.presets import PAPER, apply_build_preset, apply_probe_preset, get_preset
from spar_bench.provenance import PROTOCOL_VERSION

from helpers import run_cmd

REPO = Path(__file__).resolve().parents[1]


def test_paper_preset_table_is_pinned():
    assert PAPER.build == {"seed": 0, "samples_per_case": 32, "l12_min_organs": 8, "arrangement": "rows-by-y",
                           "counterfactual": "mirror", "limit": {"lits": 20},
                           "split_ratio": {"lits": "0.7,0.1,0.2"}}
    assert PAPER.probe == {"seeds": "0,1,2", "heads": "mlp,transformer", "lr": 1e-3,
                           "weight_decay": 0.01, "batch_size": 256, "patience": 8}
    assert PAPER.pinned["totalsegmentator_split_scored"] == "test"
    for key in ("orientation", "size_distance_bins", "totalsegmentator", "totalsegmentator_split",
                "samples_per_case", "arrangement", "lits", "heads", "seeds", "training"):
        assert PAPER.choices[key], key  # every silent choice is stated
    with pytest.raises(ConfigError, match="presets: paper"):
        get_preset("nope")


def test_code_matches_what_the_preset_pins():
    from spar_bench.builder.samples import SampleConfig
    from spar_bench.builder.samples import thresholds as th
    from spar_bench.builder.schema import LEVEL3_CLASS_NAMES, LEVEL3_N_CLASSES
    from spar_bench.probes.runs.spec import OPTIONS
    from spar_bench.probes.train import TrainConfig

    pinned = PAPER.pinned
    assert LEVEL3_N_CLASSES["orientation"] == pinned["orientation_classes"] == 8
    assert ", ".join(LEVEL3_CLASS_NAMES["orientation"]) in pinned["orientation"]
    assert th.METHOD == "tertiles" and th.MIN_N == pinned["threshold_min_n"]
    assert LEVEL3_CLASS_NAMES["size"] == ("small", "medium", "large")
    assert SampleConfig().symmetry_band == pinned["symmetry_band"]
    labels = json.loads((REPO / "manifests" / "labels" / "totalsegmentator.json").read_text())
    ts = pinned["totalsegmentator"]
    for organ in ("head_of_femur_left", "head_of_femur_right", "intestine", "bladder"):
        assert labels["classes"][ts[organ]] == organ
    assert {c for c, o in labels["classes"].items() if o == "adrenal"} == set(ts["adrenal"])
    assert labels["annotated_false"] == ts["unannotated"] == ["rectum"]
    # the probe options the preset sets exist, and equal today's defaults (runs keep their folders)
    for key in ("lr", "weight_decay", "batch_size", "patience"):
        assert key in OPTIONS and getattr(TrainConfig(), key) == PAPER.probe[key]
    SampleConfig(samples_per_case=PAPER.build["samples_per_case"], arrangement=PAPER.build["arrangement"],
                 counterfactual=PAPER.build["counterfactual"], l12_min_organs=PAPER.build["l12_min_organs"])


def test_apply_fills_missing_options_and_records_overrides():
    opts = {"source": ("word", "lits"), "seed": 0, "samples_per_case": 4, "l12_min_organs": None, "arrangement": None,
            "counterfactual": None, "limit": (), "split_ratio": ()}
    out, rec = apply_build_preset("paper", opts, {"samples_per_case"})
    assert out["samples_per_case"] == 4 and out["counterfactual"] == "mirror"
    assert out["limit"] == ("lits=20",) and out["split_ratio"] == ("lits=0.7,0.1,0.2",)
    assert rec == {"name": "paper", "overridden": ["samples_per_case"],
                   "options": {"seed": 0, "l12_min_organs": 8, "arrangement": "rows-by-y", "counterfactual": "mirror",
                               "limit": ["lits=20"], "split_ratio": ["lits=0.7,0.1,0.2"]}}
    out, rec = apply_build_preset("paper", {**opts, "source": ("word",)}, set())
    assert out["limit"] == () and "limit" not in rec["options"]  # no LiTS in this build
    out, rec = apply_build_preset("paper", {**opts, "limit": ("word=5",)}, {"limit"})
    assert out["limit"] == ("word=5", "lits=20") and rec["options"]["limit"] == ["lits=20"]
    out, rec = apply_build_preset("paper", {**opts, "limit": ("lits=3",)}, {"limit"})
    assert out["limit"] == ("lits=3",) and "limit[lits]" in rec["overridden"]
    out, rec = apply_build_preset("paper", {**opts, "limit": ("7",)}, {"limit"})  # every source
    assert out["limit"] == ("7",) and "limit[lits]" in rec["overridden"]
    p, prec = apply_probe_preset("paper", {"seeds": "0", "lr": 0.01, "patience": None}, {"lr"})
    assert p == {"seeds": "0,1,2", "lr": 0.01, "patience": 8}  # fit has no --heads: skipped
    assert prec["overridden"] == ["lr"] and prec["options"] == {"seeds": "0,1,2", "patience": 8}


@pytest.mark.slow
def test_build_and_runs_record_the_preset(tmp_path, pipeline):
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.cli import cli as probe_cli

    assert run_cmd(build_cli, ["phantom", "--out", tmp_path / "ph", "--n", 2]) == 0
    out = tmp_path / "shards"
    assert run_cmd(build_cli, ["--source", "phantom", "--root", tmp_path / "ph", "--out", out, "--preset", "paper",
                               "--levels", "level1", "--samples-per-case", 1, "--no-hf"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["protocol_version"] == PROTOCOL_VERSION
    assert man["config"]["preset"]["name"] == "paper"
    assert man["config"]["preset"]["overridden"] == ["samples_per_case"]
    assert man["sample_config"]["counterfactual"] == "mirror" and man["sample_config"]["samples_per_case"] == 1
    assert man["sample_config"]["l12_min_organs"] == 8
    assert run_cmd(build_cli, ["--source", "phantom", "--root", tmp_path / "ph", "--out", tmp_path / "bad",
                               "--preset", "nope", "--no-hf"]) == 2

    runs = tmp_path / "runs"
    assert run_cmd(probe_cli, ["fit", "--features", pipeline["cache"], "--probe", "level3.symmetry", "--head",
                               "linear", "--out", runs, "--bootstrap", 5, "--max-epochs", 2, "--seeds", "0",
                               "--lr", "0.01", "--preset", "paper"]) == 0
    (cfg_path,) = runs.rglob("config.json")
    cfg = json.loads(cfg_path.read_text())
    assert cfg["options"]["preset"] == "paper" and cfg["options"]["preset_overridden"] == ["lr", "seeds"]
    assert cfg["options"]["train"]["lr"] == 0.01 and cfg["options"]["train"]["patience"] == 8
    assert cfg["protocol"]["protocol_version"] == PROTOCOL_VERSION
    assert cfg_path.parent.name == "seed0" and cfg_path.parent.parent.name == "linear,lr=0.01,max_epochs=2"


def test_sweep_preset_plans_the_papers_grid(pipeline, capsys):
    from spar_bench.probes.cli import cli as probe_cli

    assert run_cmd(probe_cli, ["sweep", "--features", pipeline["cache"], "--probes", "level3.symmetry",
                               "--preset", "paper", "--list", "--out", "unused-runs"]) == 0
    ids = [line for line in capsys.readouterr().out.splitlines() if "level3.symmetry" in line]
    assert len(ids) == 6  # mlp and transformer x seeds 0, 1, 2
    assert sum("/transformer/" in i for i in ids) == 3
