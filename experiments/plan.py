"""An experiment as a plan: steps, each identified by the hash of its inputs and options.

:func:`make_plan` expands an :class:`~.config.Experiment` into steps in dependency order:

* ``build:<b>``: a phantom generated and built, or sources built (``spar-build``);
* ``cache:<e>@<b>``: the feature cache of frozen encoder ``e`` over build ``b``;
* ``heads:<e>``: the heads of the frozen mode, every probe x seed (``spar-probe sweep``);
* ``<mode>:<e>``: encoder and head trained end to end, ``finetune`` or ``scratch``;
* ``eval:<step>@<b>``: every run of a heads/finetune/scratch step scored on transfer build
  ``b`` without retraining (``spar-probe eval``: on ``b``'s cache, or re-encoding ``b``);
* ``vqa:<m>@<b>``: an MLLM asked build ``b``'s Level 3 (and Level 4) questions (``spar-probe vqa``);
* ``report``: ``spar-probe report`` and the experiment's report over every run.

Level 4 (volumes) is checked here, before any step runs (:func:`check_kinds`): 3-D encoders
(:func:`encoder_kind`) take the Level 4 probes of builds that have Level 4, 2-D encoders the
others; a mix-up is one line naming the file, the line and the key.

A step holds data, not command lines: its specs, each ``(kind, record)`` with ``record`` the
JSON-safe config of one library call (:mod:`.runner` makes the call), its keys the fields of
the library's config objects (an experiment file's option keys are checked against them,
:func:`options`). A step's hash covers its specs (paths inside ``out`` written relative to
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

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_json

from . import sizes
from .config import Experiment

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


# --------------------------------------------------------------------------- options as spec fields
#: spellings an experiment file may use for a spec field: today's CLI-only and old spellings
#: (``!``: the field is the negation, ``hf: false`` sets ``no_hf``)
ALIASES: dict[str, dict[str, str]] = {
    "phantom": {"slices": "n_slices"},
    "build": {"workers": "jobs", "hf": "!no_hf"},
    "cache": {"workers": "loader_workers", "batch": "batch_size"},
    "sweep": {"bootstrap": "n_boot", "no_controls": "!controls"},
    "finetune": {"bootstrap": "n_boot", "no_controls": "!controls", "loader_workers": "workers"},
    "vqa": {"bootstrap": "n_boot", "probe": "probes", "cache": "cache_path", "seed": "seeds",
            "no_convention_hint": "!convention_hint",
            "no_circular": "!circular", "no_blind": "!blind"},
}  # fmt: skip
#: fields a step sets itself (from the file's other keys), never an option
_OWN = {"phantom": {"out"}, "build": {"source", "root", "out", "resume", "overwrite"},
        "cache": {"weights", "random_init", "revision", "model_args", "async_writes", "probe"},
        "sweep": {"features", "heads", "probes", "seeds", "out", "only", "partition", "options"},
        "finetune": {"encoder", "data", "probe", "head", "seed", "cfg", "head_cfg", "model_kwargs", "resume"},
        "vqa": set()}  # fmt: skip


def spec_fields(kind: str) -> dict[str, str]:
    """The options a step of ``kind`` takes: each field of the library's config and its type (text)."""
    from dataclasses import fields

    if kind == "phantom":
        from spar_bench.builder.phantom.generate import PhantomOptions

        found = {"n": "int", **{f.name: str(f.type) for f in fields(PhantomOptions)}}
    elif kind == "build":
        from spar_bench.builder.build import BUILD_OPTIONS, BuildConfig
        from spar_bench.builder.samples.config import SampleConfig

        types = {f.name: str(f.type) for c in (BuildConfig, SampleConfig) for f in fields(c)}
        found = {k: types.get("workers" if k == "jobs" else k, "") for k in BUILD_OPTIONS}
        found["no_hf"] = "bool"
    elif kind == "cache":
        from spar_bench.probes.cache import CacheOptions

        found = {**{f.name: str(f.type) for f in fields(CacheOptions)}, "token_grid": "int", "token_proj": "str",
                 "token_int8": "bool"}  # fmt: skip
    elif kind == "sweep":
        from spar_bench.probes.runs.spec import OPTIONS
        from spar_bench.probes.runs.sweep import SweepConfig

        found = {**{f.name: str(f.type) for f in fields(SweepConfig)},
                 **{o.name: o.type.__name__ if o.type in (int, float, bool, str) else "proj_width"
                    for o in OPTIONS.values()}}  # fmt: skip
    elif kind == "finetune":
        from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec

        found = {f.name: str(f.type) for c in (FinetuneConfig, FinetuneSpec) for f in fields(c)}
        found["threads"] = "int"
    else:
        from spar_bench.probes.vqa.options import VqaOptions

        found = {f.name: str(f.type) for f in fields(VqaOptions)}
    return {k: v for k, v in found.items() if k not in _OWN[kind]}


