"""An experiment file: read, with variables, validated against one schema.

``spar-bench run EXPERIMENT.yaml`` reads a YAML mapping (docs/EXPERIMENTS.md):

* ``experiment``: its name; ``vars``: variables, used as ``${NAME}`` in any string below
  (also ``${env:NAME}``; a ``${NAME}`` that no ``vars`` entry and no ``--set`` defines is read
  from the environment), so one file serves every lab (``${WEIGHTS}/rad-dino``);
* ``out``: the folder everything is written under (``builds/``, ``cache/``, ``runs/``,
  ``report/``, ``.plan/``);
* ``builds``: each a phantom (``phantom:``), sources with roots (``sources:``/``roots:``), or
  an existing build folder (``path:``), with ``spar-build`` options;
* ``encoders``: ``spec`` (``timm:resnet50``; 3-D, for Level 4 volumes: ``monai:resnet10``),
  ``weights`` or a pinned ``revision``, ``random_init: true`` only when written, and
  ``model_args`` (the constructor's, to ``cache`` and ``finetune``);
* ``modes``: ``frozen`` (heads on a feature cache), ``finetune`` and ``scratch`` (encoder and
  head trained end to end), each with its encoders, heads and options;
* ``probes``, ``seeds``, ``train_on`` (the build heads train on), ``transfer`` (builds every
  trained run is scored on, zero-shot), ``mllms`` (``spar-probe vqa`` models; with ``stages:``
  also the model's own features, one frozen encoder ``<name>-<stage>`` per stage: ``vision``,
  ``projector``, ``llm:N``, ``answer`` for its VQA run, and ``llm:N+q`` (the question in the
  prompt) one encoder ``<name>-llmNq-<probe>`` per Level 3 probe, cached for that probe's
  questions), ``report``.

Every error is one line naming the file, the line and the key, with "did you mean" for a
misspelt key.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spar_bench.errors import ConfigError
from spar_bench.probes.encoders.mllm_family import asks_question, parse_stage
from spar_bench.probes.heads import head_defaults
from spar_bench.probes.kinds import run_kind
from spar_bench.probes.tasks import get_probe, probe_names

#: the keys of each section (``*``: any name, whose value has the schema of the entry)
SCHEMA: dict[str, Any] = {
    "experiment": str, "description": str, "vars": {"*": (str, int, float)}, "out": str,
    "builds": {"*": {"phantom": {"n": int, "layout": str, "seed": int, "intensities": str, "size": str,
                                 "in_plane": int, "slices": int, "lesions": bool, "jobs": int},
                     "sources": [str], "roots": [str], "path": str, "thresholds_from": str,
                     "options": {"*": object}}},
    "encoders": {"*": {"spec": str, "weights": str, "revision": str, "random_init": bool,
                       "model_args": {"*": object}, "label": str}},
    "modes": {"frozen": {"encoders": [str], "heads": [str], "options": {"*": object}, "cache": {"*": object}},
              "finetune": {"encoders": [str], "heads": [str], "options": {"*": object}},
              "scratch": {"encoders": [str], "heads": [str], "options": {"*": object}}},
    "probes": (str, [str]), "seeds": (int, [int]), "train_on": str, "transfer": [str],
    "mllms": {"*": {"model": str, "builds": [str], "options": {"*": object}, "stages": [str]}},
    "predictors": {"*": {"kind": str, "builds": [str], "bootstrap": int, "options": {"*": object}}},
    "calibration": {"*": object},  # the calibration step's options (experiments/calibration.py:CalibrationConfig)
    "jobs": int, "report": {"title": str},
    "resources": {"*": {"cpus": int, "mem": (str, int), "gpus": int, "time": (str, int)}},
}  # fmt: skip
#: the kinds of step (:mod:`.plan`), as ``resources:`` names them (``default``: every kind)
KINDS = ("build", "cache", "heads", "train", "eval", "vqa", "predict", "calibration", "report")
#: what each mode runs: heads on a cache of a frozen encoder, or the encoder trained end to end
MODES = ("frozen", "finetune", "scratch")
_VAR = re.compile(r"\$\{(env:)?([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Build:
    name: str
    phantom: dict[str, Any] | None = None
    sources: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()
    path: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    thresholds_from: str | None = None  # another build of the experiment (a dependency)


@dataclass(frozen=True)
class Encoder:
    name: str
    spec: str
    weights: str | None = None
    revision: str | None = None
    random_init: bool = False
    model_args: dict[str, Any] | None = None
    label: str | None = None
    #: the one probe a question stage (``mllm:DIR@llm:N+q``) is cached and trained for
    probe: str | None = None


@dataclass(frozen=True)
class Mode:
    name: str
    encoders: tuple[str, ...]
    heads: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Mllm:
    """An MLLM asked the questions (``answer``) and, with ``stages``, probed at its stages."""

    name: str
    model: str
    builds: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    stages: tuple[str, ...] = ()  # empty: its VQA run only

    @property
    def answers(self) -> bool:
        """Whether its VQA run is made: no ``stages:``, or ``answer`` among them."""
        return not self.stages or ANSWER in self.stages


#: the stage of an ``mllms:`` entry that is its own VQA run (the others are frozen encoders)
ANSWER = "answer"


def stage_encoder_name(mllm: str, stage: str, probe: str | None = None) -> str:
    """The encoder an MLLM's stage becomes: ``qwen`` + ``llm:16`` -> ``qwen-llm16`` (a file name);
    a question stage's, one per probe: ``qwen`` + ``llm:16+q`` + ``level3.size`` -> ``qwen-llm16q-size``."""
    name = f"{mllm}-{stage.replace(':', '').replace('+', '')}"
    return name if probe is None else f"{name}-{probe.split('.', 1)[-1]}"


