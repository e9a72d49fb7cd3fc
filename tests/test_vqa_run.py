"""``spar-probe vqa`` end to end on the shared phantom pipeline (the ``pipeline`` fixture, conftest.py).

A tiny random LLaVA is made and saved locally (word-level tokenizer trained on the
prompts, nothing downloaded) and asked through ``hf:`` in constrained and generation
modes; ``dummy`` runs every probe; a linear head is fitted beside them so the report shows
MLLMs and encoders in one table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from spar_bench.probes.cli import cli

from helpers import run_cmd


def _vqa(*args) -> int:
    """``spar-probe vqa`` in fp32: ``--compute auto`` takes bf16 on a CPU with native bf16, and a
    bf16 run's folder is ``vqa-loglik,dtype=bfloat16`` (the folders read here are fp32's)."""
    return run_cmd(cli, ["vqa", "--bootstrap", 30, "--compute", "fp32", *args])


@pytest.fixture(scope="module")
def env(tmp_path_factory, pipeline):
    p = pipeline
    root = tmp_path_factory.mktemp("vqa")
    runs = root / "runs"
    assert run_cmd(cli, ["fit", "--features", p["cache"], "--probe", "level3.symmetry", "--head", "linear",
                      "--out", runs, "--bootstrap", 30, "--max-epochs", 3]) == 0
    assert _vqa("--model", "dummy", "--data", p["shards"], "--out", runs) == 0
    return {**p, "root": root, "runs": runs}


@pytest.fixture(scope="module")
def tiny(env):
    pytest.importorskip("transformers")
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    path = make_tiny_llava(env["root"] / "models" / "tiny", seed=0)
    assert _vqa("--model", f"hf:{path}", "--data", env["shards"], "--out", env["runs"],
                "--probe", "symmetry") == 0
    return path


def _tiny(runs: Path) -> str:
    """The tiny model's run folder name: ``hf-<folder name>-<sha8>``."""
    (name,) = [p.name for p in runs.iterdir() if p.name.startswith("hf-tiny-")]
    assert re.fullmatch(r"hf-tiny-[0-9a-f]{8}", name)
    return name


def _metrics(runs: Path, model: str, probe: str, head: str) -> dict:
    return json.loads((runs / model / f"level3.{probe}" / head / "seed0" / "metrics.json").read_text())


def test_dummy_run_folder_scores_and_controls(env):
    runs = env["runs"]
    rd = runs / "dummy" / "level3.relative_position" / "vqa-loglik" / "seed0"
    assert sorted(f.name for f in rd.iterdir()) == ["answers.jsonl", "config.json", "metrics.json"]
    m = json.loads((rd / "metrics.json").read_text())
    cfg = json.loads((rd / "config.json").read_text())
    assert m["headline"] == "accuracy" and 0 <= m["test"]["accuracy"] <= 1
    assert len(m["test"]["ci"]["accuracy"]) == 2 and m["controls"]["parse_rate"] == 1.0
    assert m["controls"]["chance"] == 0.5 and m["controls"]["majority"] is not None
    assert m["controls"]["prior"]["n"] == m["test"]["n"]  # the spec's input-free optimum
    assert m["controls"]["blind"]["n"] == m["test"]["n"] and m["mirror"]["n"] > 0
    circ = m["controls"]["circular"]  # the MLLM's own controls, beside the shared ones
    assert circ["n_rotations"] == 2 and circ["strict"] <= circ["mean"]
    assert not {"parse_rate", "unparsed", "circular"} & m.keys()
    assert cfg["inputs"]["template_version"] == "relative_position@3" and cfg["options"]["convention_hint"] is True
    assert cfg["kind"] == "mllm" and cfg["files"].keys() == {"answers.jsonl"}
    assert str(env["root"]) not in (rd / "config.json").read_text()  # no local path published
    recs = [json.loads(line) for line in (rd / "answers.jsonl").read_text().splitlines()]
    n, nm = m["n_items"]["test"], m["n_items"]["test_mirror"]
    assert len(recs) == 2 * n + nm + (n + nm)  # 2 rotations + mirrors + blind
    assert all(r["template"] == "relative_position@3" for r in recs)
    assert {r["variant"] for r in recs} == {"image", "blind"}
    assert (runs / "dummy" / "level3.counting").is_dir()  # every probe the build has