def options(kind: str, given: dict[str, Any], key: str, exp: Experiment) -> dict[str, Any]:
    """``given`` (an experiment file's ``{samples_per_case: 8, hf: false}``) as the fields of
    ``kind``'s spec (:data:`ALIASES` resolved, values of the field's type); a key that is no
    field is one line naming the file, the line and the key, with a close one."""
    known, aliases = spec_fields(kind), ALIASES.get(kind, {})
    out: dict[str, Any] = {}
    for k, v in given.items():
        name = k.replace("-", "_")
        name = aliases.get(name, name)
        negate = name.startswith("!")
        name = name.lstrip("!")
        if name not in known:
            close = difflib.get_close_matches(k.replace("-", "_"), [*known, *aliases], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"
            raise error_at(exp, f"{key}.{k}", f"not an option of a {kind} step{hint}")
        value = _typed(v, known[name], exp, f"{key}.{k}")
        out[name] = (not value) if negate else value
    return out


def _typed(v: Any, type_text: str, exp: Experiment, key: str) -> Any:
    """``v`` as the field's scalar type, as the command line read it: ``1e-3`` (text to YAML) or
    ``1`` where a float is taken is the float, ``"true"`` a bool, ``448`` where text is taken the text."""
    first = type_text.split("|")[0].strip()
    if isinstance(v, bool) or v is None or isinstance(v, (list, dict)):
        return v
    try:
        if first == "bool" and isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if first == "bool":
            raise ValueError
        if first == "float":
            return float(v)
        if first == "int" and isinstance(v, str):
            return int(v)
        if first == "proj_width":  # a token head's PCA width, or none
            from spar_bench.probes.runs.spec import proj_width

            return proj_width(v)
    except ValueError:
        raise error_at(exp, key, f"expected {_TYPE_WORDS.get(first, first)}, got {v!r}") from None
    return str(v) if first == "str" and isinstance(v, (int, float)) else v


_TYPE_WORDS = {"bool": "a switch: true or false", "int": "an integer", "float": "a number", "proj_width": "a width >= 1 or none"}


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


def _path_digest(path: str) -> str:
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


def build_choice(exp: Experiment, b: str) -> sizes.Choice:
    """What build ``b`` makes (:class:`~.sizes.Choice`): its sources, roots, options with the
    preset filled in, and levels."""
    bd = exp.builds[b]
    if bd.phantom is not None:
        sources, roots, n = ("phantom",), (), int(bd.phantom.get("n", 12))
    else:
        sources, roots, n = tuple(bd.sources), tuple(bd.roots), None
    given = options("build", bd.options, f"builds.{b}.options", exp)
    return sizes.Choice(sources, roots, sizes.with_preset(given, sources), build_levels(exp, b) or DEFAULT_LEVELS, n)


def case_count(exp: Experiment, b: str) -> int:
    """Cases build ``b`` will have: a phantom's ``n``, else its sources' cases (on disk, else
    their public sizes) as its own selection (``limit``, ``cases``, a preset's) keeps them."""
    return sizes.case_total(build_choice(exp, b))


def _manifest_counts(exp: Experiment, b: str) -> dict[str, Any] | None:
    bd = exp.builds[b]
    where = Path(bd.path) if bd.path else exp.out / BUILDS / b
    try:
        counts = json.loads((where / "manifest.json").read_text())["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return counts if isinstance(counts, dict) else None


def estimated_images(exp: Experiment, b: str, kind: str | None = None) -> int:
    """Images of build ``b`` (``kind`` ``"3d"``: its Level 4 volumes instead): counted from its
    manifest when it exists, else estimated (:mod:`.sizes`: the build's selected cases x the
    measured images per case of each source, its levels and counterfactual copies)."""
    counts = _manifest_counts(exp, b)
    if counts is not None:
        count = (lambda v: v.get("volumes", 0)) if kind == "3d" else (lambda v: v.get("samples", v.get("slices", 0)))
        try:
            return int(sum(count(v) for lv in counts.values() for v in lv.values() if isinstance(v, dict)))
        except (AttributeError, TypeError):
            pass
    return int(round(sizes.images(build_choice(exp, b), volumes=kind == "3d")))


def estimated_questions(exp: Experiment, b: str) -> int:
    """Level 3 and Level 4 questions of build ``b``'s test split (what an MLLM is asked):
    counted from its manifest when it exists, else estimated (:mod:`.sizes`)."""
    counts = _manifest_counts(exp, b)
    if counts is not None:
        try:
            return int(sum(lv.get("test", {}).get("questions", 0) for name, lv in counts.items()
                           if name in ("level3", "level4")))  # fmt: skip
        except (AttributeError, TypeError):
            pass
    return int(round(sizes.questions(build_choice(exp, b))))


# --------------------------------------------------------------------------- 2-D and 3-D
#: the levels a build has when its options do not say (Level 4 is opt-in)
DEFAULT_LEVELS = ("level1", "level2", "level3")


def encoder_kind(spec: str) -> str | None:
    """``"3d"`` (reads Level 4 volumes: ``monai:``, a ``torchscript:`` file whose sidecar has a
    3-entry ``input_size``), ``"2d"`` (reads Levels 1-3 images: ``timm:``, ``hf:``, ``open_clip:``,
    ``dummy``, the aliases, a ``torchscript:`` file without such a sidecar), or None when the
    plan cannot tell (a ``torchscript:`` file not there yet, an encoder registered by a plugin)."""
    from spar_bench.probes.encoders import ALIASES

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
    from spar_bench.builder.schema import LEVEL_SPECS
    from spar_bench.probes.tasks import get_probe

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


def error_at(exp: Experiment, key: str, message: str) -> ConfigError:
    at = exp.where.at(key) if exp.where is not None else exp.source
    return ConfigError(f"{at}: {key}: {message}")


def _trained(exp: Experiment) -> list[str]:
    """Every encoder a mode trains on or caches (each once, in the file's order)."""
    return list(dict.fromkeys(e for m in exp.modes.values() for e in m.encoders))


def encoder_probes(exp: Experiment, e: str) -> tuple[str, ...]:
    """The probes of encoder ``e``: those of its kind among ``probes:``; ``all``: every probe of
    its kind (written ``all`` for a 2-D encoder on a build without Level 4, as before Level 4,
    and for an encoder of unknown kind); an encoder left with none is one line."""
    from spar_bench.probes.tasks import probe_names

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
    from spar_bench.probes.vqa.volume import check_volume_as

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


# --------------------------------------------------------------------------- the steps
def build_step(exp: Experiment, b: str) -> Step | None:
    bd = exp.builds[b]
    if bd.path:
        return None
    out = build_dir(exp, b)
    specs: list[tuple[str, dict[str, Any]]] = []
    if bd.phantom is not None:
        ph = options("phantom", {"n": 12, "layout": "canonical", **bd.phantom}, f"builds.{b}.phantom", exp)
        root = f"{{out}}/{BUILDS}/{b}-phantom"
        specs.append(("phantom", {"out": root, **ph}))
        sources, roots = ["phantom"], [root]
    else:
        sources, roots = list(bd.sources), list(bd.roots)
    record: dict[str, Any] = {"source": sources, "root": roots, "out": out}
    needs: tuple[str, ...] = ()
    if bd.thresholds_from:  # another build's size/distance thresholds: it comes first
        record["thresholds_from"] = build_dir(exp, bd.thresholds_from)
        needs = _needs_build(exp, bd.thresholds_from)
    specs.append(("build", {**record, "options": options("build", bd.options, f"builds.{b}.options", exp)}))
    inputs = tuple((r, _path_digest(r)) for r in roots if not r.startswith("{out}"))
    return Step(f"build:{b}", "build", tuple(specs), needs, outputs=(out, f"{out}.tmp", *(roots if bd.phantom is not None else ())),
                inputs=inputs, cost=_build_cost(exp, b))  # fmt: skip


def _build_cost(exp: Experiment, b: str) -> tuple[tuple[str, float], ...]:
    """A build's cases and the seconds one process takes to build them (measured per source)."""
    choice = build_choice(exp, b)
    return (("cases", float(sizes.case_total(choice))), ("build_seconds", sizes.build_seconds(choice)))


def _needs_build(exp: Experiment, b: str) -> tuple[str, ...]:
    return () if exp.builds[b].path else (f"build:{b}",)


def _encoder(exp: Experiment, e: str) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """Encoder ``e``'s record (spec, and weights or revision when given) and its outside inputs."""
    enc = exp.encoders[e]
    record: dict[str, Any] = {"encoder": enc.spec}
    if enc.weights:
        record["weights"] = enc.weights
    if enc.revision:
        record["revision"] = enc.revision
    inputs = ((enc.weights, _path_digest(enc.weights)),) if enc.weights else ()
    local = local_path(enc.spec)
    if local:
        inputs += ((local, _path_digest(local)),)
    return record, inputs


def cache_step(exp: Experiment, e: str, b: str) -> Step:
    record, inputs = _encoder(exp, e)
    enc = exp.encoders[e]
    if enc.random_init:
        record["random_init"] = True
    if enc.model_args:  # e.g. a monai: encoder's input_size
        record["model_args"] = enc.model_args
    if enc.probe:  # a question stage: the cache of one probe's questions
        record["probe"] = enc.probe
    record.update(data=build_dir(exp, b), out=cache_file(e, b),
                  options=options("cache", exp.modes["frozen"].cache, "modes.frozen.cache", exp))
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, _path_digest(exp.builds[b].path)),)
    return Step(f"cache:{e}@{b}", "cache", (("cache", record),), _needs_build(exp, b),
                (cache_file(e, b),), inputs, _encode_cost(exp, e, b), device=True)


