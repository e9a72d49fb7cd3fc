"""``spar-bench run``: a small experiment end to end, killed midway and rerun, and in partitions.

Two encoders (a random timm model, a tiny local Hugging Face model), frozen heads and a
finetune, a transfer build and the dummy MLLM. The killed run, rerun, runs every step exactly
once and writes the report of an uninterrupted run; so do partitions run one after another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import make_hf_dinov2

pytestmark = pytest.mark.slow  # each test runs a whole experiment (its module fixture alone ~80 s)

EXPERIMENT = """
experiment: small
vars:
  OUT: {out}
  HF: {hf}
out: ${{OUT}}
builds:
  train: {{phantom: {{n: 6, layout: canonical, in_plane: 96, slices: 16}}, options: {{samples_per_case: 2, counterfactual: mirror, hf: false}}}}
  moved: {{phantom: {{n: 6, layout: random, seed: 1, in_plane: 96, slices: 16}}, options: {{samples_per_case: 2, hf: false, levels: "level1,level3"}}}}
train_on: train
transfer: [moved]
encoders:
  r10: {{spec: "timm:resnet10t", random_init: true}}
  tiny: {{spec: "hf:${{HF}}"}}
modes:
  frozen: {{encoders: [r10, tiny], heads: [mlp], options: {{max_epochs: 2, bootstrap: 20}}}}
  finetune: {{encoders: [tiny], heads: [mlp], options: {{max_epochs: 1, batch_size: 8, bootstrap: 20, device: cpu, compute: fp32}}}}
probes: [level1.localisation, level3.relative_position]
seeds: [0]
mllms:
  dummy: {{model: dummy, options: {{bootstrap: 20}}}}
report: {{title: small}}
"""


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spar_bench.experiments.cli", "run", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experiment")
    hf = make_hf_dinov2(root)[0].partition(":")[2]
    path = root / "small.yaml"
    path.write_text(EXPERIMENT.format(out=root / "whole", hf=hf))
    done = subprocess.run(_cmd(str(path)), env=_env(), capture_output=True, encoding="utf-8", errors="replace", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "file": path, "whole": root / "whole"}


def _finished(out: Path) -> list[str]:
    log = (out / ".plan" / "log.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in log if json.loads(x)["event"] == "finish"]


def _report(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "report").glob("*")) if p.suffix in (".md", ".json")}


@pytest.mark.slow
def test_the_plan_has_every_kind_of_step(experiment):
    listed = subprocess.run(_cmd(str(experiment["file"]), "--list"), env=_env(), capture_output=True, encoding="utf-8", errors="replace")
    ids = [line.split("\t")[0] for line in listed.stdout.splitlines()]
    assert ids == ["build:train", "build:moved", "cache:r10@train", "cache:r10@moved", "cache:tiny@train",
                   "cache:tiny@moved", "heads:r10", "heads:tiny", "finetune:tiny", "eval:heads:r10@moved",
                   "eval:heads:tiny@moved", "eval:finetune:tiny@moved", "vqa:dummy@train", "report"]
    assert all(line.endswith("\tdone") for line in listed.stdout.splitlines())
    whole = experiment["whole"]
    assert sorted(_finished(whole)) == sorted(ids)  # each once
    evals = sorted(p.name for p in (whole / "runs").rglob("eval-*.json"))
    assert evals and all(n in ("eval-moved.json", "eval-r10@moved.json", "eval-tiny@moved.json") for n in evals), evals
    kinds = {json.loads(m.read_text()).get("training", {}) and "finetuned" for m in (whole / "runs").rglob("metrics.json")}
    assert "finetuned" in kinds


@pytest.mark.slow
def test_killed_midway_then_rerun_runs_each_step_once_and_gives_the_same_report(experiment):
    out, path = experiment["root"] / "killed", str(experiment["file"])
    proc = subprocess.Popen(_cmd(path, "--set", f"OUT={out}"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    steps = out / ".plan" / "steps"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if steps.is_dir() and len(list(steps.glob("*.json"))) >= 5:  # builds and caches done, heads next
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) in (143, -signal.SIGTERM), proc.stderr.read()[-2000:]
    assert not (out / "report" / "report.md").exists()
    again = subprocess.run(_cmd(path, "--set", f"OUT={out}"), env=_env(), capture_output=True, encoding="utf-8", errors="replace", timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    finished = _finished(out)
    assert len(finished) == len(set(finished)) == 14, finished
    assert _report(out) == _report(experiment["whole"])


@pytest.mark.slow
def test_partitions_one_after_another_give_the_same_report(experiment):
    out, path = experiment["root"] / "parts", str(experiment["file"])
    early = subprocess.run(_cmd(path, "--set", f"OUT={out}", "--partition", "2/3"), env=_env(), capture_output=True,
                           encoding="utf-8", errors="replace")
    assert early.returncode == 2 and early.stderr.count("\n") == 1 and "run it first" in early.stderr, early.stderr
    for i in range(3):
        done = subprocess.run(_cmd(path, "--set", f"OUT={out}", "--partition", f"{i}/3"), env=_env(),
                              capture_output=True, encoding="utf-8", errors="replace", timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(_finished(out)) == sorted(_finished(experiment["whole"]))
    assert _report(out) == _report(experiment["whole"])


def test_a_changed_option_redoes_that_step_and_what_needs_it(experiment, tmp_path):
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan
    from spar_bench.experiments.runner import status

    text = experiment["file"].read_text().replace("max_epochs: 2, bootstrap: 20", "max_epochs: 3, bootstrap: 20")
    path = tmp_path / "changed.yaml"
    path.write_text(text)
    plan = make_plan(load_experiment(path))
    state = {s.id: status(plan, s) for s in plan.steps}
    assert state["heads:r10"] == state["heads:tiny"] == "changed"
    assert state["eval:heads:r10@moved"] == state["report"] == "changed"
    assert state["build:train"] == state["cache:r10@train"] == state["finetune:tiny"] == "done"


@pytest.mark.slow
def test_steps_run_side_by_side_on_several_devices(tmp_path):
    """--devices cpu,cpu: two builds at once, then the MLLM on each, then the report."""
    path = tmp_path / "two.yaml"
    path.write_text(f"""
