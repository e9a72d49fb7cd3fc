"""``mllm:DIR@llm:N+q``: the LM's image tokens with the probe's question in the prompt, on tiny
random LLaVA and Qwen2-VL models; its cache (one probe's questions, a row each), the heads on it
and the experiment's expansion to one encoder per probe."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.encoders.mllm_family import chat_prompt
from spar_bench.probes.features import FeatureCache
from spar_bench.probes.vqa.tiny import make_tiny_llava, make_tiny_qwen2_vl

from helpers import images, interrupted_cache, run_cmd

pytest.importorskip("transformers")

Q1 = "Is the centre of the liver to the patient's left of the centre of the spleen?\nOptions:\nA. yes\nB. no"
Q2 = "How many separate lesions (tumours) are visible on this slice?"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mllms")
    return {"llava": make_tiny_llava(root / "llava"), "qwen": make_tiny_qwen2_vl(root / "qwen", pixels=112)}


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """A small phantom build, Level 3 only, with mirrors (symmetry: 10 train and 4 test questions)."""
    from spar_bench.builder.cli import cli

    root = tmp_path_factory.mktemp("qbuild")
    assert run_cmd(cli, ["phantom", "--out", root / "ph", "--n", 4, "--in-plane", 96, "--slices", 16,
                         "--layout", "canonical"]) == 0
    assert run_cmd(cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "shards", "--levels", "level3",
                         "--samples-per-case", 2, "--counterfactual", "mirror", "--no-hf"]) == 0
    return root / "shards"


def _asked(enc, x, texts):
    with enc.asking(texts):
        return enc(x)[-1][0]


@pytest.mark.parametrize("model", ["llava", "qwen"])
def test_the_question_changes_the_image_tokens(models, model) -> None:
    asked, neutral = load_encoder(f"mllm:{models[model]}@llm:2+q"), load_encoder(f"mllm:{models[model]}@llm:2")
    x = images(2)
    a, b, n = _asked(asked, x, [Q1, Q1]), _asked(asked, x, [Q2, Q2]), neutral(x)[-1][0]
    assert a.shape == n.shape == (2, neutral.spec.n_tokens, 32) and asked.spec.n_tokens == neutral.spec.n_tokens
    assert asked.spec.grid == neutral.spec.grid and asked.spec.extra["stage"] == "llm:2+q"
    assert asked.spec.extra["prompt"].index("{question}") < asked.spec.extra["prompt"].index("<")  # before the image
    assert not torch.allclose(a, n, atol=1e-3) and not torch.allclose(a, b, atol=1e-3)
    # one image alone, or beside a longer question (right-padded): the same tokens
    torch.testing.assert_close(_asked(asked, x[:1], [Q2]), b[:1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="needs the question of each of its 2 images.*--probe"):
        asked(x)


def test_after_the_image_the_question_cannot_change_a_causal_lm_s_image_tokens(models) -> None:
    """Why the stage puts the question first: as ``spar-probe vqa`` sends it (image first), every
    layer's image tokens are the neutral prompt's (causal attention: no token reads a later one).

    Not bit for bit: the two prompts have different lengths, so the CPU's kernels block the
    matmuls and the attention differently and sum in another order (on an AMX CPU, 49 of 1024
    fp32 values differed by up to 4.2e-7, a few ulps). The tolerance, 1e-5, is ~100x that and
    ~100x below what a question BEFORE the image changes (> 1e-3, the test above)."""
    neutral = load_encoder(f"mllm:{models['llava']}@llm:2")
    x = images(2)
    want = neutral(x)[-1][0]
    neutral.prompt = chat_prompt(neutral.processor, Q1)
    got = neutral(x)[-1][0]
    assert got.dtype == torch.float32  # the encoder's own precision, whatever the CPU
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    asked = load_encoder(f"mllm:{models['llava']}@llm:2+q")
    assert not torch.allclose(_asked(asked, x, [Q1, Q1]), want, atol=1e-3)  # before the image: it changes


def _opts(**kw) -> CacheOptions:
    return CacheOptions(splits=("train", "test"), batch_size=4, dtype="fp32", compute="fp32", **kw)


@pytest.mark.slow
def test_a_question_cache_holds_one_probe_s_questions_and_resumes(models, build, tmp_path) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import load_questions

    name = f"mllm:{models['llava']}@llm:2+q"
    full = write_cache(name, build, tmp_path / "full.h5", _opts(probe="level3.symmetry"), progress=False)
    part = tmp_path / "part.h5"
    interrupted_cache(name, build, part, _opts(probe="level3.symmetry", async_writes=False))
    with pytest.raises(ConfigError, match=r"part\.h5: a partial cache made with other arguments .*encoder_config"):
        write_cache(name, build, part, _opts(probe="level3.counting"), progress=False)
    write_cache(name, build, part, _opts(probe="level3.symmetry"), progress=False)
    qs = load_questions(Build(build), get_probe("level3.symmetry"), ["train"])
    with FeatureCache(full) as a, FeatureCache(part) as b:
        assert a.levels() == ["level3"] and list(a.keys("level3", "train")) == list(qs.key)
        assert qs.is_mirror.any() and a.tokens("level3", "train").shape == (len(qs), 16, 32)
        for split in ("train", "test"):
            np.testing.assert_array_equal(a.tokens("level3", split, -1), b.tokens("level3", split, -1))
        extra = a.meta["encoder_config"]["extra"]
    assert extra["question_probe"] == "level3.symmetry" and extra["question_template"] == "symmetry@3"
    assert extra["question_rows"] == {"test": 4, "train": 10} and len(extra["questions_sha256"]) == 64
    assert extra["stage"] == "llm:2+q" and "{question}" in extra["prompt"]


def test_the_probe_is_given_once_and_kept(models, build, tmp_path) -> None:
    from spar_bench.probes.cli import cli

    asked, neutral = f"mllm:{models['llava']}@llm:2+q", f"mllm:{models['llava']}@llm:2"
    for name, opts, match in ((asked, _opts(), "a question stage is cached for one probe's questions; pass --probe"),
                              (neutral, _opts(probe="level3.size"), "--probe applies to the question stages"),
                              (asked, _opts(probe="level1.localisation"), "reads Level 3 questions"),
                              (asked, _opts(probe="level3.nope"), "level3.nope")):
        with pytest.raises(ConfigError, match=match):
            write_cache(name, build, tmp_path / "x.h5", opts, progress=False)
    code = run_cmd(cli, ["cache", "--encoder", asked, "--data", build, "--out", tmp_path / "y.h5"])
    assert code != 0 and not (tmp_path / "y.h5").exists()


@pytest.mark.slow  # a cache and two fits through the CLI
def test_a_head_trains_on_a_question_cache_and_no_other_probe_does(models, build, tmp_path, capsys) -> None:
    from spar_bench.probes.cli import cli

    # every split: val holds no symmetry question, so it is not cached (fit holds out train patients)
    opts = CacheOptions(batch_size=4, dtype="fp32", compute="fp32", probe="level3.symmetry")
    cache = write_cache(f"mllm:{models['qwen']}@llm:1+q", build, tmp_path / "q.h5", opts, progress=False)
    with FeatureCache(cache) as fc:
        assert fc.splits("level3") == ["test", "train"]
    args = ["--data", build, "--out", tmp_path / "runs", "--head", "linear", "--seeds", "0", "--max-epochs", 2,
            "--bootstrap", 20]
    assert run_cmd(cli, ["fit", "--features", cache, "--probe", "all", *args]) == 0  # all: the cache's one probe
    (metrics,) = (tmp_path / "runs").rglob("metrics.json")
    m = json.loads(metrics.read_text())
    assert m["probe"] == "level3.symmetry" and "blind" in json.dumps(m)
    capsys.readouterr()
    assert run_cmd(cli, ["fit", "--features", cache, "--probe", "level3.size", *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a question cache made for level3.symmetry" in err[0] and "--probe level3.size" in err[0]


STAGED = """
experiment: stages
out: {out}
builds:
  train: {{phantom: {{n: 4, in_plane: 96, slices: 16}}, options: {{samples_per_case: 2, hf: false, levels: level3}}}}
