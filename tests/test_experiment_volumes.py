"""``spar-bench run volumes``: Level 4 (volumes) as an experiment file (issue 24).

The shipped preset end to end from the CLI (a 12-case phantom of 16^3 volumes with mirrored
and flipped copies, a random-init monai:resnet10 cache, mlp heads on every Level 4 probe,
2 seeds, the mask oracle as an MLLM row, the report): the report has Level 4 columns with
their blind, prior, mirrored and flipped controls, a rerun skips every step, and the random
3-D encoder is no better than its blind baseline. Plan-time errors of 2-D/3-D mix-ups are
one line naming the file, the line and the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.experiments.config import load_experiment
from spar_bench.experiments.plan import make_plan

#: the question probes whose test split has enough items (32: 2 test volumes x 16) to compare
#: a score with its blind baseline; symmetry (1 item) and counting (2) are too few, and
#: containment has no test item on this phantom. Measured (seed 0 / seed 1, accuracy [95% CI]
#: vs blind [CI]): relative position 65.6 [62.5, 68.8] vs 68.8 [68.8, 68.8] / 65.6 vs 71.9
#: [68.8, 75.0]; distance 53.1 [37.5, 68.8] vs 65.6 [56.2, 75.0] / 53.1 vs 53.1; volume 93.8
#: vs 93.8 / 90.6 [81.2, 100] vs 93.8 [87.5, 100]; adjacency 75.0 vs 75.0 (both seeds)
COMPARED = ("level4.relative_position", "level4.distance", "level4.volume", "level4.adjacency")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spar_bench.experiments.cli", "run", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), env=_env(), capture_output=True, encoding="utf-8", errors="replace",
                          timeout=900)


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    pytest.importorskip("monai")  # the preset's encoder (the plan-time tests need no monai)
    out = tmp_path_factory.mktemp("volumes") / "out"
    done = _run("volumes", "--set", f"OUT={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _metrics(out: Path, probe: str) -> list[dict]:
    found = sorted((out / "runs" / "frozen-random3d").glob(f"*/{probe}/mlp*/seed*/metrics.json"))
    return [json.loads(p.read_text()) for p in found]


@pytest.mark.slow
def test_the_volumes_preset_reports_level4_with_every_control_and_reruns_nothing(volumes: Path) -> None:
    doc = json.loads((volumes / "report" / "experiment.json").read_text())
    md = (volumes / "report" / "experiment.md").read_text()
    assert "## Flip counterfactual (Level 4)" in md and "## Mirror counterfactual" in md and "RANDOM-INIT" in md
    rows = {(r["encoder"], r["mode"]): r for r in doc["configurations"]}
    frozen = next(r for (enc, mode), r in rows.items() if enc.startswith("monai:resnet10") and mode == "frozen")
    asked = [p for p in frozen["cells"] if p.startswith("level4.")]
    assert "level4.localisation" in asked and set(COMPARED) <= set(asked)
    for p in asked:
        cell = frozen["cells"][p]
        assert cell["test"] and cell["blind"] and cell["mirror"] and cell["flipped"], p
        assert cell["prior"] is not None, p
    # the mask oracle (the MLLM track's oracle on the stored label volumes): 100 %, original,
    # mirrored and flipped; its blind row abstains
    oracle = next(r for (enc, mode), r in rows.items() if mode == "MLLM")
    for p, cell in oracle["cells"].items():
        assert cell["test"]["mean"] == cell["mirror"]["mean"] == cell["flipped"]["mean"] == 1.0, p
    # the cache was made at the preset's input_size (spar-probe cache --model-args), recorded
    from spar_bench.probes.features import FeatureCache

    with FeatureCache(volumes / "cache" / "random3d@volumes.h5") as fc:
        config = fc.meta["encoder_config"]
        assert fc.levels() == ["level4"] and fc.meta["random_init"] is True
        assert config["extra"]["model_args"] == {"input_size": 16} and list(config["input_size"]) == [16, 16, 16]
    # a rerun: every step done, nothing run
    again = _run("volumes", "--set", f"OUT={volumes}")
    assert again.returncode == 0 and "0 step(s) run, 0 redone, 5 already done" in again.stdout, again.stderr[-2000:]


@pytest.mark.slow
def test_a_random_3d_encoder_sits_at_its_blind_baseline(volumes: Path) -> None:
    """On the question probes with 32 test items, 2 seeds each: the heads on the random 3-D
    encoder answer, pooled, as many items right as their blind controls (tests/helpers.py
    assert_at_blind: within 2.5 sd of two binomial scores)."""
    from helpers import assert_at_blind

    runs = []
    for probe in COMPARED:
        found = _metrics(volumes, probe)
        assert len(found) == 2, probe
        for m in found:
            assert m["random_init"] is True and m["n_items"]["test"] >= 32 and m["n_items"]["test_flipped"] >= 32
        runs += found
    assert_at_blind(runs)


def test_cache_model_args_are_for_timm_and_monai_only(tmp_path: Path) -> None:
    from spar_bench.builder.synthetic import write_synthetic_build
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    build = write_synthetic_build(tmp_path / "b", 2, levels=("level3",))
    argv = ["cache", "--encoder", "dummy", "--model-args", '{"depth": 1}', "--data", build, "--out", tmp_path / "c.h5"]
    assert run_cmd(cli, argv) == 2
    assert not (tmp_path / "c.h5").exists()


# --------------------------------------------------------------------------- plan-time errors
BASE = """
experiment: t
out: {out}
builds:
  b: {{phantom: {{n: 4}}, options: {{levels: {levels}, volume_size: 16, counterfactual: mirror+flip}}}}
