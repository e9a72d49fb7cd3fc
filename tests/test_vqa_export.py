"""``spar-build export`` (VLMEvalKit TSV, lmms-eval tasks) and ``spar-probe vqa --answers``.

On the shared phantom pipeline (conftest.py ``pipeline``): the TSV has VLMEvalKit's
``CustomMCQDataset`` columns and the prompts ``vqa`` asks, its images decode to the build's
stored slices; the ``dummy`` model's answers written as a VLMEvalKit prediction file (and as
lmms-eval ``--log_samples``) score back through ``--answers`` to exactly the metrics of
``spar-probe vqa --model dummy --generate``; a wrong file is refused in one line.
"""

from __future__ import annotations

import base64
import csv
import importlib.util
import io
import json
import string
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.probes.cli import cli as probe_cli

from helpers import run_cmd

PROBE = "level3.symmetry"
#: VLMEvalKit's CustomMCQDataset / ImageMCQDataset columns (docs: "Custom MCQ benchmark")
VLMEVALKIT_COLUMNS = ("index", "image", "question", "answer", "category")

csv.field_size_limit(1 << 30)


def _read_tsv(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _exported_rows(vk: Path) -> list[dict]:
    """Every exported row in index order: ``<probe>.tsv`` (with an image) and
    ``<probe>.blind.tsv`` (no image column; ``image`` is "" here)."""
    rows = _read_tsv(vk / f"{PROBE}.tsv") + [{"image": "", **r} for r in _read_tsv(vk / f"{PROBE}.blind.tsv")]
    return sorted(rows, key=lambda r: int(r["index"]))


def _write_table(rows: list[dict], path: Path) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]), delimiter="\t", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path


def _letters(row: dict) -> list[str]:
    return [c for c in row if len(c) == 1 and c in string.ascii_uppercase]


def _dummy_predictions(rows: list[dict]) -> list[dict]:
    """The prediction file VLMEvalKit would write for the ``dummy`` model (generate mode):
    every exported column but the image, plus ``prediction``."""
    from PIL import Image

    from spar_bench.probes.vqa.base import Request
    from spar_bench.probes.vqa.dummy import DummyBackend

    d = DummyBackend(mode="generate", seed=0)
    out = []
    for r in rows:
        img = Image.open(io.BytesIO(base64.b64decode(r["image"]))) if r["image"] else None
        letters = _letters(r)
        req = Request(r["spar_key"], r["question"], tuple(letters), tuple(r[c] for c in letters), img)
        out.append({**{k: v for k, v in r.items() if k != "image"}, "prediction": d.answer([req])[0].text})
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory, pipeline):
    root = tmp_path_factory.mktemp("export")
    vk, lm = root / "vk", root / "lm"
    assert run_cmd(build_cli, ["export", pipeline["shards"], "--format", "vlmevalkit", "--out", vk, "--probe", PROBE]) == 0
    assert run_cmd(build_cli, ["export", pipeline["shards"], "--format", "lmms-eval", "--out", lm, "--probe", PROBE]) == 0
    runs = root / "runs"
    assert run_cmd(probe_cli, ["vqa", "--model", "dummy", "--generate", "--data", pipeline["shards"], "--probe", PROBE,
                               "--out", runs, "--bootstrap", 30]) == 0
    rows = _exported_rows(vk)
    return {**pipeline, "root": root, "vk": vk, "lm": lm, "runs": runs, "rows": rows, "preds": _dummy_predictions(rows)}


def _metrics(run: Path) -> dict:
    """metrics.json of a run folder (``.../seed0``) or of its head folder's seed 0."""
    return json.loads(((run if run.name == "seed0" else run / "seed0") / "metrics.json").read_text())


def _scores(m: dict) -> dict:
    """What a run scores (everything but who answered)."""
    return {k: m[k] for k in ("test", "circular", "parse_rate", "controls", "mirror") if k in m}


def _answers(env, path: Path, out: Path | None = None, probe: bool = True, extra: list | None = None) -> int:
    return run_cmd(probe_cli, ["vqa", "--answers", path, "--data", env["shards"], *(["--probe", PROBE] * probe),
                               "--out", out or env["root"] / "runs", "--bootstrap", 30, *(extra or [])])


def _run_dir(env, name: str, out: Path | None = None) -> Path:
    return (out or env["root"] / "runs") / f"answers-{name}" / PROBE / "vqa-generate" / "seed0"


