"""The options and parsers every ``spar-probe`` command shares: probe, head and seed lists, the run
options of :data:`~spar_bench.probes.runs.spec.OPTIONS`, presets, and the one-line summary.

One vocabulary (docs/USAGE.md, "One vocabulary"): ``--probe`` and ``--head`` (repeatable, or comma
lists), ``--batch-size``, ``--jobs`` for processes, ``--loader-workers`` for DataLoader
workers, ``--bootstrap N >= 1``, and one meaning for ``--device`` (:func:`device_option`),
``--compute`` (:func:`compute_option`), ``--threads`` (:func:`threads_option`) and ``--seeds``
(:func:`seeds_option`) in every command that takes them. The spellings before 0.2 (``sweep
--probes/--heads``, ``cache --batch``, ``cache``/``finetune --workers``, ``vqa --dtype/--seed``)
still work, hidden (:func:`spar_bench.clitools.old_spelling`), and go in 0.3.
"""

from __future__ import annotations

from typing import Any

import click

from spar_bench.clitools import LazyHelpOption, old_spelling
from spar_bench.errors import ConfigError

from ..names import cache_levels, names_all, parse_heads, parse_probes, parse_seeds, split_list  # noqa: F401
from ..runs.spec import OPTIONS, with_preset  # noqa: F401


def probe_option(help_text: str = "Probe name(s) or 'all'.", *, param: str = "probes",
                 old: bool = False):
    """``--probe`` (repeatable, or a comma list; default all); ``old``: with ``sweep``'s
    hidden ``--probes``."""

    def decorate(f):
        if old:
            f = old_spelling("--probes", "--probe", param, multiple=True)(f)
        return click.option("--probe", param, multiple=True, default=("all",), show_default=True,
                            help=f"{help_text} Repeat it or give a comma list.")(f)

    return decorate


def head_option(default: str = "mlp", *, param: str = "head", old: bool = False):
    """``--head`` (repeatable, or a comma list); ``old``: with ``sweep``'s hidden ``--heads``."""

    from ..heads import HEADS  # the registry's names: listing them imports no torch

    def decorate(f):
        if old:
            f = old_spelling("--heads", "--head", param, multiple=True)(f)
        return click.option("--head", param, multiple=True, default=(default,), show_default=True,
                            help=f"Head(s): {', '.join(HEADS.names())}; repeat it or give a "
                                 "comma list (one run per head).")(f)  # fmt: skip

    return decorate


def _at_least_one(ctx, param, value: int) -> int:
    if value is not None and value < 1:  # a one-line error (click's range error is a usage block)
        raise ConfigError(f"--bootstrap must be at least 1, got {value}")
    return value


def bootstrap_option(f):
    """``--bootstrap N`` (N >= 1, else one error line), stored as ``n_boot``."""
    return click.option("--bootstrap", "n_boot", default=1000, show_default=True, type=int,
                        callback=_at_least_one, metavar="N>=1", help="Bootstrap replicates.")(f)  # fmt: skip


def loader_workers_option(help_text: str):
    """``--loader-workers N`` (DataLoader workers, stored as ``workers``) and its hidden old
    spelling ``--workers``."""

    def decorate(f):
        f = old_spelling("--workers", "--loader-workers", "workers", type=click.IntRange(0))(f)
        return click.option("--loader-workers", "workers", default=None, type=click.IntRange(0),
                            help=help_text)(f)

    return decorate


def seeds_option(default: str = "0"):
    """``--seeds LIST`` (comma-separated integers, read with :func:`parse_seeds`; one run per seed)."""
    return click.option("--seeds", default=default, show_default=True, metavar="LIST",
                        help="Comma-separated seeds, e.g. 0,1,2 (one run per seed).")


def device_option(f):
    """``--device``, the same in every command: ``auto`` (CUDA when visible, else the CPU) by
    default; the command resolves it with :func:`~spar_bench.probes.hardware.pick_device` (a
    bad or unusable value: one line)."""
    return click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]",
                        help="Where it runs: auto (CUDA when visible, else the CPU), cpu, cuda or "
                             "cuda:N.")(f)  # fmt: skip