def _path_data(exp: Experiment, b: str) -> dict[str, str]:
    """``data: DIR`` for a ``path:`` build read through its cache: a cache records its build
    folder only when it lies beside the cache's folder (no local path is published)."""
    return {"data": build_dir(exp, b)} if exp.builds[b].path else {}


def _encode_cost(exp: Experiment, e: str, b: str) -> tuple[tuple[str, float], ...]:
    """What encoding build ``b`` with encoder ``e`` costs: its images, or a 3-D encoder's volumes."""
    kind = encoder_kind(exp.encoders[e].spec)
    return (("volumes" if kind == "3d" else "images", float(estimated_images(exp, b, kind))),)


def _runs(exp: Experiment, e: str, heads: tuple[str, ...]) -> dict[str, Any]:
    return {"heads": list(heads), "probes": list(encoder_probes(exp, e)), "seeds": list(exp.seeds)}


def _n_runs(exp: Experiment, e: str, heads: tuple[str, ...]) -> int:
    from spar_bench.probes.tasks import probe_names

    probes = encoder_probes(exp, e)
    if "all" in probes:  # a 2-D encoder, or one of unknown kind: the probes of Levels 1-3
        probes = tuple(p for p in probe_names() if not is_volume_probe(p))
    return len(heads) * len(exp.seeds) * len(probes)