def test_tsv_has_vlmevalkit_columns_and_vqa_prompts(env):
    from spar_bench.builder.shards import Build
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.ask import AskConfig, plan
    from spar_bench.probes.vqa.questions import load_questions

    rows = env["rows"]
    head = list(_read_tsv(env["vk"] / f"{PROBE}.tsv")[0])
    assert head[:3] == ["index", "image", "question"] and set(VLMEVALKIT_COLUMNS) <= set(head)
    assert list(_read_tsv(env["vk"] / f"{PROBE}.blind.tsv")[0]) == [c for c in head if c != "image"]
    n = get_probe(PROBE).n_classes
    assert _letters(rows[0]) == list(string.ascii_uppercase[:n])
    assert [int(r["index"]) for r in rows] == list(range(len(rows)))
    qs = load_questions(Build(env["shards"]), get_probe(PROBE), ["test"])
    items = plan(qs, AskConfig())
    assert len(rows) == len(items)
    for r, it in zip(rows, items, strict=True):  # the prompt, option order and truth vqa asks
        assert r["question"] == it.prompt.text and r["spar_key"] == str(qs.key[it.q])
        assert tuple(r[c] for c in _letters(r)) == it.prompt.options
        assert r["answer"] == it.prompt.letters[it.prompt.order.index(int(qs.answer[it.q]))]
        assert (r["image"] == "") == (it.variant == "blind")
    cats = {r["category"] for r in rows}
    assert {"plain", "blind", "mirror", "mirror-blind"} | {f"circular-{k}" for k in range(1, n)} == cats
    meta = json.loads((env["vk"] / f"{PROBE}.json").read_text())
    assert meta["build_fingerprint"] == Build(env["shards"]).fingerprint
    assert meta["protocol"]["protocol_version"] and meta["rows"] == len(rows)
    assert sorted(meta["files"]) == [f"{PROBE}.blind.tsv", f"{PROBE}.tsv"]
    assert str(env["root"]) not in json.dumps(meta)  # no local path


def test_tsv_images_decode_to_the_stored_slices(env):
    from PIL import Image

    from spar_bench.builder.shards import Build

    build = Build(env["shards"])
    lookup = {}
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.questions import load_questions

    qs = load_questions(build, get_probe(PROBE), ["test"])
    for i in range(len(qs)):
        lookup[str(qs.key[i])] = (str(qs.split[i]), int(qs.row[i]))
    checked = 0
    for r in env["rows"][:40]:
        if not r["image"]:
            continue
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(r["image"]))))
        split, row = lookup[r["spar_key"]]
        stored = build.images("level3", split, np.array([row]))[0]
        assert img.shape == (*stored.shape, 3) and all(np.array_equal(img[..., c], stored) for c in range(3))
        checked += 1
    assert checked > 10


# VLMEvalKit's loading rule, reproduced (no vlmeval package here; read at open-compass/VLMEvalKit
# e8e78f0): ``build_dataset`` (vlmeval/dataset/__init__.py) builds an unregistered TSV with
# ``A`` and ``B`` as ``CustomMCQDataset`` when it has an ``image`` or ``image_path`` column, else
# as ``CustomTextMCQDataset``; ``load`` (vlmeval/smp/file.py) reads a TSV with
# ``pd.read_csv(f, sep='\t')``; ``ImageBaseDataset.__init__`` (vlmeval/dataset/image_base.py)
# keeps ``data[~pd.isna(data['image'])]`` (``skip_noimg=True``, the default);
# ``TextBaseDataset.__init__`` (text_base.py) keeps every row.
def _vlmevalkit_dataset(tsv: Path):
    """``(class name, rows kept)`` of ``tsv`` as VLMEvalKit's ``build_dataset`` loads it."""
    pd = pytest.importorskip("pandas")
    data = pd.read_csv(tsv, sep="\t")
    if "A" in data and "B" in data and ("image" in data or "image_path" in data):
        return "CustomMCQDataset", data[~pd.isna(data["image"])] if "image" in data else data
    assert "A" in data and "B" in data
    return "CustomTextMCQDataset", data