def test_position_bias_is_caught_by_circular_eval(env):
    assert _vqa("--model", "dummy:A", "--data", env["shards"], "--out", env["runs"],
                "--probe", "relative_position", "--no-blind") == 0
    m = _metrics(env["runs"], "dummy-A", "relative_position", "vqa-loglik")
    assert m["controls"]["position_rate"] == [1.0, 0.0]
    assert m["controls"]["circular"]["strict"] == 0.0 and m["controls"]["circular"]["mean"] == pytest.approx(0.5)
    assert m["controls"].get("blind") is None


def test_hf_tiny_constrained_beside_encoder_in_report(env, tiny):
    m = _metrics(env["runs"], _tiny(env["runs"]), "symmetry", "vqa-loglik")
    assert m["controls"]["parse_rate"] == 1.0 and m["controls"]["circular"]["n_rotations"] == 3
    assert m["random_init"] is False and m["mode"] == "constrained"
    recs = [json.loads(x) for x in (env["runs"] / _tiny(env["runs"]) / "level3.symmetry/vqa-loglik/seed0/answers.jsonl")
            .read_text().splitlines()]
    assert all(len(r["scores"]) == 3 and r["choice"] == max(range(3), key=lambda j, r=r: r["scores"][j])
               for r in recs)
    cfg = json.loads((env["runs"] / _tiny(env["runs"]) / "level3.symmetry/vqa-loglik/seed0/config.json").read_text())
    assert cfg["inputs"]["model_identity"]["kind"] == "dir" and len(cfg["inputs"]["model_identity"]["sha256"]) == 64
    out = env["root"] / "report"
    assert run_cmd(cli, ["report", env["runs"], "--out", out]) == 0
    md = (out / "report.md").read_text()
    table = md.split("## level3.symmetry")[1].split("## ")[0]
    assert "| linear [max_epochs=3] |" in table and "| vqa-loglik |" in table and _tiny(env["runs"]) in table
    assert "parse" in table and "circular (all rot.)" in table


def test_rerun_reads_the_cache_and_another_model_does_not(env, tiny, monkeypatch):
    from spar_bench.probes.vqa import hf
    from spar_bench.probes.vqa.cache import ResponseCache
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    rd = env["runs"] / _tiny(env["runs"]) / "level3.symmetry/vqa-loglik/seed0"
    before = (rd / "metrics.json").read_bytes()
    real = hf.HFBackend._constrained

    def refuse(self, reqs):
        raise AssertionError("cached answers were asked again")

    monkeypatch.setattr(hf.HFBackend, "_constrained", refuse)
    assert _vqa("--model", f"hf:{tiny}", "--data", env["shards"], "--out", env["runs"], "--probe", "symmetry") == 0
    assert (rd / "metrics.json").read_bytes() == before  # resumed and rescored identically
    # another model with the same folder name: same slug and cache file, never the same answers
    other = make_tiny_llava(env["root"] / "models2" / "tiny", seed=1)
    calls = []
    monkeypatch.setattr(hf.HFBackend, "_constrained", lambda self, reqs: calls.append(len(reqs)) or real(self, reqs))
    cache = env["runs"] / ".vqa-cache" / f"{_tiny(env['runs'])}.sqlite"
    with ResponseCache(cache) as c:
        n_before = len(c)
    assert _vqa("--model", f"hf:{other}", "--data", env["shards"], "--out", env["root"] / "runs2",
                "--probe", "symmetry", "--cache", cache) == 0
    with ResponseCache(cache) as c:
        assert len(c) == 2 * n_before
    assert sum(calls) == n_before


def test_hf_tiny_generation_mode_parses_strictly(env, tiny):
    assert _vqa("--model", f"hf:{tiny}", "--data", env["shards"], "--out", env["runs"], "--probe",
                "symmetry", "--generate", "--max-new-tokens", 4, "--no-circular") == 0
    m = _metrics(env["runs"], _tiny(env["runs"]), "symmetry", "vqa-generate,max_new_tokens=4")
    assert 0.0 <= m["controls"]["parse_rate"] <= 1.0 and m["controls"]["circular"] is None
    assert m["variant"] == "max_new_tokens=4"
    recs = [json.loads(x) for x in (env["runs"] / _tiny(env["runs"]) /
                                    "level3.symmetry/vqa-generate,max_new_tokens=4/seed0/answers.jsonl")
            .read_text().splitlines()]
    assert all(isinstance(r["text"], str) for r in recs)
    unparsed = [r for r in recs if not r["parsed"]]
    assert all(r["answer"] is None and r["correct"] is False for r in unparsed)
    n_unparsed = sum(1 for r in unparsed if r["variant"] == "image" and not r["mirror"] and r["rotation"] == 0)
    assert sum(m["controls"]["unparsed"]["test"].values()) == n_unparsed
    assert m["controls"]["parse_rate"] == pytest.approx(1 - n_unparsed / m["test"]["n"])