def _question_probes(probes: tuple[str, ...], key: str, where: _Where) -> tuple[str, ...]:
    """The Level 3 probes of ``probes:`` (``all``: every one), which a question stage is cached for."""

    names = probe_names() if "all" in probes else probes
    found = tuple(p for p in names if get_probe(p).level == "level3")
    if not found:
        raise where.error(key, "a question stage (llm:N+q) reads Level 3 questions, and probes: has no level3 probe")
    return found


def _stage_encoders(mllms: dict[str, Any], probes: tuple[str, ...], where: _Where) -> dict[str, Encoder]:
    """One frozen encoder ``mllm:DIR@STAGE`` per stage of each ``mllms:`` entry with ``stages:``
    (its model a local ``hf:DIR``; a folder not there is one line at plan time); a question
    stage ``llm:N+q`` one per Level 3 probe of ``probes`` (its cache is made for that probe's
    questions)."""

    out: dict[str, Encoder] = {}
    for n, m in mllms.items():
        if not m.stages:
            continue
        family, _, folder = m.model.partition(":")
        if family != "hf" or not Path(folder).is_dir():
            what = "is not a folder" if family == "hf" else "is not a local hf:DIR model"
            raise where.error(f"mllms.{n}.model", f"{m.model} {what}; stages: probe a local save_pretrained "
                                                  "folder (give its path, e.g. through a ${VARIABLE})")
        for i, st in enumerate(m.stages):
            if st == ANSWER:
                continue
            try:
                parse_stage(st, n)
            except ConfigError as e:
                raise where.error(f"mllms.{n}.stages[{i}]", f"{e} or {ANSWER}") from None
            asked = _question_probes(probes, f"mllms.{n}.stages[{i}]", where) if asks_question(st) else (None,)
            for p in asked:
                name = stage_encoder_name(n, st, p)
                out[name] = Encoder(name, f"mllm:{folder}@{st}", label=f"{n} @ {st}", probe=p)
    return out


def _modes(exp: dict[str, Any], encoders: dict[str, Encoder], stages: dict[str, Encoder]) -> dict[str, Mode]:
    """``modes:``, the stage encoders added to ``frozen`` (made with the default head when absent);
    ``finetune``/``scratch`` without ``encoders:`` train every encoder but the stages."""
    modes = {m: Mode(m, tuple(d.get("encoders") or encoders), tuple(d.get("heads") or ("mlp",)),
                     dict(d.get("options") or {}), dict(d.get("cache") or {}))
             for m, d in (exp.get("modes") or {}).items()}  # fmt: skip
    if stages:
        frozen = modes.get("frozen", Mode("frozen", (), ("mlp",)))
        kept = tuple(e for e in frozen.encoders if e not in stages)
        modes["frozen"] = Mode("frozen", (*kept, *stages), frozen.heads, frozen.options, frozen.cache)
    return modes


@dataclass(frozen=True)
class Predictor:
    """A run kind that reads a build (``prior``, ``oracle``, a plug-in's), scored on every probe x seed."""

    name: str
    kind: str
    builds: tuple[str, ...] = ()
    n_boot: int = 1000
    options: dict[str, Any] = field(default_factory=dict)  # the kind's own (PredictorSpec.options)


