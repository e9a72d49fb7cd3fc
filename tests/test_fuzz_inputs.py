"""Property-based tests of the files users write (issue 47.4): experiment files through
``spar-bench run --dry-run`` and ``--answers`` JSONL through ``spar-probe vqa``.

Hypothesis generates valid and broken inputs: a valid experiment (or a valid lmms-eval
``--log_samples`` file) with keys dropped, added or given values of any type, names of any
alphabet, and raw text corrupted or cut. The only allowed outcomes are success (exit 0) or
exit 2 with exactly one line on stderr; a traceback fails the test. The examples are
derandomized (the same ones on every run): a bounded number in the fast run, more under
``slow``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from spar_bench.experiments.cli import cli as bench_cli
from spar_bench.probes.cli import cli as probe_cli

from helpers import run_cmd

FAST = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
SLOW = settings(FAST, max_examples=400)
PROGRESS = re.compile(r"\[\d+/\d+\] \S+$")


def outcome(group, argv: list) -> tuple[int, list[str]]:
    """Exit status and stderr's lines (progress bars and step lines aside) of one in-process run."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_cmd(group, argv)
    lines = [ln for ln in err.getvalue().replace("\r", "\n").splitlines()
             if ln.strip() and "%|" not in ln and not PROGRESS.match(ln) and not ln.startswith(("note: ", "--probe all"))]  # fmt: skip
    return code, lines


def assert_clean(code: int, lines: list[str], what) -> None:
    """Success, or exit 2 and one line; the outcome is a Hypothesis event (``--hypothesis-show-statistics``)."""
    event(f"exit {code}" + (f": {re.sub(r'[^a-z ]', '', lines[0].split(': ')[-1])[:40]}" if code and lines else ""))
    assert code == 0 or (code == 2 and len(lines) == 1 and lines[0].startswith("error: ")), (code, lines, what)


# -- experiment files ----------------------------------------------------------------------
#: text without '/' or '.': a value never names a folder outside the example's own (no '..', no root)
SAFE_TEXT = st.text(st.characters(blacklist_characters="/.\\\x00", blacklist_categories=("Cs",)), max_size=12)
NAMES = st.one_of(st.sampled_from(["b", "e", "m", "x.v2", "a-b_c", "", ".h", "..", "a/b", "../../x", "a\uff0fb",
                                   "\u2024\u2024", "a@b", "-x", "e:1"]), SAFE_TEXT)  # fmt: skip
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), SAFE_TEXT,
                    st.sampled_from(["all", "dummy", "linear", "level1.localisation", "${X}", "${env:SPAR_FUZZ}",
                                     "frozen", "prior", "phantom"]))  # fmt: skip
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(SAFE_TEXT, inner, max_size=3)), max_leaves=6)
#: key paths of the base experiment a mutation may touch
PATHS = ["experiment", "vars", "builds", "builds.b", "builds.b.phantom", "builds.b.phantom.n", "builds.b.options",
         "builds.b.options.levels", "builds.b.options.samples_per_case", "encoders", "encoders.e", "encoders.e.spec",
         "modes", "modes.frozen", "modes.frozen.encoders", "modes.frozen.heads", "modes.frozen.options",
         "probes", "seeds", "train_on", "transfer", "mllms", "mllms.m", "mllms.m.model", "mllms.m.options",
         "predictors", "predictors.p", "predictors.p.kind", "jobs", "report", "resources"]  # fmt: skip


def base(out: Path) -> dict:
    return {"experiment": "fuzz", "vars": {"X": "1"}, "out": str(out),
            "builds": {"b": {"phantom": {"n": 4, "in_plane": 64, "slices": 16},
                             "options": {"levels": "level1,level3", "samples_per_case": 2}}},
            "encoders": {"e": {"spec": "dummy"}},
            "modes": {"frozen": {"encoders": ["e"], "heads": ["linear"]}},
            "mllms": {"m": {"model": "dummy"}}, "predictors": {"p": {"kind": "prior"}},
            "probes": ["level1.localisation"], "seeds": [0]}  # fmt: skip


def _mutate(doc: dict, path: str, op: str, value, name: str) -> None:
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return
    if op == "drop":
        node.pop(last, None)
    elif op == "set":
        node[last] = value
    elif op == "rename" and last in node:
        node[name] = node.pop(last)
    elif op == "add" and isinstance(node.get(last), dict):
        node[last][name] = value