modes:
  frozen: {{heads: [linear], options: {{max_epochs: 1, bootstrap: 10}}, cache: {{batch_size: 8, compute: fp32}}}}
probes: [level3.relative_position, level3.symmetry]
seeds: [0]
mllms:
  tiny: {{model: "hf:{model}", stages: [vision, llm:2, llm:2+q, answer], options: {{bootstrap: 10}}}}
"""


def test_a_question_stage_expands_to_one_encoder_and_cache_per_probe(models, tmp_path) -> None:
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    path = tmp_path / "e.yaml"
    path.write_text(STAGED.format(out=tmp_path / "out", model=models["llava"]))
    exp = load_experiment(path)
    q = ("tiny-llm2q-relative_position", "tiny-llm2q-symmetry")
    assert exp.modes["frozen"].encoders == ("tiny-vision", "tiny-llm2", *q)
    assert [exp.encoders[e].probe for e in q] == ["level3.relative_position", "level3.symmetry"]
    assert {exp.encoders[e].spec for e in q} == {f"mllm:{models['llava']}@llm:2+q"}
    steps = {s.id: s for s in make_plan(exp).steps}
    cache = dict(steps["cache:tiny-llm2q-symmetry@train"].specs)["cache"]
    sweep = dict(steps["heads:tiny-llm2q-symmetry"].specs)["sweep"]
    assert cache["probe"] == "level3.symmetry" and sweep["probes"] == ["level3.symmetry"]
    assert "probe" not in dict(steps["cache:tiny-llm2@train"].specs)["cache"]
    path.write_text(STAGED.format(out=tmp_path / "out", model=models["llava"]).replace(
        "[level3.relative_position, level3.symmetry]", "[level1.localisation]"))
    with pytest.raises(ConfigError, match=r"e\.yaml:\d+: mllms\.tiny\.stages\[2\]: .*no level3 probe"):
        load_experiment(path)


def test_the_stage_table_puts_each_question_stage_beside_its_layer() -> None:
    from spar_bench.experiments.report import stage_summary, stage_tables

    def row(encoder: str, probe: str, test: float) -> dict:
        cell = {"percent": True, "test": {"mean": test, "std": 0.0, "n": 1}, "blind": {"mean": 0.5, "std": 0.0, "n": 1}}
        return {"encoder": encoder, "mode": "frozen", "head": "mlp", "options": "", "build": "", "tag": "",
                "cells": {probe: cell}}

    rows = [row(f"mllm:m@0123abcd@{st}", "level3.size", v) for st, v in
            (("llm:10+q", 0.6), ("llm:10", 0.7), ("llm:2+q", 0.8), ("vision", 0.9), ("llm:2", 0.75))]
    doc = {"probes": ["level3.size"], "configurations": rows}
    (model,) = stage_summary(doc)
    assert [s["stage"] for s in model["stages"]] == ["vision", "llm:2", "llm:2+q", "llm:10", "llm:10+q"]
    assert "| probe | vision | llm:2 | llm:2+q | llm:10 | llm:10+q |" in "\n".join(stage_tables(doc))


@pytest.fixture(scope="module")
def llava15(tmp_path_factory) -> Path:
    from spar_bench.probes.vqa.tiny import LLAVA_15_TEMPLATE, make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("llava15") / "m", chat_template=LLAVA_15_TEMPLATE, bos=True)


def test_llava_15_s_template_still_gets_the_question_first(llava15) -> None:
    """LLaVA-1.5's template writes the image first whatever the content's order: the stage splices
    the image's own rendering after the question, so the image tokens attend to it (the old
    prompt, the content reordered only, left them exactly the neutral stage's)."""
    from spar_bench.probes.vqa.chat import render

    asked, neutral = load_encoder(f"mllm:{llava15}@llm:2+q"), load_encoder(f"mllm:{llava15}@llm:2")
    old = render(asked.processor, [{"type": "text", "text": Q1}, {"type": "image"}])
    assert old.index("<image>") < old.index("Is the centre")  # the template ignores the order given
    prompt = asked.spec.extra["prompt"]
    assert prompt == "USER: {question}\n<image> ASSISTANT:"
    assert asked.spec.extra["question_before_image"] is True and asked.spec.extra["question_placement"] == "spliced"
    x = images(2)
    a, n = _asked(asked, x, [Q1, Q1]), neutral(x)[-1][0]
    assert a.shape == n.shape and not torch.allclose(a, n, atol=1e-3)


def test_a_template_that_cannot_ask_first_refuses_the_stage(tmp_path) -> None:
    """A template that writes the image ahead of the whole conversation: one line, no stage."""
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    template = ("<image>{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
                "{{ c['text'] }}{% endfor %}{% endfor %}{% if add_generation_prompt %} assistant : {% endif %}")
    folder = make_tiny_llava(tmp_path / "m", chat_template=template)
    with pytest.raises(ConfigError, match=r"cannot put the question before the image.*probe llm:N$"):
        load_encoder(f"mllm:{folder}@llm:1+q")
    assert load_encoder(f"mllm:{folder}@llm:1").spec.extra.get("question_before_image") is None