def heads_step(exp: Experiment, e: str) -> Step:
    m, b = exp.modes["frozen"], exp.train_on
    record = {"features": cache_file(e, b), **_path_data(exp, b), **_runs(exp, e, m.heads), "jobs": exp.jobs,
              "out": run_folder("frozen", e), "options": options("sweep", m.options, "modes.frozen.options", exp)}  # fmt: skip
    runs = _n_runs(exp, e, m.heads)
    images = estimated_images(exp, b, encoder_kind(exp.encoders[e].spec))
    return Step(f"heads:{e}", "heads", (("sweep", record),), (f"cache:{e}@{b}",), (run_folder("frozen", e),),
                cost=(("runs", float(runs)), ("run_images", float(runs * images))), device=True)


def train_step(exp: Experiment, mode: str, e: str) -> Step:
    """``finetune`` or ``scratch``: encoder + head trained end to end on the training build."""
    m, b = exp.modes[mode], exp.train_on
    record, inputs = _encoder(exp, e)
    enc = exp.encoders[e]
    if mode == "scratch":
        record["init"] = "scratch"
    if enc.model_args:
        record["model_kwargs"] = enc.model_args
    record.update(data=build_dir(exp, b), **_runs(exp, e, m.heads), out=run_folder(mode, e),
                  options=options("finetune", m.options, f"modes.{mode}.options", exp))
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, _path_digest(exp.builds[b].path)),)
    runs = _n_runs(exp, e, m.heads)
    epochs = float(m.options.get("max_epochs", 20))
    images = estimated_images(exp, b, encoder_kind(enc.spec))
    return Step(f"{mode}:{e}", "train", (("finetune", record),), _needs_build(exp, b),
                (run_folder(mode, e),), inputs,
                (("runs", float(runs)), ("train_images", runs * epochs * images / 3)), device=True)