experiment: two
out: {tmp_path / 'out'}
builds:
  a: {{phantom: {{n: 4}}, options: {{samples_per_case: 1, hf: false, levels: level3}}}}
  b: {{phantom: {{n: 4, seed: 2}}, options: {{samples_per_case: 1, hf: false, levels: level3}}}}
mllms:
  dummy: {{model: dummy, builds: [a, b], options: {{bootstrap: 10, probe: relative_position}}}}
""")
    done = subprocess.run(_cmd(str(path), "--devices", "cpu,cpu"), env=_env(), capture_output=True, encoding="utf-8", errors="replace",
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(_finished(tmp_path / "out")) == ["build:a", "build:b", "report", "vqa:dummy@a", "vqa:dummy@b"]
    assert (tmp_path / "out" / "report" / "report.md").is_file()


def test_a_build_taking_another_builds_thresholds_comes_after_it(tmp_path):
    from spar_bench.errors import ConfigError
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    text = """
experiment: t
out: {out}
builds:
  moved: {{phantom: {{n: 4}}, thresholds_from: train}}
  train: {{phantom: {{n: 4}}}}
"""
    path = tmp_path / "t.yaml"
    path.write_text(text.format(out=tmp_path / "out"))
    plan = make_plan(load_experiment(path))
    assert [s.id for s in plan.steps] == ["build:train", "build:moved"]
    moved = plan.step("build:moved")
    assert moved.needs == ("build:train",) and moved.specs[-1][1]["thresholds_from"] == "{out}/builds/train"
    path.write_text(text.format(out=tmp_path / "out").replace("train: {phantom: {n: 4}}",
                                                               "train: {phantom: {n: 4}, thresholds_from: moved}"))
    with pytest.raises(ConfigError, match="a cycle"):
        make_plan(load_experiment(path))
