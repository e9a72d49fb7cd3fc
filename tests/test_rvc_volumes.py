"""experiments/recall-vs-computation-3d.yaml (issue 24, deliverable 6): the Level 4 row of the
recall-vs-computation experiment. Its plan builds the three distinct-intensity phantom layouts as
volumes with both 3-D counterfactuals, trains the 3-D encoder from scratch on one layout and scores
it on the others; its encoder's model arguments give the attnpool head a 3-D token grid. Plan-time
only (no build, no training): about a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from spar_bench.experiments.config import load_experiment
from spar_bench.experiments.plan import make_plan

FILE = Path(__file__).resolve().parents[1] / "experiments" / "recall-vs-computation-3d.yaml"


def _plan(tmp_path: Path, **values: str):
    return make_plan(load_experiment(FILE, {"OUT": str(tmp_path / "out"), **values}))


def _spec(plan, step: str, i: int = 0) -> dict:
    return plan.step(step).specs[i][1]


def test_the_plan_builds_three_layouts_as_volumes_and_trains_from_scratch(tmp_path):
    plan = _plan(tmp_path)
    assert [s.id for s in plan.steps] == ["build:canonical", "build:mirrored", "build:random", "scratch:rn10n",
                                          "eval:scratch:rn10n@mirrored", "eval:scratch:rn10n@random", "report"]  # fmt: skip
    for layout in ("canonical", "mirrored", "random"):  # each build is named after its layout
        (_, phantom), (_, build) = plan.step(f"build:{layout}").specs
        assert phantom["layout"] == layout and phantom["intensities"] == "distinct"
        options = build["options"]
        assert options["levels"] == ["level4"] and options["counterfactual"] == "mirror+flip"
        assert options["volume_size"] == 32
    train = _spec(plan, "scratch:rn10n")
    assert train["init"] == "scratch" and train["heads"] == ["attnpool"]
    assert train["encoder"] == "monai:resnet10" and train["options"]["layer"] == 2
    assert train["probes"] == ["level4.relative_position"] and train["seeds"] == [0, 1]
    assert train["data"] == "{out}/builds/canonical"
    assert not train["options"]["train_mirrors"]  # the canonical model never sees a mirrored volume


def test_the_second_half_trains_on_random_layouts(tmp_path):
    plan = _plan(tmp_path, TRAIN_ON="random", TRANSFER="[canonical, mirrored]")
    assert _spec(plan, "scratch:rn10n")["data"] == "{out}/builds/random"
    mirrors = _plan(tmp_path, TRAIN_ON="random", TRANSFER="[canonical]", TRAIN_MIRRORS="true")
    assert _spec(mirrors, "scratch:rn10n")["options"]["train_mirrors"] is True
    assert [s.id for s in plan.steps if s.kind == "eval"] == ["eval:scratch:rn10n@canonical",
                                                              "eval:scratch:rn10n@mirrored"]  # fmt: skip


def test_the_encoder_reads_a_4x4x4_token_grid_at_the_trained_layer(tmp_path):
    pytest.importorskip("monai")

    from spar_bench.probes.encoders import load_encoder

    train = _spec(_plan(tmp_path), "scratch:rn10n")
    enc = load_encoder("monai:resnet10", random_init=True, model_kwargs=train["model_kwargs"])
    assert enc.spec.input_size == (32, 32, 32)
    assert enc.spec.extra["layer_grids"][str(train["options"]["layer"])] == [4, 4, 4]