def _vlmevalkit_predictions(env, tsv: Path, path: Path) -> Path:
    """The prediction file VLMEvalKit writes for the dataset of ``tsv``: the rows its dataset
    class kept, the image column dropped, ``prediction`` added, saved with ``to_excel``."""
    pytest.importorskip("openpyxl")
    _, data = _vlmevalkit_dataset(tsv)
    by_index = {int(r["index"]): r["prediction"] for r in env["preds"]}
    data = data.drop(columns=[c for c in ("image",) if c in data])
    data["prediction"] = [by_index[int(i)] for i in data["index"]]
    data.to_excel(path, index=False)
    return path


def test_vlmevalkit_keeps_every_exported_row(env, tmp_path):
    """Under VLMEvalKit's loading rule every exported row survives: the image rows as a custom
    MCQ dataset, the blind rows (no image column) as a custom text MCQ dataset. The former
    layout (one TSV, blind rows with an empty image) loses every blind row."""
    kind, kept = _vlmevalkit_dataset(env["vk"] / f"{PROBE}.tsv")
    assert kind == "CustomMCQDataset" and len(kept) == sum(r["image"] != "" for r in env["rows"])
    kind, kept = _vlmevalkit_dataset(env["vk"] / f"{PROBE}.blind.tsv")
    assert kind == "CustomTextMCQDataset" and len(kept) == sum(r["image"] == "" for r in env["rows"])
    assert set(kept["category"]) == {"blind", "mirror-blind"}
    old = _write_table([{k: r[k] for k in r if not k.startswith("spar_")} for r in env["rows"]], tmp_path / "one.tsv")
    _, kept = _vlmevalkit_dataset(old)
    assert "blind" not in set(kept["category"]) and len(kept) < len(env["rows"])


@pytest.mark.parametrize("suffix", [".tsv", ".xlsx"])
def test_vlmevalkit_answers_score_as_vqa(env, suffix):
    name = f"dummy_vk_{suffix[1:]}"
    path = env["root"] / f"{name}{suffix}"
    if suffix == ".xlsx":  # VLMEvalKit's two datasets, two prediction files, read back together
        _vlmevalkit_predictions(env, env["vk"] / f"{PROBE}.tsv", path)
        blind = _vlmevalkit_predictions(env, env["vk"] / f"{PROBE}.blind.tsv", env["root"] / f"{name}_blind.xlsx")
        assert _answers(env, path, extra=["--answers", blind]) == 0
    else:
        _write_table(env["preds"], path)
        assert _answers(env, path) == 0
    got = _metrics(_run_dir(env, name))
    want = _metrics(env["runs"] / "dummy" / PROBE / "vqa-generate")
    assert _scores(got) == _scores(want)
    assert got["controls"]["circular"] and got["controls"]["blind"] and got["mirror"]
    assert "missing" not in got["requests"] and "not_measured" not in got
    assert got["controls"]["blind"]["accuracy"] == want["controls"]["blind"]["accuracy"]


def test_blind_rows_dropped_are_refused_not_zero(env, capsys):
    """VLMEvalKit's answers to the image TSV alone have no blind answer: refused in one line
    (exit 2); ``--accept-missing`` scores it with blind "not measured", never 0 %."""
    path = _vlmevalkit_predictions(env, env["vk"] / f"{PROBE}.tsv", env["root"] / "noblind.xlsx")
    out = env["root"] / "runs-noblind"
    assert _answers(env, path, out) == 2
    err = capsys.readouterr().err.strip().split("\r")[-1].strip()  # after the progress bar
    assert err.startswith("error: --answers") and "every blind answer is missing" in err and "\n" not in err
    assert not (_run_dir(env, "noblind", out) / "metrics.json").exists()
    assert _answers(env, path, out, extra=["--accept-missing"]) == 0
    captured = capsys.readouterr()
    assert "blind=not measured" in captured.out and "blind=0.0%" not in captured.out
    m = _metrics(_run_dir(env, "noblind", out))
    assert m["controls"]["blind"] == {"not_measured": m["not_measured"]["blind"]}
    assert set(m["not_measured"]) == {"blind", "blind_mirror"}
    assert m["test"]["accuracy"] == _metrics(env["runs"] / "dummy" / PROBE / "vqa-generate")["test"]["accuracy"]
    assert '"prompt": "harness' in (_run_dir(env, "noblind", out) / "config.json").read_text()
    _reports_say_not_measured(out, env["root"] / "reports-noblind")


