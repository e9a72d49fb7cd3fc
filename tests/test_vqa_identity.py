"""What an MLLM run's answers depend on, and where they go (issues 19 and 20).

* the response cache key holds the image's digest: another build's pixels are asked again;
* byte-identical blind prompts are asked once;
* the run folder is named by the options that change answers (splits, guided decoding,
  generation budget, dtype, the server) and a finished run made otherwise is refused;
* the report's headline table holds test-split runs only; a CI over one patient is n/a;
* ``dummy:<letter>``: unknown letters refused, a missing letter answers nothing;
* a damaged response cache is one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from spar_bench.probes.cli import cli
from spar_bench.probes.vqa import dummy

from helpers import run_cmd


def _vqa(*args) -> int:
    return run_cmd(cli, ["vqa", "--bootstrap", 20, *args])


@pytest.fixture()
def asked(monkeypatch):
    """Every request the dummy backend is asked, in order."""
    seen: list = []
    real = dummy.DummyBackend.answer
    monkeypatch.setattr(dummy.DummyBackend, "answer", lambda self, reqs: seen.extend(reqs) or real(self, reqs))
    return seen


@pytest.fixture(scope="module")
def repainted(pipeline):
    """The pipeline's build made again from the same phantom with synthesized pixels: the
    same questions, other images."""
    from spar_bench.builder.cli import cli as build_cli

    out = pipeline["root"] / "shards-synth"
    if not (out / "manifest.json").is_file():
        assert run_cmd(build_cli, ["--source", "phantom", "--root", pipeline["root"] / "ph", "--out", out,
                                   "--samples-per-case", 3, "--counterfactual", "mirror", "--no-hf",
                                   "--levels", "level3", "--images", "synthesize"]) == 0
    return out


def _records(rd: Path) -> list[dict]:
    return [json.loads(x) for x in (rd / "answers.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cache_key_holds_the_image_so_another_builds_pixels_are_asked_again(pipeline, repainted, tmp_path,
                                                                            asked, capsys):
    from spar_bench.builder.shards import Build

    runs = tmp_path / "runs"
    args = ["--model", "dummy", "--out", runs, "--probe", "symmetry"]
    assert _vqa(*args, "--data", pipeline["shards"]) == 0
    rd = runs / "dummy/level3.symmetry/vqa-loglik/seed0"
    first = _records(rd)
    n_first = len(asked)
    assert _vqa(*args, "--data", pipeline["shards"]) == 0 and len(asked) == n_first  # the cache serves a rerun
    # the other build into the same runs folder: the finished run is refused, nothing is asked
    assert _vqa(*args, "--data", repainted) == 2 and len(asked) == n_first
    err = capsys.readouterr().err
    assert "build_fingerprint=" in err and "delete that folder" in err and str(rd) in err
    import shutil

    shutil.rmtree(rd)  # as the error says; the cache (runs/.vqa-cache) stays
    asked.clear()
    assert _vqa(*args, "--data", repainted) == 0
    second = _records(rd)
    images = {r["image_sha256"] for r in second if r["variant"] == "image"}
    assert images.isdisjoint({r["image_sha256"] for r in first})  # every pixel differs somewhere
    # every question shown with its image is asked again; blind prompts (no image) are not
    asked_image = [a for a in asked if a.image is not None]
    n_image = len({(r["key"], tuple(r["order"])) for r in second if r["variant"] == "image"})
    assert len(asked_image) == n_image and not [a for a in asked if a.image is None]
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["build_fingerprint"] == Build(repainted).fingerprint != Build(pipeline["shards"]).fingerprint
    build = Build(repainted)  # the digests recorded are this build's slices
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.ask import image_digest
    from spar_bench.probes.vqa.questions import load_questions

    qs = load_questions(build, get_probe("level3.symmetry"), ["test"])
    row = {str(k): int(r) for k, r in zip(qs.key, qs.row, strict=True)}
    rec = next(r for r in second if r["variant"] == "image")
    (img,) = build.images("level3", "test", np.array([row[rec["key"]]]))
    assert rec["image_sha256"] == image_digest(img)


def test_byte_identical_blind_prompts_are_asked_once(pipeline, tmp_path, asked, capsys):
    runs = tmp_path / "runs"
    assert _vqa("--model", "dummy", "--data", pipeline["shards"], "--out", runs, "--probe",
                "relative_position") == 0
    rd = runs / "dummy/level3.relative_position/vqa-loglik/seed0"
    recs, m = _records(rd), json.loads((rd / "metrics.json").read_text())
    blind = [r for r in recs if r["variant"] == "blind"]
    assert len(asked) == m["requests"]["distinct"] == len(recs) - m["requests"]["deduplicated"]
    assert m["requests"]["deduplicated"] > 0 and m["requests"]["answers"] == len(recs)
    blind_asked = [a for a in asked if a.image is None]
    assert len(blind_asked) == len({a.text for a in blind_asked}) < len(blind)  # each prompt once
    assert f"{m['requests']['deduplicated']} requests saved" in capsys.readouterr().out


def test_identical_blind_prompts_get_one_answer(pipeline, tmp_path):
    """Scored answers of blind questions with one prompt are one answer, whatever the question."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.ask import AskConfig, plan
    from spar_bench.probes.vqa.questions import load_questions

    runs = tmp_path / "runs"
    assert _vqa("--model", "dummy", "--data", pipeline["shards"], "--out", runs, "--probe", "size",
                "--no-circular") == 0
    qs = load_questions(Build(pipeline["shards"]), get_probe("level3.size"), ["test"])
    text = {str(qs.key[it.q]): it.prompt.text for it in plan(qs, AskConfig(circular=False)) if it.variant == "blind"}
    answers: dict[str, set] = {}
    for r in _records(runs / "dummy/level3.size/vqa-loglik/seed0"):
        if r["variant"] == "blind":
            answers.setdefault(text[r["key"]], set()).add(r["choice"])
    assert all(len(v) == 1 for v in answers.values()) and len(answers) < len(text)


