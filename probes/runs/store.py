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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.provenance import json_safe

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.json"
HEAD_FILE = "head.pt"
#: The files of a run of a head on cached features.
RUN_FILES = frozenset({CONFIG_FILE, HEAD_FILE, METRICS_FILE, METRICS_FILE + ".tmp"})


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
    name = f"{head},{variant}" if variant else head
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
def owned_run(rd: Path) -> set[str] | None:
    """The files of an earlier head run in ``rd``, or None if ``rd`` is not a run folder."""
    try:
        config = json.loads((Path(rd) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not {"probe", "head", "seed"} <= set(config):
        return None
    return set(RUN_FILES) | {p.name for p in Path(rd).glob("eval-*.json")}


def fresh_run_dir(rd: Path, owned: Callable[[Path], set[str] | None], what: str) -> None:
    """Make ``rd`` an empty run folder: an earlier run (``owned`` says whose files) is removed
    whole; a folder holding anything else is refused (``spar_bench.outputs.claim``)."""
    from spar_bench.outputs import check_target, claim, remove

    check_target(rd)
    if claim(rd, overwrite=True, owned=owned, what=what):
        remove(rd)
    rd.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- writing
def write_config(rd: Path, config: dict[str, Any]) -> None:
    """``config.json``, whole or not at all."""
    from spar_bench.outputs import write_bytes

    write_bytes(rd / CONFIG_FILE, json.dumps(json_safe(config), indent=2, default=str) + "\n")


def write_metrics(rd: Path, metrics: dict[str, Any]) -> None:
    """``metrics.json``, written last through a temporary file: its presence marks a finished run."""
    tmp = rd / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    tmp.replace(rd / METRICS_FILE)


def save_head(rd: Path, model, config: dict[str, Any], prior: dict | None = None) -> None:
    """``head.pt``: the trained head's ``state_dict`` on the CPU, its config and the prior fitted
    on its training items (a transfer evaluation scores the prior and the conflict items by it)."""
    from spar_bench.outputs import save_torch

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_torch({"state_dict": state, "config": config, "prior": prior}, rd / HEAD_FILE)


def write_run(rd: Path, config: dict, metrics: dict, model, prior: dict | None = None) -> None:
    """A head run: config.json, head.pt, then metrics.json last."""
    fresh_run_dir(rd, owned_run, "run folder")  # an earlier run of the same spec is replaced whole
    write_config(rd, config)
    save_head(rd, model, config, prior)
    write_metrics(rd, metrics)


# --------------------------------------------------------------------------- finished runs
def refuse_other(rd: Path, had: dict[str, Any], want: dict[str, Any], replace: str, why: str = "") -> None:
    """A one-line refusal naming ``rd`` and every recorded value that differs from this run's
    (``replace``: how the command replaces the finished run; ``why``: a note after the list)."""
    diff = differences(had, want)
    if diff:
        raise ConfigError(f"{rd}: finished with {', '.join(diff)}{why}; write to a new --out, or {replace} to "
                          "rerun it")  # fmt: skip


def finished_with(rd: Path, identity: Callable[[dict[str, Any]], dict[str, Any]], want: dict[str, Any],
                  replace: str) -> bool:
    """Whether ``rd`` holds a finished run (``metrics.json``) whose ``config.json`` has the
    ``identity`` ``want``; one of another identity (or an unreadable one) is refused in one line."""
    if not (rd / METRICS_FILE).is_file():
        return False
    try:
        had = identity(json.loads((rd / CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise ConfigError(f"{rd}: a finished run with an unreadable config.json ({e}); {replace} to "
                          "rerun it") from None  # fmt: skip
    refuse_other(rd, had, want, replace)
    return True


def recorded(rd: Path, name: str = CONFIG_FILE) -> dict[str, Any]:
    """A run file's JSON, or a one-line error naming it."""
    try:
        return json.loads((rd / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{rd}: a finished run with an unreadable {name} ({e}); delete the folder "
                          "to rerun it") from None


def finished_run(run, rd: Path, cache, grid_prune: int = 0, replace: str = "delete that folder") -> bool:
    """Whether ``rd`` holds a finished run of ``run`` (a :class:`~.spec.RunSpec`) on ``cache``
    (a :class:`~..features.FeatureCache`); one finished with other options (``--bootstrap`` and
    ``--no-controls`` included), or on a cache of another build or identity
    (:func:`~.inputs.cache_identity`: dtypes, encoder configuration), is an error (``replace``:
    how the command replaces it); so is a run pruned by ``--grid-prune K`` when the sweep asks
    for another ``grid_prune`` (0: a full run). A run from before the identity was recorded is
    checked on the build alone.

    A folder's name holds only the options that differ from their defaults, so a run
    finished under other defaults (an older spar-bench) sits where ``run`` would write; so
    does the same encoder's run on another build. Skipping it would report the old run as
    this one.
    """
    from ..heads import head_defaults
    from .inputs import cache_identity

    if not (rd / METRICS_FILE).is_file():
        return False
    cache_fingerprint = cache.fingerprint
    try:
        cfg = json.loads((rd / CONFIG_FILE).read_text(encoding="utf-8"))
        had = {**cfg["head_config"], **cfg["run"]["train"], **{k: cfg["run"].get(k) for k in ("controls", "n_boot")}}
        old_cache = cfg["cache_fingerprint"]
        pruned = json.loads((rd / METRICS_FILE).read_text(encoding="utf-8"))["train"].get("pruned_at")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{rd}: a finished run with an unreadable config.json or metrics.json ({e}); delete the folder to rerun it") from None
    if old_cache != cache_fingerprint:
        raise ConfigError(f"{rd}: finished on a feature cache of another build ({cfg.get('features')}, build "
                          f"fingerprint {str(old_cache)[:12]}; this cache's {cache_fingerprint[:12]}); "
                          f"write to a new --out, or {replace} to rerun it")  # fmt: skip
    if "cache_identity" in cfg:
        refuse_other(rd, cfg["cache_identity"], cache_identity(cache), replace,
                     f" (its feature cache {cfg.get('features')}; this one {Path(cache.path).name})")
    if pruned is not None and pruned != grid_prune:
        asked = f"--grid-prune {grid_prune}" if grid_prune else "a full run"
        raise ConfigError(f"{rd}: pruned after epoch {pruned} (--grid-prune {pruned}) and this sweep asks for "
                          f"{asked}; rerun with --grid-prune {pruned}, or delete the folder to train it")  # fmt: skip
    want = json.loads(json.dumps(json_safe({**head_defaults(run.head), **run.head_config, **run.train.to_dict(),
                                            "controls": run.controls, "n_boot": run.n_boot})))
    refuse_other(rd, {k: v for k, v in had.items() if k != "device"}, {k: v for k, v in want.items() if k != "device"},
                 replace, " (other options, or defaults changed since)")  # fmt: skip
    return True


def kept_eval(out: Path, inputs: dict[str, Any], overwrite: bool) -> bool:
    """True when ``out`` (an ``eval-*.json``) holds this evaluation already: the same ``inputs``
    (kept as it is). One of other inputs is refused in one line unless ``overwrite``."""
    import click

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


def write_eval(out: Path, result: dict[str, Any]) -> Path:
    """An ``eval-*.json`` (a transfer evaluation of a finished run)."""
    out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    return out
