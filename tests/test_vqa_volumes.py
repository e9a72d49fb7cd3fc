"""Level 4 (volumes) in the MLLM track: ``spar-probe vqa --volume-as video|montage|views``.

A small phantom build with Level 4 only (16^3 cubes, ``--counterfactual mirror+flip``) is
asked by the mask oracle (100 % on originals, mirrored and flipped copies, under every option
rotation, whatever the volume is shown as) and by the dummy (deterministic); the pure
functions that turn a volume into what is sent are checked for order and orientation; a
tiny random Qwen2-VL saved here (nothing downloaded) takes the video path of ``hf:``; the
``openai:`` backend sends a video as one image part per frame to a 127.0.0.1 stub.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.schema import LEVEL4_PROBES
from spar_bench.probes.cli import cli
from spar_bench.probes.vqa.prompts import VolumeContext, render_volume
from spar_bench.probes.vqa.volume import (
    GAP,
    frame_indices,
    grid_shape,
    montage,
    show,
    view_slices,
    views,
)

from helpers import run_cmd, running_stub

PROBES = ",".join(f"level4.{p}" for p in LEVEL4_PROBES)
SPLITS = "val,test"  # the phantom's test split has no containment question; val has


@pytest.fixture(scope="module")
def build4(tmp_path_factory) -> Path:
    from spar_bench.builder.cli import cli as build_cli

    root = tmp_path_factory.mktemp("vqa4")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 6, "--layout", "canonical", "--in-plane", 64,
                               "--slices", 24]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "shards",
                               "--levels", "level4", "--volume-size", 16, "--counterfactual", "mirror+flip",
                               "--no-hf"]) == 0  # fmt: skip
    return root / "shards"


def _vqa(*args) -> int:
    return run_cmd(cli, ["vqa", "--bootstrap", 10, *args])


def _run(runs: Path, model: str, probe: str, head: str) -> Path:
    return runs / model / f"level4.{probe}" / f"{head},splits=val+test" / "seed0"


# -- what is sent ------------------------------------------------------------------------
def _marked(side: int = 32) -> np.ndarray:
    """A cube with one bright voxel block superior (high z), anterior (low row), patient-left (high col)."""
    v = np.zeros((side,) * 3, np.uint8)
    v[-6:, 2:6, -6:-2] = 255
    return v


def test_frames_run_inferior_to_superior_and_views_are_display_oriented():
    assert frame_indices(128).tolist() == list(range(4, 128, 8))  # 16 slab centres, 8 voxels apart
    assert frame_indices(8).tolist() == list(range(8)) and grid_shape(16) == (4, 4) and grid_shape(8) == (3, 3)
    v = _marked()
    frames = show(v, "video", 32).frames
    lit = [int(np.asarray(f).max() > 0) for f in frames]
    assert len(frames) == 16 and lit == [0] * 13 + [1] * 3  # the superior block: the last frames
    axial, coronal, sagittal = view_slices(v)
    assert axial.shape == coronal.shape == sagittal.shape == (32, 32)
    v2 = v.copy()
    v2[14:18, 2:6, -6:-2] = 255  # the same block at the centre slice of z
    a2, _, _ = view_slices(v2)
    rows, cols = np.nonzero(a2)
    assert rows.mean() < 16 and cols.mean() > 16  # axial: anterior up, patient's left on the right
    v3 = v.copy()
    v3[-6:-2, 14:18, -6:-2] = 255  # at the centre row: coronal shows it
    _, c3, _ = view_slices(v3)
    rows, cols = np.nonzero(c3)
    assert rows.mean() < 16 and cols.mean() > 16  # coronal: superior up, patient's left on the right
    v4 = v.copy()
    v4[-6:-2, 2:6, 14:18] = 255  # at the centre col: sagittal shows it
    _, _, s4 = view_slices(v4)
    rows, cols = np.nonzero(s4)
    assert rows.mean() < 16 and cols.mean() < 16  # sagittal: superior up, anterior on the left
    m = montage(v, 20)
    assert m.size == (4 * 20 + 3 * GAP, 4 * 20 + 3 * GAP)
    assert np.asarray(m)[-20:, -20:].max() > 0 and np.asarray(m)[:20, :20].max() == 0  # last cell: superior
    assert views(v, 20).size == (3 * 20 + 2 * GAP, 20)
    assert np.array_equal(np.asarray(montage(v, 20)), np.asarray(montage(v.copy(), 20)))  # pure
    with pytest.raises(ValueError):
        show(np.zeros((4, 5, 5), np.uint8), "montage", 8)


def test_prompts_state_how_the_volume_is_shown_and_blind_shows_nothing():
    ctx = {va: VolumeContext(va, 224, 128, 2.0, 0.15, 3.0, 3) for va in ("video", "montage", "views")}
    video = render_volume("relative_position", (0, 1, -1), 2, (0, 1), context=ctx["video"]).text
    assert "16 axial slices, one per frame" in video and "most inferior" in video and "16.0 mm apart" in video
    assert "superior to" in video and "patient's left is on the right side of the image" in video
    mont = render_volume("relative_position", (0, 1, -1), 0, (1, 0), context=ctx["montage"])
    assert "4 rows of 4" in mont.text and "top left" in mont.text and mont.options == ("yes", "no")
    assert "sagittal slice has anterior on the left" in render_volume(
        "volume", (0, 1, -1), -1, (0, 1), context=ctx["views"]).text
    dist = render_volume("distance", (0, 1, 2), -1, (1, 0), context=ctx["video"])
    assert dist.options == ("the left kidney", "the spleen") and dist.version == "level4.distance@1"
    assert "at most 3 mm" in render_volume("adjacency", (0, 1, -1), -1, (0, 1), context=ctx["views"]).text
    blind = render_volume("counting", (-1, -1, -1), -1, (0, 1, 2, 3), blind=True, context=ctx["video"]).text
    assert "No image is shown" in blind and "frame" not in blind and "fewer than 3 voxels" in blind
    nohint = render_volume("volume", (0, 1, -1), -1, (0, 1), hint=False, context=ctx["montage"]).text
    assert "radiological" not in nohint and "4 rows of 4" in nohint


# -- end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle_runs(build4, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("oracle4") / "runs"
    for va in ("video", "montage", "views"):
        assert _vqa("--model", "oracle", "--data", build4, "--out", runs, "--probe", PROBES,
                    "--splits", SPLITS, "--volume-as", va, "--image-size", 32) == 0
    return runs


@pytest.mark.slow
def test_oracle_scores_100_on_originals_mirrored_and_flipped(oracle_runs):
    for va in ("video", "montage", "views"):
        for p in LEVEL4_PROBES:
            m = json.loads((_run(oracle_runs, "oracle", p, f"vqa-loglik-32px-{va}") / "metrics.json").read_text())
            assert m["n_items"]["test"] > 0 and m["flipped"]["n"] > 0 and m["mirror"]["n"] > 0, (va, p)
            assert m["test"]["accuracy"] == m["mirror"]["accuracy"] == m["flipped"]["accuracy"] == 1.0, (va, p)
            assert m["controls"]["circular"]["strict"] == 1.0 and m["template_version"] == f"level4.{p}@1"
            assert m["controls"]["blind"]["accuracy"] == 0.0 and "blind_flipped" in m["controls"]


def test_answers_record_volume_as_and_the_cache_keys_it(oracle_runs):
    rd = _run(oracle_runs, "oracle", "relative_position", "vqa-loglik-32px-video")
    recs = [json.loads(x) for x in (rd / "answers.jsonl").read_text().splitlines()]
    image = [r for r in recs if r["variant"] == "image"]
    assert {r["volume_as"] for r in image} == {"video"} and {r["volume_as"] for r in recs if r not in image} == {None}
    assert {r["flipped"] for r in recs} == {True, False} and all(len(r["image_sha256"]) == 64 for r in image)
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["options"]["volume_as"] == "video" and cfg["options"]["image_size"] == 32
    from spar_bench.probes.vqa.cache import ResponseCache

    with ResponseCache(oracle_runs / ".vqa-cache" / "oracle.sqlite") as c:
        keys = [json.loads(k) for (k,) in c._db.execute("SELECT key FROM replies")]
    shown = {k["image"]["volume_as"] for k in keys if k["image"]}
    assert shown == {"video", "montage", "views"}  # one volume, three ways shown: three answers
    assert all(k["image"]["sha256"] for k in keys if k["image"])


def test_dummy_is_deterministic_and_auto_is_montage(build4, tmp_path):
    outs = []
    for name in ("a", "b"):
        assert _vqa("--model", "dummy", "--data", build4, "--out", tmp_path / name, "--probe", "level4.volume",
                    "--splits", SPLITS, "--image-size", 24) == 0
        outs.append((_run(tmp_path / name, "dummy", "volume", "vqa-loglik-24px-montage") / "answers.jsonl").read_bytes())
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_one_line_errors(build4, tmp_path, capsys):
    assert _vqa("--model", "dummy", "--data", build4, "--out", tmp_path, "--volume-as", "movie") == 2
    err = capsys.readouterr().err
    assert "--volume-as movie" in err and len(err.strip().splitlines()) == 1
    from spar_bench.builder.synthetic import write_synthetic_build

    flat = write_synthetic_build(tmp_path / "flat", 8)  # Levels 1-3 only
    assert _vqa("--model", "dummy", "--data", flat, "--out", tmp_path, "--probe", "level4.volume") == 2
    err = capsys.readouterr().err
    assert "has no level4" in err and len(err.strip().splitlines()) == 1
    from spar_bench.probes.cli.vqa import parse_question_probes

    assert parse_question_probes("adjacency,distance,level4.distance") == [  # short: Level 3 first
        "level4.adjacency", "level3.distance", "level4.distance"]


# -- backends ----------------------------------------------------------------------------
def test_hf_video_path_with_a_tiny_qwen2_vl(build4, tmp_path, capsys):
    pytest.importorskip("transformers")
    from spar_bench.probes.vqa.tiny import make_tiny_llava, make_tiny_qwen2_vl

    qwen = make_tiny_qwen2_vl(tmp_path / "qwen", seed=0)
    runs = tmp_path / "runs"
    assert _vqa("--model", f"hf:{qwen}", "--data", build4, "--out", runs, "--probe", "level4.symmetry",
                "--splits", SPLITS, "--no-circular", "--image-size", 56,
                "--compute", "fp32") == 0  # volume-as auto: the processor takes video; fp32 names no dtype
    (model,) = [p.name for p in runs.iterdir() if p.name.startswith("hf-")]
    m = json.loads((_run(runs, model, "symmetry", "vqa-loglik-56px-video") / "metrics.json").read_text())
    assert m["controls"]["parse_rate"] == 1.0 and m["test"]["n"] > 0 and m["flipped"]["n"] > 0
    from spar_bench.probes.vqa import BackendOptions, load_backend
    from spar_bench.probes.vqa.base import Request

    be = load_backend(f"hf:{qwen}", BackendOptions())
    p = render_volume("volume", (0, 1, -1), -1, (0, 1), context=VolumeContext("video", 56, 16, 2.0))
    frames = show(_marked(16), "video", 56).frames
    req = Request("k", p.text, p.letters, p.options, frames=frames)
    enc = be.encode([be.prompt_text(req)], [req], "right")
    assert "pixel_values_videos" in enc and "pixel_values" not in enc
    assert enc["video_grid_thw"].tolist() == [[8, 4, 4]]  # 16 frames, 2 per temporal patch
    assert be.answer([req])[0].choice in (0, 1)
    llava = make_tiny_llava(tmp_path / "llava", seed=0)
    capsys.readouterr()
    assert _vqa("--model", f"hf:{llava}", "--data", build4, "--out", runs, "--probe", "level4.symmetry",
                "--splits", SPLITS, "--no-circular", "--volume-as", "video") == 2
    err = capsys.readouterr().err  # (transformers' loading bars before it)
    assert "takes no video" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_openai_sends_a_video_as_one_image_per_frame():
    from spar_bench.probes.vqa.base import BackendOptions, Request
    from spar_bench.probes.vqa.openai import OpenAIBackend

    p = render_volume("volume", (0, 1, -1), -1, (0, 1), context=VolumeContext("video", 32, 16, 2.0))
    shown = {va: show(_marked(16), va, 32) for va in ("video", "montage", "views")}
    with running_stub() as srv:
        be = OpenAIBackend("tiny-vlm", BackendOptions(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1",
                                                      timeout=2.0, retries=0, concurrency=1))
        for va in ("video", "montage", "views"):
            (rep,) = be.answer([Request(va, p.text, p.letters, p.options, shown[va].image, shown[va].frames)])
            assert rep.text == "The correct answer is (B)."
        parts = [[c["type"] for c in s["body"]["messages"][0]["content"]] for s in srv.seen]
    assert parts[0] == ["image_url"] * 16 + ["text"]  # frames in order, then the prompt
    assert parts[1] == parts[2] == ["image_url", "text"]