def test_options_that_change_answers_name_the_folder(pipeline, tmp_path, asked, capsys):
    runs = tmp_path / "runs"
    base = ["--model", "dummy", "--data", pipeline["shards"], "--out", runs, "--probe", "symmetry"]
    assert _vqa(*base) == 0
    test_run = runs / "dummy/level3.symmetry/vqa-loglik/seed0"
    before = (test_run / "metrics.json").read_bytes()
    assert _vqa(*base, "--splits", "val") == 0  # beside the test run, never over it
    val_run = runs / "dummy/level3.symmetry/vqa-loglik,splits=val/seed0"
    assert json.loads((val_run / "metrics.json").read_text())["splits"] == ["val"]
    assert (test_run / "metrics.json").read_bytes() == before
    assert _vqa(*base, "--splits", "val,test") == 0
    assert (runs / "dummy/level3.symmetry/vqa-loglik,splits=val+test/seed0/metrics.json").is_file()
    # the report: the headline table holds the test run only; the others are labelled by split
    out = tmp_path / "report"
    assert run_cmd(cli, ["report", runs, "--out", out]) == 0
    md = (out / "report.md").read_text()
    headline, other = md.split("## level3.symmetry")[1].split("### Every metric")[0].split("### Runs on other splits")
    assert "| vqa-loglik |" in headline and "splits=" not in headline
    assert "| vqa-loglik [splits=val] |" in other and "| vqa-loglik [splits=val+test] |" in other
    metrics = md.split("### Every metric, every evaluation")[1]
    assert "| vqa-loglik [splits=val] | val |" in metrics and "| vqa-loglik [splits=val] | test |" not in metrics
    # a finished run made with other answer-changing options is refused in one line, nothing asked
    n = len(asked)
    capsys.readouterr()
    assert _vqa(*base, "--no-blind") == 2 and len(asked) == n
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blind=True (now False)" in err[0] and str(test_run) in err[0]
    assert (test_run / "metrics.json").read_bytes() == before
    assert _vqa(*base) == 0 and (test_run / "metrics.json").read_bytes() == before  # same run: rescored


