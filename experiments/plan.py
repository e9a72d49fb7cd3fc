"""An experiment as a plan: steps, each identified by the hash of its inputs and options.

:func:`make_plan` expands an :class:`~.config.Experiment` into steps in dependency order: each
step kind (:data:`~.steps.STEPS`, declared in :mod:`.step_kinds`) adds its steps, in its
declared order (builds, caches, heads, finetune/scratch, transfer evaluations, MLLMs,
predictors, the report). This module holds what every kind shares: :class:`Step` and
:class:`Plan`, the folders and paths of an experiment, the digests of outside inputs, and the
2-D and 3-D checks.

Level 4 (volumes) is checked here, before any step runs (:func:`check_kinds`): 3-D encoders
(:func:`encoder_kind`) take the Level 4 probes of builds that have Level 4, 2-D encoders the
others; a mix-up is one line naming the file, the line and the key.

A step holds data, not command lines: its specs, each ``(kind, record)`` with ``record`` the
JSON-safe config of one library call (:mod:`.runner` makes the call), its keys the fields of
the library's config objects (an experiment file's option keys are checked against them,
:func:`.steps.options`). A step's hash covers its specs (paths inside ``out`` written relative to
it), the hashes of the steps it needs, and the digests of what it reads from outside (an existing build's
manifest fingerprint, a weights file's size and modification time): a step whose hash is
recorded as finished is skipped, one recorded with another hash is redone (its outputs
removed first), never both silently.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_json
from spar_bench.probes.encoders import ALIASES
from spar_bench.probes.tasks import get_probe, probe_names
from spar_bench.probes.vqa.volume import check_volume_as

from .config import Experiment, error_at
from .steps import planned_kinds

#: the folder of each kind of output, under ``out``
BUILDS, CACHES, RUNS, REPORT, PLAN = "builds", "cache", "runs", "report", ".plan"


@dataclass(frozen=True)
class Step:
    """One unit of work: its specs (``(kind, record)``: the library call each runs, a JSON-safe
    record of its config; ``{out}`` stands for the experiment's folder), the steps it needs, the
    paths under ``out`` it owns, and its estimated cost."""

    id: str
    kind: str
    specs: tuple[tuple[str, dict[str, Any]], ...]
    needs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    inputs: tuple[tuple[str, str], ...] = ()  # (what, digest) read from outside the experiment
    cost: tuple[tuple[str, float], ...] = ()  # (unit, amount): images, runs, questions ...
    device: bool = False  # whether the specs take a device

    def ident(self, hashes: dict[str, str]) -> str:
        """sha256 of the specs, the needed steps' hashes and the outside inputs: a CLI flag's
        spelling is no part of it."""
        record = {"id": self.id, "kind": self.kind, "specs": [[k, d] for k, d in self.specs],
                  "needs": {n: hashes[n] for n in self.needs}, "inputs": list(self.inputs)}  # fmt: skip
        return sha256_json(record, default=str)


@dataclass
class Plan:
    experiment: Experiment
    steps: list[Step]
    hashes: dict[str, str]
    legacy: dict[str, str] | None = None  # the hashes 0.2 gave the steps (runner.legacy_hashes)

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.id == step_id:
                return s
        close = difflib.get_close_matches(step_id, [s.id for s in self.steps], n=1)
        hint = f"; did you mean {close[0]}?" if close else "; list the steps with --list"
        raise ConfigError(f"--only {step_id}: no such step in {self.experiment.source}{hint}")


# --------------------------------------------------------------------------- paths and digests
def build_dir(exp: Experiment, b: str) -> str:
    """Where build ``b`` is: its ``path:``, or ``{out}/builds/<b>``."""
    return exp.builds[b].path or f"{{out}}/{BUILDS}/{b}"


def cache_file(e: str, b: str) -> str:
    return f"{{out}}/{CACHE_DIR}/{e}@{b}.h5"


CACHE_DIR = CACHES


def run_folder(mode: str, e: str) -> str:
    """The runs of one mode x encoder: ``{out}/runs/<mode>-<encoder>`` (a step owns its folder)."""
    return f"{{out}}/{RUNS}/{mode}-{e}"


def path_digest(path: str) -> str:
    """What an outside input is: a build's fingerprint, a file's size and modification time."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        try:
            return "fingerprint:" + json.loads((p / "manifest.json").read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            return "unreadable manifest"
    if p.is_file():
        st = p.stat()
        return f"file:{st.st_size}:{st.st_mtime_ns}"
    if p.is_dir():  # every file's name, size and modification time (weights of one size that changed too)
        files = sorted((q.relative_to(p).as_posix(), q.stat().st_size, q.stat().st_mtime_ns)
                       for q in p.rglob("*") if q.is_file())
        return "folder:" + hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return "missing"


def local_path(spec: str) -> str | None:
    """The local file or folder an encoder spec names (``hf:DIR``, ``open_clip:local-dir:DIR``), or None."""
    parts = spec.split(":")
    for i in range(1, len(parts)):
        candidate = ":".join(parts[i:])
        if candidate and Path(candidate).exists():
            return candidate
    if spec.startswith("mllm:"):  # mllm:DIR@STAGE
        folder = spec.removeprefix("mllm:").rpartition("@")[0]
        return folder if folder and Path(folder).exists() else None
    return None


# --------------------------------------------------------------------------- 2-D and 3-D
#: the levels a build has when its options do not say (Level 4 is opt-in)
DEFAULT_LEVELS = ("level1", "level2", "level3")


def encoder_kind(spec: str) -> str | None:
    """``"3d"`` (reads Level 4 volumes: ``monai:``, a ``torchscript:`` file whose sidecar has a
    3-entry ``input_size``), ``"2d"`` (reads Levels 1-3 images: ``timm:``, ``hf:``, ``open_clip:``,
    ``dummy``, the aliases, a ``torchscript:`` file without such a sidecar), or None when the
    plan cannot tell (a ``torchscript:`` file not there yet, an encoder registered by a plugin)."""

    family, sep, rest = spec.partition(":")
    if not sep:
        return "2d" if spec == "dummy" or spec in ALIASES else None
    if family == "monai":
        return "3d"
    if family == "torchscript":
        if not Path(rest).is_file():
            return None
        side = Path(rest).with_name(Path(rest).name + ".json")
        try:
            size = json.loads(side.read_text()).get("input_size", ()) if side.is_file() else ()
        except (OSError, ValueError, AttributeError):
            return None
        return "3d" if isinstance(size, list) and len(size) == 3 else "2d"
    return "2d" if family in ("timm", "hf", "open_clip", "mllm") else None


def is_volume_probe(probe: str) -> bool:
    """Whether ``probe`` is asked of whole volumes (Level 4)."""

    return bool(LEVEL_SPECS[get_probe(probe).level].volume)


def build_levels(exp: Experiment, b: str) -> tuple[str, ...] | None:
    """The levels build ``b`` has: its ``levels`` option (default Levels 1-3), or for a
    ``path:`` build those of its manifest; None when unreadable."""
    bd = exp.builds[b]
    if bd.path:
        try:
            return tuple(json.loads((Path(bd.path) / "manifest.json").read_text())["counts"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    given = next((bd.options[k] for k in ("levels",) if k in bd.options), None)
    if given is None:
        return DEFAULT_LEVELS
    return tuple(str(x).strip() for x in (given if isinstance(given, list) else str(given).split(",")) if str(x).strip())



def _trained(exp: Experiment) -> list[str]:
    """Every encoder a mode trains on or caches (each once, in the file's order)."""
    return list(dict.fromkeys(e for m in exp.modes.values() for e in m.encoders))


def encoder_probes(exp: Experiment, e: str) -> tuple[str, ...]:
    """The probes of encoder ``e``: those of its kind among ``probes:``; ``all``: every probe of
    its kind (written ``all`` for a 2-D encoder on a build without Level 4, as before Level 4,
    and for an encoder of unknown kind); an encoder left with none is one line."""

    if exp.encoders[e].probe:  # a question stage: its cache holds one probe's questions
        return (exp.encoders[e].probe,)
    kind = encoder_kind(exp.encoders[e].spec)
    if kind is None:
        return exp.probes
    if "all" in exp.probes:
        if kind == "2d" and "level4" not in (build_levels(exp, exp.train_on) or ()):
            return exp.probes
        return tuple(p for p in probe_names() if is_volume_probe(p) == (kind == "3d"))
    mine = tuple(p for p in exp.probes if is_volume_probe(p) == (kind == "3d"))
    if not mine:
        what = ("3-D: it reads Level 4 volumes, and probes: has no level4 probe" if kind == "3d" else
                "2-D: it reads Levels 1-3 images, and probes: has only level4 (volume) probes")
        raise error_at(exp, f"encoders.{e}.spec", f"{exp.encoders[e].spec} is {what}; add probes of its levels "
                                                 "or drop it from modes")  # fmt: skip
    return mine


def _check_levels(exp: Experiment, e: str, builds: tuple[str, ...]) -> None:
    """Every build encoder ``e`` reads has the levels of its kind."""
    kind = encoder_kind(exp.encoders[e].spec)
    for b in builds:
        levels = build_levels(exp, b)
        if kind is None or levels is None:
            continue
        where = f"builds.{b}.options.levels"
        where = where if exp.where is not None and where in exp.where.lines else f"builds.{b}"
        if kind == "3d" and "level4" not in levels:
            raise error_at(exp, where, f"has no level4 (levels {','.join(levels)}), which 3-D encoder {e} "
                                             "reads: add level4 to its options' levels")  # fmt: skip
        if kind == "2d" and not set(levels) & set(DEFAULT_LEVELS):
            raise error_at(exp, where, f"has only {','.join(levels)}, and 2-D encoder {e} reads Levels 1-3 "
                                             "images: add them to its options' levels")  # fmt: skip


def check_kinds(exp: Experiment) -> None:
    """2-D and 3-D at plan time: each encoder has probes and builds of its kind, each listed
    probe is taken by an encoder, and an MLLM shown volumes (``volume_as``) reads a Level 4 build."""
    trained = _trained(exp)
    for e in trained:
        encoder_probes(exp, e)
        _check_levels(exp, e, (exp.train_on, *exp.transfer))
    kinds = {encoder_kind(exp.encoders[e].spec) for e in trained}
    if trained and None not in kinds and "all" not in exp.probes:
        for i, p in enumerate(exp.probes):
            if ("3d" if is_volume_probe(p) else "2d") not in kinds:
                key = f"probes[{i}]" if exp.where is not None and f"probes[{i}]" in exp.where.lines else "probes"
                need = "3-D (Level 4 volumes)" if is_volume_probe(p) else "2-D (Levels 1-3 images)"
                raise error_at(exp, key, f"{p} needs a {need} encoder, and modes have none")
    for n in exp.mllms:
        _check_volume_as(exp, n)


def _check_volume_as(exp: Experiment, n: str) -> None:
    """An MLLM's ``volume_as``: a known way to show a volume, on builds that have Level 4."""

    m = exp.mllms[n]
    key = next((k for k in ("volume_as", "volume-as") if k in m.options), None)
    if key is None:
        return
    try:
        check_volume_as(str(m.options[key]))
    except ConfigError as e:
        raise error_at(exp, f"mllms.{n}.options.{key}", str(e)) from None
    for b in m.builds:
        levels = build_levels(exp, b)
        if levels is not None and "level4" not in levels:
            raise error_at(exp, f"mllms.{n}.options", f"volume_as shows Level 4 volumes, and build {b} has no "
                                                    "level4: add level4 to its options' levels")  # fmt: skip


def make_plan(exp: Experiment) -> Plan:
    """Every step of ``exp`` in dependency order, with its hash: each step kind adds its steps
    (:data:`~.steps.STEPS`, in their declared order), after those it may need."""
    check_kinds(exp)
    steps: list[Step] = []
    for _, kind in planned_kinds():
        steps += kind.plan(exp, steps)
    hashes: dict[str, str] = {}
    for s in steps:
        hashes[s.id] = s.ident(hashes)
    return Plan(exp, steps, hashes)


def partition(plan: Plan, i: int, n: int) -> list[Step]:
    """Partition ``i`` of ``n`` (1-based): a contiguous run of the steps in dependency order, so
    partitions 1..n run one after another do the whole plan, each after its inputs."""
    k = len(plan.steps)
    lo, hi = (i - 1) * k // n, i * k // n
    return plan.steps[lo:hi]
