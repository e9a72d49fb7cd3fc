"""``mllm:DIR@STAGE``: tiny random LLaVA, Qwen2-VL and PaliGemma models built offline, each stage's
tokens (counts, grids, differences), a resumable cache and a head fitted on every stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from spar_bench.errors import ConfigError
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.features import FeatureCache
from spar_bench.probes.vqa.tiny import make_tiny_llava, make_tiny_paligemma, make_tiny_qwen2_vl

from helpers import images, interrupted_cache, run_cmd

pytest.importorskip("transformers")

#: model -> (vision tokens, LM tokens) of its 224 input: LLaVA 32 px / patch 8 (no CLS: the
#: ``default`` strategy); Qwen2-VL 112 px / patch 14 = 8x8 patches merged 2x2; PaliGemma 4x4
TOKENS = {"llava": (16, 16), "qwen": (64, 16), "pali": (16, 16)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mllms")
    return {"llava": make_tiny_llava(root / "llava"), "qwen": make_tiny_qwen2_vl(root / "qwen", pixels=112),
            "pali": make_tiny_paligemma(root / "pali")}


def _tokens(name: str) -> tuple[torch.Tensor, object]:
    enc = load_encoder(name)
    toks, pooled = enc(images(2))[-1]
    assert pooled.shape == (2, toks.shape[-1])
    return toks, enc.spec


@pytest.mark.parametrize("model", sorted(TOKENS))
def test_each_stage_has_its_token_count_and_the_stages_differ(models, model) -> None:
    got = {st: _tokens(f"mllm:{models[model]}@{st}") for st in ("vision", "projector", "llm:0", "llm:2")}
    n_vision, n_lm = TOKENS[model]
    for st, (toks, spec) in got.items():
        want = n_vision if st == "vision" else n_lm
        assert toks.shape == (2, want, 32) and spec.n_tokens == want, st
        assert spec.extra["stage"] == st and spec.extra["image_tokens"] == n_lm and spec.family == "mllm"
        assert spec.name.startswith(f"mllm:{model}@") and spec.name.endswith(f"@{st}")  # no local path
        assert spec.weights["kind"] == "dir" and not spec.random_init
        assert len(spec.extra["config_sha256"]) == 64
    # what the LM receives at its input is the projector's output, and every later stage differs
    torch.testing.assert_close(got["projector"][0], got["llm:0"][0])
    stages = ["projector", "llm:2"] + (["vision"] if n_vision == n_lm else [])
    for i, a in enumerate(stages):
        for b in stages[i + 1:]:
            assert not torch.allclose(got[a][0], got[b][0], atol=1e-3), (a, b)
    assert got["llm:2"][1].extra["prompt"] and got["vision"][1].extra["prompt"] is None


def test_qwen_vision_tokens_are_row_major_and_merge_to_the_projector(models) -> None:
    """Qwen2-VL's processor lists patches 2x2 window by window; the vision stage gives them in
    row-major order (the grid heads assume): undone, its merger reproduces the projector."""
    enc = load_encoder(f"mllm:{models['qwen']}@vision")
    assert enc.spec.grid == (8, 8) and enc.spec.extra["lm_grid"] == [4, 4]
    x = images(2)
    vis = enc(x)[-1][0]  # (2, 64, D) row-major
    proj = load_encoder(f"mllm:{models['qwen']}@projector")(x)[-1][0]
    windows = vis.reshape(2, 4, 2, 4, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(-1, vis.shape[-1])
    with torch.inference_mode():
        merged = enc.module.model.visual.merger(windows).reshape(2, 16, -1)
    torch.testing.assert_close(merged, proj)


def test_bad_names_are_one_line(models, tmp_path) -> None:
    d = models["llava"]
    for name, match in ((f"mllm:{d}", "name a stage"), (f"mllm:{d}@lm:3", "unknown stage"),
                        (f"mllm:{d}@llm:9", "layer 9 out of range.*2 layers"),
                        (f"mllm:{tmp_path}/nope@vision", "not a folder")):
        with pytest.raises(ConfigError, match=match):
            load_encoder(name)
    with pytest.raises(ConfigError, match="holds the weights; drop --random-init"):
        load_encoder(f"mllm:{d}@vision", random_init=True)


def test_random_weights_only_when_asked(models, tmp_path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(models["llava"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ConfigError, match="holds no weights.*--random-init"):
        load_encoder(f"mllm:{bare}@projector")
    a = load_encoder(f"mllm:{bare}@projector", random_init=True)
    b = load_encoder(f"mllm:{bare}@projector", random_init=True)
    assert a.spec.random_init and a.spec.weights["kind"] == "random-init"
    torch.testing.assert_close(a(images(1))[-1][0], b(images(1))[-1][0])  # one seeded network


def _opts(**kw) -> CacheOptions:
    return CacheOptions(levels=("level3",), splits=("train", "test"), batch_size=4, dtype="fp32", compute="fp32",
                        **kw)


@pytest.mark.slow  # the session's phantom pipeline
def test_stage_cache_resumes_to_the_same_bytes(models, pipeline, tmp_path) -> None:
    name = f"mllm:{models['qwen']}@llm:1"
    full = write_cache(name, pipeline["shards"], tmp_path / "full.h5", _opts(), progress=False)
    part = tmp_path / "part.h5"
    interrupted_cache(name, pipeline["shards"], part, _opts(async_writes=False))
    write_cache(name, pipeline["shards"], part, _opts(), progress=False)
    with FeatureCache(full) as a, FeatureCache(part) as b:
        for split in a.splits("level3"):
            np.testing.assert_array_equal(a.tokens("level3", split, -1), b.tokens("level3", split, -1))
            np.testing.assert_array_equal(a.pooled("level3", split, -1), b.pooled("level3", split, -1))
        config = json.loads(b.meta["encoder_config"]) if isinstance(b.meta["encoder_config"], str) \
            else b.meta["encoder_config"]
    assert config["grid"] == [4, 4] and config["extra"]["vision_grid"] == [8, 8]
    assert config["extra"]["stage"] == "llm:1" and "/" not in config["name"].split(":", 1)[1].split("@")[0]


@pytest.mark.slow  # the session's phantom pipeline, a cache and a fit per stage
@pytest.mark.parametrize("stage", ["vision", "projector", "llm:2"])
def test_a_head_trains_on_each_stage(models, pipeline, tmp_path, stage) -> None:
    from spar_bench.probes.cli import cli

    cache = write_cache(f"mllm:{models['llava']}@{stage}", pipeline["shards"], tmp_path / "c.h5", _opts(),
                        progress=False)
    code = run_cmd(cli, ["fit", "--features", cache, "--data", pipeline["shards"], "--out", tmp_path / "runs",
                         "--probe", "level3.relative_position", "--head", "linear", "--seeds", "0",
                         "--max-epochs", 2, "--bootstrap", 20])
    assert code == 0
    (metrics,) = (tmp_path / "runs").rglob("metrics.json")
    m = json.loads(metrics.read_text())
    assert m["probe"] == "level3.relative_position" and "blind" in json.dumps(m)


STAGED = """
experiment: stages
out: {out}
builds:
  train: {{phantom: {{n: 4, in_plane: 96, slices: 16}}, options: {{samples_per_case: 2, hf: false, levels: level3}}}}