def test_one_line_errors(env, capsys):
    assert _vqa("--model", "hf:org/name", "--data", env["shards"], "--out", env["runs"]) == 2
    assert "--revision" in capsys.readouterr().err
    assert _vqa("--model", "dumy", "--data", env["shards"], "--out", env["runs"]) == 2
    assert "Did you mean 'dummy'" in capsys.readouterr().err
    assert _vqa("--model", "dummy", "--data", env["shards"], "--probe", "level1.localisation") == 2
    assert "question probes only" in capsys.readouterr().err
    assert _vqa("--model", "dummy", "--data", env["shards"], "--splits", "tset") == 2
    assert "tset" in capsys.readouterr().err


def test_openai_backend_end_to_end_on_stub_server(env, capsys):
    import base64
    import io

    from PIL import Image

    from helpers import running_stub

    with running_stub() as srv:
        srv.plan = ["text:I am not sure."] * 5 + ["text:A or B"] * 2
        srv.default = "text:Answer: B"
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        assert _vqa("--model", "openai:stub-vlm", "--base-url", url, "--data", env["shards"], "--out",
                    env["runs"], "--probe", "symmetry", "--image-size", 448, "--concurrency", 3,
                    "--retries", 0, "--timeout", 10) == 0
    (rd,) = env["runs"].glob("openai-stub-vlm-*/level3.symmetry/vqa-generate-448px/seed0")
    assert re.fullmatch(r"openai-stub-vlm-[0-9a-f]{8}", rd.parts[-4])  # the server's URL names it too
    recs = [json.loads(x) for x in (rd / "answers.jsonl").read_text().splitlines()]
    m = json.loads((rd / "metrics.json").read_text())
    assert len(recs) == len(srv.seen) + m["requests"]["deduplicated"] and sum(not r["parsed"] for r in recs) >= 7
    assert m["controls"]["parse_rate"] < 1.0 and m["mode"] == "generate"
    png = next(s["body"]["messages"][0]["content"][0]["image_url"]["url"] for s in srv.seen
               if s["body"]["messages"][0]["content"][0]["type"] == "image_url")
    img = Image.open(io.BytesIO(base64.b64decode(png.split(",", 1)[1])))
    assert img.size == (448, 448) and img.mode == "RGB"
    assert "parse=" in capsys.readouterr().out


def test_hf_scores_do_not_depend_on_batch_or_scoring_path(tiny):
    """Right padding: a question scored alone or in a batch gets the same log-likelihoods,
    and scoring whole prompt+letter sequences agrees with the one-pass last-position read."""
    import numpy as np

    from spar_bench.probes.vqa import BackendOptions, load_backend
    from spar_bench.probes.vqa.base import Request, to_pil
    from spar_bench.probes.vqa.prompts import PromptContext, render

    be = load_backend(f"hf:{tiny}", BackendOptions(batch_size=4))
    rng = np.random.default_rng(0)
    reqs = []
    for i, (probe, n, axis) in enumerate([("relative_position", 2, 0), ("orientation", 8, -1),
                                           ("size", 3, -1), ("relative_position", 2, 1)]):
        p = render(probe, i, i + 2, axis, tuple(range(n)), context=PromptContext(1.5, 224, (900.0, 2000.0)))
        img = to_pil(rng.integers(0, 255, (224, 224), dtype=np.uint8), 224)
        reqs.append(Request(f"k{i}", p.text, p.letters, p.options, img if i != 2 else None))
    together = be.answer(reqs)
    alone = [be.answer([r])[0] for r in reqs]
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-4, atol=1e-4)
        assert a.choice == b.choice
    with_image = [r for r in reqs if r.image is not None]
    prompts = [be.prompt_text(r) for r in with_image]
    conts = be.letter_ids(prompts, [r.letters for r in with_image])
    fast = be._last_position(prompts, with_image, conts)
    full = be._full_sequences(prompts, with_image, conts)
    for f, g in zip(fast, full, strict=True):
        np.testing.assert_allclose(f, g, rtol=1e-4, atol=1e-4)


