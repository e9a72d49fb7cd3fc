"""The experiment files shipped with the package (``spar-bench run demo|paper|recall-vs-computation``):
each loads and its ``--dry-run`` works without any data or weights on disk; the paper's plan
is the whole grid; the experiment of docs/RESULTS.md has its builds and transfer evaluations; a bad
file is one line naming the file, the line and the problem."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spar_bench.clitools import run_cli
from spar_bench.experiments import PRESETS, preset_path
from spar_bench.experiments.cli import cli
from spar_bench.experiments.config import load_experiment
from spar_bench.experiments.plan import make_plan


class _Result:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output = exit_code, output


@pytest.fixture
def run(capsys):
    """``spar-bench run ARGS`` as the console script runs it (one-line errors, exit codes)."""

    def go(*args: str) -> _Result:
        capsys.readouterr()
        code = run_cli(cli, ["run", *args])
        got = capsys.readouterr()
        return _Result(code, got.out + got.err)

    return go


def _kinds(plan) -> Counter:
    return Counter(s.id.split(":", 1)[0] for s in plan.steps)


def _bare(tmp_path: Path) -> list[str]:
    """Variables pointing at folders that do not exist: a dry run needs no data or weights."""
    return ["--set", f"OUT={tmp_path / 'out'}", "--set", f"DATA={tmp_path / 'nodata'}",
            "--set", f"WEIGHTS={tmp_path / 'noweights'}"]  # fmt: skip


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "mllm-stages"])  # its own test: test_mllm_stages
def test_every_shipped_preset_loads_and_dry_runs(name, tmp_path, run):
    assert preset_path(name).is_file()
    exp = load_experiment(preset_path(name), {"OUT": str(tmp_path / "out")})
    assert make_plan(exp).steps
    result = run(name, "--dry-run", "--set", f"OUT={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    steps = [ln for ln in lines if "\t" in ln]
    assert steps and all(ln.split("\t")[1] == "todo" for ln in steps)
    assert lines[-3].startswith("total: ") and lines[-2].startswith("estimated time: ")
    assert lines[-1].startswith("reference leaderboard")
    # a dry run writes nothing but the reference leaderboard (the planned rows, the paper's numbers)
    written = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written == [".plan/reference/leaderboard.csv", ".plan/reference/leaderboard.json"]


def _rows(exp) -> int:
    """Configuration rows: encoder x mode x head."""
    return sum(len(m.encoders) * len(m.heads) for m in exp.modes.values())


def test_the_paper_plan_is_the_papers_13_configurations(tmp_path):
    exp = load_experiment(preset_path("paper"), {"OUT": str(tmp_path / "out")})
    plan = make_plan(exp)
    frozen = ["resnet50", "vit-b32", "rad-dino", "biomedclip", "radimagenet"]
    assert _kinds(plan) == Counter({"build": 2, "cache": 2 * len(frozen), "heads": len(frozen), "finetune": 1,
                                    "scratch": 1, "eval": len(frozen) + 2, "vqa": 4, "report": 1})  # fmt: skip
    ids = {s.id for s in plan.steps}
    assert {f"cache:{e}@{b}" for e in frozen for b in ("word", "totalsegmentator")} <= ids
    assert {"finetune:rad-dino", "scratch:vit-b32-scratch", "eval:finetune:rad-dino@totalsegmentator"} <= ids
    assert {f"eval:heads:{e}@totalsegmentator" for e in frozen} <= ids
    assert plan.steps[-1].id == "report" and set(plan.steps[-1].needs) >= {
        s.id for s in plan.steps if s.kind == "vqa"
    }
    # 2x2 + unified (ViT-B/32 from scratch, Transformer) + 3 foundation models frozen x 2 heads
    # + RadDINO finetuned x 2 heads = 13 rows, 8 probes x 3 seeds each
    assert _rows(exp) == 13 and exp.seeds == (0, 1, 2) and exp.probes == ("all",)
    assert exp.modes["scratch"].heads == ("transformer",) and exp.modes["finetune"].encoders == ("rad-dino",)
    runs = sum(dict(s.cost)["runs"] for s in plan.steps if s.kind in ("heads", "train"))
    assert runs == 13 * 8 * 3


def test_paper_extended_is_the_20_row_superset(tmp_path):
    paper = load_experiment(preset_path("paper"), {"OUT": str(tmp_path / "p")})
    exp = load_experiment(preset_path("paper-extended"), {"OUT": str(tmp_path / "x")})
    plan = make_plan(exp)
    assert _rows(exp) == 20 and all(m.heads == ("mlp", "transformer") for m in exp.modes.values())
    assert set(exp.modes["frozen"].encoders) == {*paper.modes["frozen"].encoders, "unified"}
    assert exp.modes["finetune"].encoders == ("rad-dino", "biomedclip", "radimagenet")
    assert sum(dict(s.cost)["runs"] for s in plan.steps if s.kind in ("heads", "train")) == 20 * 8 * 3
    assert exp.builds == paper.builds and exp.mllms == paper.mllms


def test_an_unpinned_mllm_revision_stops_the_run_naming_its_variable(tmp_path, run):
    result = run("paper", *_bare(tmp_path))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "mllms.internvl3-8b.options.revision" in lines[0] and "set INTERNVL3_REVISION" in lines[0]
    assert "paper.yaml:" in lines[0] and not (tmp_path / "out").exists()  # before any step
    pinned = ["--set", "INTERNVL3_REVISION=" + "a" * 40]
    assert "set MEDGEMMA_REVISION" in run("paper", *_bare(tmp_path), *pinned).output
    from spar_bench.experiments.values import check_revisions

    check_revisions(load_experiment(preset_path("paper"), {"INTERNVL3_REVISION": "a" * 40,
                                                           "MEDGEMMA_REVISION": "b" * 40}))  # fmt: skip
    # a plan printed (--dry-run) leaves the revisions to the run
    assert run("paper", "--dry-run", *_bare(tmp_path)).exit_code == 0


def test_an_unpinned_revision_of_a_dotted_mllm_name_names_its_variable(tmp_path, run):
    """Names may hold dots (qwen2.5): the hint still finds the ${VARIABLE} the revision is written as."""
    path = tmp_path / "dotted.yaml"
    path.write_text("experiment: dotted\nvars: {QWEN_REVISION: set-me}\nout: out\n"
                    "builds: {b: {phantom: {n: 4}}}\nprobes: [level3.size]\n"
                    "mllms:\n  qwen2.5: {model: hf:Qwen/Qwen2.5-VL-7B-Instruct, options: {revision: \"${QWEN_REVISION}\"}}\n")
    result = run(str(path), "--set", f"OUT={tmp_path / 'out'}")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "mllms.qwen2.5.options.revision" in lines[0] and "set QWEN_REVISION" in lines[0], lines[0]


def test_the_paper_plan_spells_the_paper_preset_and_pins_every_mllm(tmp_path):
    plan = make_plan(load_experiment(preset_path("paper"), {"OUT": str(tmp_path / "out")}))
    for b in ("word", "totalsegmentator"):
        assert plan.step(f"build:{b}").specs[-1][1]["options"]["preset"] == "paper"
    assert plan.step("build:word").specs[-1][1]["source"] == ["word", "lits"]
    assert plan.step("heads:rad-dino").specs[0][1]["options"]["preset"] == "paper"
    vqa = [s for s in plan.steps if s.kind == "vqa"]
    assert len(vqa) == 4
    for s in vqa:
        spec = s.specs[0][1]
        assert spec["model"].startswith("hf:") and "revision" in spec["options"]
    # weights are local paths from variables, never hub ids
    exp = plan.experiment
    assert all(e.revision is None for e in exp.encoders.values())
    assert exp.encoders["rad-dino"].spec == f"hf:{exp.variables['WEIGHTS']}/rad-dino"


def test_the_paper_dry_run_lists_the_grid_with_costs_without_data_or_weights(tmp_path, run):
    result = run(str(preset_path("paper")), "--dry-run", *_bare(tmp_path))
    assert result.exit_code == 0, result.output
    steps = [ln.split("\t") for ln in result.output.splitlines() if "\t" in ln]
    assert len(steps) == 31 and all(len(cols) == 4 for cols in steps)
    assert "runs to train" in result.output and "questions to ask" in result.output
    assert "images to encode" in result.output


def test_recall_vs_computation_has_its_builds_training_and_transfer(tmp_path):
    plan = make_plan(load_experiment(preset_path("recall-vs-computation"), {"OUT": str(tmp_path)}))
    assert [s.id for s in plan.steps] == ["build:canonical", "build:mirrored", "build:random", "scratch:rn10t",
                                          "eval:scratch:rn10t@mirrored", "eval:scratch:rn10t@random", "calibration",
                                          "report"]  # fmt: skip
    phantom = plan.step("build:random").specs[0][1]
    assert phantom["layout"] == "random" and phantom["intensities"] == "distinct"
    train = plan.step("scratch:rn10t").specs[0][1]
    assert train["init"] == "scratch" and train["heads"] == ["attnpool"]
    assert train["data"] == "{out}/builds/canonical"
    assert "calibration" in plan.step("report").needs  # its tables: a section of the report
    other = make_plan(
        load_experiment(
            preset_path("recall-vs-computation"),
            {"OUT": str(tmp_path), "TRAIN_ON": "random", "TRANSFER": "[canonical, mirrored]"},
        )
    )
    assert [s.id for s in other.steps if s.kind == "eval"] == ["eval:scratch:rn10t@canonical",
                                                               "eval:scratch:rn10t@mirrored"]  # fmt: skip


def _demo_copy(tmp_path: Path, old: str, new: str) -> tuple[Path, int]:
    """demo.yaml with ``old`` replaced by ``new``; returns the copy and the 1-based line changed."""
    text = preset_path("demo").read_text()
    assert old in text
    line = text[: text.index(old)].count("\n") + 1
    path = tmp_path / "demo-copy.yaml"
    path.write_text(text.replace(old, new, 1))
    return path, line


def test_a_misspelt_key_is_one_line_naming_file_line_and_the_right_key(tmp_path, run):
    path, line = _demo_copy(tmp_path, "    heads: [mlp]", "    haeds: [mlp]")
    result = run(str(path), "--dry-run")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert f"{path}:{line}:" in lines[0] and "modes.frozen.haeds" in lines[0]
    assert "did you mean 'heads'" in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize(("old", "new", "words"), [
    ("  organ_maps: ${CAL_ORGAN_MAPS}", "  organ_map: 3", ("calibration.organ_map", "did you mean 'organ_maps'")),
    ("  epochs: ${CAL_EPOCHS}", "  epochs: many", ("calibration.epochs", "expected an integer, got 'many'")),
    ("  organ_map_dice: 1", "  organ_map_dice: -1", ("--organ-map-dice must be >= 0",)),
])
def test_a_bad_calibration_option_is_one_line_at_plan_time(tmp_path, run, old, new, words):
    text = preset_path("recall-vs-computation").read_text()
    assert old in text
    path = tmp_path / "rvc.yaml"
    path.write_text(text.replace(old, new, 1))
    result = run(str(path), "--dry-run", "--set", f"OUT={tmp_path / 'out'}")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.output


def test_the_calibration_takes_device_auto_and_refuses_a_bad_one(tmp_path, run):
    """``device: auto`` (CUDA when visible) is the calibration's as the finetune's; ``tpu`` is one line."""
    text = preset_path("recall-vs-computation").read_text().replace("  device: ${DEVICE}\n", "  device: ${CAL_DEVICE}\n")
    path = tmp_path / "rvc.yaml"
    path.write_text(text.replace("vars:\n", "vars:\n  CAL_DEVICE: auto\n", 1))
    assert run(str(path), "--list", "--set", f"OUT={tmp_path / 'out'}").exit_code == 0
    result = run(str(path), "--list", "--set", f"OUT={tmp_path / 'out'}", "--set", "CAL_DEVICE=tpu")
    assert result.exit_code == 2 and "calibration.device: tpu: not a device" in result.output, result.output


def test_an_undefined_variable_is_one_line(tmp_path, monkeypatch, run):
    monkeypatch.delenv("SPAR_NO_SUCH_VAR", raising=False)
    path, line = _demo_copy(tmp_path, "out: ${OUT}", "out: ${SPAR_NO_SUCH_VAR}")
    result = run(str(path), "--dry-run")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert f"{path}:{line}:" in lines[0] and "${SPAR_NO_SUCH_VAR} is not defined" in lines[0]
    # the environment defines it
    monkeypatch.setenv("SPAR_NO_SUCH_VAR", str(tmp_path / "o"))
    assert run(str(path), "--dry-run").exit_code == 0


def test_word_real_weights_pits_imagenet_against_the_same_architecture_random(tmp_path, run):
    exp = load_experiment(preset_path("word-real-weights"), {"OUT": str(tmp_path / "out")})
    plan = make_plan(exp)
    assert _kinds(plan) == Counter({"build": 2, "cache": 4, "heads": 2, "eval": 2, "report": 1})
    enc = exp.encoders
    assert enc["lite0-imagenet"].spec == "efficientnet-lite0" and not enc["lite0-imagenet"].random_init
    assert enc["lite0-random"].spec == "timm:tf_efficientnet_lite0" and enc["lite0-random"].random_init
    word = plan.step("build:word").specs[-1][1]
    assert word["source"] == ["word"] and word["root"] == ["../shared/data/word-labels"]
    assert word["options"]["images"] == "synthesize" and word["options"]["counterfactual"] == "mirror"
    ts = plan.step("build:totalsegmentator").specs[-1][1]
    assert ts["root"] == ["../shared/data/totalsegmentator-sample"]
    assert "build:word" in plan.step("build:totalsegmentator").needs  # WORD's thresholds
    for e in enc:
        heads = plan.step(f"heads:{e}").specs[0][1]
        assert heads["heads"] == ["mlp", "transformer"] and heads["probes"] == ["all"]
        assert heads["seeds"] == [0, 1, 2]
        ev = plan.step(f"eval:heads:{e}@totalsegmentator").specs[0][1]
        assert ev["n_boot"] == heads["options"]["n_boot"]  # the transfer scores draw the mode's bootstrap
    result = run("word-real-weights", "--dry-run", *_bare(tmp_path))
    assert result.exit_code == 0, result.output


@pytest.mark.slow  # ~15 s CPU: three tiny phantoms twice, a 1-epoch finetune, organ maps and the scoring
def test_recall_vs_computation_runs_tiny_and_its_report_has_the_calibration_tables(tmp_path, capsys):
    """The preset end to end at a tiny size: the calibration step writes docs/RESULTS.md's table
    layout (``calibration.json`` + ``.md``), the report carries it as a section, and
    ``spar-bench check`` of the output against itself passes."""
    import json

    from spar_bench.clitools import run_cli
    from spar_bench.experiments.calibration_tables import calibration_section
    from spar_bench.experiments.cli import cli

    out = tmp_path / "rvc"
    sets = {"OUT": out, "CASES": 3, "EVAL_CASES": 2, "EPOCHS": 1, "CAL_CASES": 4, "CAL_EVAL_CASES": 3,
            "CAL_IN_PLANE": 64, "CAL_SLICES": 8, "CAL_EPOCHS": 1, "CAL_ORGAN_MAPS": 1, "CAL_SEEDS": "[0]",
            "CAL_SCORE": "level3.relative_position", "CAL_BOOTSTRAP": 5, "CAL_THREADS": 1}
    argv = ["run", "recall-vs-computation", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    assert run_cli(cli, argv) == 0, capsys.readouterr().err
    rows = json.loads((out / "calibration" / "calibration.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["oracle", "blind (canonical prior)", "blind (random prior)",
                                          "recall", "computation"]
    section = "\n".join(calibration_section(rows))
    assert section in (out / "report" / "experiment.md").read_text()
    assert section in (out / "report" / "calibration.md").read_text()
    capsys.readouterr()
    own = out / "calibration" / "calibration.json"
    assert run_cli(cli, ["check", str(own), "--against", str(own)]) == 0
    assert "conclusions of the reference hold" in capsys.readouterr().out


def test_an_eval_step_scores_with_its_modes_bootstrap_and_the_default_without_one(tmp_path, monkeypatch):
    """``modes.frozen.options.bootstrap: N`` reaches the transfer evaluation (it drew 1000 replicates
    whatever the mode said); a mode without one plans the eval step as before (its hash kept)."""
    from spar_bench.experiments import step_kinds

    def plan_of(options: str):
        path = tmp_path / "e.yaml"
        path.write_text(f"experiment: t\nout: {tmp_path}/out\nbuilds:\n  a: {{phantom: {{n: 4}}}}\n"
                        "  b: {phantom: {n: 4}}\nencoders:\n  d: {spec: dummy}\n"
                        f"modes:\n  frozen: {{heads: [mlp]{options}}}\nprobes: level3.size\ntransfer: [b]\n",
                        encoding="utf-8")  # fmt: skip
        return make_plan(load_experiment(path))

    assert plan_of(", options: {bootstrap: 50}").step("eval:heads:d@b").specs[0][1]["n_boot"] == 50
    assert "n_boot" not in plan_of("").step("eval:heads:d@b").specs[0][1]
    seen = []
    monkeypatch.setattr(step_kinds, "evaluate_on", lambda rd, target: seen.append(target.n_boot))
    runs = tmp_path / "runs" / "r"
    runs.mkdir(parents=True)
    (runs / "metrics.json").write_text("{}", encoding="utf-8")
    step_kinds._evaluate({"runs": str(tmp_path / "runs"), "features": "f.h5", "n_boot": 50}, None)
    step_kinds._evaluate({"runs": str(tmp_path / "runs"), "features": "f.h5"}, None)
    assert seen == [50, 1000]