encoders:
  e: {{spec: "{spec}", random_init: true}}
modes:
  frozen: {{encoders: [e]}}
probes: {probes}
"""


def _plan(tmp_path: Path, **kw: str):
    values = {"out": tmp_path / "out", "levels": "[level4]", "spec": "monai:resnet10",
              "probes": "[level4.relative_position]", **kw}
    path = tmp_path / "t.yaml"
    path.write_text(BASE.format(**values))
    return make_plan(load_experiment(path)), path


def test_a_2d_and_a_3d_encoder_each_take_the_probes_of_their_levels(tmp_path: Path) -> None:
    text = BASE.replace('  e: {{spec: "{spec}", random_init: true}}',
                        '  e: {{spec: "{spec}", random_init: true, model_args: {{input_size: 16}}}}\n'
                        '  flat: {{spec: "timm:resnet10t", random_init: true}}')
    path = tmp_path / "two.yaml"
    path.write_text(text.replace("frozen: {{encoders: [e]}}", "frozen: {{encoders: [e, flat]}}").format(
        out=tmp_path / "out", levels='"level1,level2,level3,level4"', spec="monai:resnet10",
        probes="[level3.size, level4.volume]"))
    plan = make_plan(load_experiment(path))
    build = plan.step("build:b").specs[-1][1]["options"]
    assert build["levels"] == "level1,level2,level3,level4"
    assert build["counterfactual"] == "mirror+flip" and "volume_size" in build
    for e, probe in (("e", "level4.volume"), ("flat", "level3.size")):
        assert plan.step(f"heads:{e}").specs[0][1]["probes"] == [probe]
    cache = plan.step("cache:e@b").specs[0][1]
    assert cache["model_args"] == {"input_size": 16} and cache["random_init"] is True
    assert "model_args" not in plan.step("cache:flat@b").specs[0][1]


def test_all_becomes_the_probes_of_each_encoders_levels(tmp_path: Path) -> None:
    from spar_bench.probes.tasks import probe_names

    level4 = ",".join(p for p in probe_names() if p.startswith("level4."))
    flat = ",".join(p for p in probe_names() if not p.startswith("level4."))
    for spec, levels, want in (("monai:resnet10", "[level4]", level4),
                               ("timm:resnet18", '"level1,level2,level3,level4"', flat),
                               ("timm:resnet18", '"level1,level3"', "all")):  # as before Level 4
        plan, _ = _plan(tmp_path, spec=spec, levels=levels, probes="all")
        assert ",".join(plan.step("heads:e").specs[0][1]["probes"]) == want, spec
        assert dict(plan.step("heads:e").cost)["runs"] == 8


@pytest.mark.parametrize("kw, line, says", [
    ({"spec": "timm:resnet18", "levels": '"level1,level3,level4"'}, 7,
     "is 2-D: it reads Levels 1-3 images, and probes: has only level4"),
    ({"probes": "[level3.size]", "levels": '"level3,level4"'}, 7, "is 3-D: it reads Level 4 volumes"),
    ({"levels": "[level3]"}, 5, "has no level4 (levels level3), which 3-D encoder e reads"),
    ({"probes": "[level3.size, level4.volume]", "levels": '"level3,level4"', "spec": "timm:resnet18"}, 10,
     "level4.volume needs a 3-D (Level 4 volumes) encoder, and modes have none"),
])  # fmt: skip
def test_2d_3d_mix_ups_are_one_line_at_plan_time(tmp_path: Path, kw: dict, line: int, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, **kw)
    text = str(e.value)
    assert "\n" not in text and says in text and text.startswith(f"{tmp_path / 't.yaml'}:{line}:"), text


def test_volume_as_needs_a_level4_build(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(f"""
experiment: m
out: {tmp_path / 'out'}
builds:
  b: {{phantom: {{n: 4}}}}
mllms:
  oracle: {{model: oracle, options: {{volume_as: views}}}}
""")
    with pytest.raises(ConfigError, match=r"m\.yaml:7: mllms\.oracle\.options: volume_as shows Level 4 volumes"):
        make_plan(load_experiment(path))
    path.write_text(path.read_text().replace("n: 4}}", "n: 4}, options: {levels: [level4]}}").replace("views", "vidoe"))
    with pytest.raises(ConfigError, match=r"m\.yaml:7: mllms\.oracle\.options\.volume_as: --volume-as vidoe: "
                                          "expected one of auto, video, montage, views"):
        make_plan(load_experiment(path))
