"""The experiment report (issue 23): the paper's tables over a folder of runs of every kind.

One module fixture makes tiny real runs in tmp_path: frozen heads (mlp, linear; 2 seeds) on a
random-init tiny ViT cache, the same ViT trained from scratch end to end (``finetune``), a
zero-shot transfer of both onto the pipeline's ``other-shards`` build (a cache of it for the
frozen heads, a re-encoding for the finetuned run), and the dummy MLLM (``vqa``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError
from spar_bench.experiments.report import (
    encoder_tag,
    mode_of,
    weights_digest,
    write_experiment_report,
)
from spar_bench.probes.cli import cli
from spar_bench.provenance import local_paths, local_prefixes

from helpers import run_cmd

VIT = "timm:vit_tiny_patch16_224"
VIT_ARGS = {"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64}
PROBES = "level1.localisation,level3.relative_position"
PROVENANCE = {"experiment": "tiny", "file_sha256": "ab" * 32, "plan_hash": "cd" * 8,
              "versions": {"spar-bench": "test"}}  # fmt: skip


def _vit_cache(data: Path, out: Path, levels: list[str]) -> Path:
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.finetune.model import load_trainable

    enc = load_trainable(VIT, weights=None, init="scratch", seed=0, model_kwargs=VIT_ARGS)
    opts = CacheOptions(levels=levels, device="cpu", compute="fp32", random_init=True)
    return write_cache(VIT, data, out, opts, encoder_obj=enc, progress=False)


@pytest.fixture(scope="module")
def exp(pipeline, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experiment")
    runs = root / "runs"
    cache = _vit_cache(pipeline["shards"], root / "cache" / "vit.h5", ["level1", "level3"])
    other = _vit_cache(pipeline["other"], root / "cache" / "other-shards.h5", ["level1"])
    assert run_cmd(cli, ["fit", "--features", cache, "--data", pipeline["shards"], "--out", runs / "heads",
                      "--probe", PROBES, "--head", "mlp,linear", "--seeds", "0,1", "--max-epochs", 2,
                      "--bootstrap", 50]) == 0  # fmt: skip
    assert run_cmd(cli, ["finetune", "--encoder", VIT, "--model-args", json.dumps(VIT_ARGS), "--init", "scratch",
                      "--data", pipeline["shards"], "--out", runs / "finetune", "--probe", PROBES, "--head", "mlp",
                      "--max-epochs", 1, "--bootstrap", 50, "--device", "cpu", "--compute", "fp32",
                      "--batch-size", 8, "--no-controls"]) == 0  # fmt: skip
    for rd in sorted(runs.rglob("level1.localisation/*/seed*")):
        cached = ["--features", other] if "heads" in rd.parts else []  # else: re-encoded by the trained encoder
        assert run_cmd(cli, ["eval", "--run", rd, "--data", pipeline["other"], "--bootstrap", 50, *cached]) == 0
    assert run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--out", runs / "vqa",
                      "--probe", "relative_position,symmetry", "--bootstrap", 50]) == 0  # fmt: skip
    out = root / "report"
    write_experiment_report(runs, out, title="Tiny experiment", provenance=PROVENANCE)
    return {"root": root, "runs": runs, "out": out, "other": pipeline["other"]}


def _md(exp) -> str:
    return (exp["out"] / "experiment.md").read_text()


def _doc(exp) -> dict:
    return json.loads((exp["out"] / "experiment.json").read_text())


def _section(text: str, title: str) -> list[list[str]]:
    """The table under heading ``title``: rows of cells (header first, the |---| line dropped)."""
    lines = text.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("|---")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


#: a cell: mean [+- std: several seeds only] [mean 95 % CI] [(n=k)]
CELL_PCT = re.compile(r"\d+\.\d( \+- \d+\.\d)? \[\d+\.\d, \d+\.\d\]( \(n=\d\))?")
CELL_PX = re.compile(r"\d+\.\d\d( \+- \d+\.\d\d)? \[\d+\.\d\d, \d+\.\d\d\]( \(n=\d\))?")


@pytest.mark.slow
def test_main_table_has_a_row_per_configuration_and_a_column_per_probe(exp) -> None:
    table = _section(_md(exp), "## Main table")
    head, rows = table[0], table[1:]
    probes = ["level1.localisation", "level3.relative_position", "level3.symmetry"]  # probe_names() order
    assert head == ["encoder", "mode", "head", "options", "seeds", *probes]
    configs = [tuple(r[:3]) for r in rows if r[0]]
    assert configs == [(f"{VIT} **(random-init)**", "frozen", "linear"), (f"{VIT} **(random-init)**", "frozen", "mlp"),
                       (VIT, "scratch", "mlp"), ("dummy", "MLLM", "vqa-loglik")]  # fmt: skip
    assert [r[2] for r in rows if not r[0]] == ["blind"] * 4  # a blind sub-row under every configuration
    frozen_mlp = rows[2]
    assert frozen_mlp[4] == "2" and CELL_PX.fullmatch(frozen_mlp[5]) and CELL_PCT.fullmatch(frozen_mlp[6])
    assert " +- " in frozen_mlp[5]  # two seeds: a spread
    assert frozen_mlp[7] == "-"  # no symmetry runs of frozen heads
    assert re.fullmatch(r"\d+\.\d \+- \d+\.\d", rows[3][6])  # the blind sub-row: mean +- std
    doc = _doc(exp)
    assert [c["mode"] for c in doc["configurations"]] == ["frozen", "frozen", "scratch", "MLLM"]
    assert doc["configurations"][1]["cells"]["level1.localisation"]["seeds"] == [0, 1]


def test_frozen_and_scratch_rows_of_one_encoder_and_head_stand_side_by_side(exp) -> None:
    rows = [r for r in _section(_md(exp), "## Main table")[1:] if r[0]]
    i = rows.index(next(r for r in rows if r[1] == "frozen" and r[2] == "mlp"))
    assert rows[i + 1][:3] == [VIT, "scratch", "mlp"]


def test_transfer_table_per_target_build(exp) -> None:
    from spar_bench.builder.shards import Build

    text, doc = _md(exp), _doc(exp)
    fp = Build(exp["other"]).fingerprint[:12]
    assert doc["transfer_targets"] == {fp: "other-shards"}  # the cache and the re-encoding: one target
    table = _section(text, "## Zero-shot transfer: other-shards")
    assert table[0][5:] == ["level1.localisation", "level3.relative_position", "level3.symmetry"]
    rows = [r for r in table[1:] if r[0]]
    assert [tuple(r[1:3]) for r in rows] == [("frozen", "linear"), ("frozen", "mlp"), ("scratch", "mlp")]
    for r in rows:
        assert CELL_PX.fullmatch(r[5]) and r[6] == "-"
    assert [r[2] for r in table[1:] if not r[0]] == ["prior"] * 3


def test_mllm_rows_show_level3_with_blind_circular_and_parse_rate(exp) -> None:
    table = _section(_md(exp), "## Multimodal LLMs (Level 3)")
    assert table[0][5:] == ["level3.relative_position", "level3.symmetry"]
    assert table[1][:3] == ["dummy", "MLLM", "vqa-loglik"] and CELL_PCT.fullmatch(table[1][5])
    assert [r[2] for r in table[2:]] == ["blind (no image)", "circular (strict)", "parse rate"]
    assert table[4][5] == "100.0"  # one seed: its value, no spread


def test_a_cell_of_one_seed_shows_no_spread_in_md_and_html() -> None:
    """experiment.md and report.html show a cell of one seed as its value (never ``+- 0.0``),
    of several as mean +- std (one rule: ``with_spread``)."""
    from spar_bench.experiments.html import mean_text
    from spar_bench.experiments.report import fmt_summary, summary

    one = summary([{"x": 0.5, "ci": {"x": [0.4, 0.6]}}], "x")
    two = summary([{"x": 0.5}, {"x": 0.7}], "x")
    assert one["std"] == 0.0 and fmt_summary(one, True) == "50.0 [40.0, 60.0]"
    assert fmt_summary(one, True, n_row=2) == "50.0 [40.0, 60.0] (n=1)"
    assert fmt_summary(two, False) == "0.60 +- 0.14" and fmt_summary(two, True, ci=False) == "60.0 +- 14.1"
    assert mean_text(one, True) == "50.0" and mean_text(two, True) == "60.0 ± 14.1"


def test_provenance_names_every_run_relative_to_runs_and_no_local_path(exp) -> None:
    runs, doc, text = exp["runs"], _doc(exp), _md(exp)
    made = {p.parent.relative_to(runs).as_posix() for p in runs.rglob("metrics.json")}
    listed = [x for c in doc["configurations"] for cell in c["cells"].values() for x in cell["runs"]]
    assert sorted(x["run"] for x in listed) == sorted(made)
    assert all(x["build_fingerprint"] and len(x["build_fingerprint"]) == 12 for x in listed)
    weights = {(c["mode"], x["weights"]) for c in doc["configurations"] for cell in c["cells"].values()
               for x in cell["runs"]}  # fmt: skip
    assert weights == {("frozen", "random-init"), ("scratch", "init random-init"), ("MLLM", "dummy (seed=0)")}
    evals = [e["file"] for x in listed for e in x["evals"]]
    assert len(evals) == 5 and all((runs / f).is_file() for f in evals)
    prov = _section(text, "## Provenance of every cell")
    assert any(r[5] == "heads/timm-vit_tiny_patch16_224-random-init/level1.localisation/mlp,max_epochs=2/"
               "{seed0, seed1}" for r in prov)  # fmt: skip
    prefixes = local_prefixes(exp["root"])
    assert not local_paths([doc, text], prefixes)
    assert str(exp["root"]) not in (exp["out"] / "experiment.json").read_text()


def test_runner_provenance_and_random_init_banner_at_the_top(exp) -> None:
    top = _md(exp).split("## Main table")[0]
    assert top.startswith("# Tiny experiment\n")
    assert f"| plan_hash | {'cd' * 8} |" in top and '| versions | {"spar-bench": "test"} |' in top
    assert "RANDOM-INIT FEATURES" in top
    assert _doc(exp)["provenance"] == PROVENANCE


def test_same_runs_give_the_same_bytes(exp, tmp_path: Path) -> None:
    again = write_experiment_report(exp["runs"], tmp_path / "again", title="Tiny experiment", provenance=PROVENANCE)
    assert again == tmp_path / "again" / "experiment.md"
    for name in ("experiment.md", "experiment.json", "experiment.png"):
        assert (tmp_path / "again" / name).read_bytes() == (exp["out"] / name).read_bytes(), name


def test_no_runs_is_one_line_config_error(tmp_path: Path) -> None:
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no metrics.json") as e:
        write_experiment_report(tmp_path / "runs", tmp_path / "out", title="x")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bad_provenance_and_twin_runs_are_config_errors(exp, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local path"):
        write_experiment_report(exp["runs"], tmp_path / "a", title="x", provenance={"file": str(tmp_path / "e.yaml")})
    seed = next(exp["runs"].rglob("level3.symmetry/vqa-loglik/seed0"))
    runs = tmp_path / "runs"
    shutil.copytree(seed, runs / "a" / "seed0")
    shutil.copytree(seed, runs / "b" / "seed0")
    with pytest.raises(ConfigError, match=r"runs a/seed0 and b/seed0: the same configuration, probe and seed 0"):
        write_experiment_report(runs, tmp_path / "b", title="x")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _rec(**config):
    """A run record, as read from a config.json of these fields (one written before the record)."""
    from spar_bench.probes.runs.record import RunRecord

    return RunRecord.from_dict({"probe": "level1.localisation", "head": "mlp", "seed": 0, **config})


def test_modes_and_weights_digests() -> None:
    from spar_bench.probes.runs.record import RunRecord

    ft = {"training": {"mode": "finetuned", "init_weights": {"kind": "hub", "repo": "org/m", "revision": "abc"}}}
    assert mode_of(ft, _rec(command="finetune")) == "finetuned"
    assert mode_of(ft, _rec()) == "finetuned (frozen head)"  # a head fitted on a cache of the export
    assert mode_of({"training": None}, _rec()) == "frozen" and mode_of({}, _rec(track="vqa")) == "MLLM"
    # the report reads the kind from the record: a kind it does not know is named as it is
    assert mode_of({}, RunRecord(kind="mykind", probe="level1.localisation", head="h", seed=0)) == "mykind"
    assert mode_of(ft, RunRecord(kind="finetune", probe="level1.localisation", head="h", seed=0)) == "finetuned"
    assert weights_digest(_rec(), ft) == "finetuned, init org/m@abc"
    assert weights_digest(_rec(command="finetune", weights={"kind": "random-init"}), {}) == "init random-init"
    assert weights_digest(_rec(weights={"kind": "file", "name": "w.pth", "sha256": "0123456789abcdef"}), {}) == \
        "w.pth sha256:0123456789ab"
    assert weights_digest(_rec(), {"random_init": True}) == "random-init"
    assert weights_digest(_rec(), {}) == "not recorded"
    named = "sha256:01f68600 (8 hex, from the encoder name)"
    assert weights_digest(_rec(encoder="hf:tiny@01f68600"), {}) == named
    assert weights_digest(_rec(encoder="timm:resnet50"), {"encoder": "timm-resnet50-01f68600-per-tile"}) == named


def test_encoder_tags_tell_features_apart_and_align_frozen_with_finetuned() -> None:
    r50, sha = "timm:resnet50", "1a2b3c4d" + "0" * 56
    assert encoder_tag(r50, {"encoder": "timm-resnet50-1a2b3c4d-per-tile"}, _rec()) == "1a2b3c4d-per-tile"
    assert encoder_tag(r50, {"encoder": "timm-resnet50-1a2b3c4d"}, _rec()) == "1a2b3c4d"
    assert encoder_tag(r50, {}, _rec(command="finetune", weights={"kind": "file", "sha256": sha})) == "1a2b3c4d"
    assert encoder_tag(r50, {"encoder": "timm-resnet50-random-init"}, _rec()) == ""
    trained = {"encoder": "timm-resnet50-1a2b3c4d-scratch-shards-frozen", "training": {"mode": "scratch", "build": "shards"}}
    assert encoder_tag(r50, trained, _rec()) == "1a2b3c4d"
    assert encoder_tag("hf:tiny@1a2b3c4d", {}, _rec(command="finetune", weights={"kind": "dir", "sha256": sha})) == ""


# --------------------------------------------------------------------------- leaderboard, the paper beside it
def _leaderboard(out: Path) -> dict:
    return json.loads((out / "leaderboard.json").read_text())


def test_leaderboard_has_a_row_per_configuration_with_blind_gap_and_provenance(exp) -> None:
    import csv

    doc, board = _doc(exp), _leaderboard(exp["out"])
    assert board["format"] == "spar-bench-leaderboard/1" and not board["reference_only"]
    assert len(board["rows"]) == len(doc["configurations"]) and board["probes"] == doc["probes"]
    for row, cfg in zip(board["rows"], doc["configurations"], strict=True):
        assert (row["encoder"], row["head"], row["mode"]) == (cfg["encoder"], cfg["head"], cfg["mode"])
        assert row["seeds"] == cfg["seeds"] and row["protocol"] and row["build_fingerprint"]
        for p, e in row["probes"].items():
            cell = cfg["cells"][p]
            assert e["mean"] == cell["test"]["mean"] and e["n_seeds"] == len(cell["seeds"])
            if e["blind"] is not None:
                assert e["blind_gap"] == pytest.approx(e["mean"] - e["blind"])
            assert e["paper"] == []  # no configuration of this experiment is one of the paper's
    table = list(csv.reader((exp["out"] / "leaderboard.csv").read_text().splitlines()))
    assert len(table) == 1 + len(board["rows"])
    assert "level1.localisation blind_gap" in table[0] and "level3.relative_position paper" in table[0]
    assert {"leaderboard.json", "leaderboard.csv"} <= set(doc["files"])
    assert not local_paths([board, (exp["out"] / "leaderboard.csv").read_text()], local_prefixes(exp["runs"]))


def test_a_row_of_the_papers_configurations_shows_the_papers_number(exp, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(exp["runs"] / "heads", runs / "frozen-rad-dino")  # as the paper preset names the folder
    write_experiment_report(runs, tmp_path / "report", title="t", provenance=PROVENANCE)
    rows = _section((tmp_path / "report" / "experiment.md").read_text(), "## Main table")
    head = rows[0]
    paper = [r for r in rows if r[2] == "paper"]
    assert len(paper) == 2  # under the mlp and the linear row
    loc, rel = head.index("level1.localisation"), head.index("level3.relative_position")
    assert {r[loc] for r in paper} == {"9.88", "-"}  # RadDINO + MLP's stated 9.88 px; no linear number
    assert {r[rel] for r in paper} == {">= 98.0"}  # the bound stated for every configuration
    board = _leaderboard(tmp_path / "report")
    mlp = next(r for r in board["rows"] if r["head"] == "mlp")
    assert mlp["folder"] == "frozen-rad-dino" and mlp["probes"]["level1.localisation"]["paper"][0]["value"] == 9.88


def test_compare_sets_two_leaderboards_side_by_side(exp, tmp_path: Path) -> None:
    from spar_bench.errors import ConfigError
    from spar_bench.experiments.leaderboard import compare, read_leaderboard

    a = read_leaderboard(exp["out"])
    same = compare(a, read_leaderboard(exp["out"] / "leaderboard.json"))
    body = [ln for ln in same.splitlines()[2:] if ln.startswith("| ")]
    assert body and all("| +0.00 |" in ln and ln.endswith("| yes |") for ln in body)
    b = json.loads(json.dumps(a))
    e = b["rows"][0]["probes"]["level3.relative_position"]
    e["mean"] += 0.5  # far outside the interval
    shifted = compare(a, b)
    assert "| +50.00 | no |" in shifted or "| +50.00 | one |" in shifted
    with pytest.raises(ConfigError, match="no leaderboard.json"):
        read_leaderboard(tmp_path)
    from spar_bench.clitools import run_cli
    from spar_bench.experiments.cli import cli as bench_cli

    (tmp_path / "b.json").write_text(json.dumps(b))
    assert run_cli(bench_cli, ["compare", str(exp["out"]), str(tmp_path / "b.json")]) == 0
    assert run_cli(bench_cli, ["compare", str(exp["out"]), str(tmp_path / "none")]) == 2


def test_the_paper_dry_run_writes_the_reference_leaderboard(tmp_path: Path, capsys) -> None:
    from spar_bench.clitools import run_cli
    from spar_bench.experiments import preset_path
    from spar_bench.experiments.cli import cli as bench_cli

    out = tmp_path / "out"
    sets = ["--set", f"OUT={out}", "--set", f"DATA={tmp_path / 'nodata'}", "--set", f"WEIGHTS={tmp_path / 'w'}"]
    assert run_cli(bench_cli, ["run", str(preset_path("paper")), "--dry-run", *sets]) == 0
    assert "reference leaderboard" in capsys.readouterr().out
    board = _leaderboard(out / ".plan" / "reference")
    assert board["reference_only"] and (out / ".plan" / "reference" / "leaderboard.csv").is_file()
    rows = {(r["folder"], r["head"]): r for r in board["rows"]}
    assert rows[("frozen-biomedclip", "mlp")]["probes"]["level2.arrangement"]["paper"][0]["value"] == 0.007
    assert rows[("frozen-biomedclip", "transformer")]["probes"]["level2.arrangement"]["paper"][0]["value"] == 0.678
    assert not (out / "report").exists()  # no result is written, nor anything the report step owns
