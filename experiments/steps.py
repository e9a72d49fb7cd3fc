"""Step kinds: each kind of spec an experiment's steps hold, declared once (:class:`StepKind`).

A step (:class:`~.plan.Step`) holds specs, each ``(kind, record)``: one library call and the
JSON-safe record of its config. :data:`STEPS` maps each kind to its declaration, which says
everything the experiment machinery needs of it:

* ``fields``: the options the kind takes and their types, read from the library's config
  dataclasses (:func:`spar_bench.fields.field_types`), never parsed from annotation text;
* ``aliases`` and ``own``: the spellings a file may use, and the fields the step sets itself;
* ``given`` and ``settings``: the file's mappings of its options, and the settings classes its
  call builds of them (the plan-time value check, :mod:`.values`);
* ``plan``: its steps in the plan (:func:`.plan.make_plan` asks every kind in ``order``);
* ``call``: the library call of one spec (:mod:`.runner`);
* ``runs``: whether its steps make runs the report reads; ``fresh``: its outputs are written
  afresh (removed first) every time; ``auto_device``: its call takes ``device: auto``.

The ten kinds of SPAR-Bench are declared in :mod:`.step_kinds` and registered here lazily; a
plugin or a test adds one with ``STEPS.register(name, StepKind(...))`` (or
``STEPS.registered`` for a ``with`` block) and touches no other file.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from spar_bench.fields import scalar
from spar_bench.registry import Registry

from .config import Experiment, error_at


def _no_fields() -> dict[str, Any]:
    return {}


def _nothing(*_: Any) -> Iterator[Any]:
    yield from ()


@dataclass(frozen=True)
class StepKind:
    """One kind of spec, declared once (see the module's docstring)."""

    call: Callable[[dict[str, Any], str | None], None]
    fields: Callable[[], dict[str, Any]] = _no_fields
    settings: Callable[[Experiment, str, Any, str], Iterator[tuple[type, dict[str, Any]]]] = _nothing
    given: Callable[[Experiment], Iterator[tuple[dict[str, Any], str]]] = _nothing
    plan: Callable[[Experiment, list], list] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    own: frozenset[str] = frozenset()
    order: int = 0
    runs: bool = False
    fresh: bool = False
    auto_device: bool = False


#: every step kind, by the name its specs carry
STEPS: Registry[StepKind] = Registry("step kind")
STEPS.register_lazy("phantom", "spar_bench.experiments.step_kinds:PHANTOM_KIND")
STEPS.register_lazy("build", "spar_bench.experiments.step_kinds:BUILD_KIND")
STEPS.register_lazy("cache", "spar_bench.experiments.step_kinds:CACHE_KIND")
STEPS.register_lazy("sweep", "spar_bench.experiments.step_kinds:SWEEP_KIND")
STEPS.register_lazy("finetune", "spar_bench.experiments.step_kinds:FINETUNE_KIND")
STEPS.register_lazy("eval", "spar_bench.experiments.step_kinds:EVAL_KIND")
STEPS.register_lazy("vqa", "spar_bench.experiments.step_kinds:VQA_KIND")
STEPS.register_lazy("predict", "spar_bench.experiments.step_kinds:PREDICT_KIND")
STEPS.register_lazy("calibration", "spar_bench.experiments.step_kinds:CALIBRATION_KIND")
STEPS.register_lazy("report", "spar_bench.experiments.step_kinds:REPORT_KIND")


def kinds() -> list[tuple[str, StepKind]]:
    """Every step kind and its declaration, in their declared order."""
    return sorted(((n, STEPS.get(n)) for n in STEPS.names()), key=lambda nk: (nk[1].order, nk[0]))


def planned_kinds() -> list[tuple[str, StepKind]]:
    """The kinds that add steps to a plan, in the order their steps come."""
    return [(n, k) for n, k in kinds() if k.plan is not None]


# --------------------------------------------------------------------------- options as spec fields
def spec_fields(kind: str) -> dict[str, Any]:
    """The options a step of ``kind`` takes: each field of its library config and how a value is read."""
    k = STEPS.get(kind)
    return {name: scalar(tp) for name, tp in k.fields().items() if name not in k.own}


def options(kind: str, given: dict[str, Any], key: str, exp: Experiment) -> dict[str, Any]:
    """``given`` (an experiment file's ``{samples_per_case: 8, hf: false}``) as the fields of
    ``kind``'s spec (its aliases resolved, values of the field's type); a key that is no
    field is one line naming the file, the line and the key, with a close one."""
    known, aliases = spec_fields(kind), STEPS.get(kind).aliases
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
        value = typed(v, known[name], exp, f"{key}.{k}")
        out[name] = (not value) if negate else value
    return out


def typed(v: Any, tp: Any, exp: Experiment, key: str) -> Any:
    """``v`` as the field's scalar type ``tp`` (:func:`scalar`), as the command line read it:
    ``1e-3`` (text to YAML) or ``1`` where a float is taken is the float, ``"true"`` a bool,
    ``448`` where text is taken the text; a converter (a token head's PCA width) converts."""
    if isinstance(v, bool) or v is None or isinstance(v, (list, dict)):
        return v
    try:
        if tp is bool and isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if tp is bool:
            raise ValueError
        if tp is float:
            return float(v)
        if tp is int and isinstance(v, str):
            return int(v)
        if tp is not None and not isinstance(tp, type):
            return tp(v)
    except ValueError:
        raise error_at(exp, key, f"expected {_TYPE_WORDS.get(tp) or 'a ' + tp.__name__}, got {v!r}") from None
    return str(v) if tp is str and isinstance(v, (int, float)) else v


_TYPE_WORDS = {bool: "a switch: true or false", int: "an integer", float: "a number"}
