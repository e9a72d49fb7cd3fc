"""``answers:FILE`` (``spar-probe vqa --answers FILE``): a backend that answers from another
harness's answers to a ``spar-build export``.

It reads VLMEvalKit's prediction file (``.xlsx``, ``.tsv`` or ``.csv`` with the exported
columns and ``prediction``) or lmms-eval's ``--log_samples`` JSONL (each sample's
``spar_accuracy`` value, written by the export's ``process_results``). A request of the
``vqa`` pipeline is answered by the row of its question key, variant (image or blind) and
the sha256 of its prompt text; so the run, every control, CircularEval and the report are
those of ``spar-probe vqa``, and the text is read by its parser (``generate`` mode).

Refused in one line: a file that is not UTF-8, a prediction over :data:`MAX_ANSWER_CHARS`
characters, a row of another build (fingerprint) or protocol, a row that matches no
exported question (re-planned from the build and the row's ``spar_config``), two answers to
one request. A request the file has no answer for is answered ``missing`` (unanswered; the
run's ``metrics.json`` counts them under ``requests.missing``); a variant with more than a
stated share missing is not measured, one with all missing is refused unless accepted
(:mod:`.measured`).

Several files answer one run (``--answers A --answers B``; ``answers:A<os.pathsep>B``):
VLMEvalKit answers the export's ``<probe>.tsv`` and ``<probe>.blind.tsv`` as two datasets.

The prompt: lmms-eval's exported task sends ``doc_to_text`` = the exported question, ``vqa``'s
exact prompt (``prompt: exact``). VLMEvalKit wraps the question in its own prompt
(``ImageMCQDataset.build_prompt`` in ``vlmeval/dataset/image_mcq.py`` and
``TextMCQDataset.build_prompt`` in ``text_mcq.py``: "Question: ..", the options listed again,
"Please select the correct answer from the options above."; a model class may use its own), so
answers read from a table file are recorded as asked with the harness's prompt (``prompt:
harness (VLMEvalKit ...)`` in the run's model identity) and the reports mark them "harness
prompt".
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.provenance import PROTOCOL_VERSION

from ..tasks import get_probe, probe_names
from .ask import MISSING, plan
from .base import Backend, BackendOptions, Reply, Request
from .export import config_of, prompt_sha256
from .questions import load_questions

ID = ("spar_key", "spar_variant", "spar_prompt_sha256")
REQUIRED = (*ID, "spar_build", "spar_protocol", "spar_config", "spar_probe")
#: the lmms-eval metric whose per-sample value carries the spar fields
LMMS_METRIC = "spar_accuracy"
#: how the answers of each file kind were asked (recorded in the run's model identity)
PROMPTS = {"table": "harness (VLMEvalKit build_prompt wraps the exported question)", "jsonl": "exact"}


def _table_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a VLMEvalKit prediction file (``.xlsx``, ``.tsv``, ``.csv``) as dicts."""
    if path.suffix == ".xlsx":
        try:
            import openpyxl
        except ImportError:
            raise ConfigError(f"--answers {path}: reading .xlsx needs openpyxl (pip install openpyxl), "
                              "or save the predictions as .tsv") from None
        try:
            sheet = openpyxl.load_workbook(path, read_only=True).worksheets[0]
        except Exception as e:  # noqa: BLE001 (a damaged workbook raises zip, XML or key errors)
            raise ConfigError(f"--answers {path}: not a readable .xlsx workbook ({type(e).__name__}: {e}); "
                              "save the predictions again, or as .tsv") from None  # fmt: skip
        values = list(sheet.iter_rows(values_only=True))
        head = [str(h) for h in values[0]] if values else []
        return [dict(zip(head, v, strict=False)) for v in values[1:]]
    csv.field_size_limit(1 << 30)
    try:
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ","))
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except csv.Error as e:
        raise ConfigError(f"--answers {path}: not a readable {path.suffix[1:]} table ({e})") from None


