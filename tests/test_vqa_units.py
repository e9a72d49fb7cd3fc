"""MLLM track pieces: prompts, the response cache (never across models), scoring, registry."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.builder.schema import LEVEL3_CLASS_NAMES, LEVEL3_PROBES, ORGANS
from spar_bench.errors import IntegrityError
from spar_bench.probes.vqa.prompts import (
    CONVENTION_HINT,
    PromptContext,
    render,
    rotations,
    template_version,
)


def test_prompts_name_organs_options_and_patient_frame():
    liver, spleen = ORGANS.index("liver"), ORGANS.index("spleen")
    p = render("relative_position", liver, spleen, 0, (0, 1))
    assert "Is the centre of the liver to the patient's left of the centre of the spleen?" in p.text
    assert CONVENTION_HINT in p.text and "patient's left" in p.text and "centroid" in p.text
    assert "A. no" in p.text and "B. yes" in p.text and p.version == "relative_position@3"
    ap = render("relative_position", liver, spleen, 1, (1, 0), hint=False)
    assert "anterior" in ap.text and CONVENTION_HINT not in ap.text
    assert ap.options == ("yes", "no") and ap.class_of(0) == 1 and ap.class_of(None) == -1
    for probe in LEVEL3_PROBES:  # every probe renders, options = its class names, in order
        n = len(LEVEL3_CLASS_NAMES[probe])
        q = render(probe, 2, 3, 0 if probe == "relative_position" else -1, tuple(range(n)),
                   context=PromptContext(1.5, 224, (100.0, 200.0), 0.15, 3))
        assert len(q.letters) == n and q.text.count("\n") >= n + 2
        assert template_version(probe) == q.version
    sym = render("symmetry", ORGANS.index("kidney_left"), ORGANS.index("kidney_right"), -1, (0, 1, 2),
                 context=PromptContext(band=0.15))
    assert "left kidney" in sym.text and "right kidney" in sym.text


def test_rotations_cover_every_position():
    rots = rotations(3)
    assert rots == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    for c in range(3):  # each class is shown once at each position
        assert sorted(r.index(c) for r in rots) == [0, 1, 2]


def _key(model: str, **over):
    k = {"model": {"kind": "dir", "name": model, "sha256": model * 4}, "decoding": {"mode": "constrained"},
         "template": "size@1", "prompt_sha256": "p", "sample": "s/q000", "order": [0, 1, 2],
         "image": {"size": 224}, "tool": "0.2"}
    k.update(over)
    return k


def test_cache_never_crosses_models_and_detects_tampering(tmp_path):
    import sqlite3

    from spar_bench.probes.vqa.cache import ResponseCache, key_hash

    path = tmp_path / "c.sqlite"
    with ResponseCache(path) as c:
        c.put_many([(_key("model-a"), {"text": "A"})])
        assert c.get(_key("model-a")) == {"text": "A"}
        assert c.get(_key("model-b")) is None  # same question, another model: a miss
        for field, value in [("template", "size@3"), ("order", [1, 2, 0]), ("image", None),
                             ("decoding", {"mode": "generate"}), ("tool", "0.3"), ("sample", "s/q001")]:
            assert c.get(_key("model-a", **{field: value})) is None, field
        c.put_many([(_key("model-b"), {"text": "B"})])
        assert c.get(_key("model-a")) == {"text": "A"} and len(c) == 2
    with ResponseCache(path) as c:  # persisted: a rerun resumes
        assert c.get(_key("model-b")) == {"text": "B"}
    db = sqlite3.connect(path)  # file model-b's answer under model-a's hash
    db.execute("DELETE FROM replies WHERE hash=?", (key_hash(_key("model-a")),))
    db.execute("UPDATE replies SET hash=?", (key_hash(_key("model-a")),))
    db.commit()
    db.close()
    with ResponseCache(path) as c, pytest.raises(IntegrityError):
        c.get(_key("model-a"))


def test_unparseable_answers_count_wrong_never_as_another_class():
    from spar_bench.probes.metrics import level3_metrics, macro_f1

    y = np.array([0, 1, 2, 0])
    pred = np.array([0, -1, 2, -1])  # the shared evaluation scores an MLLM's answers with these
    m = level3_metrics(y, pred, 3)
    assert m["accuracy"] == 0.5 and m["chance"] == pytest.approx(1 / 3) and "ci" not in m
    ci = level3_metrics(y, pred, 3, groups=np.array(["p", "p", "q", "q"]), rng=np.random.default_rng(0),
                        n_reps=20)["ci"]
    assert ci["accuracy"][0] <= 0.5 <= ci["accuracy"][1]
    # class 0: tp 1, fn 1 -> 2/3; class 1: fn 1 -> 0; class 2: tp 1 -> 1
    assert macro_f1(y, pred, 3) == pytest.approx((2 / 3 + 0 + 1) / 3)


def _answered_questions():
    """Six relative-position questions (4 original over 2 patients, 2 mirrored) and answers
    in every form: rotations 0 and 1, blind, one unparsed."""
    from spar_bench.probes.targets import Targets
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import Questions

    y = np.array([1, 0, 1, 0, 0, 1])
    fields = {"answer": y, "organ_a": np.zeros(6, np.int64), "organ_b": np.ones(6, np.int64),
              "axis": np.array([0, 0, 1, 1, 0, 1])}
    t = Targets(get_probe("level3.relative_position"), "test", np.arange(6), np.array(["p", "p", "q", "q", "p", "q"]),
                np.array([False] * 4 + [True] * 2), fields)
    qs = Questions(t, np.array([f"k{i}" for i in range(6)]), np.full(6, "test"))
    recs = []
    for i in range(6):
        rots = (0, 1) if i < 4 else (0,)
        for r in rots:  # right at rotation 0 except question 3 (unparsed); wrong at rotation 1 on question 0
            cls = -1 if (i, r) == (3, 0) else (1 - y[i] if (i, r) == (0, 1) else y[i])
            recs.append({"key": f"k{i}", "variant": "image", "rotation": r, "mirror": i >= 4, "class": int(cls),
                         "choice": None if cls < 0 else int(cls), "reason": "hedged" if cls < 0 else None})
        recs.append({"key": f"k{i}", "variant": "blind", "rotation": 0, "mirror": i >= 4, "class": 0, "choice": 0,
                     "reason": None})
    return qs, recs


def test_mllm_answers_are_scored_by_the_shared_evaluation_with_their_own_controls():
    from spar_bench.probes.runs.evaluate import evaluate
    from spar_bench.probes.runs.spec import PredictorSpec
    from spar_bench.probes.vqa.ask import asked_splits
    from spar_bench.probes.vqa.predictor import Answered

    qs, recs = _answered_questions()
    m = evaluate(PredictorSpec("level3.relative_position", "vqa-loglik", n_boot=20), Answered.of(qs, recs),
                 asked_splits(qs, None), None)
    assert m["test"]["accuracy"] == 0.75 and m["test"]["n"] == 4 and m["mirror"]["accuracy"] == 1.0
    ctrl = m["controls"]  # the shared controls (no prior without a train split) and the MLLM's own
    assert ctrl["blind"]["accuracy"] == 0.5 and ctrl["blind_mirror"]["accuracy"] == 0.5 and "prior" not in ctrl
    assert ctrl["parse_rate"] == 0.75 and ctrl["unparsed"]["test"] == {"hedged": 1}
    assert ctrl["circular"]["strict"] == 0.5 and ctrl["circular"]["per_rotation"] == [0.75, 0.75]
    assert ctrl["position_rate"] == pytest.approx([4 / 7, 3 / 7])
    assert not {"parse_rate", "unparsed", "circular"} & m.keys()


def test_a_predictor_without_own_controls_gets_only_the_shared_ones():
    from spar_bench.probes.runs.evaluate import evaluate
    from spar_bench.probes.runs.spec import PredictorSpec
    from spar_bench.probes.vqa.ask import asked_splits
    from spar_bench.probes.vqa.predictor import Answered

    qs, recs = _answered_questions()

    class Plain:
        kind = "plain"
        inner = Answered.of(qs, recs)

        def fit(self, train, val):
            return None

        def predict(self, t, split="test"):
            return self.inner.predict(t, split)

        def blind(self):
            return None

    m = evaluate(PredictorSpec("level3.relative_position", "x", n_boot=20), Plain(), asked_splits(qs, None), None)
    assert set(m["controls"]) == {"chance"} and m["test"]["accuracy"] == 0.75


def test_circular_eval_strict_and_mean():
    from spar_bench.probes.vqa.score import circular_metrics

    y = np.array([1, 0])
    image = np.array([[1, 1], [0, 1]])  # q0 right twice, q1 right once
    m = circular_metrics(y, image, np.array(["p0", "p1"]), np.random.default_rng(0), 20)
    assert m["strict"] == 0.5 and m["mean"] == 0.75 and m["per_rotation"] == [1.0, 0.5]
    assert circular_metrics(y, image[:, :1], np.array(["p0", "p1"]), np.random.default_rng(0), 5) is None


def test_backend_registry_is_lazy_and_suggests():
    import subprocess
    import sys

    from spar_bench.errors import ConfigError
    from spar_bench.probes.vqa import BACKENDS, BackendOptions, load_backend

    assert {"dummy", "hf", "openai"} <= set(BACKENDS.names())
    with pytest.raises(ConfigError, match="Did you mean 'openai'"):
        load_backend("opneai:x", BackendOptions())
    code = "import sys, spar_bench.probes.cli.vqa; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, encoding="utf-8", errors="replace", check=True)
    assert out.stdout.split() == ["False", "False"]


def test_image_size_auto_only_upscales():
    from types import SimpleNamespace

    from spar_bench.errors import ConfigError
    from spar_bench.probes.cli.vqa import resolve_image_size

    assert resolve_image_size("auto", SimpleNamespace(preferred_size=336)) == 336
    assert resolve_image_size("auto", SimpleNamespace(preferred_size=32)) == 224
    assert resolve_image_size("auto", SimpleNamespace()) == 224
    assert resolve_image_size("448", SimpleNamespace(preferred_size=336)) == 448
    with pytest.raises(ConfigError, match="integer or auto"):
        resolve_image_size("big", SimpleNamespace())
    transformers = pytest.importorskip("transformers")
    from spar_bench.probes.vqa.hf import preferred_size

    clip = transformers.CLIPImageProcessor(size={"shortest_edge": 336},
                                           crop_size={"height": 336, "width": 336})
    assert preferred_size(clip) == 336
    assert preferred_size(None) is None