def test_server_guided_variant_tokens_and_dtype_name_the_folder():
    from spar_bench.probes.vqa.ask import AskConfig, head_name, variant_of
    from spar_bench.probes.vqa.base import BackendOptions
    from spar_bench.probes.vqa.predictor import MllmSpec

    cfg = AskConfig()

    def run_dir(options: BackendOptions, probe: str, out: str, cfg: AskConfig) -> Path:  # as its spec names it
        spec = MllmSpec("openai:m", "", probe, cfg, options)
        return spec.run_dir(out, spec.backend().name)

    def folder(**kw) -> str:
        kw.setdefault("base_url", "http://127.0.0.1:8000/v1")
        rd = run_dir(BackendOptions(**kw), "level3.size", "runs", cfg)
        return "/".join(rd.parts[-4:])

    one, two = folder(), folder(base_url="http://10.0.0.2:8000/v1")
    assert one != two and one.split("/")[0].startswith("openai-m-")  # two servers: two runs
    assert folder(base_url="http://127.0.0.1:8000/v1/") == one  # the same server
    guided = {folder(guided=g) for g in ("none", "guided_choice", "structured_outputs")}
    assert len(guided) == 3 and any("vqa-guided,guided=structured_outputs" in g for g in guided)
    assert "max_new_tokens=8" in folder(max_new_tokens=8) and folder(max_new_tokens=64) == one
    hf_like = SimpleNamespace(name="hf-x", mode="constrained", decoding={"mode": "constrained", "dtype": "bfloat16"})
    named = lambda c: f"{head_name(hf_like, c)},{variant_of(hf_like, c)}"  # noqa: E731 (what the spec names)
    assert named(cfg) == "vqa-loglik,dtype=bfloat16"
    assert named(AskConfig(splits=("val",))) == "vqa-loglik,dtype=bfloat16,splits=val"