def _not_utf8(path: Path, e: UnicodeDecodeError) -> ConfigError:
    return ConfigError(f"--answers {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                       "save the predictions as UTF-8")


#: the longest prediction read (characters): an answer to one question, reasoning included, is far
#: shorter; a longer one is refused in one line (the parser's time grows with an answer's length)
MAX_ANSWER_CHARS = 100_000


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The spar fields and prediction of each lmms-eval ``--log_samples`` line."""
    out = []
    for n, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested beyond what json reads
            raise ConfigError(f"--answers {path}: line {n} is not JSON; pass lmms-eval's --log_samples JSONL") from None
        got = sample.get(LMMS_METRIC) if isinstance(sample, dict) else None
        if not isinstance(got, dict):
            raise ConfigError(f"--answers {path}: line {n} has no {LMMS_METRIC} record; pass the samples of a "
                              "task exported by spar-build export --format lmms-eval")
        out.append(got)
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every answer row of ``path`` with its spar fields and ``prediction`` (text)."""
    if not path.is_file():
        raise ConfigError(f"--answers {path}: no such file")
    if path.suffix not in (".xlsx", ".tsv", ".csv", ".jsonl"):
        raise ConfigError(f"--answers {path}: expected a VLMEvalKit prediction file (.xlsx, .tsv, .csv) "
                          "or lmms-eval --log_samples (.jsonl)")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _table_rows(path)
    for n, r in enumerate(rows, 1):
        lacking = [c for c in REQUIRED if r.get(c) in (None, "")] + ([] if "prediction" in r else ["prediction"])
        if lacking:
            raise ConfigError(f"--answers {path}: row {n} has no {', '.join(lacking)}; answer a file exported by "
                              "spar-build export (its spar_* columns kept) and keep the prediction column")
        size = len(str(r["prediction"])) if r["prediction"] is not None else 0
        if size > MAX_ANSWER_CHARS:
            raise ConfigError(f"--answers {path}: row {n}'s prediction is {size:,} characters, over the limit of "
                              f"{MAX_ANSWER_CHARS:,} (an answer to one question); check the harness's output, "
                              "or cut that answer")  # fmt: skip
    return rows


def probes_answered(path: str | Path) -> list[str]:
    """The probes ``path`` (files joined by ``os.pathsep``) has answers for (``spar_probe``), in
    registry order: what ``--answers`` asks when no ``--probe`` is given."""

    got = {str(r["spar_probe"]) for x in str(path).split(os.pathsep) if x for r in read_rows(Path(x))}
    if not got:
        raise ConfigError(f"--answers {path}: no answer rows; pass the predictions of an exported file")
    return [p for p in probe_names() if p in got]


def _exported(build, probe: str, config: str) -> set[tuple[str, str, str]]:
    """The ids of every row ``spar-build export`` writes for ``probe`` asked as ``config``."""

    cfg = config_of(config)
    qs = load_questions(build, get_probe(probe), list(cfg.splits))
    return {(str(qs.key[it.q]), it.variant, prompt_sha256(it.prompt.text)) for it in plan(qs, cfg)}


def _check_config(path: Path, n: int, probe: str, config: str) -> None:
    """Row ``n``'s ``spar_probe`` and ``spar_config`` as an export writes them, else one line."""

    try:
        get_probe(probe)
    except ConfigError as e:
        raise ConfigError(f"--answers {path}: row {n}: {e}") from None
    try:
        config_of(config)
    except (ConfigError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--answers {path}: row {n}'s spar_config {config[:80]!r} is not one spar-build export "
                          f"writes ({type(e).__name__}: {e}); answer the exported rows, unedited") from None


def check_rows(path: Path, rows: list[dict[str, Any]], build) -> dict[tuple[str, str, str], str]:
    """The prediction of each row id, after the one-line refusals (build, protocol, no such
    exported question, duplicates)."""

    plans: dict[tuple[str, str], set] = {}
    got: dict[tuple[str, str, str], str] = {}
    for n, r in enumerate(rows, 1):
        if str(r["spar_build"]) != build.fingerprint:
            raise ConfigError(f"--answers {path}: row {n} answers build {str(r['spar_build'])[:12]}, not --data's "
                              f"{build.fingerprint[:12]}; export --data with spar-build export and answer that")
        if str(r["spar_protocol"]) != PROTOCOL_VERSION:
            raise ConfigError(f"--answers {path}: row {n} was exported under protocol {r['spar_protocol']}, this is "
                              f"protocol {PROTOCOL_VERSION}; export the build again and answer that")
        ident = tuple(str(r[c]) for c in ID)
        where = (str(r["spar_probe"]), str(r["spar_config"]))
        if where not in plans:
            _check_config(path, n, *where)
            plans[where] = _exported(build, *where)
        if ident not in plans[where]:
            raise ConfigError(f"--answers {path}: row {n} ({ident[0]}, {ident[1]}) matches no exported question of "
                              f"{where[0]}; answer the rows spar-build export wrote, unedited")
        if ident in got:
            raise ConfigError(f"--answers {path}: row {n} answers {ident[0]} ({ident[1]}) a second time; "
                              "keep one answer per exported row")
        p = r.get("prediction")
        got[ident] = "" if p is None else str(p)
    return got


def prompt_of(paths: list[Path]) -> str:
    """How the answers of ``paths`` were asked (:data:`PROMPTS`); one kind per run."""
    kinds = {"jsonl" if p.suffix == ".jsonl" else "table" for p in paths}
    if len(kinds) > 1:
        raise ConfigError(f"--answers {paths[0]}: mixes lmms-eval samples and VLMEvalKit predictions, which were "
                          "asked with different prompts; score each harness's answers on their own")
    return PROMPTS[kinds.pop()]


class AnswersBackend(Backend):
    """Answers each request from files of another harness's answers (see the module doc)."""

    def __init__(self, path: str, data: str | None, accept_missing: bool = False):
        paths = [Path(x) for x in path.split(os.pathsep) if x]
        if not paths:
            raise ConfigError("--answers: name the answers file (--answers FILE)")
        self.source = "--answers " + " ".join(map(str, paths))
        if not data:
            raise ConfigError(f"--answers {paths[0]}: needs --data, the build that was exported")
        rows = [(p, read_rows(p)) for p in paths]
        build = Build(data)
        self.answers: dict = {}
        for p, rs in rows:
            got = check_rows(p, rs, build)
            if set(got) & set(self.answers):
                raise ConfigError(f"--answers {p}: answers rows another --answers file answers; keep one answer "
                                  "per exported row")
            self.answers.update(got)
        digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
        digest = digests[0] if len(paths) == 1 else hashlib.sha256(" ".join(digests).encode()).hexdigest()
        self.name = "answers-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", paths[0].stem).strip("-")[-60:] or "file")
        self.mode = "generate"
        self.identity = {"kind": "answers", "sha256": digest, "prompt": prompt_of(paths)}
        self.decoding = {"mode": "generate"}
        self.batch_size = 256
        self.missing = 0
        self.accept_missing = accept_missing

    def answer(self, requests: list[Request]) -> list[Reply]:
        out = []
        for r in requests:
            ident = (r.key, "blind" if r.blind else "image", hashlib.sha256(r.text.encode("utf-8")).hexdigest())
            text = self.answers.get(ident)
            if text is None:
                self.missing += 1
                out.append(Reply(text="", meta={MISSING: True}))
            else:
                out.append(Reply(text=text))
        return out


def load_answers(rest: str, options: BackendOptions) -> AnswersBackend:
    return AnswersBackend(rest, options.data, options.accept_missing)
