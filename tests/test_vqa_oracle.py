"""Protocol 1.2: every MLLM question is answerable from its image.

The mask oracle (``--model oracle``) recomputes every answer from the build's stored
geometry and the thresholds its prompt states; on the shared phantom build (with
``--counterfactual mirror``) it scores 100 % on every probe, original and mirrored, and
under every rotation of the options. ``oracle:pixels`` reads the 224 masks alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.samples.pixels import Geometry, decide
from spar_bench.builder.schema import LEVEL3_PROBES, ORGANS
from spar_bench.errors import ConfigError
from spar_bench.probes.cli import cli
from spar_bench.probes.vqa.oracle import stated_numbers
from spar_bench.probes.vqa.prompts import BLIND_NOTE, CONVENTION_HINT, PromptContext, render
from spar_bench.provenance import PROTOCOL_VERSION

from helpers import run_cmd


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory, pipeline):
    runs = tmp_path_factory.mktemp("oracle") / "runs"
    assert run_cmd(cli, ["vqa", "--model", "oracle", "--data", pipeline["shards"], "--out", runs,
                         "--bootstrap", 10]) == 0
    return runs


def _metrics(runs: Path, model: str, probe: str) -> dict:
    return json.loads((runs / model / f"level3.{probe}" / "vqa-loglik" / "seed0" / "metrics.json").read_text())


def test_oracle_scores_100_on_every_probe_original_and_mirrored(oracle_runs):
    for probe in LEVEL3_PROBES:
        m = _metrics(oracle_runs, "oracle", probe)
        assert m["n_items"]["test"] > 0 and m["n_items"]["test_mirror"] > 0, probe
        assert m["test"]["accuracy"] == 1.0, probe
        assert m["mirror"]["accuracy"] == 1.0, probe
        assert m["controls"]["circular"]["strict"] == 1.0, probe  # whatever the order of the options
        assert m["protocol_version"] == PROTOCOL_VERSION and m["build_protocol_version"] == PROTOCOL_VERSION
        assert m["template_version"] == f"{probe}@3"


def test_oracle_recomputes_rather_than_reading_the_answer(oracle_runs):
    """The answers the oracle gives differ from a flipped label: a labelling bug would show."""
    recs = [json.loads(line) for line in
            (oracle_runs / "oracle" / "level3.relative_position" / "vqa-loglik" / "seed0" / "answers.jsonl")
            .read_text().splitlines()]
    image = [r for r in recs if r["variant"] == "image"]
    assert image and all(r["class"] == r["truth"] for r in image)
    assert len({r["truth"] for r in image}) == 2  # both answers occur: not a constant
    blind = [r for r in recs if r["variant"] == "blind"]
    assert blind and all(r["class"] == -1 for r in blind)  # no image, no answer


def test_decide_follows_the_stated_rules():
    g = Geometry(a=(150.0, 100.0), b=(80.0, 120.0), area_a=1000.0, area_b=700.0, count=5, mm_per_pixel=2.0)
    assert decide("relative_position", 0, g, ()) == 1  # a has the larger x: the patient's left
    assert decide("relative_position", 1, g, ()) == 1  # a has the smaller y: anterior
    assert decide("orientation", -1, g, ()) == 4  # b lies to the patient's right (and a bit back)
    assert decide("symmetry", -1, g, (15.0,)) == 0  # d = 0.35 > 0.15, left (a) larger
    assert decide("symmetry", -1, g, (40.0,)) == 1
    assert decide("size", -1, g, (500.0, 1000.0)) == 2  # at the upper cut: large
    assert decide("distance", -1, g, (100.0, 200.0)) == 1  # hypot(70, 20) * 2 = 145.6 mm
    assert decide("counting", -1, g, ()) == 3


def test_prompts_state_what_decides_them():
    ctx = PromptContext(mm_per_pixel=1.75, image_size=448, cuts=(1203.74, 2500.0), band=0.15)
    size = render("size", ORGANS.index("liver"), -1, -1, (0, 1, 2), context=ctx)
    assert stated_numbers("size", size.text) == (1203.7, 2500.0)
    assert "392.0 mm wide" in size.text and "0.875 mm wide" in size.text  # 448 px shown
    dist = render("distance", 0, 1, -1, (2, 0, 1), context=ctx)
    assert stated_numbers("distance", dist.text) == (1203.7, 2500.0) and "centroid" in dist.text
    sym = render("symmetry", 2, 3, -1, (0, 1, 2), context=ctx)
    assert stated_numbers("symmetry", sym.text) == (15.0,)
    with pytest.raises(ConfigError):
        render("size", 0, -1, -1, (0, 1, 2))  # a size prompt without its thresholds
    count = render("counting", -1, -1, -1, (0, 1, 2, 3), context=PromptContext(min_pixels=3))
    assert "fewer than 3 pixels of the image at 224 x 224 pixels" in count.text  # the image's terms
    assert stated_numbers("counting", count.text) == (3.0,)


def test_blind_prompt_does_not_describe_an_image():
    ctx = PromptContext(mm_per_pixel=1.75, cuts=(10.0, 20.0), band=0.15, min_pixels=3)
    for probe, n in (("relative_position", 2), ("size", 3), ("distance", 3), ("counting", 4)):
        p = render(probe, 0, 1 if probe != "size" else -1, 0, tuple(range(n)), blind=True, context=ctx)
        assert "The image is" not in p.text and CONVENTION_HINT not in p.text
        assert BLIND_NOTE in p.text and "mm wide" not in p.text
        seen = render(probe, 0, 1 if probe != "size" else -1, 0, tuple(range(n)), context=ctx)
        assert "The image is an axial CT slice" in seen.text


def test_mllm_truth_is_decided_by_the_stated_thresholds(pipeline):
    """Size and distance are scored against the thresholds as the prompt states them."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import load_questions

    for probe in ("size", "distance"):
        qs = load_questions(Build(pipeline["shards"]), get_probe(f"level3.{probe}"), ["test"])
        expect = [int(m >= c[0]) + int(m >= c[1]) for m, c in zip(qs.measure, qs.cuts, strict=True)]
        assert list(qs.answer) == expect
        assert np.all(qs.cuts == np.round(qs.cuts, 1))
        # the encoders' stored answers: the same classes (protocol 1.4 drops items within
        # 0.05 of a cut, where the one-decimal rounding would decide)
        assert np.array_equal(qs.answer, qs.t.y["answer"])


