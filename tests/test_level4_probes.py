"""Level 4 (volumes) on the probes track: specs, targets, metrics, heads, controls, the mask oracle.

Two builds: the fake Level 4 of ``builder/synthetic.py`` (random but valid answers: loading,
shapes, the heads) and a real tiny phantom build with Level 4 (``--volume-size 24``,
``--counterfactual mirror+flip``), on which the mask oracle, reading the stored label and
lesion volumes, must answer every Level 4 question and localise every organ exactly, on the
original, mirrored and flipped items of every split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.schema import LEVEL4_N_CLASSES, LEVEL4_PROBES, VOLUME_AXES

L4 = ["level4.localisation", *(f"level4.{p}" for p in LEVEL4_PROBES)]
SIZE = 24


@pytest.fixture(scope="module")
def fake4(tmp_path_factory) -> Path:
    from spar_bench.builder.synthetic import write_synthetic_build

    out = tmp_path_factory.mktemp("fake4") / "build"
    return write_synthetic_build(out, 8, levels=("level3", "level4"), n_volumes=6, volume_size=16)


@pytest.fixture(scope="module")
def phantom4(tmp_path_factory) -> Path:
    """A real phantom build of Level 4 only: 8 cases, 24^3 volumes, mirrored and flipped copies."""
    from spar_bench.builder.cli import cli as build_cli
    from tests.helpers import run_cmd

    root = tmp_path_factory.mktemp("phantom4")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 8, "--layout", "canonical", "--in-plane", 64,
                               "--slices", 24]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "b", "--levels",
                               "level3,level4", "--volume-size", SIZE, "--counterfactual", "mirror+flip",
                               "--no-hf"]) == 0  # fmt: skip
    return root / "b"


def _targets(build_dir: Path, probe: str, split: str):
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.inputs import BuildKeys
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    b = Build(build_dir)
    return b, load_targets(b, get_probe(probe), split, BuildKeys(b).keys("level4", split))


# ------------------------------------------------------------------ specs, targets, metrics
def test_level4_specs_declare_volumes_and_their_questions():
    from spar_bench.probes.tasks import get_probe

    loc = get_probe("level4.localisation")
    assert (loc.output_shape, loc.metrics, loc.per_organ) == ((16, 3), ("med_vox", "med_mm", "sdr10_vox"), "med_vox")
    for p in LEVEL4_PROBES:
        s = get_probe(f"level4.{p}")
        assert s.asks and s.n_classes == LEVEL4_N_CLASSES[p] and s.index == LEVEL4_PROBES.index(p)
        assert s.row_field == "q_volume" and s.scale_field == "mm_per_voxel" and "q_organ_c" in s.fields
        assert s.question_keys == ("organ_a", "organ_b", "organ_c", "axis", "probe")
    assert get_probe("level4.relative_position").axes == VOLUME_AXES
    l3 = get_probe("level3.relative_position")  # Level 3's vocabulary unchanged
    assert l3.question_keys == ("organ_a", "organ_b", "axis", "probe") and l3.row_field == "q_slice"


def test_fake_level4_targets_load_for_every_probe(fake4):
    for probe in L4:
        b, t = _targets(fake4, probe, "train")
        assert len(t) > 0 and t.is_flipped is not None and not t.flipped.any()
        if probe == "level4.localisation":
            assert t.y["centroid"].shape == (len(t), 16, 3) and set(t.y["size"].tolist()) == {16.0}
        else:
            assert {"organ_c", "mm_per_voxel"} <= set(t.y) and (t.y["probe"] == t.spec.index).all()
            assert t.spec.question(t, np.arange(len(t))).keys() == set(t.spec.question_keys)


def test_level4_probes_on_a_build_without_level4_are_unavailable_in_one_line(tmp_path):
    from spar_bench.builder.shards import Build
    from spar_bench.builder.synthetic import write_synthetic_build
    from spar_bench.probes.runs.inputs import ProbeUnavailable, build_splits
    from spar_bench.probes.runs.spec import PredictorSpec

    b = Build(write_synthetic_build(tmp_path / "b", 8, levels=("level3",)))
    with pytest.raises(ProbeUnavailable, match=r"build has no level4; levels: level3$") as e:
        build_splits(b, PredictorSpec("level4.distance", "prior", features=str(b.root)))
    assert "\n" not in str(e.value)


def test_3d_localisation_metrics_in_voxels_and_mm():
    from spar_bench.probes.metrics import LEVEL4_KEYS, localisation_metrics

    true = np.full((2, 16, 3), 0.5)
    present = np.zeros((2, 16), bool)
    present[:, 0] = True
    pred = true.copy()
    pred[0, 0, 2] += 5 / 20  # 5 voxels along z in a 20^3 volume
    pred[1, 0, 0] += 12 / 40  # 12 voxels along x in a 40^3 volume
    m = localisation_metrics(pred, true, present, np.array([2.0, 1.0]), np.array([20.0, 40.0]), 10.0, LEVEL4_KEYS)
    assert m["med_vox"] == pytest.approx(8.5) and m["med_mm"] == pytest.approx((10 + 12) / 2)
    assert m["sdr10_vox"] == 0.5 and m["n"] == 2 and m["per_organ"]["liver"]["n"] == 2


def test_question_prior_types_include_organ_c():
    from spar_bench.probes.targets import Targets
    from spar_bench.probes.tasks import get_probe

    spec = get_probe("level4.distance")
    y = {"answer": np.array([0, 1, 1, 0]), "organ_a": np.array([0, 0, 0, 0]), "organ_b": np.array([1, 1, 2, 2]),
         "organ_c": np.array([2, 2, 1, 1]), "axis": np.full(4, -1), "probe": np.ones(4, int)}  # fmt: skip
    t = Targets(spec, "train", np.arange(4), np.array(list("abcd")), np.zeros(4, bool), y)
    prior = spec.fit_prior(t)
    assert prior["answer"] == {"0|1|2|-1": 0, "0|2|1|-1": 0}  # ties: the smaller answer
    assert spec.prior_predict(prior, t).tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------ heads
@pytest.mark.parametrize("head", ["linear", "mlp", "attnpool", "transformer"])
def test_heads_read_organ_c_and_the_si_axis_and_level3_keeps_its_shapes(head, fake4, one_torch_thread):
    from spar_bench.probes.heads import build_head, head_input
    from spar_bench.probes.train import TrainConfig, predict, seeded, train_head

    l3 = seeded(lambda: build_head(head, "level3.distance", 8, 4), 0).state_dict()
    l4 = seeded(lambda: build_head(head, "level4.relative_position", 8, 4), 0).state_dict()
    assert not any("organ_c" in k for k in l3) and l3["question.axis.weight"].shape[0] == 3
    assert l3["question.probe.weight"].shape[0] == 6
    assert l4["question.axis.weight"].shape[0] == 4 and l4["question.probe.weight"].shape[0] == len(LEVEL4_PROBES)
    assert "question.organ_c.weight" in l4
    shared = [k for k in l3 if not k.startswith("question.") and l3[k].shape == l4[k].shape]
    assert shared  # the rest of the head as before

    _, t = _targets(fake4, "level4.distance", "train")
    pooled = head_input(head) == "pooled"
    model = seeded(lambda: build_head(head, "level4.distance", 8, 4), 0)
    feats = np.random.default_rng(0).normal(size=(6, 8) if pooled else (6, 4, 8)).astype(np.float32)
    if not pooled:
        model.fit_projection(feats.reshape(-1, 8))
        feats = model.preproject(feats)
    train_head(model, (feats, t), (feats, t), TrainConfig(max_epochs=2, patience=1), 0)
    pred = predict(model, feats, t)
    assert pred.shape == (len(t),) and set(pred.tolist()) <= {0, 1}
    import torch

    model.eval()
    q = {k: torch.as_tensor(v) for k, v in t.spec.question(t, np.arange(len(t))).items()}
    e1 = model.question(q)
    q["organ_c"] = (q["organ_c"] + 1) % 16
    assert not torch.equal(e1, model.question(q))  # organ C reaches the head


# ------------------------------------------------------------------ the mask oracle
@pytest.mark.slow
def test_mask_oracle_scores_100_on_every_level4_probe_original_mirrored_and_flipped(phantom4):
    from spar_bench.probes.runs.mask_oracle import MaskOracle

    seen = {"mirror": 0, "flipped": 0, "original": 0}
    for probe in L4:
        for split in ("train", "val", "test"):
            b, t = _targets(phantom4, probe, split)
            if not len(t):
                continue
            oracle = MaskOracle(t.spec, b)
            t.y.pop("answer", None)  # it never reads the stored answer
            pred = oracle.predict(t, split)
            _, t = _targets(phantom4, probe, split)
            for part, mask in (("original", t.original), ("mirror", t.is_mirror), ("flipped", t.flipped)):
                if not mask.any():
                    continue
                seen[part] += int(mask.sum())
                if t.spec.output == "points":
                    m = t.spec.score(t.subset(mask), pred[mask], None, 0)
                    assert m["med_vox"] < 1e-4 and m["sdr10_vox"] == 1.0, (probe, split, part)
                else:
                    wrong = np.flatnonzero(pred[mask] != t.y["answer"][mask])
                    assert wrong.size == 0, (probe, split, part, wrong[:5])
            blind = oracle.blind().predict(t, split)
            if t.spec.output != "points":
                assert (blind == -1).all()  # it abstains without the volume
    assert min(seen.values()) > 0
    for probe in ("level4.containment", "level4.counting", "level4.symmetry", "level4.adjacency"):
        _, t = _targets(phantom4, probe, "train")
        assert len(t) > 0, probe  # the phantom asks every probe


def _run(build_dir: Path, probe: str, predictor_of, head: str, out: Path) -> dict:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.runs.session import BuildJob, execute
    from spar_bench.probes.runs.spec import PredictorSpec

    b = Build(build_dir)
    run = PredictorSpec(probe, head, seed=0, features=str(build_dir), n_boot=20)
    rd = execute(BuildJob.of(run, predictor_of(b, run.spec), b, out, head))
    return json.loads((rd / "metrics.json").read_text())


@pytest.mark.slow
def test_prior_and_oracle_runs_report_flipped_beside_mirrored_in_level3s_schema(phantom4, tmp_path):
    from spar_bench.probes.runs.mask_oracle import MaskOracle
    from spar_bench.probes.runs.predictors import ConstantPrior

    prior = lambda b, s: ConstantPrior(s)  # noqa: E731
    oracle = lambda b, s: MaskOracle(s, b)  # noqa: E731
    runs = tmp_path / "runs"
    l3 = _run(phantom4, "level3.relative_position", prior, "prior", runs)
    assert "flipped" not in l3 and "test_flipped" not in l3["n_items"]
    assert not any(k.endswith("_flipped") for k in l3["controls"])
    for probe in ("level4.relative_position", "level4.containment", "level4.localisation"):
        mp = _run(phantom4, probe, prior, "prior", runs)
        mo = _run(phantom4, probe, oracle, "oracle", runs)
        h = mp["headline"]
        for m in (mp, mo):  # Level 3's layout, and the flipped block beside the mirrored one
            assert set(m) == set(l3) | {"flipped"} and m["flipped"] is not None
            assert set(m["n_items"]) == set(l3["n_items"]) | {"test_flipped"}
            assert m["n_items"]["test_flipped"] == m["n_items"]["test_mirror"] == m["n_items"]["test"]
            no_majority = {"majority", "majority_class"} if probe == "level4.localisation" else set()
            assert set(m["controls"]) == (set(l3["controls"]) - no_majority) | {"prior_flipped", "blind_flipped"}
            assert set(m["flipped"]) == set(m["mirror"]) == set(m["test"])
            if probe == "level4.relative_position":
                assert set(m["test"]) == set(l3["test"]) and set(m["test"]["per_axis"]) <= set(VOLUME_AXES)
        assert mp["test"][h] == mp["controls"]["prior"][h]  # the prior predictor IS the prior control
        assert mp["flipped"][h] == mp["controls"]["prior_flipped"][h]
        if probe == "level4.localisation":
            assert mo["test"]["med_vox"] < 1e-4 and mo["flipped"]["med_vox"] < 1e-4
            assert mo["controls"]["blind"]["med_vox"] > 1.0
        else:
            assert mo["test"]["accuracy"] == mo["mirror"]["accuracy"] == mo["flipped"]["accuracy"] == 1.0
            assert mo["controls"]["blind"]["accuracy"] == 0.0  # abstains
            c = mo["test"]["conflict"]
            assert c["n"] == 0 or c["accuracy"] == 1.0
    _reports_show_level4_beside_level3(runs, tmp_path)


def _reports_show_level4_beside_level3(runs: Path, tmp_path: Path) -> None:
    from spar_bench.experiments.report import write_experiment_report
    from spar_bench.probes.runs.report import write_report

    md = write_report(runs, tmp_path / "report").read_text()
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["probes"]
    assert md.index("## level3.relative_position") < md.index("## level4.localisation") < md.index(
        "## level4.relative_position")
    l4_table = md[md.index("## level4.relative_position"):]
    assert "| flipped | prior (flipped) | blind (flipped) |" in l4_table
    assert "superior_inferior" in l4_table and "flipped: conflict acc." in l4_table
    assert "flipped" not in md[md.index("## level3.relative_position"):md.index("## level4.localisation")]
    assert all("flipped" not in r for r in rows["level3.relative_position"])
    oracle = next(r for r in rows["level4.relative_position"] if r["encoder"] == "oracle")
    assert oracle["mean"] == oracle["mirror"] == oracle["flipped"] == 1.0 and oracle["blind"] == 0.0
    assert (tmp_path / "report" / "level4.localisation-per-organ.png").is_file()
    ex = write_experiment_report(runs, tmp_path / "exp", title="Level 4").read_text()
    head = next(ln for ln in ex[ex.index("## Main table"):].splitlines() if ln.startswith("| encoder"))
    assert head.index("level3.relative_position") < head.index("level4.localisation")
    flip = ex[ex.index("## Flip counterfactual (Level 4)"):]
    assert "level4.relative_position" in flip.split("\n\n")[2] and "level3" not in flip.split("\n\n")[2]
