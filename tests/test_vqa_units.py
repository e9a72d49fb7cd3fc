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
    from spar_bench.probes.metrics import macro_f1
    from spar_bench.probes.vqa.score import answer_metrics

    y = np.array([0, 1, 2, 0])
    pred = np.array([0, -1, 2, -1])
    m = answer_metrics(y, pred, 3, None, None, 10)
    assert m["accuracy"] == 0.5 and m["parse_rate"] == 0.5 and m["n_unparsed"] == 2
    assert m["chance"] == pytest.approx(1 / 3) and "ci" not in m
    ci = answer_metrics(y, pred, 3, np.array(["p", "p", "q", "q"]), np.random.default_rng(0), 20)["ci"]
    assert ci["accuracy"][0] <= 0.5 <= ci["accuracy"][1]
    # class 0: tp 1, fn 1 -> 2/3; class 1: fn 1 -> 0; class 2: tp 1 -> 1
    assert macro_f1(y, pred, 3) == pytest.approx((2 / 3 + 0 + 1) / 3)


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
