"""Protocol 1.4: every Level 3 question is answerable from its pixels.

The build answers every question again from its slice's stored 224 masks (the pixel reader,
``builder/samples/pixels.py``), stores that answer as ``q_pixel_answer``, drops the questions
where it is not the label, and records the dropped share per probe and per source in the
manifest; ``oracle:pixels`` is then exact on every probe, original and mirrored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.builder.samples.pixels import UNDECIDABLE, answerable, pixel_answers
from spar_bench.builder.schema import LEVEL3_PROBES
from spar_bench.errors import ConfigError
from spar_bench.probes.cli import cli

from helpers import run_cmd

P = {name: i for i, name in enumerate(LEVEL3_PROBES)}


def _slice_rows() -> dict[str, np.ndarray]:
    """One 224 slice: liver (id 1) on the image's left half, spleen (id 2) on its right,
    a 2-pixel and a 4-pixel lesion; 2 mm pixels."""
    label = np.zeros((1, 224, 224), np.uint8)
    label[0, 50:70, 20:60] = 1  # liver: centre x 39.5, y 59.5; 800 px = 3200 mm^2
    label[0, 50:60, 150:170] = 2  # spleen: centre x 159.5; 200 px = 800 mm^2
    lesion = np.zeros((1, 224, 224), np.uint8)
    lesion[0, 100, 100:102] = 1
    lesion[0, 120:122, 120:122] = 1
    return {"label": label, "lesion": lesion, "mm_per_pixel": np.array([2.0], np.float32)}


def _questions(rows: list[tuple[str, int, int, int, int]]) -> dict[str, np.ndarray]:
    """(probe, axis, organ a, organ b, label) rows on slice 0."""
    n = len(rows)
    return {"q_key": np.array([f"q{i}" for i in range(n)], dtype=object), "q_slice": np.zeros(n, np.int32),
            "q_probe": np.array([P[r[0]] for r in rows], np.int8), "q_axis": np.array([r[1] for r in rows], np.int8),
            "q_organ_a": np.array([r[2] for r in rows], np.int8), "q_organ_b": np.array([r[3] for r in rows], np.int8),
            "q_answer": np.array([r[4] for r in rows], np.int8),
            "q_area_a_mm2": np.full(n, np.nan, np.float32), "q_distance_mm": np.full(n, np.nan, np.float32)}


def test_pixel_reader_answers_from_the_masks_and_the_build_keeps_only_agreeing_items():
    liver, spleen, stomach = 0, 1, 4
    q = _questions([
        ("relative_position", 0, spleen, liver, 1),  # spleen has the larger x: patient's left, right
        ("relative_position", 0, liver, spleen, 1),  # wrong label: the pixels say 0
        ("orientation", -1, liver, spleen, 0),  # spleen to the patient's left of the liver: sector 0
        ("symmetry", -1, liver, stomach, 1),  # stomach has no pixel: undecidable
        ("counting", -1, -1, -1, 1),  # the 4-pixel lesion only (at least 3 pixels)
    ])
    q["q_pixel_answer"] = pixel_answers(_slice_rows(), q, None, 0.15, 3)
    assert q["q_pixel_answer"].tolist() == [1, 0, 0, UNDECIDABLE, 1]
    assert answerable(q, None).tolist() == [True, False, True, False, True]
    assert pixel_answers(_slice_rows(), q, None, 0.15, 1)[-1] == 2  # every region counted


def test_size_items_within_rounding_of_a_cut_are_dropped():
    """The MLLM track states the cuts to one decimal: an item whose stored measurement the
    stated cut classes otherwise than the full-precision cut is dropped even if the pixels agree."""
    th = {"size": {"global": {"cuts": [3199.96, 5000.0]}, "groups": {}},
          "distance": {"global": {"cuts": [1.0, 2.0]}, "groups": {}}}
    q = _questions([("size", -1, 0, -1, 1), ("size", -1, 0, -1, 1)])  # labels: medium (>= 3199.96)
    q["q_area_a_mm2"][:] = [3199.98, 3300.0]
    q["q_pixel_answer"] = pixel_answers(_slice_rows(), q, th, 0.15, 3)
    assert q["q_pixel_answer"].tolist() == [1, 1]  # the liver's 800 px x 4 mm^2 >= the stated 3200.0
    # item 0: the pixels agree, but its stored 3199.98 is below the cut as stated (3200.0)
    assert answerable(q, th).tolist() == [False, True]


@pytest.fixture(scope="module")
def random_build(tmp_path_factory) -> Path:
    """A random-layout phantom (lesions on) built with mirrors: the layout where the old
    labels and the pixels disagreed most (issue 37)."""
    root = tmp_path_factory.mktemp("pixels")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 6, "--layout", "random",
                               "--in-plane", 96, "--slices", 16]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "shards",
                               "--levels", "level3", "--counterfactual", "mirror", "--no-hf"]) == 0
    return root / "shards"


def test_manifest_records_the_dropped_share_per_probe_and_source(random_build):
    from spar_bench.builder.shards import Build

    m = json.loads((random_build / "manifest.json").read_text())
    assert m["protocol_version"] == "1.4" and m["sample_config"]["lesion_min_pixels"] == 3
    u = m["unanswerable"]
    assert set(u["per_probe"]) == set(LEVEL3_PROBES) and set(u["per_source"]) == {"phantom"}
    b = Build(random_build)
    stored = {p: 0 for p in LEVEL3_PROBES}
    for split in b.splits("level3"):
        q = b.read("level3", split, ["q_probe", "q_answer", "q_pixel_answer"])
        np.testing.assert_array_equal(q["q_pixel_answer"], q["q_answer"])  # only answerable items kept
        for p, name in enumerate(LEVEL3_PROBES):
            stored[name] += int((q["q_probe"] == p).sum())
    for name, e in u["per_probe"].items():
        assert e == u["per_source"]["phantom"][name]
        assert e["asked"] - e["dropped"] == stored[name] > 0, name  # the shards hold what was kept
        assert e["share"] == pytest.approx(e["dropped"] / e["asked"], abs=1e-6)
    assert u["per_probe"]["counting"]["dropped"] == 0  # counted on the stored mask: never dropped
    assert sum(e["dropped"] for e in u["per_probe"].values()) > 0  # the screen did something here


def test_pixel_oracle_is_exact_on_every_probe_and_the_report_shows_the_share(random_build, tmp_path):
    runs = tmp_path / "runs"
    assert run_cmd(cli, ["vqa", "--model", "oracle:pixels", "--data", random_build, "--out", runs,
                         "--bootstrap", 5, "--no-circular", "--no-blind"]) == 0
    m_all = {}
    for probe in LEVEL3_PROBES:
        mp = next((runs / "oracle-pixels" / f"level3.{probe}").rglob("metrics.json"))
        m = json.loads(mp.read_text())
        assert m["n_items"]["test"] > 0 and m["test"]["accuracy"] == 1.0, probe
        assert m["mirror"]["accuracy"] == 1.0, probe
        m_all[probe] = m["build_unanswerable"]
    assert run_cmd(cli, ["report", runs, "--out", tmp_path / "report"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    u = m_all["orientation"]
    assert "Dropped at build time as not answerable from the image's pixels" in md
    assert f"({u['dropped']} of {u['asked']})" in md


def test_a_build_older_than_1_4_is_refused_for_counting_with_a_rebuild_line(random_build, tmp_path):
    from spar_bench.builder.shards import Build
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import load_questions

    old = tmp_path / "old"
    shutil.copytree(random_build, old)
    mp = old / "manifest.json"
    m = json.loads(mp.read_text())
    del m["sample_config"]["lesion_min_pixels"], m["unanswerable"]
    m["protocol_version"] = "1.3"
    mp.write_text(json.dumps(m))
    with pytest.raises(ConfigError, match=r"protocol 1\.3.*rebuild it with this version"):
        load_questions(Build(old), get_probe("level3.counting"), ["test"])
    assert len(load_questions(Build(old), get_probe("level3.size"), ["test"])) > 0  # other probes: readable


@pytest.mark.slow
def test_word_maps_pixel_oracle_is_exact(word_labels_dir, tmp_path):
    """The 20 real WORD label maps (images synthesized): oracle:pixels is 100 % on every
    organ probe of every split (WORD has no lesion channel: no counting)."""
    from spar_bench.builder.build import BuildConfig, build

    out = tmp_path / "word"
    # every 6th slice (the default: every 2nd) of all 20 maps: the same screen, a third of the slices
    build(BuildConfig(sources=("word",), roots=(str(word_labels_dir),), out=str(out), images="synthesize",
                      fit_thresholds_on="test", hf=False, sample={"levels": ["level3"], "l3_stride": 6}), quiet=True)
    u = json.loads((out / "manifest.json").read_text())["unanswerable"]
    assert set(u["per_probe"]) == set(LEVEL3_PROBES) - {"counting"} and set(u["per_source"]) == {"word"}
    runs = tmp_path / "runs"
    assert run_cmd(cli, ["vqa", "--model", "oracle:pixels", "--data", out, "--out", runs, "--splits", "test",
                         "--bootstrap", 5, "--no-circular", "--no-blind"]) == 0
    for probe in set(LEVEL3_PROBES) - {"counting"}:
        m = json.loads(next((runs / "oracle-pixels" / f"level3.{probe}").rglob("metrics.json")).read_text())
        assert m["n_items"]["test"] > 0 and m["test"]["accuracy"] == 1.0, probe