modes:
  frozen: {{heads: [linear], options: {{max_epochs: 1, bootstrap: 10}}, cache: {{batch_size: 8, compute: fp32}}}}
probes: [level3.relative_position]
seeds: [0]
mllms:
  tiny: {{model: "hf:{model}", stages: [vision, llm:2, answer], options: {{bootstrap: 10, probe: relative_position, compute: fp32}}}}
"""


def test_stages_expand_to_one_frozen_encoder_each(models, tmp_path) -> None:
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    path = tmp_path / "e.yaml"
    path.write_text(STAGED.format(out=tmp_path / "out", model=models["llava"]))
    exp = load_experiment(path)
    assert exp.modes["frozen"].encoders == ("tiny-vision", "tiny-llm2")
    assert exp.encoders["tiny-llm2"].spec == f"mllm:{models['llava']}@llm:2"
    ids = [s.id for s in make_plan(exp).steps]
    assert ids == ["build:train", "cache:tiny-vision@train", "cache:tiny-llm2@train", "heads:tiny-vision",
                   "heads:tiny-llm2", "vqa:tiny@train", "report"]
    path.write_text(STAGED.format(out=tmp_path / "out", model=models["llava"]).replace(", answer]", "]"))
    assert "vqa:tiny@train" not in [s.id for s in make_plan(load_experiment(path)).steps]  # no answer: no VQA
    for bad, match in ((STAGED.replace("{model}", "{out}/nowhere"), r"e\.yaml:\d+: mllms\.tiny\.model: .* not a folder"),
                       (STAGED.replace("llm:2,", "llm:x,"), r"mllms\.tiny\.stages\[1\]: .*unknown stage 'llm:x'")):
        path.write_text(bad.format(out=tmp_path / "out", model=models["llava"]))
        with pytest.raises(ConfigError, match=match):
            load_experiment(path)


@pytest.mark.slow  # a phantom build, two caches, two heads and a VQA run through `spar-bench run`
def test_the_stage_pipeline_runs_end_to_end_into_the_report(models, tmp_path) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "e.yaml"
    path.write_text(STAGED.format(out=tmp_path / "out", model=models["llava"]))
    done = subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", "run", str(path)],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          encoding="utf-8", errors="replace", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "out" / "report" / "experiment.md").read_text(encoding="utf-8")
    assert "## Where the MLLM loses it: llava@" in text, text
    header = next(line for line in text.splitlines() if line.startswith("| probe | vision"))
    assert header.startswith("| probe | vision | llm:2 | answer |")
    row = next(line for line in text.splitlines() if line.startswith("| level3.relative_position |"))
    assert row.count("(") == 3  # every stage and the answer with its blind baseline
    doc = json.loads((tmp_path / "out" / "report" / "experiment.json").read_text())
    assert doc["stages"][0]["stages"] == ["vision", "llm:2"] and len(doc["stages"][0]["vqa"]) == 1
    assert "stages.png" in doc["files"] and (tmp_path / "out" / "report" / "stages.png").is_file()


def test_the_preset_runs_the_four_mllms_by_stage_once_their_folders_are_given(tmp_path) -> None:
    from spar_bench.experiments import preset_path
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    bare = {"OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "WEIGHTS": str(tmp_path / "w")}
    with pytest.raises(ConfigError, match=r"mllm-stages\.yaml:\d+: mllms\.qwen2\.5-vl-7b\.model: .* not a folder"):
        load_experiment(preset_path("mllm-stages"), bare)
    for d in ("Qwen2.5-VL-7B-Instruct", "llava-1.5-7b-hf", "InternVL3-8B-hf", "medgemma-4b-it"):
        (tmp_path / "w" / d).mkdir(parents=True)
    plan = make_plan(load_experiment(preset_path("mllm-stages"), bare))
    ids = [s.id for s in plan.steps]
    # 6 stages, and llm:N+q once per probe (6 probes)
    assert sum(i.startswith("cache:") for i in ids) == sum(i.startswith("heads:") for i in ids) == 4 * (6 + 6)
    assert sum(i.startswith("vqa:") for i in ids) == 4 and ids[-1] == "report"
    assert "cache:llava-1.5-7b-llm32@word" in ids and "cache:llava-1.5-7b-llm16q-counting@word" in ids


# -- the other families of the paper's MLLMs: Qwen2.5-VL (attention windows), InternVL (pixel
# shuffle), Gemma 3 (MedGemma; pooled tokens), built here at tiny sizes ------------------------
def _words(special: tuple[str, ...]):
    from spar_bench.probes.vqa.tiny import _vocabulary, _word_tokenizer

    words = _vocabulary(special=special)
    return words, {w: i for i, w in enumerate(words)}, _word_tokenizer


TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def _qwen25(path: Path) -> Path:
    import transformers as tf

    from spar_bench.probes.vqa.tiny import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL

    words, vocab, tok = _words(QWEN_SPECIAL)
    px = {"min_pixels": 224 * 224, "max_pixels": 224 * 224, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    proc = tf.Qwen2_5_VLProcessor(image_processor=tf.Qwen2VLImageProcessor(**px), video_processor=tf.Qwen2VLVideoProcessor(**px),
                                  tokenizer=tok(words, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}),
                                  chat_template=QWEN_CHAT_TEMPLATE)
    text = {**TEXT, "vocab_size": len(words), "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    # a tower narrower than the LM (Qwen's vision hidden_size is its width, out_hidden_size the LM's)
    vision = {"depth": 2, "hidden_size": 16, "out_hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"])
    return _save(tf.Qwen2_5_VLForConditionalGeneration(cfg), proc, path)


def _internvl(path: Path) -> Path:
    import transformers as tf

    from spar_bench.probes.vqa.tiny import CHAT_TEMPLATE

    words, vocab, tok = _words(("<image>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"))
    fast = tok(words, {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
                       "end_image_token": "</img>", "video_token": "<video>"})
    size = {"height": 224, "width": 224}
    proc = tf.InternVLProcessor(image_processor=tf.GotOcr2ImageProcessor(size=size), tokenizer=fast,
                                video_processor=tf.InternVLVideoProcessor(size=size), image_seq_length=16,
                                chat_template=CHAT_TEMPLATE.replace("<image>", "<IMG_CONTEXT>"))
    cfg = tf.InternVLConfig(text_config={**TEXT, "model_type": "qwen2", "vocab_size": len(words)},
                            vision_config={**VIT, "image_size": [224, 224], "patch_size": [28, 28]},
                            image_token_id=vocab["<IMG_CONTEXT>"], downsample_ratio=0.5)
    return _save(tf.InternVLForConditionalGeneration(cfg), proc, path)


def _gemma3(path: Path) -> Path:
    import transformers as tf

    from spar_bench.probes.vqa.tiny import CHAT_TEMPLATE

    words, vocab, tok = _words(("<image>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"))
    fast = tok(words, {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"})
    proc = tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessor(size={"height": 64, "width": 64}), tokenizer=fast,
                              chat_template=CHAT_TEMPLATE.replace("<image>", "<start_of_image>"), image_seq_length=16)
    cfg = tf.Gemma3Config(text_config={**TEXT, "vocab_size": len(words), "head_dim": 16},
                          vision_config={**VIT, "image_size": 64, "patch_size": 8}, mm_tokens_per_image=16,
                          image_token_id=vocab["<image_soft_token>"], boi_token_index=vocab["<start_of_image>"],
                          eoi_token_index=vocab["<end_of_image>"])
    return _save(tf.Gemma3ForConditionalGeneration(cfg), proc, path)


def _save(model, proc, path: Path) -> Path:
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


@pytest.mark.parametrize(("make", "grids"), [
    pytest.param(_qwen25, ((16, 16), (8, 8)), id="qwen2.5-vl"),
    pytest.param(_internvl, ((8, 8), (4, 4)), id="internvl", marks=pytest.mark.slow),  # beyond the 3 families asked
    pytest.param(_gemma3, ((8, 8), (4, 4)), id="gemma3", marks=pytest.mark.slow)])
def test_the_paper_mllms_families_give_their_grids(tmp_path, make, grids) -> None:
    torch.manual_seed(0)
    d = make(tmp_path / make.__name__.strip("_"))
    x = images(2)
    got = {st: load_encoder(f"mllm:{d}@{st}") for st in ("vision", "projector", "llm:0", "llm:2")}
    toks = {st: enc(x)[-1][0] for st, enc in got.items()}
    for st, enc in got.items():
        grid = grids[0] if st == "vision" else grids[1]
        width = 16 if st == "vision" and make is _qwen25 else 32
        assert enc.spec.grid == grid and toks[st].shape == (2, grid[0] * grid[1], width) == (2, enc.spec.n_tokens,
                                                                                              enc.spec.dim), st
        assert enc.spec.extra["vision_grid"] == list(grids[0]) and enc.spec.extra["lm_grid"] == list(grids[1])
    torch.testing.assert_close(toks["projector"], toks["llm:0"])
    assert not torch.allclose(toks["projector"], toks["llm:2"], atol=1e-3)
    if make is _qwen25:  # its tower works in attention windows: the vision stage undoes them too
        vis = toks["vision"]
        windows = vis.reshape(2, 8, 2, 8, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16)
        with torch.inference_mode():
            merged = got["vision"].module.model.visual.merger(windows).reshape(2, 64, -1)
        torch.testing.assert_close(merged, toks["projector"])


def test_the_stage_table_orders_stages_and_finds_the_models_own_answer() -> None:
    from spar_bench.experiments.report import stage_summary, stage_tables

    def row(encoder: str, mode: str, test: float, blind: float) -> dict:
        cell = {"percent": True, "test": {"mean": test, "std": 0.0, "n": 1}, "blind": {"mean": blind, "std": 0.0, "n": 1}}
        return {"encoder": encoder, "mode": mode, "head": "mlp", "options": "", "build": "", "tag": "",
                "cells": {"level3.size": cell}}

    rows = [row(f"mllm:m@0123abcd@{st}", "frozen", v, 0.5) for st, v in
            (("llm:-1", 0.6), ("llm:10", 0.7), ("projector", 0.8), ("vision", 0.9), ("llm:2", 0.75))]
    rows += [row("hf-m-0123abcd", "MLLM", 0.3, 0.25), row("hf-other-89abcdef", "MLLM", 0.1, 0.1),
             row("timm:resnet50", "frozen", 0.95, 0.5)]
    doc = {"probes": ["level3.size"], "configurations": rows}
    (model,) = stage_summary(doc)
    assert [s["stage"] for s in model["stages"]] == ["vision", "projector", "llm:2", "llm:10", "llm:-1"]
    assert [r["encoder"] for r in model["vqa"]] == ["hf-m-0123abcd"]
    text = "\n".join(stage_tables(doc))
    assert "| probe | vision | projector | llm:2 | llm:10 | llm:-1 | answer |" in text
    assert "| level3.size | 90.0 (50.0) |" in text and "| 30.0 (25.0) |" in text  # one seed: no spread


def _header_only_model(folder: Path, params: int) -> Path:
    """A LLaVA-1.5-7B-shaped folder: its config and a safetensors file whose header declares
    ``params`` parameters (no tensor data: the estimate reads headers only)."""
    import struct

    folder.mkdir(parents=True)
    cfg = {"model_type": "llava", "text_config": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32064},
           "vision_config": {"image_size": 336, "patch_size": 14}}
    (folder / "config.json").write_text(json.dumps(cfg))
    head = json.dumps({"w": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 2 * params]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    return folder


def test_a_7b_stage_cache_is_priced_by_its_parameters_and_tokens(tmp_path) -> None:
    """A 7 B LLaVA's llm:16 cache: tens of images/s on one GPU, not a small CNN's thousands;
    deeper and asking stages cost more; the vision stage reads the tower only."""
    from spar_bench.experiments.estimate import cache_rate, mllm_cache_rate

    folder = _header_only_model(tmp_path / "llava-1.5-7b-hf", 7_063_427_072)
    cpu, gpu = mllm_cache_rate(f"mllm:{folder}@llm:16")
    assert 10 < gpu < 100 and cpu < 0.05 and gpu < cache_rate("")[1] / 20
    assert mllm_cache_rate(f"mllm:{folder}@llm:32")[1] < gpu and mllm_cache_rate(f"mllm:{folder}@llm:16+q")[1] < gpu
    assert mllm_cache_rate(f"mllm:{folder}@vision")[1] > 5 * gpu


def test_the_dry_run_refuses_empty_or_wrong_weight_folders(tmp_path) -> None:
    from spar_bench.experiments import preset_path
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.estimate import step_seconds
    from spar_bench.experiments.plan import make_plan

    bare = {"OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "WEIGHTS": str(tmp_path / "w")}
    for d in ("Qwen2.5-VL-7B-Instruct", "llava-1.5-7b-hf", "InternVL3-8B-hf", "medgemma-4b-it"):
        (tmp_path / "w" / d).mkdir(parents=True)
    plan = make_plan(load_experiment(preset_path("mllm-stages"), bare))
    step = next(s for s in plan.steps if s.id.startswith("cache:llava"))
    with pytest.raises(ConfigError, match=r"holds no config\.json and \*\.safetensors weights") as e:
        step_seconds(plan, step)
    assert "\n" not in str(e.value)
    (tmp_path / "w" / "llava-1.5-7b-hf" / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    (tmp_path / "w" / "llava-1.5-7b-hf" / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match="not an image-text model"):
        step_seconds(plan, step)


def test_stage_weights_are_bf16_on_a_gpu_and_fp32_on_the_cpu(models, monkeypatch) -> None:
    """On a GPU a stage encoder holds bf16 weights (a 7-8 B model in 14-16 GB, as vqa loads it),
    recorded as weights_dtype; on the CPU fp32 and nothing recorded. The GPU rule is run here
    on the CPU (stage_dtype patched) to check the bf16 path end to end."""
    from spar_bench.probes.encoders import mllm_family

    assert mllm_family.stage_dtype("cuda:0") == torch.bfloat16 and mllm_family.stage_dtype("cpu") == torch.float32
    enc = load_encoder(f"mllm:{models['llava']}@llm:2").to("cpu")
    assert next(enc.module.parameters()).dtype == torch.float32 and "weights_dtype" not in enc.spec.extra
    monkeypatch.setattr(mllm_family, "stage_dtype", lambda device: torch.bfloat16)
    enc.to("cpu")
    assert next(enc.module.parameters()).dtype == torch.bfloat16 and enc.spec.extra["weights_dtype"] == "bfloat16"
    toks = enc(images(2))[-1][0]
    assert toks.shape == (2, enc.spec.n_tokens, 32) and torch.isfinite(toks.float()).all()