def test_dummy_letters(pipeline, tmp_path, capsys):
    from spar_bench.errors import ConfigError

    with pytest.raises(ConfigError, match="A..H"):
        dummy.DummyBackend("Z")
    assert _vqa("--model", "dummy:Z", "--data", pipeline["shards"], "--out", tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dummy:Z" in err and "A..H" in err
    runs = tmp_path / "runs"
    for probe in ("relative_position", "symmetry"):
        assert _vqa("--model", "dummy:C", "--data", pipeline["shards"], "--out", runs, "--probe", probe) == 0
    two = json.loads((runs / "dummy-C/level3.relative_position/vqa-loglik/seed0/metrics.json").read_text())
    three = json.loads((runs / "dummy-C/level3.symmetry/vqa-loglik/seed0/metrics.json").read_text())
    assert two["controls"]["parse_rate"] == 0.0 and two["test"]["accuracy"] == 0.0  # no option C: never a silent A
    assert three["controls"]["parse_rate"] == 1.0 and three["controls"]["position_rate"] == [0.0, 0.0, 1.0]
    recs = _records(runs / "dummy-C/level3.relative_position/vqa-loglik/seed0")
    assert {(r["text"], r["choice"], r["parsed"]) for r in recs} == {("C", None, False)}
    gen = dummy.DummyBackend("C", mode="generate")
    from spar_bench.probes.vqa.base import Request

    (rep,) = gen.answer([Request("k", "q", ("A", "B"), ("no", "yes"))])
    assert rep.text == "The correct answer is (C)."


def test_confidence_interval_over_one_patient_is_n_a(tmp_path):
    from spar_bench.probes.runs.evaluate import score
    from spar_bench.probes.runs.report import aggregate, collect, render_markdown
    from spar_bench.probes.targets import Targets
    from spar_bench.probes.tasks import get_probe

    y, pred = np.array([0, 1, 1, 0]), np.array([0, 1, 0, -1])  # -1: an unparsed answer, a miss

    def items(patients):
        fields = {"answer": y, "organ_a": np.zeros(4, np.int64), "organ_b": np.ones(4, np.int64),
                  "axis": np.zeros(4, np.int64)}
        return Targets(get_probe("level3.relative_position"), "test", np.arange(4), np.array(patients),
                       np.zeros(4, bool), fields)

    one = score(items(["p"] * 4), pred, np.random.default_rng(0), 50, min_patients=2)  # as an MLLM run scores
    assert score(items(["p"] * 4), pred, np.random.default_rng(0), 50)["ci"] is not None  # a head's layout
    assert one["accuracy"] == 0.5 and one["ci"] is None
    two = score(items(["p", "p", "q", "q"]), pred, np.random.default_rng(0), 50, min_patients=2)
    assert len(two["ci"]["accuracy"]) == 2
    d = tmp_path / "runs" / "dummy" / "level3.relative_position" / "vqa-loglik" / "seed0"
    d.mkdir(parents=True)
    m = {"probe": "level3.relative_position", "head": "vqa-loglik", "seed": 0, "encoder": "dummy",
         "random_init": True, "track": "vqa", "splits": ["test"], "test": one, "controls": {"chance": 0.5}}
    (d / "metrics.json").write_text(json.dumps(m))
    md = render_markdown(aggregate(collect(tmp_path / "runs")), True)
    row = next(ln for ln in md.splitlines() if ln.startswith("| dummy"))
    assert "| 50.0 | n/a |" in row and "50.0, 50.0" not in md


def test_report_reads_an_older_mllm_runs_own_controls_at_the_top_level(tmp_path):
    """Runs written before the MLLM's own controls moved into ``controls`` (issue 34) still show them."""
    from spar_bench.probes.runs.report import aggregate, collect, render_markdown

    rows = {}
    for name, where in (("old", "top"), ("new", "controls")):
        own = {"parse_rate": 0.5, "circular": {"strict": 0.25, "mean": 0.375}, "unparsed": {"test": {"hedged": 2}}}
        m = {"probe": "level3.relative_position", "head": "vqa-generate", "seed": 0, "encoder": f"m-{name}",
             "random_init": False, "track": "vqa", "splits": ["test"], "test": {"accuracy": 0.5, "n": 4},
             "controls": {"chance": 0.5, **(own if where == "controls" else {})}, **(own if where == "top" else {})}
        d = tmp_path / "runs" / f"m-{name}" / "level3.relative_position" / "vqa-generate" / "seed0"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps(m))
    md = render_markdown(aggregate(collect(tmp_path / "runs")), True)
    for name in ("old", "new"):
        rows[name] = next(ln for ln in md.splitlines() if ln.startswith(f"| m-{name}"))
    assert rows["old"].replace("m-old", "m-new") == rows["new"]
    assert "| 50.0 | 25.0 | 37.5 | hedged 2 |" in rows["new"]  # parse, circular (all rot., mean), unparsed


def test_damaged_response_cache_is_one_line(pipeline, tmp_path, capsys):
    from spar_bench.errors import ConfigError
    from spar_bench.probes.vqa.cache import ResponseCache

    cache = tmp_path / "c.sqlite"
    args = ["--model", "dummy", "--data", pipeline["shards"], "--out", tmp_path / "runs", "--probe",
            "orientation", "--cache", cache]
    assert _vqa(*args) == 0
    raw = bytearray(cache.read_bytes())
    assert len(raw) > 3 * 4096
    for off in range(2 * 4096, len(raw), 4096):  # every page after the first two: garbage
        raw[off:off + 64] = b"\xff" * 64
    cache.write_bytes(bytes(raw))
    capsys.readouterr()
    assert _vqa(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(cache) in err and "delete" in err and "Traceback" not in err
    # damage found at a lookup (after the check at open) is the same one line
    with ResponseCache(tmp_path / "d.sqlite") as c:
        c.put_many([({"k": i, "pad": "x" * 200}, {"text": "A" * 300}) for i in range(200)])
    c = ResponseCache(tmp_path / "d.sqlite")
    raw = bytearray((tmp_path / "d.sqlite").read_bytes())
    for off in range(2 * 4096, len(raw), 4096):
        raw[off:off + 100] = b"\xff" * 100
    raw[24:28] = (int.from_bytes(raw[24:28], "big") + 1).to_bytes(4, "big")  # file change counter
    (tmp_path / "d.sqlite").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="damaged.*delete the file"):
        c.get({"k": 5, "pad": "x" * 200})
    c.close()