@dataclass(frozen=True)
class Experiment:
    """A validated experiment file (paths as written, variables substituted)."""

    name: str
    source: str  # the file, as given
    sha256: str  # of the file's bytes
    out: Path
    builds: dict[str, Build]
    encoders: dict[str, Encoder]
    modes: dict[str, Mode]
    probes: tuple[str, ...]
    seeds: tuple[int, ...]
    train_on: str
    transfer: tuple[str, ...]
    mllms: dict[str, Mllm]
    predictors: dict[str, Predictor] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None  # ``calibration:``: its step's options (None: no such step)
    jobs: int = 1
    title: str = ""
    variables: dict[str, str] = field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)  # step kind -> SLURM resources
    where: Any = field(default=None, compare=False, repr=False)  # key -> file:line, for errors


# --------------------------------------------------------------------------- YAML with lines
class _Where:
    """The file and the line of every key path (``builds.demo.options``)."""

    def __init__(self, path: str):
        self.path, self.lines = path, {}

    def at(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else self.path

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.at(key)}: {key}: {message}" if key else f"{self.path}: {message}")


def _to_python(node, where: _Where, key: str = "") -> Any:
    """A composed YAML node as Python, recording each key's line."""

    where.lines.setdefault(key, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k, v in node.value:
            name = str(_to_python(k, where, key))
            path = f"{key}.{name}" if key else name
            if name in out:
                raise ConfigError(f"{where.path}:{k.start_mark.line + 1}: {path}: given twice")
            where.lines[path] = k.start_mark.line + 1
            out[name] = _to_python(v, where, path)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, where, f"{key}[{i}]") for i, v in enumerate(node.value)]
    try:
        return _scalar(node)
    except Exception as e:  # noqa: BLE001 (an unknown tag !spec, a bad !!binary or !!timestamp: yaml raises anything)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where.path}:{node.start_mark.line + 1}: {key or 'the file'}: not valid YAML "
                          f"({problem})") from None


