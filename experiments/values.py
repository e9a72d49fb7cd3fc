"""Every value of an experiment file, checked when the plan is made, before any step runs.

The loader (:mod:`.config`) checks each key's type; this module checks what the commands the
values go to would refuse only once their step runs, after the steps before it:

* each option (``builds.B.phantom``, ``builds.B.options``, ``modes.M.options``,
  ``modes.frozen.cache``, ``mllms.L.options``) through its command's own click parameter
  (``--n`` >= 1, ``--in-plane`` >= 32, a choice, a number), then through the settings object the
  command makes of it (a build's sample settings, a head's or a finetune's training settings);
* ``seeds`` and every ``seed`` (numpy takes no negative seed), ``jobs``, a ``path:`` build (a
  finished build folder), a ``device`` (``cpu``, ``cuda[:N]``, ``auto`` where the command takes it).

Each problem is one line naming the file, the line and the key. :func:`check_devices` checks
``spar-bench run --devices`` against the devices this machine has.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .config import Experiment
from .plan import error_at  # error_at: "FILE:LINE: KEY: problem"

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


# --------------------------------------------------------------------------- devices
def cuda_count() -> int:
    """CUDA devices this process sees (0 without torch's CUDA)."""
    import torch

    return int(torch.cuda.device_count())


def visible_devices(n_cuda: int) -> str:
    return ", ".join(["cpu", *(f"cuda:{i}" for i in range(n_cuda))])


def device_problem(name: str, auto: bool = False, here: bool = True) -> str | None:
    """What is wrong with device ``name`` (None: nothing); ``auto``: whether ``auto`` is one (the
    commands whose own default it is); ``here``: whether it must be on this machine (a run, not
    a plan printed on a login node for GPU nodes)."""
    if name == "auto" and auto:
        return None
    if not _DEVICE.fullmatch(name):
        return f"not a device; give cpu or cuda:N{', or auto' if auto else ''}"
    if here and name.startswith("cuda"):
        n = cuda_count()
        if int(name.partition(":")[2] or 0) >= n:
            return f"not on this machine (visible: {visible_devices(n)})"
    return None


def check_devices(text: str | None, here: bool = True) -> tuple[str, ...]:
    """``spar-bench run --devices``: a comma list of devices (``here``: that this machine
    has), else one line."""
    if text is None:
        return ()
    names = tuple(d.strip() for d in text.split(","))
    if not any(names):
        raise ConfigError(f"--devices {text!r}: no device given; e.g. --devices cuda:0,cuda:1 (or cpu)")
    for name in names:
        problem = "empty entry in the list" if not name else device_problem(name, here=here)
        if problem:
            raise ConfigError(f"--devices {text}: {name or repr(text)}: {problem}")
    return names


# --------------------------------------------------------------------------- the file's values
def option_sets(exp: Experiment) -> Iterator[tuple[str, str | None, dict[str, Any], str]]:
    """``(program, subcommand, options, key)`` of every mapping of command options in the file."""
    for b, bd in exp.builds.items():
        if bd.phantom is not None:
            yield "spar-build", "phantom", bd.phantom, f"builds.{b}.phantom"
        yield "spar-build", None, bd.options, f"builds.{b}.options"
    for m, mode in exp.modes.items():
        yield "spar-probe", "sweep" if m == "frozen" else "finetune", mode.options, f"modes.{m}.options"
        if m == "frozen":
            yield "spar-probe", "cache", mode.cache, "modes.frozen.cache"
    for n, mllm in exp.mllms.items():
        yield "spar-probe", "vqa", mllm.options, f"mllms.{n}.options"


def check_values(exp: Experiment, here: bool = True) -> None:
    """Every value of ``exp`` as its command will check it; the first problem as one line
    (``here``: devices must be on this machine)."""
    seeds = list(exp.seeds)
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise error_at(exp, "seeds", f"must be distinct integers >= 0, got {seeds}")
    if exp.jobs < 1:
        raise error_at(exp, "jobs", f"must be >= 1 (processes of each sweep), got {exp.jobs}")
    for b, bd in exp.builds.items():
        if bd.path is not None and not (Path(bd.path) / "manifest.json").is_file():
            raise error_at(exp, f"builds.{b}.path", f"{bd.path} has no manifest.json: give a finished "
                                                  "build folder (or build it with phantom: or sources:)")  # fmt: skip
    for program, name, options, key in option_sets(exp):
        for k, v in options.items():
            option, value = _click_value(exp, program, name, k, v, key, here)
            _settings_check(exp, (program, name), option, value, f"{key}.{k}")
    if here:  # a plan printed (--dry-run, --list) may leave the revisions to the run
        check_revisions(exp)


#: what a revision left to be set reads as
_UNSET = ("", "set-me")
_WHOLE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def check_revisions(exp: Experiment) -> None:
    """Every hub MLLM (``hf:ORG/NAME``, not a local folder) pinned to a revision; one left
    empty (or ``set-me``) is one line naming the variable to set."""
    for n, m in exp.mllms.items():
        family, _, rest = m.model.partition(":")
        if family != "hf" or "/" not in rest or Path(rest).is_dir():
            continue
        if str(m.options.get("revision") or "").strip() not in _UNSET:
            continue
        key = f"mllms.{n}.options.revision"
        var = _variable_of(exp, key)
        how = f"set {var} (--set {var}=<commit>)" if var else "give options: {revision: <commit>}"
        raise error_at(exp, key if var or key in getattr(exp.where, "lines", {}) else f"mllms.{n}",
                       f"{m.model} has no revision: {how}, the 40-hex hub commit of {rest} to load offline")


def _variable_of(exp: Experiment, key: str) -> str | None:
    """The variable a key's value is written as (``${NAME}`` alone), from the file's text."""
    from .config import read_yaml

    try:
        node: Any = read_yaml(exp.source)[0]
    except ConfigError:
        return None
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    m = _WHOLE_VAR.fullmatch(node.strip()) if isinstance(node, str) else None
    return m.group(1) if m else None


def _click_value(exp: Experiment, program: str, name: str | None, k: str, v: Any, key: str,
                 here: bool) -> tuple[str, Any]:
    """Option ``k: v`` as its command's click parameter reads the flag the plan writes:
    ``(the parameter's name, its value)``."""
    import click

    cmd = command_of(program, name)
    argv = _flags(cmd, k, v)  # a key with no flag (a config field alone) was checked by the plan
    if not argv:
        return k.replace("-", "_"), v
    param = next(p for p in cmd.params if argv[0] in (*p.opts, *p.secondary_opts))
    what = f"{program} {name}" if name else program
    if getattr(param, "is_flag", False):
        if not isinstance(v, bool):
            raise error_at(exp, f"{key}.{k}", f"{what} {argv[0]} is a flag: write true or false, got {v!r}")
        return param.name, v
    given = tuple(argv[1::2]) if param.multiple else argv[1]
    ctx = click.Context(cmd, info_name=what)
    try:
        value = param.process_value(ctx, given)
    except (click.BadParameter, ConfigError) as e:
        message = f"{what} {argv[0]}: {e.message}" if isinstance(e, click.BadParameter) else str(e)
        raise error_at(exp, f"{key}.{k}", message) from None
    if param.name == "device" and isinstance(value, str):
        problem = device_problem(value, auto=param.default == "auto", here=here)
        if problem:
            raise error_at(exp, f"{key}.{k}", f"{value}: {problem}")
    return param.name, value


def _settings_check(exp: Experiment, command: tuple[str, str | None], option: str, value: Any, key: str) -> None:
    """``value`` of parameter ``option`` of ``command`` through the settings object the command
    makes of it (ranges its click parameters leave open: ``samples_per_case`` >= 1, ``lr`` > 0 ...)."""
    if option in ("seed", "seeds") and isinstance(value, int) and value < 0:
        raise error_at(exp, key, f"a seed is an integer >= 0, got {value}")
    try:
        for cls, given in _settings(exp, command, option, value, key):
            cls(**given)
    except ConfigError as e:
        raise error_at(exp, key, str(e)) from None
    except (TypeError, ValueError) as e:
        raise error_at(exp, key, f"{value!r}: {e}") from None


def _settings(exp: Experiment, command: tuple[str, str | None], option: str, value: Any,
              key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    """The settings classes its command builds, with the keywords that hold ``option``."""
    program, name = command
    if program == "spar-build" and name is None:
        yield from _build_settings(exp.builds[key.split(".")[1]], option, value)
    elif program == "spar-probe" and name == "sweep":
        from spar_bench.probes.runs.spec import ALIASES, OPTIONS
        from spar_bench.probes.train import TrainConfig

        option = ALIASES.get(option, option)
        if option in OPTIONS and OPTIONS[option].where == "train":
            yield TrainConfig, {option: value}
    elif program == "spar-probe" and name == "finetune":
        from spar_bench.probes.finetune.config import FinetuneConfig

        if option in _names(FinetuneConfig):
            yield FinetuneConfig, {option: value}


def _build_settings(bd, option: str, value: Any) -> Iterator[tuple[type, dict[str, Any]]]:
    """A build's sample settings and build settings (``spar-build``'s own reading of its options)."""
    from spar_bench.builder.build import BuildConfig, choice_options
    from spar_bench.builder.samples.config import SampleConfig

    if option in _names(SampleConfig):
        given = [s.strip() for s in str(value).split(",") if s.strip()] if option == "levels" else value
        yield SampleConfig, {option: given}
    sources = ("phantom",) if bd.phantom is not None else bd.sources
    base = {"sources": sources, "roots": (".",) * len(sources), "out": "."}
    field_name = {"jobs": "workers"}.get(option, option)
    if field_name in ("workers", "shard_size"):
        yield BuildConfig, {**base, field_name: value}
    if option in ("cases", "limit", "split_ratio"):
        yield BuildConfig, {**base, **choice_options({option: value}, sources)}


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


# --------------------------------------------------------------------------- the declared option types
def command_of(program: str, name: str | None):
    """The click command whose declared parameters (types, ranges, choices) check a value of
    ``program`` (``spar-build``/``spar-probe``) ``name``; only its declarations are read: no
    step is run through it (:mod:`.runner` calls the library)."""
    import click

    if program == "spar-build":
        from spar_bench.builder.cli import cli
    else:
        from spar_bench.probes.cli import cli
    return cli if name is None else cli.get_command(click.Context(cli), name)


def _flags(cmd, k: str, v: Any) -> list[str]:
    """Option ``k: v`` as the flag and text the command's parameter reads; ``[]`` when the command
    has no such flag (or a false flag)."""
    import json

    params = {p.name: p for p in cmd.params if getattr(p, "opts", None) and p.opts[0].startswith("--")}
    spelled = {o[2:].replace("-", "_"): p for p in params.values() for o in p.opts if o.startswith("--")}
    kn = k.replace("-", "_")
    p = spelled.get(kn) or params.get(kn)
    if p is None and v is False and f"no_{kn}" in params:  # hf: false -> --no-hf
        return [params[f"no_{kn}"].opts[0]]
    if p is None:
        return []
    text = lambda x: ("true" if x else "false") if isinstance(x, bool) else str(x)  # noqa: E731
    if getattr(p, "is_flag", False):
        return ([p.opts[0] if v else p.secondary_opts[0]] if p.secondary_opts else [p.opts[0]] if v else []) \
            if isinstance(v, bool) else [p.opts[0]]
    if isinstance(v, list) and getattr(p, "multiple", False):
        return [x for item in v for x in (p.opts[0], text(item))]
    if isinstance(v, list):
        return [p.opts[0], ",".join(text(x) for x in v)]
    if isinstance(v, dict):
        return [p.opts[0], json.dumps(v, sort_keys=True)]
    return [p.opts[0], text(v)]