@pytest.mark.slow
def test_pixel_oracle_reads_the_shown_masks(oracle_runs, pipeline):
    """``oracle:pixels`` measures on the 224 masks; the build kept only the items it answers
    (protocol 1.4), so it is exact on every probe, original and mirrored."""
    assert run_cmd(cli, ["vqa", "--model", "oracle:pixels", "--data", pipeline["shards"], "--out", oracle_runs,
                         "--bootstrap", 10, "--no-circular", "--no-blind"]) == 0
    for probe in LEVEL3_PROBES:
        m = _metrics(oracle_runs, "oracle-pixels", probe)
        assert m["n_items"]["test"] > 0, probe
        assert m["test"]["accuracy"] == 1.0 and m["mirror"]["accuracy"] == 1.0, probe


def test_oracle_needs_its_build(tmp_path):
    from spar_bench.probes.vqa import BackendOptions, load_backend

    with pytest.raises(ConfigError, match="--data"):
        load_backend("oracle", BackendOptions())
    with pytest.raises(ConfigError, match="oracle:pixels"):
        load_backend("oracle:nope", BackendOptions(data=str(tmp_path)))


def test_report_says_which_protocol_each_run_used(oracle_runs, tmp_path):
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(oracle_runs / "oracle" / "level3.size", runs / "oracle" / "level3.size")
    old = runs / "old-model" / "level3.size"
    shutil.copytree(oracle_runs / "oracle" / "level3.size", old)
    mp = old / "vqa-loglik" / "seed0" / "metrics.json"
    m = json.loads(mp.read_text())
    del m["protocol_version"], m["build_protocol_version"]
    m["encoder"] = "old-model"
    mp.write_text(json.dumps(m))
    assert run_cmd(cli, ["report", runs, "--out", tmp_path / "report"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"Protocol (docs/PROTOCOL.md) of these runs: {PROTOCOL_VERSION}, <1.2 (<1.2: runs made before" in md
    assert "| old-model [protocol <1.2] |" in md and "| oracle |" in md


def test_size_prompt_needs_the_builds_thresholds(pipeline, tmp_path, capsys):
    """A build that records no thresholds cannot state them: one line, exit 2."""
    import shutil

    data = tmp_path / "shards"
    shutil.copytree(pipeline["shards"], data)
    man = json.loads((data / "manifest.json").read_text())
    man["thresholds"] = {}
    (data / "manifest.json").write_text(json.dumps(man))
    assert run_cmd(cli, ["vqa", "--model", "oracle", "--data", data, "--out", tmp_path / "runs",
                         "--probe", "size", "--bootstrap", 5]) == 2
    assert "records no size thresholds" in capsys.readouterr().err