def test_no_convention_hint_is_its_own_run_and_cache_entries(env):
    from spar_bench.probes.vqa.cache import ResponseCache

    cache = env["root"] / "hint-cache.sqlite"
    runs = env["root"] / "runs-hint"
    args = ["--model", "dummy", "--data", env["shards"], "--out", runs, "--probe", "symmetry",
            "--no-circular", "--no-blind", "--cache", cache]
    assert _vqa(*args) == 0
    with ResponseCache(cache) as c:
        n = len(c)
    assert _vqa(*args, "--no-convention-hint") == 0
    with ResponseCache(cache) as c:
        assert len(c) == 2 * n  # another prompt: asked again, never read from the hinted one
    rd = runs / "dummy/level3.symmetry/vqa-loglik-nohint/seed0"
    assert json.loads((rd / "config.json").read_text())["options"]["convention_hint"] is False


def test_http_failure_stops_in_one_line_and_the_rerun_resumes(env, capsys):
    from spar_bench.probes.vqa.cache import ResponseCache

    from helpers import running_stub

    cache = env["root"] / "http-cache.sqlite"
    args = ["--model", "openai:stub-vlm", "--data", env["shards"], "--out", env["root"] / "runs-http",
            "--probe", "symmetry", "--no-circular", "--retries", 0, "--concurrency", 2,
            "--batch-size", 4, "--cache", cache]
    with running_stub() as srv:
        srv.plan = ["text:A"] * 9 + ["status:400"]
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        assert _vqa(*args, "--base-url", url) == 2
        first = len(srv.seen)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]  # beside the progress bar
    assert len(lines) == 1 and "HTTP 400" in lines[0] and "Traceback" not in err
    assert not (env["root"] / "runs-http/openai-stub-vlm/level3.symmetry").exists()  # nothing looks complete
    with ResponseCache(cache) as c:
        kept = len(c)
    assert kept == first - 1  # every answer that came back is cached
    with running_stub() as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        assert _vqa(*args, "--base-url", url) == 0
        asked_again = len(srv.seen)
    with ResponseCache(cache) as c:
        assert len(c) == kept + asked_again  # only the missing answers were asked



def test_tiny_letters_only_answers_a_letter(tmp_path):
    """``make_tiny_llava(letters_only=...)``: the head scores only the letters and the
    generation prompt's own tokens embed to 0, so a greedy one-token answer is a letter or
    nothing (tests/test_lmms_eval.py compares such answers across harnesses)."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    from transformers import LlavaForConditionalGeneration

    from spar_bench.probes.vqa import BackendOptions, load_backend
    from spar_bench.probes.vqa.base import Request, to_pil
    from spar_bench.probes.vqa.prompts import PromptContext, render
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    path = make_tiny_llava(tmp_path / "tiny", seed=0, letters_only="ABC")
    be = load_backend(f"hf:{path}", BackendOptions(mode="generate", max_new_tokens=1, batch_size=1))
    vocab = be.tok.get_vocab()
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(4):
        p = render("size", i, i + 2, -1, (0, 1, 2), context=PromptContext(1.5, 224, (900.0, 2000.0)))
        img = to_pil(rng.integers(0, 255, (224, 224), dtype=np.uint8), 224)
        reqs.append(Request(f"k{i}", p.text, p.letters, p.options, img if i % 2 else None))
    texts = [r.text for r in be.answer(reqs)]
    assert set(texts) <= {"A", "B", "C", ""} and set(texts) != {""}
    model = LlavaForConditionalGeneration.from_pretrained(path)
    head = model.get_output_embeddings().weight.detach()
    scored = {int(i) for i in torch.nonzero(head.abs().sum(dim=1)).flatten()}
    assert scored == {vocab[c] for c in "ABC"}
    emb = model.get_input_embeddings().weight.detach()
    assert not emb[[vocab["assistant"], vocab[":"]]].any() and emb[vocab["size"]].any()
