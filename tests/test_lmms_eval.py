"""lmms-eval itself runs a SPAR-Bench export, and its answers score as ``spar-probe vqa``'s.

A small phantom build; a tiny random LLaVA (``letters_only``: its one-token answers are option
letters or nothing, so the scores are not all zero); ``spar-build export --format
lmms-eval`` of ``level3.symmetry``; lmms-eval's own CLI (``--model llava_hf``, the chat class:
it sends the ``[image, text]`` message ``vqa``'s ``hf:`` backend sends) runs every variant task
of the group with ``--log_samples``; the joined samples go through ``spar-probe vqa --answers``,
and ``spar-probe vqa --model hf:<the same folder>`` asks the same questions. The two run
folders must agree row by row (every answer's text, parse and correctness) and in every score.

The export is made with ``--no-blind``: lmms-eval 0.7.3's ``llava_hf`` cannot ask a question
without an image (docs/USAGE.md, "Use SPAR-Bench from your harness").

lmms-eval lives in its own virtual environment (``scripts/lmms-eval-venv.sh``; ``.ci/run`` makes
it and sets ``SPAR_LMMS_EVAL`` to its ``lmms-eval``). Without it the tests skip with the reason;
under CI (env ``CI`` set) that is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.probes.cli import cli as probe_cli

from helpers import run_cmd

pytestmark = pytest.mark.slow

PROBE = "level3.symmetry"
GROUP = "spar_level3_symmetry"
#: the venv scripts/lmms-eval-venv.sh makes by default (used when SPAR_LMMS_EVAL is not set)
DEFAULT_VENV = Path(tempfile.gettempdir()) / "spar-ci-lmms"
#: what both sides are asked with: greedy, one new token, one request at a time, fp32 on the CPU
NEW_TOKENS = 1
VQA_ASK = ["--generate", "--max-new-tokens", NEW_TOKENS, "--batch-size", 1, "--compute", "fp32",
           "--device", "cpu", "--no-blind", "--bootstrap", 30, "--probe", PROBE]


def lmms_eval_executable() -> Path:
    """``SPAR_LMMS_EVAL``, else the default venv's ``lmms-eval``; skip (fail under CI) without it."""
    given = os.environ.get("SPAR_LMMS_EVAL")
    exe = Path(given) if given else DEFAULT_VENV / "bin" / "lmms-eval"
    if exe.is_file():
        return exe
    why = (f"SPAR_LMMS_EVAL={given} is not a file" if given else
           f"SPAR_LMMS_EVAL is not set and {exe} is missing") + " (scripts/lmms-eval-venv.sh makes it)"
    if os.environ.get("CI"):
        pytest.fail(f"lmms-eval is not installed, and CI is set: {why}")
    pytest.skip(f"lmms-eval is not installed: {why}; CI fails here instead")


def _build(root: Path) -> Path:
    """Four phantom cases, Level 3 only, one sample each, with mirrors: 10 symmetry questions."""
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 4, "--layout", "canonical"]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "shards",
                               "--levels", "level3", "--samples-per-case", 1, "--counterfactual", "mirror",
                               "--no-hf"]) == 0
    return root / "shards"


