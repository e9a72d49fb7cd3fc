"""Every value of an experiment file, checked when the plan is made, before any step runs.

The loader (:mod:`.config`) checks each key's type; this module checks what the commands the
values go to would refuse only once their step runs, after the steps before it:

* each option (``builds.B.phantom``, ``builds.B.options``, ``modes.M.options``,
  ``modes.frozen.cache``, ``mllms.L.options``) as its field's type, then through the settings
  classes its step makes of it, which check the limits they declare (``--in-plane`` >= 32, a
  choice, a range: :mod:`spar_bench.fields`): a phantom's, a build's sample and build settings, a
  head's, a sweep's, a finetune's, a cache's, an MLLM run's. No command-line declaration is read:
  the commands make their click types from the same declarations;
* ``seeds`` and every ``seed`` (numpy takes no negative seed), ``jobs``, a ``path:`` build (a
  finished build folder), a ``device`` (``cpu``, ``cuda[:N]``, ``auto`` where the command takes it).

Each problem is one line naming the file, the line and the key. :func:`check_devices` checks
``spar-bench run --devices`` against the devices this machine has.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .config import Experiment, error_at, read_yaml  # error_at: "FILE:LINE: KEY: problem"
from .steps import STEPS, kinds, options

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
def check_values(exp: Experiment, here: bool = True) -> None:
    """Every value of ``exp`` as the library's settings classes check it when its step runs; the
    first problem as one line (``here``: devices must be on this machine)."""
    seeds = list(exp.seeds)
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise error_at(exp, "seeds", f"must be distinct integers >= 0, got {seeds}")
    if exp.jobs < 1:
        raise error_at(exp, "jobs", f"must be >= 1 (processes of each sweep), got {exp.jobs}")
    for b, bd in exp.builds.items():
        if bd.path is not None and not (Path(bd.path) / "manifest.json").is_file():
            raise error_at(exp, f"builds.{b}.path", f"{bd.path} has no manifest.json: give a finished "
                                                  "build folder (or build it with phantom: or sources:)")  # fmt: skip
    for kind, declared in kinds():  # each mapping of options in the file, as its step kind reads it
        for given, key in declared.given(exp):
            for k, v in given.items():
                ((name, value),) = options(kind, {k: v}, key, exp).items()  # its field, typed
                _check_value(exp, kind, name, value, f"{key}.{k}", here)
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

    try:
        node: Any = read_yaml(exp.source)[0]
    except ConfigError:
        return None
    node = _at(node, key)
    m = _WHOLE_VAR.fullmatch(node.strip()) if isinstance(node, str) else None
    return m.group(1) if m else None


def _at(node: Any, key: str) -> Any:
    """The value at a dotted ``key`` whose names may hold dots themselves (``mllms.qwen2.5.model``):
    at each level the longest name that the rest of the key starts with."""
    while key:
        if not isinstance(node, dict):
            return None
        name = max((k for k in node if isinstance(k, str) and (key == k or key.startswith(f"{k}."))), key=len,
                   default=None)  # fmt: skip
        if name is None:
            return None
        node, key = node[name], key[len(name) + 1:]
    return node


def _check_value(exp: Experiment, kind: str, name: str, value: Any, key: str, here: bool) -> None:
    """One option's value: a device, then the settings classes its step makes of it."""
    if name == "device" and isinstance(value, str):
        problem = device_problem(value, auto=STEPS.get(kind).auto_device, here=here)
        if problem:
            raise error_at(exp, key, f"{value}: {problem}")
    if name in ("seed", "seeds") and isinstance(value, int) and value < 0:
        raise error_at(exp, key, f"a seed is an integer >= 0, got {value}")
    try:
        for cls, given in STEPS.get(kind).settings(exp, name, value, key):
            cls(**given)
    except ConfigError as e:
        raise error_at(exp, key, str(e)) from None
    except (TypeError, ValueError) as e:
        raise error_at(exp, key, f"{value!r}: {e}") from None