def resolved_device(device: str) -> str:
    """``--device`` as a run records it, ``auto`` resolved (``cpu``, ``cuda``): where a run trains
    never names its folder (:meth:`~..runs.spec.RunSpec.variant`), so ``auto`` changes no run id.

    Interned: ``head.pt`` pickles its config, and pickle writes a second reference to one string
    object as a back-reference but an equal, distinct string in full (``"cpu"`` must be the
    literal's object for the same bytes)."""
    import sys

    from ..hardware import pick_device

    return sys.intern(str(pick_device(device)))


def compute_option(f):
    """``--compute``, the same in every command: the compute precision, resolved with
    :func:`~spar_bench.probes.hardware.pick_compute`."""
    from ..hardware import COMPUTE_DTYPES

    return click.option("--compute", type=click.Choice(COMPUTE_DTYPES), default="auto", show_default=True,
                        help="Compute precision; auto = bf16 on GPUs (fp16 without bf16) and on CPUs with "
                             "native bf16 (AMX/AVX512-BF16), else fp32; the choice is recorded. "
                             "(Storage precision is --dtype.)")(f)  # fmt: skip


def threads_option(f):
    """``--threads N``, the same in every command: 1 by default (the help says why)."""
    return click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
                        help="torch CPU threads per process; 1 everywhere, as a CPU result's last bits "
                             "depend on the thread count (parallel sums add in another order): 1 gives "
                             "the same bytes on every machine, and --jobs processes never oversubscribe "
                             "the cores. More speed up one long CPU run (finetune).")(f)  # fmt: skip


def spec_options(where: tuple[str, ...] = ("train", "head", "run")):
    """One option per :data:`OPTIONS` entry of kind ``where`` (``--d-model`` ...; default None:
    the run's own), their help made when ``--help`` shows it (:func:`~..runs.spec.option_help`
    reads the head classes, which import torch)."""
    from ..runs.spec import option_help

    def decorate(f):
        for opt in reversed([o for o in OPTIONS.values() if o.where in where]):
            flag = f"--{opt.name.replace('_', '-')}"
            kind = {"is_flag": True} if opt.type is bool else {"type": opt.type}
            f = click.option(flag, opt.name, cls=LazyHelpOption, default=None,
                             help_of=lambda opt=opt: option_help(opt), **kind)(f)  # fmt: skip
        return f

    return decorate


def run_options(f):
    """The options every run takes, shared by ``fit`` and ``sweep`` (one per :data:`OPTIONS`)."""
    f = spec_options()(f)
    f = click.option("--data", default=None, type=click.Path(file_okay=False),
                     help="Build dir (default: the cache's dataset_dir).")(f)  # fmt: skip
    f = bootstrap_option(f)
    f = click.option("--no-controls", is_flag=True, help="Skip the blind baseline (faster).")(f)
    f = click.option("--preset", default=None, metavar="NAME",
                     help="Fill the options not given from a named preset: paper (docs/PROTOCOL.md "
                          "§12); explicit options win, and each run records both.")(f)  # fmt: skip
    return threads_option(device_option(f))


def apply_preset(params: dict[str, Any]) -> tuple[dict[str, Any], dict | None]:
    """``--preset`` (popped from ``params``): the command's parameters with the preset's values
    where none was given on the command line, and the preset's record (None without one)."""
    name = params.pop("preset", None)
    if not name:
        return params, None
    from spar_bench.presets import apply_probe_preset, explicit_options

    return apply_probe_preset(name, params, explicit_options(click.get_current_context()))


def pop_run_options(kw: dict) -> dict[str, Any]:
    """The :data:`OPTIONS` values among click's keyword arguments (removed from ``kw``)."""
    return {name: kw.pop(name) for name in OPTIONS}


def fmt(v) -> str:
    """A headline value as a command's summary line prints it."""
    return "n/a" if v is None else f"{v:.4f}"