def _scalar(node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> tuple[dict[str, Any], _Where, bytes]:
    """The file's mapping, its key lines and its bytes; a one-line error for bad YAML."""

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the experiment file ({e.strerror or e})") from None
    where = _Where(str(path))
    try:
        node = yaml.compose(data.decode("utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}{line}: not valid YAML ({problem})") from None
    if node is None or not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{p}: an experiment file is a YAML mapping (experiment:, builds:, encoders: ...)")
    return _to_python(node, where), where, data


# --------------------------------------------------------------------------- validation
def _type_name(t: Any) -> str:
    if isinstance(t, dict):
        return "a mapping"
    if isinstance(t, list):
        return f"a list of {_type_name(t[0])}"
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", object: "a value"}[t]


def _matches(value: Any, t: Any) -> bool:
    if isinstance(t, tuple):
        return any(_matches(value, x) for x in t)
    if isinstance(t, list):
        return isinstance(value, list)
    if isinstance(t, dict):
        return isinstance(value, dict)
    if t is object:
        return True
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, t)


def check(value: Any, schema: Any, where: _Where, key: str = "") -> None:
    """``value`` against ``schema`` (:data:`SCHEMA`); the first problem as one line."""
    if not _matches(value, schema):
        raise where.error(key, f"expected {_type_name(schema)}, got {type(value).__name__} {value!r}")
    if isinstance(schema, tuple):
        schema = next(x for x in schema if _matches(value, x))
    if isinstance(schema, list):
        for i, v in enumerate(value):
            check(v, schema[0], where, f"{key}[{i}]")
    elif isinstance(schema, dict):
        for k, v in value.items():
            path = f"{key}.{k}" if key else k
            if k not in schema and "*" not in schema:
                close = difflib.get_close_matches(k, list(schema), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(schema)}"
                raise where.error(path, f"unknown key{hint}")
            check(v, schema.get(k, schema.get("*")), where, path)


def substitute(value: Any, variables: dict[str, str], where: _Where, key: str = "") -> Any:
    """``${NAME}``/``${env:NAME}`` in every string of ``value``; an undefined one is one line."""
    if isinstance(value, dict):
        return {k: substitute(v, variables, where, f"{key}.{k}" if key else k) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        env, name = m.group(1), m.group(2)
        got = os.environ.get(name) if env else variables.get(name, os.environ.get(name))
        if got is None:
            known = sorted(variables)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean ${{{close[0]}}}?" if close else ""
            if env:  # read from the environment only: vars: and --set do not reach it
                raise where.error(key, f"${{env:{name}}} is not set: set the environment variable {name} "
                                       f"(export {name}=VALUE), or write ${{{name}}} to take vars: or --set too")
            raise where.error(key, f"${{{name}}} is not defined: add it under vars:, pass "
                                   f"--set {name}=VALUE, or set the environment variable{hint}")  # fmt: skip
        return str(got)

    m = _VAR.fullmatch(value)
    if m:  # a whole-value variable takes the type its text reads as (2 -> 2, true -> True)
        text = one(m)
        try:
            return yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError:
            return text
    return _VAR.sub(one, value)


def _variables(raw: dict[str, Any], overrides: dict[str, str], where: _Where) -> dict[str, str]:
    """``vars:`` with ``--set`` overrides; a variable may use those defined before it."""
    out: dict[str, str] = {}
    for name, v in (raw.get("vars") or {}).items():
        out[name] = overrides[name] if name in overrides else substitute(str(v), out, where, f"vars.{name}")
    unknown = sorted(set(overrides) - set(out))
    for name in unknown:
        out[name] = overrides[name]
    return out


def _names(value: Any) -> tuple:
    return tuple(value) if isinstance(value, list) else (value,)


def _refs(names: tuple[str, ...], known: dict, what: str, where: _Where, key: str) -> None:
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; defined: {', '.join(known) or 'none'}"
            raise where.error(key, f"no {what} named {n!r}{hint}")


def _build(name: str, d: dict[str, Any], where: _Where) -> Build:
    kinds = [k for k in ("phantom", "sources", "path") if k in d]
    if len(kinds) != 1:
        raise where.error(f"builds.{name}", "give exactly one of phantom:, sources: (with roots:) or path:")
    if "sources" in d and len(d.get("roots") or []) not in (0, len(d["sources"])):
        raise where.error(f"builds.{name}.roots", "give one root per source (or none: the default roots)")
    return Build(name, d.get("phantom"), tuple(d.get("sources") or ()), tuple(d.get("roots") or ()), d.get("path"),
                 dict(d.get("options") or {}), d.get("thresholds_from"))  # fmt: skip


def _check_names(exp_raw: dict[str, Any], builds: dict, encoders: dict, where: _Where) -> None:
    """Every name a section uses is defined: builds, encoders, probes and heads."""

    for m, d in (exp_raw.get("modes") or {}).items():
        _refs(tuple(d.get("encoders") or ()), encoders, "encoder", where, f"modes.{m}.encoders")
        for i, h in enumerate(d.get("heads") or ()):
            try:
                head_defaults(h)
            except ConfigError as e:
                raise where.error(f"modes.{m}.heads[{i}]", str(e)) from None
    for i, p in enumerate(_names(exp_raw.get("probes", "all"))):
        if p != "all":
            try:
                get_probe(p)
            except ConfigError as e:
                raise where.error(f"probes[{i}]" if isinstance(exp_raw.get("probes"), list) else "probes",
                                  str(e)) from None  # fmt: skip
    _refs(tuple(exp_raw.get("transfer") or ()), builds, "build", where, "transfer")
    for n, d in (exp_raw.get("builds") or {}).items():
        if d.get("thresholds_from"):
            _refs((d["thresholds_from"],), builds, "build", where, f"builds.{n}.thresholds_from")
    for n, d in (exp_raw.get("mllms") or {}).items():
        _refs(tuple(d.get("builds") or ()), builds, "build", where, f"mllms.{n}.builds")
    for n, d in (exp_raw.get("predictors") or {}).items():
        _refs(tuple(d.get("builds") or ()), builds, "build", where, f"predictors.{n}.builds")
        _check_kind(d.get("kind") or n, where, f"predictors.{n}", d.get("options"))


def _check_kind(kind: str, where: _Where, key: str, options: dict | None = None) -> None:
    """A registered run kind that reads a build (a plug-in's too), else one line with "did you mean";
    ``options`` checked by the kind's ``check_options`` (a kind without one takes none)."""

    try:
        cls = run_kind(kind)
    except ConfigError as e:
        raise where.error(key, str(e)) from None
    if getattr(cls, "on_build", None) is None:
        raise where.error(key, f"run kind {kind} reads a feature cache or a model, not a build: use modes: or mllms:")
    if options:
        check = getattr(cls, "check_options", None)
        if check is None:
            raise where.error(f"{key}.options", f"run kind {kind} takes no options")
        try:
            check(options)
        except ConfigError as e:
            raise where.error(f"{key}.options", str(e)) from None


def load_experiment(path: str | Path, overrides: dict[str, str] | None = None) -> Experiment:
    """The experiment of ``path`` (``overrides``: ``--set NAME=VALUE``), validated."""

    raw, where, data = read_yaml(path)
    check({k: v for k, v in raw.items() if k == "vars"}, {"vars": SCHEMA["vars"]}, where)
    variables = _variables(raw, dict(overrides or {}), where)
    exp = substitute({k: v for k, v in raw.items() if k != "vars"}, variables, where)
    check(exp, SCHEMA, where)
    for key in ("experiment", "out", "builds"):
        if key not in exp:
            raise ConfigError(f"{path}: missing {key}: (see docs/EXPERIMENTS.md)")
    _check_declared_names(exp, raw, where)
    builds = {n: _build(n, d, where) for n, d in exp["builds"].items()}
    if not builds:
        raise where.error("builds", "no build defined; give one (phantom:, sources: with roots:, or path:)")
    encoders = {n: Encoder(n, d["spec"] if "spec" in d else _missing(where, f"encoders.{n}", "spec"),
                           d.get("weights"), d.get("revision"), bool(d.get("random_init", False)),
                           d.get("model_args"), d.get("label"))
                for n, d in (exp.get("encoders") or {}).items()}  # fmt: skip
    _check_names(exp, builds, encoders, where)
    train_on = exp.get("train_on") or next(iter(builds))
    _refs((train_on,), builds, "build", where, "train_on")
    mllms = {n: Mllm(n, d["model"] if "model" in d else _missing(where, f"mllms.{n}", "model"),
                     tuple(d.get("builds") or (train_on,)), dict(d.get("options") or {}), tuple(d.get("stages") or ()))
             for n, d in (exp.get("mllms") or {}).items()}  # fmt: skip
    stages = _stage_encoders(mllms, _names(exp.get("probes", "all")), where)
    clash = sorted(set(stages) & set(encoders))
    if clash:
        raise where.error(f"encoders.{clash[0]}", "this name is also an mllms: stage's encoder; rename it")
    modes = _modes(exp, encoders, stages)
    encoders = {**encoders, **stages}
    predictors = {n: Predictor(n, d.get("kind") or n, tuple(d.get("builds") or (train_on,)), int(d.get("bootstrap", 1000)),
                               dict(d.get("options") or {}))
                  for n, d in (exp.get("predictors") or {}).items()}  # fmt: skip
    return Experiment(
        name=exp["experiment"], source=str(path), sha256=hashlib.sha256(data).hexdigest(), out=Path(exp["out"]),
        builds=builds, encoders=encoders, modes=modes, probes=_names(exp.get("probes", "all")),
        seeds=tuple(int(s) for s in _names(exp.get("seeds", 0))), train_on=train_on,
        transfer=tuple(exp.get("transfer") or ()), mllms=mllms, predictors=predictors, jobs=int(exp.get("jobs", 1)),
        calibration=None if "calibration" not in exp else dict(exp["calibration"] or {}),
        title=(exp.get("report") or {}).get("title") or exp["experiment"], variables=variables, where=where,
        resources=_resources(exp.get("resources") or {}, where),
    )  # fmt: skip


#: the sections whose entries' names become file and folder names (``builds/<b>``, ``cache/<e>@<b>.h5`` ...)
NAMED = ("builds", "encoders", "mllms", "predictors")


def _check_declared_names(exp: dict[str, Any], raw: dict[str, Any], where: _Where) -> None:
    """Every name that becomes a path, where it is declared (:func:`spar_bench.names.check_name`):
    the experiment's (a ``${VARIABLE}``'s value too: ``--set``) and each entry's of :data:`NAMED`."""
    from spar_bench.names import check_name

    given = raw.get("experiment")
    via = f" (the value of {given})" if isinstance(given, str) and _VAR.search(given) else ""
    check_name(exp["experiment"], f"{where.at('experiment')}: experiment{via}")
    for section in NAMED:
        for n in exp.get(section) or {}:
            check_name(n, f"{where.at(f'{section}.{n}')}: {section}.{n}")


def _resources(given: dict[str, Any], where: _Where) -> dict[str, dict[str, Any]]:
    """``resources:`` by step kind (``default``: every kind), for ``--executor slurm``."""
    for kind in given:
        if kind not in (*KINDS, "default"):
            close = difflib.get_close_matches(kind, [*KINDS, "default"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; kinds: default, {', '.join(KINDS)}"
            raise where.error(f"resources.{kind}", f"not a kind of step{hint}")
    return {k: dict(v) for k, v in given.items()}


def _missing(where: _Where, key: str, name: str):
    raise where.error(key, f"needs {name}:")


def error_at(exp: Experiment, key: str, message: str) -> ConfigError:
    """``FILE:LINE: KEY: message``: a problem of ``exp``'s value at ``key``."""
    at = exp.where.at(key) if exp.where is not None else exp.source
    return ConfigError(f"{at}: {key}: {message}")