def _reports_say_not_measured(runs: Path, where: Path) -> None:
    """report.md, experiment.md and report.html print the blind baseline as not measured (and
    the answers as asked with the harness prompt), never as 0.0."""
    import re

    from spar_bench.experiments.report import write_experiment_report
    from spar_bench.probes.runs.report import write_report

    md = write_report(runs, where / "probe").read_text(encoding="utf-8")
    row = next(line for line in md.splitlines() if line.startswith("| answers-noblind"))
    cols = [c.strip() for c in md.splitlines()[md.splitlines().index(row) - 2].split("|")]
    cells = [c.strip() for c in row.split("|")]
    assert cells[cols.index("blind")] == "not measured" and "(harness prompt)" in row
    write_experiment_report(runs, where / "exp", title="t")
    exp = (where / "exp" / "experiment.md").read_text(encoding="utf-8")
    assert re.search(r"\| blind \(no image\) (\| *)+\| not measured \|", exp)  # the MLLM table's blind row
    assert re.search(r"\| \d+\.\d( \+- [\d.]+)? \[[\d., ]+\] \(harness prompt\) \|", exp)  # (one seed: no spread)
    html = (where / "exp" / "report.html").read_text(encoding="utf-8")
    assert "blind not measured" in html and "harness prompt" in html


def test_missing_answers_count_unanswered(env, capsys):
    plain = [r["index"] for r in env["preds"] if r["category"] == "plain"]
    preds = [r for r in env["preds"] if r["index"] not in plain[::2]]  # every other plain answer
    dropped = len(env["preds"]) - len(preds)
    out = env["root"] / "runs-missing"
    assert _answers(env, _write_table(preds, env["root"] / "part.tsv"), out) == 0
    m = _metrics(_run_dir(env, "part", out))
    assert m["requests"]["missing"] == dropped
    assert f"{dropped} of" in capsys.readouterr().err
    rd = _run_dir(env, "part", out)
    reasons = [json.loads(x)["reason"] for x in (rd / "answers.jsonl").read_text().splitlines()]
    assert reasons.count("missing") == dropped
    # more than MAX_MISSING_SHARE of the plain answers missing: not measured, not a low score
    assert m["test"] == {"not_measured": f"{dropped} of {len(plain)} answers missing"} and m["controls"]["blind"]


@pytest.mark.parametrize("edit,words", [
    (lambda rows: rows + [dict(rows[3])], "a second time"),
    (lambda rows: [{**rows[0], "spar_prompt_sha256": "0" * 64}, *rows[1:]], "matches no exported question"),
    (lambda rows: [{**rows[0], "spar_build": "f" * 64}, *rows[1:]], "answers build ffffffffffff"),
    (lambda rows: [{**rows[0], "spar_protocol": "0.9"}, *rows[1:]], "protocol 0.9"),
    (lambda rows: [{k: v for k, v in r.items() if k != "spar_key"} for r in rows], "has no spar_key"),
])
def test_wrong_answer_files_refused_in_one_line(env, capsys, edit, words):
    path = _write_table(edit([dict(r) for r in env["preds"]]), env["root"] / "bad.tsv")
    assert _answers(env, path, env["root"] / "runs-bad") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --answers") and words in err and "\n" not in err


def test_model_or_answers_exactly_one(env, capsys):
    assert run_cmd(probe_cli, ["vqa", "--data", env["shards"], "--out", env["root"] / "r"]) == 2
    assert "exactly one" in capsys.readouterr().err


# --------------------------------------------------------------------------- lmms-eval
def _function_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: ("function", loader.construct_scalar(node)))
    return Loader