def _run_lmms_eval(exe: Path, folder: Path, model: Path) -> Path:
    """lmms-eval's CLI on the export ``folder``, run from another folder (the export runs from any
    working folder); its output folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(folder.parent / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    argv = [str(exe), "--model", "llava_hf", "--model_args", f"pretrained={model},device_map=cpu,dtype=float32",
            "--tasks", GROUP, "--include_path", str(folder), "--log_samples", "--output_path", str(folder / "out"),
            "--batch_size", "1", "--device", "cpu", "--gen_kwargs", f"max_new_tokens={NEW_TOKENS}"]
    elsewhere = folder.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    done = subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, encoding="utf-8", errors="replace",
                          timeout=900)
    out = folder / "out"
    if done.returncode != 0 or not list(out.glob("*/*_samples_*.jsonl")):  # it exits 0 on some errors
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        pytest.fail(f"lmms-eval failed (exit {done.returncode}, no samples written):\n{tail}")
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    exe = lmms_eval_executable()
    pytest.importorskip("transformers")
    import torch

    from spar_bench.probes.vqa.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("lmms")
    shards = _build(root)
    # its tokenizer adds BOS (as Llama's): vqa and lmms-eval must agree on it (probes/vqa/chat.py)
    model = make_tiny_llava(root / "tiny", seed=2, letters_only="ABC", bos=True)  # seed: answers that vary
    assert run_cmd(build_cli, ["export", shards, "--format", "lmms-eval", "--out", root / "lm", "--probe", PROBE,
                               "--no-blind"]) == 0
    out = _run_lmms_eval(exe, root / "lm", model)
    samples = sorted(out.glob("*/*_samples_*.jsonl"))
    joined = root / "lmms-answers.jsonl"
    joined.write_text("".join(p.read_text(encoding="utf-8") for p in samples), encoding="utf-8")
    runs = root / "runs"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as lmms-eval ran (OMP_NUM_THREADS=1)
    try:
        assert run_cmd(probe_cli, ["vqa", "--answers", joined, "--data", shards, "--out", runs, "--no-blind",
                                   "--bootstrap", 30, "--probe", PROBE]) == 0
        assert run_cmd(probe_cli, ["vqa", "--model", f"hf:{model}", "--data", shards, "--out", runs, *VQA_ASK]) == 0
    finally:
        torch.set_num_threads(threads)
    (imported,) = (runs / "answers-lmms-answers").glob(f"{PROBE}/*/seed0")
    (asked,) = runs.glob(f"hf-tiny-*/{PROBE}/*/seed0")
    return {"root": root, "lm": root / "lm" / PROBE, "out": out, "samples": samples, "imported": imported,
            "asked": asked}


def _answers(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "answers.jsonl").read_text(encoding="utf-8").splitlines()]


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text(encoding="utf-8"))


def test_lmms_eval_ran_every_variant_task_once(env):
    """One samples file per task of the group, each document answered once."""
    import yaml

    group = yaml.safe_load((env["lm"] / f"{GROUP}.yaml").read_text(encoding="utf-8"))
    docs = [json.loads(x) for x in (env["lm"] / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    per_task = {p.stem.split("_samples_", 1)[1]: [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines()]
                for p in env["samples"]}
    assert sorted(per_task) == sorted(group["task"]) and len(per_task) >= 4  # plain, 2 rotations, mirror
    want = Counter(f"{GROUP}_{d['category'].replace('-', '_')}" for d in docs)
    assert {t: len(rows) for t, rows in per_task.items()} == dict(want)
    assert not any(d["category"] in ("blind", "mirror-blind") for d in docs)


def test_answers_match_vqa_row_by_row(env):
    """Same prompts, same image pixels, same model, same greedy decoding: the same answers."""
    imported, asked = _answers(env["imported"]), _answers(env["asked"])
    assert len(imported) == len(asked) == sum(1 for p in env["samples"] for _ in p.open(encoding="utf-8"))
    assert imported == asked
    texts = Counter(r["text"] for r in asked)
    assert len(texts) > 1 and any(r["parsed"] for r in asked)  # the answers depend on the input and parse


#: metrics.json fields that name who answered (the run folder's model and variant), not a score
IDENTITY = ("encoder", "variant")


def test_scores_match_vqa(env):
    """Every score and count of metrics.json (accuracy, CircularEval, mirror, the prior and
    parse controls, requests) is the same; only the names of who answered differ."""
    got, want = _metrics(env["imported"]), _metrics(env["asked"])
    assert {k: v for k, v in got.items() if k not in IDENTITY} == {k: v for k, v in want.items() if k not in IDENTITY}
    assert "missing" not in got["requests"] and got["requests"]["answers"] == len(_answers(env["asked"]))
    assert got["controls"]["circular"]["n_rotations"] == 3 and got["mirror"]["n"] == got["test"]["n"]
    assert 0 < got["controls"]["parse_rate"] and 0 < got["test"]["accuracy"]


def test_lmms_eval_own_metric_is_vqa_correctness(env):
    """lmms-eval's per-sample ``spar_accuracy`` (utils.py, in lmms-eval's venv) marks the rows
    ``vqa`` scores correct, and each task's aggregate in results.json is their mean."""
    correct = {(r["key"], r["rotation"]): r["correct"] for r in _answers(env["asked"])}
    (results,) = env["out"].glob("*/*_results.json")
    table = json.loads(results.read_text(encoding="utf-8"))["results"]
    for path in env["samples"]:
        task = path.stem.split("_samples_", 1)[1]
        rows = [json.loads(x)["spar_accuracy"] for x in path.read_text(encoding="utf-8").splitlines()]
        assert [r["correct"] for r in rows] == [correct[(r["spar_key"], r["spar_rotation"])] for r in rows]
        assert table[task]["spar_accuracy,none"] == pytest.approx(sum(r["correct"] for r in rows) / len(rows))