MUTATIONS = st.lists(st.tuples(st.sampled_from(PATHS), st.sampled_from(["drop", "set", "rename", "add"]), VALUES,
                               NAMES), max_size=4)  # fmt: skip
CORRUPT = st.one_of(st.none(), st.tuples(st.floats(0, 1), st.sampled_from(["cut", "insert"]),
                                         st.text(alphabet=":{}[]-#&*!|>'\"%@`\t\n ,?\u00e9\ufeff", max_size=4)))


def experiment_text(out: Path, mutations, corrupt) -> str:
    doc = base(out)
    for path, op, value, name in mutations:
        _mutate(doc, path, op, value, name)
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    if corrupt is not None:
        where, how, junk = corrupt
        i = int(where * len(text))
        text = text[:i] if how == "cut" else text[:i] + junk + text[i:]
    return text


def _check_experiment(mutations, corrupt, sets) -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        root = Path(tmp)
        path = root / "e.yaml"
        # out: relative, inside the example's folder whatever a corruption makes of it ("o:ut")
        path.write_text(experiment_text(Path("out"), mutations, corrupt), encoding="utf-8")
        argv = ["run", path, "--dry-run", *[a for s in sets for a in ("--set", s)]]
        code, lines = outcome(bench_cli, argv)
        assert_clean(code, lines, path.read_text(encoding="utf-8"))
        outside = [p for p in root.iterdir() if p.name != "e.yaml" and not (p / ".plan").is_dir()]
        assert not outside, outside  # nothing written beside an OUT


SETS = st.lists(st.one_of(st.sampled_from(["X=2", "X=", "X=../../y", "Y=1", "=1", "X"]),
                          st.builds("{}={}".format, SAFE_TEXT, SAFE_TEXT)), max_size=2)  # fmt: skip


@FAST
@given(MUTATIONS, CORRUPT, SETS)
def test_experiment_files_are_planned_or_refused_in_one_line(mutations, corrupt, sets) -> None:
    _check_experiment(mutations, corrupt, sets)


@pytest.mark.slow
@SLOW
@given(MUTATIONS, CORRUPT, SETS)
def test_experiment_files_are_planned_or_refused_in_one_line_many(mutations, corrupt, sets) -> None:
    _check_experiment(mutations, corrupt, sets)


# -- --answers JSONL -----------------------------------------------------------------------
PROBE = "level3.symmetry"


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> dict:
    """A phantom Level 3 build, its lmms-eval export, and the dummy model's samples of it."""
    import importlib.util

    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.vqa.base import Request
    from spar_bench.probes.vqa.dummy import DummyBackend

    root = tmp_path_factory.mktemp("fuzz-answers")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 4, "--in-plane", 64, "--slices", 16]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", root / "ph", "--out", root / "b", "--levels",
                               "level3", "--no-hf", "--compression", "gzip"]) == 0  # fmt: skip
    assert run_cmd(build_cli, ["export", root / "b", "--format", "lmms-eval", "--out", root / "lm", "--probe", PROBE]) == 0
    folder = root / "lm" / PROBE
    spec = importlib.util.spec_from_file_location("fuzz_utils", folder / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    d = DummyBackend(mode="generate", seed=0)
    samples = []
    for doc in (json.loads(x) for x in (folder / "docs.jsonl").read_text().splitlines()):
        text = d.answer([Request(doc["spar_key"], doc["question"], tuple(doc["letters"]), tuple(doc["options"]), None)])[0].text
        samples.append({"doc_id": doc["index"], "resps": [[text]], **utils.process_results(doc, [text])})
    return {"root": root, "build": root / "b", "samples": samples}


LINE_FIELDS = ["spar_key", "spar_variant", "spar_prompt_sha256", "spar_build", "spar_protocol", "spar_config",
               "spar_probe", "prediction"]  # fmt: skip
LINE_OPS = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "drop", "dup", "raw", "swap"]),
                              st.sampled_from(LINE_FIELDS), VALUES,
                              st.binary(max_size=8)), max_size=4)  # fmt: skip


