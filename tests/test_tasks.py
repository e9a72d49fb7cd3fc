"""Probe specs: one registry that fit, eval, sweep, report and the heads read.

The priors are checked against hand-made training splits where the closed-form optimum
is known, and the registry is checked to be the only place in ``probes/`` that branches
on a level name.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.schema import LEVEL3_CLASS_NAMES, LEVEL4_PROBES, PROBES
from spar_bench.errors import ConfigError
from spar_bench.probes.targets import Targets
from spar_bench.probes.tasks import METRICS, get_probe, probe_names

REPO = Path(__file__).resolve().parents[1]


def _targets(spec, y: dict, n: int) -> Targets:
    return Targets(spec, "train", np.arange(n), np.arange(n).astype(str), np.zeros(n, bool), y)


def test_registry_holds_the_eight_probes_in_protocol_order_and_suggests_names():
    # the eight probes of Levels 1-3, then Level 4's (volumes; opt-in)
    assert probe_names() == [*PROBES, "level4.localisation", *(f"level4.{p}" for p in LEVEL4_PROBES)]
    with pytest.raises(ConfigError, match="Did you mean 'level3.counting'"):
        get_probe("level3.countin")
    for name in probe_names():
        spec = get_probe(name)
        assert spec.name == name and spec.level == name.split(".")[0]
        assert spec.headline == spec.metrics[0] and set(spec.metrics) <= set(METRICS)
    l1, l2, rp = (get_probe(p) for p in ("level1.localisation", "level2.arrangement",
                                          "level3.relative_position"))  # fmt: skip
    assert (l1.output_shape, l1.n_outputs, l1.higher_is_better) == ((16, 2), 32, False)
    assert (l2.output_shape, l2.n_queries, l2.chance is not None) == ((16, 16), 16, True)
    assert rp.asks and rp.n_queries == 1 and rp.class_names == LEVEL3_CLASS_NAMES["relative_position"]
    assert {"perm", "target_slot", "present_pos"} <= set(l2.fields)


def test_level1_prior_is_the_mean_training_centroid_per_organ():
    spec = get_probe("level1.localisation")
    cent = np.zeros((3, 16, 2), np.float32)
    cent[:, 0] = [[0.2, 0.4], [0.4, 0.6], [0.9, 0.9]]
    present = np.ones((3, 16), bool)
    present[2, 0] = False  # absent organs do not count
    t = _targets(spec, {"centroid": cent, "present": present, "mm_per_pixel": np.ones(3)}, 3)
    pred = spec.prior_predict(spec.fit_prior(t), t)
    assert pred.shape == (3, 16, 2)
    np.testing.assert_allclose(pred[:, 0], [[0.3, 0.5]] * 3, rtol=1e-6)


def test_level2_prior_puts_each_organ_in_its_most_frequent_slot():
    spec = get_probe("level2.arrangement")
    rng = np.random.default_rng(0)
    n, k = 40, 5
    perm = np.stack([rng.permutation(16) for _ in range(n)])
    present_pos = perm < k  # organs 0..4 present, shown at random positions
    slot = np.where(present_pos, perm, -1)  # organ o always sits in slot o
    slot[0, present_pos[0]] = np.roll(slot[0, present_pos[0]], 1)  # one odd sample
    y = {"perm": perm, "present_pos": present_pos, "target_slot": slot}
    t = _targets(spec, y, n)
    prior = spec.fit_prior(t)
    pred = spec.prior_predict(prior, t)
    m = spec.score(t, pred, None, 0)
    assert m["perm_acc"] == pytest.approx((n - 1) / n)
    # per-organ tile accuracy: organs 0..4 present, every other organ absent (n = 0)
    assert m["per_organ"]["liver"]["n"] == n and np.isnan(m["per_organ"]["rectum"]["tile_acc"])
    assert 0.9 < m["per_organ"]["liver"]["tile_acc"] <= 1.0


def test_level3_prior_is_the_majority_answer_per_question_type():
    spec = get_probe("level3.relative_position")
    a = np.array([0, 0, 0, 1, 1, 2])
    b = np.array([1, 1, 1, 0, 0, 3])
    axis = np.array([0, 0, 0, 0, 0, 1])
    ans = np.array([1, 1, 0, 0, 0, 1])
    y = {"organ_a": a, "organ_b": b, "axis": axis, "answer": ans, "probe": np.zeros(6, np.int64)}
    t = _targets(spec, y, 6)
    prior = spec.fit_prior(t)
    assert prior["default"] == 0  # the probe's majority answer (3 of 6 are 0; ties: smallest)
    np.testing.assert_array_equal(spec.prior_predict(prior, t), [1, 1, 1, 0, 0, 1])
    unseen = _targets(spec, {**{k: v[:1] for k, v in y.items()}, "organ_a": np.array([5])}, 1)
    np.testing.assert_array_equal(spec.prior_predict(prior, unseen), [0])
    assert spec.majority(t) == 0 and spec.majority_rate(0, t) == pytest.approx(0.5)


def test_no_level_name_branch_outside_the_probe_specs():
    """The probe registry is the only place in probes/ that knows what a level is."""
    hits = []
    for path in sorted((REPO / "probes").rglob("*.py")):
        if path.name == "tasks.py":
            continue
        toks = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for tok in toks:
            if tok.type == tokenize.STRING and re.fullmatch(r"[rbu]*['\"]level\d['\"]", tok.string):
                hits.append(f"{path.relative_to(REPO)}:{tok.start[0]}: {tok.string}")
    assert not hits, hits