def _utils(folder: Path):
    spec = importlib.util.spec_from_file_location("spar_export_utils", folder / "utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lmms_eval_tasks_load_and_score_with_the_parser(env):
    import yaml

    from spar_bench.probes.vqa.parse import parse_answer

    folder = env["lm"] / PROBE
    group = yaml.load((folder / "spar_level3_symmetry.yaml").read_text(), Loader=_function_loader())
    docs = [json.loads(x) for x in (folder / "docs.jsonl").read_text().splitlines()]
    cats = {d["category"] for d in docs}
    assert len(group["task"]) == len(cats)
    # lmms-eval reads a --tasks name that is a folder of where it runs as that folder's YAMLs
    # (every task twice, as plain-model tasks): the folder is not named like the group
    assert group["group"] == "spar_level3_symmetry" and not (env["lm"] / group["group"]).exists()
    utils = _utils(folder)
    for name in group["task"]:
        task = yaml.load((folder / f"{name}.yaml").read_text(), Loader=_function_loader())
        assert task["task"] == name and task["output_type"] == "generate_until"
        fn = task["process_docs"][1].split(".", 1)[1]
        kept = [d for d in docs if d["category"] == task["metadata"]["category"]]
        assert kept and callable(getattr(utils, fn))
        assert (folder / task["dataset_kwargs"]["data_files"]["test"]).is_file()  # beside the YAML
    doc = next(d for d in docs if d["category"] == "plain")
    assert len(utils.doc_to_visual(doc)) == 1 and utils.doc_to_text(doc) == doc["question"]
    for text in (f"The answer is ({doc['answer']}).", "B", "I cannot tell", "A or B"):
        got = utils.process_results(doc, [text])["spar_accuracy"]
        want = parse_answer(text, tuple(doc["letters"]), tuple(doc["options"])).position
        assert got["parsed"] == (want is not None)
        assert got["correct"] == (want is not None and doc["letters"][want] == doc["answer"])
    blind = next(d for d in docs if d["category"] == "blind")
    assert utils.doc_to_visual(blind) == []


def test_lmms_eval_utils_fail_at_import_without_spar_bench(env):
    """lmms-eval imports utils.py when it loads the task: without spar_bench installed that
    import fails, before any generation (not at scoring time, after all of them)."""
    import subprocess
    import sys

    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('u', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print(m.process_results)")
    utils = str(env["lm"] / PROBE / "utils.py")
    bare = subprocess.run([sys.executable, "-S", "-c", code, utils], capture_output=True, text=True, timeout=120,
                          cwd=env["root"])  # -S: no site-packages, so no spar_bench
    assert bare.returncode != 0 and "pip install spar-bench" in bare.stderr
    full = subprocess.run([sys.executable, "-c", code, utils], capture_output=True, text=True, timeout=120,
                          cwd=env["root"])
    assert full.returncode == 0, full.stderr[-500:]


def test_lmms_eval_log_samples_score_as_vqa(env):
    """Samples as lmms-eval's --log_samples writes them (the metric's per-sample value)."""
    from PIL import Image

    from spar_bench.probes.vqa.base import Request
    from spar_bench.probes.vqa.dummy import DummyBackend

    folder = env["lm"] / PROBE
    utils = _utils(folder)
    d = DummyBackend(mode="generate", seed=0)
    lines = []
    for doc in (json.loads(x) for x in (folder / "docs.jsonl").read_text().splitlines()):
        img = (utils.doc_to_visual(doc) or [None])[0]
        req = Request(doc["spar_key"], doc["question"], tuple(doc["letters"]), tuple(doc["options"]),
                      img if isinstance(img, Image.Image) else None)
        text = d.answer([req])[0].text
        lines.append(json.dumps({"doc_id": doc["index"], "resps": [[text]], "filtered_resps": [text],
                                 **utils.process_results(doc, [text])}))
    path = env["root"] / "samples_lmms.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert _answers(env, path) == 0
    got = _metrics(_run_dir(env, "samples_lmms"))
    assert _scores(got) == _scores(_metrics(env["runs"] / "dummy" / PROBE / "vqa-generate"))


def test_export_refuses_a_used_folder(env, capsys):
    assert run_cmd(build_cli, ["export", env["shards"], "--format", "vlmevalkit", "--out", env["vk"]]) == 2
    assert "not empty" in capsys.readouterr().err


def test_export_is_deterministic(env):
    """Same build and options: byte-identical files (the provenance JSON's sha256s agree)."""
    again = env["root"] / "vk-again"
    assert run_cmd(build_cli, ["export", env["shards"], "--format", "vlmevalkit", "--out", again, "--probe", PROBE]) == 0
    assert (again / f"{PROBE}.json").read_bytes() == (env["vk"] / f"{PROBE}.json").read_bytes()
    assert (again / f"{PROBE}.tsv").read_bytes() == (env["vk"] / f"{PROBE}.tsv").read_bytes()
    assert not (env["root"] / "vk-again.tmp").exists()


def test_answers_ask_the_probes_the_file_answers(env):
    """Without --probe, --answers asks the probes its file has rows of (not every probe)."""
    out = env["root"] / "runs-default"
    assert _answers(env, _write_table(env["preds"], env["root"] / "onlysym.tsv"), out, probe=False) == 0
    assert [p.name for p in (out / "answers-onlysym").iterdir()] == [PROBE]