def answers_bytes(samples: list[dict], ops) -> bytes:
    lines: list = [json.loads(json.dumps(s)) for s in samples]
    for k, op, field, value, raw in ops:
        i = k % len(lines) if lines else 0
        if op == "set" and lines and isinstance(lines[i], dict):
            lines[i].setdefault("spar_accuracy", {})[field] = value
        elif op == "drop" and lines and isinstance(lines[i], dict):
            lines[i].get("spar_accuracy", {}).pop(field, None)
        elif op == "dup" and lines:
            lines.append(lines[i])
        elif op == "raw":
            lines.insert(i % (len(lines) + 1), raw)
        elif op == "swap" and lines:
            lines[i] = value
    out = b""
    for x in lines:
        out += (x if isinstance(x, bytes) else json.dumps(x, allow_nan=True).encode()) + b"\n"
    return out


def _check_answers(answered: dict, ops) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "samples.jsonl"
        path.write_bytes(answers_bytes(answered["samples"], ops))
        argv = ["vqa", "--answers", path, "--data", answered["build"], "--out", Path(tmp) / "runs",
                "--bootstrap", 10]  # fmt: skip
        code, lines = outcome(probe_cli, argv)
        assert_clean(code, lines, path.read_bytes()[:2000])


def test_the_unmutated_answers_score(answered) -> None:
    """The property's base case succeeds: the generated files are not all refused."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "samples.jsonl"
        path.write_bytes(answers_bytes(answered["samples"], []))
        code, lines = outcome(probe_cli, ["vqa", "--answers", path, "--data", answered["build"], "--out",
                                          Path(tmp) / "runs", "--bootstrap", 10])  # fmt: skip
        assert code == 0, lines


@settings(FAST, max_examples=40)
@given(LINE_OPS)
def test_answers_files_are_scored_or_refused_in_one_line(answered, ops) -> None:
    _check_answers(answered, ops)


@pytest.mark.slow
@SLOW
@given(LINE_OPS)
def test_answers_files_are_scored_or_refused_in_one_line_many(answered, ops) -> None:
    _check_answers(answered, ops)


# -- what the fuzz found -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["!spec: dummy", '!!binary "@"', "!!float abc", "!!timestamp x"])
def test_a_tagged_yaml_value_is_one_line(tmp_path: Path, value: str) -> None:
    """Found by the experiment-file property: an unknown or failing tag (``spec: !spec: dummy``)
    passed YAML's parse and raised in its construction, a traceback."""
    path = tmp_path / "e.yaml"
    text = experiment_text(tmp_path / "out", [], None).replace("spec: dummy", f"spec: {value}")
    path.write_text(text, encoding="utf-8")
    code, lines = outcome(bench_cli, ["run", path, "--dry-run"])
    assert code == 2 and len(lines) == 1 and "encoders.e.spec" in lines[0], lines


@pytest.mark.parametrize("config", ["{x", "[]", "{}", '{"splits": 3}', "null", "no-such-probe"])
def test_an_edited_spar_config_or_probe_is_one_line(answered, config: str) -> None:
    """Found by the answers property: a row's ``spar_config`` that is no export's (not JSON,
    not an object, a key missing) reached ``json``/``KeyError``/``TypeError`` raw."""
    field = "spar_probe" if config == "no-such-probe" else "spar_config"
    ops = [(0, "set", field, config, b"")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "samples.jsonl"
        path.write_bytes(answers_bytes(answered["samples"], ops))
        code, lines = outcome(probe_cli, ["vqa", "--answers", path, "--data", answered["build"], "--out",
                                          Path(tmp) / "runs", "--bootstrap", 10])  # fmt: skip
    assert code == 2 and len(lines) == 1 and "row 1" in lines[0] and field.split("_")[1] in lines[0], lines


def test_an_experiment_without_builds_is_one_line(tmp_path: Path) -> None:
    """Found by the experiment-file property: ``builds: {}`` raised StopIteration (train_on's default)."""
    path = tmp_path / "e.yaml"
    path.write_text(experiment_text(tmp_path / "out", [("builds.b", "drop", None, "b")], None), encoding="utf-8")
    code, lines = outcome(bench_cli, ["run", path, "--dry-run"])
    assert code == 2 and len(lines) == 1 and "builds: no build defined" in lines[0], lines
