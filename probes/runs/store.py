"""The run store: where a run lives, whose files a folder holds, whether it is finished, and
how it is written (``metrics.json`` last: its presence marks a finished run).

Every run kind (a head on cached features, a finetuned encoder, an MLLM) writes
``OUT/<slug>/<probe>/<head>[,<options>]/seed<k>/`` (:func:`run_folder`), named by the options
that differ from their defaults (:func:`variant_text`). A finished run is kept when rerun
with the same options and refused, naming what differs (:func:`differences`), when rerun
with others; it is replaced only when the command is told to (``--overwrite``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from spar_bench.errors import ConfigError
from spar_bench.outputs import check_target, claim, remove, save_torch
from spar_bench.provenance import json_safe

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.json"
HEAD_FILE = "head.pt"
#: The files of a run of a head on cached features.
RUN_FILES = frozenset({CONFIG_FILE, HEAD_FILE, METRICS_FILE, METRICS_FILE + ".tmp"})
#: The files a head run declares beside its record and metrics.
HEAD_FILES = frozenset({HEAD_FILE})


# --------------------------------------------------------------------------- naming
def option_text(v: Any) -> str:
    """An option value as a folder name writes it (``True`` -> ``1``, ``0.001`` -> ``0.001``)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return format(v, "g")
    return str(v)


def variant_text(changed: dict[str, Any]) -> str:
    """``k=v,...`` (keys sorted) of the options that differ from their defaults: a run folder's suffix."""
    return ",".join(f"{k}={option_text(v)}" for k, v in sorted(changed.items()))


def run_folder(out: str | Path, slug: str, probe: str, head: str, variant: str, seed: int) -> Path:
    """``OUT/<slug>/<probe>/<head>[,variant]/seed<k>``: the folder of every kind of run."""
    from spar_bench.names import component_problem

    name = f"{head},{variant}" if variant else head
    for what, part in (("model", slug), ("probe", probe), ("head", name)):
        if (problem := component_problem(part)) is not None:  # a plug-in's name, an option's value
            raise ConfigError(f"a run folder's {what} part {problem}; a run is written inside {out} only")
    return Path(out) / slug / probe / name / f"seed{seed}"