def eval_step(exp: Experiment, source: Step, b: str) -> Step:
    """Every run of ``source`` (a heads or train step) scored on transfer build ``b``."""
    mode, e = source.id.split(":", 1)
    frozen = mode == "heads"
    needs = (source.id, f"cache:{e}@{b}") if frozen else (source.id, *_needs_build(exp, b))
    target = cache_file(e, b) if frozen else build_dir(exp, b)
    local = exp.encoders[e].spec if not frozen and local_path(exp.encoders[e].spec) else None
    record = {"runs": source.outputs[0], ("features" if frozen else "data"): target, "encoder": local}
    if frozen and exp.builds[b].path:  # a path: build read through its cache (see _path_data)
        record["data"] = build_dir(exp, b)
    return Step(f"eval:{source.id}@{b}", "eval", (("eval", record),), needs, (), (), _encode_cost(exp, e, b),
                device=not frozen)


def vqa_step(exp: Experiment, name: str, b: str) -> Step:
    m = exp.mllms[name]
    out = f"{{out}}/{RUNS}/mllm-{name}" + ("" if b == exp.train_on else f"@{b}")
    record = {"model": m.model, "data": build_dir(exp, b), "out": out,
              "options": options("vqa", m.options, f"mllms.{name}.options", exp)}
    return Step(f"vqa:{name}@{b}", "vqa", (("vqa", record),), _needs_build(exp, b), (out,),
                cost=(("questions", float(estimated_questions(exp, b))),),
                device=m.model.startswith("hf:"))


def predict_step(exp: Experiment, name: str, b: str) -> Step:
    """A build-reading run kind (``predictors:``) on every probe x seed of build ``b``."""
    pr = exp.predictors[name]
    out = f"{{out}}/{RUNS}/predict-{name}" + ("" if b == exp.train_on else f"@{b}")
    record = {"kind": pr.kind, "data": build_dir(exp, b), "probes": list(exp.probes), "seeds": list(exp.seeds),
              "n_boot": pr.n_boot, "out": out, **({"options": pr.options} if pr.options else {})}  # fmt: skip
    return Step(f"predict:{name}@{b}", "predict", (("predict", record),), _needs_build(exp, b), (out,),
                cost=(("runs", float(len(exp.probes) * len(exp.seeds))),))


def report_step(exp: Experiment, needs: tuple[str, ...]) -> Step:
    record = {"runs": f"{{out}}/{RUNS}", "out": f"{{out}}/{REPORT}", "title": exp.title}
    return Step("report", "report", (("report", record),), needs, (f"{{out}}/{REPORT}",))


def _build_order(exp: Experiment) -> list[str]:
    """The builds in the file's order, each after the build whose thresholds it takes."""
    order: list[str] = []

    def visit(b: str, seen: tuple[str, ...]) -> None:
        if b in order:
            return
        if b in seen:
            raise ConfigError(f"{exp.source}: builds.{b}.thresholds_from: a cycle ({' -> '.join((*seen, b))})")
        dep = exp.builds[b].thresholds_from
        if dep:
            visit(dep, (*seen, b))
        order.append(b)

    for b in exp.builds:
        visit(b, ())
    return order


def make_plan(exp: Experiment) -> Plan:
    """Every step of ``exp`` in dependency order, with its hash."""
    check_kinds(exp)
    steps: list[Step] = [s for b in _build_order(exp) if (s := build_step(exp, b)) is not None]
    trained: list[Step] = []
    frozen = exp.modes.get("frozen")
    for e in (frozen.encoders if frozen else ()):
        steps += [cache_step(exp, e, b) for b in (exp.train_on, *exp.transfer)]
        trained.append(heads_step(exp, e))
    for mode in ("finetune", "scratch"):
        trained += [train_step(exp, mode, e) for e in (exp.modes[mode].encoders if mode in exp.modes else ())]
    steps += trained
    steps += [eval_step(exp, t, b) for t in trained for b in exp.transfer]
    steps += [vqa_step(exp, n, b) for n, m in exp.mllms.items() if m.answers for b in m.builds]
    steps += [predict_step(exp, n, b) for n, p in exp.predictors.items() for b in p.builds]
    runs = [s.id for s in steps if s.kind in ("heads", "train", "eval", "vqa", "predict")]
    if runs:
        steps.append(report_step(exp, tuple(runs)))
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