def differences(had: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """``key=old (now new)`` for each key whose recorded value differs from this run's:
    what a finished run's refusal names (``fit``, ``finetune``, ``vqa``)."""
    return [f"{k}={had.get(k)} (now {want.get(k)})" for k in sorted(set(want) | set(had))
            if had.get(k) != want.get(k)]


def run_path(rd: Path) -> str:
    """``<encoder>/<probe>/<head>/seed<k>``: how an evaluation names the run it scored (no local path)."""
    return "/".join(Path(rd).resolve().parts[-4:])


# --------------------------------------------------------------------------- ownership
def owned_run(rd: Path, declared: frozenset[str] = RUN_FILES) -> set[str] | None:
    """The files of an earlier run in ``rd`` (its record, the files it declares, ``declared``,
    and its evaluations), or None if ``rd`` is not a run folder: one without a readable run record
    that holds anything but ``declared`` files other than a record and metrics (a run stopped
    before its record, e.g. a finetune's first checkpoint, is still a run; another tool's
    ``metrics.json`` is not)."""
    from .record import RunRecord

    rd = Path(rd)
    names = {p.name for p in rd.iterdir()} if rd.is_dir() else set()
    try:
        RunRecord.read(rd)
    except ConfigError:
        if not names or not names <= declared - {CONFIG_FILE, METRICS_FILE}:
            return None
    return set(declared) | {CONFIG_FILE, METRICS_FILE, METRICS_FILE + ".tmp"} | {n for n in names if n.startswith("eval-")}


def fresh_run_dir(rd: Path, owned: Callable[[Path], set[str] | None] = owned_run, what: str = "run folder") -> None:
    """Make ``rd`` an empty run folder: an earlier run (``owned`` says whose files) is removed
    whole; a folder holding anything else is refused (``spar_bench.outputs.claim``)."""

    check_target(rd)
    if claim(rd, overwrite=True, owned=owned, what=what):
        remove(rd)
    rd.mkdir(parents=True, exist_ok=True)


def check_run_dir(rd: Path, declared: frozenset[str], what: str = "run folder") -> None:
    """Refuse (one line) a ``rd`` that holds anything but a run of these ``declared`` files."""

    check_target(rd)
    claim(rd, overwrite=True, owned=lambda p: owned_run(p, declared), what=what)


# --------------------------------------------------------------------------- writing
def write_metrics(rd: Path, metrics: dict[str, Any]) -> None:
    """``metrics.json``, written last through a temporary file: its presence marks a finished run."""
    tmp = rd / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    tmp.replace(rd / METRICS_FILE)


def save_head(path: Path, model, config: dict[str, Any], prior: dict | None = None) -> None:
    """``head.pt``: the trained head's ``state_dict`` on the CPU, its run record (as JSON text:
    pickle writes a string shared by two objects once, so a dict's bytes would depend on which
    strings happen to be one object) and the prior fitted on its training items (a transfer
    evaluation scores the prior and the conflict items by it)."""

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    text = json.dumps(json_safe(config), sort_keys=True, default=str)
    save_torch({"state_dict": state, "config": text, "prior": prior}, path)


#: a run's file: how to write it (given its path), and whether its bytes are checked (False: a timing)
Writer = tuple[Callable[[Path], None], bool]


def staging_dir(rd: Path, tag: str = "partial") -> Path:
    """Where a run is written before it is renamed into place: a hidden sibling of ``rd``."""

    return rd.parent / f".{rd.name}.{tag}-{os.getpid()}"


def write_run(rd: Path, record, metrics: dict[str, Any], files: dict[str, Writer]) -> None:
    """A finished run, whole or absent: every declared file, the record (with the files'
    sha256) and ``metrics.json`` last are written into a staging folder beside ``rd``, which is
    then renamed into place (an earlier folder of the same run, e.g. a finetune's checkpoints,
    is moved aside first and removed after). A crash at any write leaves ``rd`` as it was, or
    absent: never a finished-looking run with a file missing."""

    tmp = staging_dir(rd)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, (write, _) in files.items():
            write(tmp / name)
        record.with_files(tmp, {n: checked for n, (_, checked) in files.items()}).write(tmp)
        write_metrics(tmp, metrics)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = staging_dir(rd, "old")
    if rd.exists():
        rd.rename(old)
    tmp.rename(rd)
    shutil.rmtree(old, ignore_errors=True)


def clear_staging(rd: Path) -> None:
    """Remove what a killed write left beside ``rd`` (its staging and set-aside folders)."""

    for p in rd.parent.glob(f".{rd.name}.*-*") if rd.parent.is_dir() else ():
        if p.is_dir() and p.name.split(".")[-1].split("-")[0] in ("partial", "old"):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- finished runs
def refuse_other(rd: Path, diff: list[str], replace: str, why: str = "") -> None:
    """A one-line refusal naming ``rd`` and every recorded value that differs from this run's
    (``replace``: how the command replaces the finished run; ``why``: a note after the list)."""
    if diff:
        raise ConfigError(f"{rd}: finished with {', '.join(diff)}{why}; write to a new --out, or {replace} to "
                          "rerun it")  # fmt: skip


def finished(rd: Path, record, declared: frozenset[str], replace: str) -> bool:
    """Whether ``rd`` holds a finished, whole run of ``record``'s identity (kept: nothing to do).

    A finished run of another identity is refused in one line naming what differs; a damaged
    one (a declared file missing or changed since it was written) is not finished: it is run
    again, with a line saying why."""

    from .record import RunRecord

    if not (rd / METRICS_FILE).is_file():
        return False
    had = RunRecord.read(rd)
    if had.build_fingerprint and record.build_fingerprint and had.build_fingerprint != record.build_fingerprint:
        on = "a feature cache of another build" if record.kind == "head" else "another build"
        raise ConfigError(f"{rd}: finished on {on} (fingerprint {had.build_fingerprint[:12]}, "
                          f"{had.build or 'unnamed'}; this run's {record.build_fingerprint[:12]}); write to a new "
                          f"--out, or {replace} to rerun it")  # fmt: skip
    refuse_other(rd, had.differences(record), replace, " (other options, or defaults changed since)")
    damage = had.damaged(rd) if not had.legacy else [f"{n} missing" for n in sorted(declared) if not (rd / n).is_file()]
    if damage:
        click.echo(f"{rd}: a damaged run ({', '.join(damage)}); running it again", err=True)
        return False
    return True


def preflight(job) -> None:
    """Refuse (one line) an opened job whose folder holds a finished run of another identity,
    before anything of this run is done (``job`` None: nothing to run)."""
    from .record import RunRecord

    if job is not None and (job.rd / METRICS_FILE).is_file():
        refuse_other(job.rd, RunRecord.read(job.rd).differences(job.record), "delete that folder")


def kept_eval(out: Path, inputs: dict[str, Any], overwrite: bool) -> bool:
    """True when ``out`` (an ``eval-*.json``) holds this evaluation already: the same ``inputs``
    (kept as it is). One of other inputs is refused in one line unless ``overwrite``."""

    if overwrite or not out.is_file():
        return False
    try:
        had = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        had = None
    diff = differences({k: had.get(k) for k in inputs} if isinstance(had, dict) else {}, inputs)
    if diff:
        raise ConfigError(f"{out}: an evaluation of other inputs ({', '.join(diff)}); pass --overwrite "
                          "to replace it")  # fmt: skip
    click.echo(f"{out}: evaluated earlier with these inputs; kept (--overwrite evaluates it again)", err=True)
    return True


@dataclass(frozen=True, kw_only=True)
class TransferEval:
    """What an ``eval-*.json`` says of the evaluation it holds (a finished run scored on another
    target without retraining): one set of keys whichever kind wrote it (a head on another
    cache, a finetune run re-encoding another build), ``None`` where a key does not apply.

    ``run``: ``<encoder>/<probe>/<head>/seed<k>``; ``features``: the cache's file name (or
    ``<build> (re-encoded)``); ``data``: the build re-encoded (None: scored on a cache);
    ``cache_fingerprint`` / ``dataset_fingerprint``: the cache's / the re-encoded build's;
    ``training``: how the run's encoder was trained (its ``metrics.json``'s)."""

    run: str
    features: str
    data: str | None = None
    cache_fingerprint: str | None = None
    dataset_fingerprint: str | None = None
    encoder: str
    random_init: bool
    training: dict | None = None
    splits: list[str]
    probe: str
    head: str
    variant: str
    seed: int
    n_bootstrap: int


def write_eval(out: Path, evaluation: TransferEval, scored: dict[str, Any]) -> Path:
    """The one writer of ``eval-*.json``: ``evaluation``'s keys, then the scores (``test``,
    ``mirror``, ``controls``: :func:`~.evaluate.transfer`)."""
    out.write_text(json.dumps(json_safe({**asdict(evaluation), **scored}), indent=2) + "\n")
    return out
