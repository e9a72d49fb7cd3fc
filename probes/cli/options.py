"""The options and parsers every ``spar-probe`` command shares: probe, head and seed lists, the run
options of :data:`~spar_bench.probes.runs.spec.OPTIONS`, presets, and the one-line summary.

One vocabulary (docs/USAGE.md, "One vocabulary"): ``--probe`` and ``--head`` (repeatable, or comma
lists), ``--batch-size``, ``--jobs`` for processes, ``--loader-workers`` for DataLoader
workers, ``--bootstrap N >= 1``, and one meaning for ``--device`` (:func:`device_option`),
``--compute`` (:func:`compute_option`), ``--threads`` (:func:`threads_option`) and ``--seeds``
(:func:`seeds_option`) in every command that takes them. The spellings before 0.2 (``sweep
--probes/--heads``, ``cache --batch``, ``cache``/``finetune --workers``, ``vqa --dtype/--seed``)
still work, hidden (:func:`spar_bench.clitools.old_spelling`), and go in 0.3.

Each shared option is declared here once, and takes its default from the config field it fills,
which each command names (``seeds_option(RunSpec, "seed")``): its click default is None, its help
shows the field's (:func:`spar_bench.clitools.field_option`), so no default is written twice.
"""

from __future__ import annotations

from typing import Any

import click

from spar_bench.clitools import LazyHelpOption, field_option, old_spelling
from spar_bench.errors import ConfigError

from ..names import cache_levels, names_all, parse_heads, parse_probes, parse_seeds, split_list  # noqa: F401
from ..runs.spec import OPTIONS, with_preset  # noqa: F401
from ..runs.sweep import SweepConfig


def probe_option(help_text: str = "Probe name(s) or 'all'.", *, cls: type = SweepConfig,
                 param: str = "probes", old: bool = False):
    """``--probe`` (repeatable, or a comma list), filling field ``probes`` of ``cls`` (its default:
    all; :class:`SweepConfig`'s for a command whose config has no such field); ``old``: with
    ``sweep``'s hidden ``--probes``."""

    def decorate(f):
        if old:
            f = old_spelling("--probes", "--probe", param, multiple=True)(f)
        return field_option(cls, "probes", "--probe", param, multiple=True, fill=True, type=click.STRING,
                            help=f"{help_text} Repeat it or give a comma list.")(f)  # fmt: skip

    return decorate


def head_option(cls: type, name: str = "head", *, param: str = "head", old: bool = False):
    """``--head`` (repeatable, or a comma list), filling field ``name`` of ``cls`` (a run's
    ``head``, a sweep's ``heads``), its default; ``old``: with ``sweep``'s hidden ``--heads``."""

    from ..heads import HEADS  # the registry's names: listing them imports no torch

    def decorate(f):
        if old:
            f = old_spelling("--heads", "--head", param, multiple=True)(f)
        return field_option(cls, name, "--head", param, multiple=True, fill=True, type=click.STRING,
                            help=f"Head(s): {', '.join(HEADS.names())}; repeat it or give a "
                                 "comma list (one run per head).")(f)  # fmt: skip

    return decorate


def _at_least_one(ctx, param, value: int) -> int:
    if value is not None and value < 1:  # a one-line error (click's range error is a usage block)
        raise ConfigError(f"--bootstrap must be at least 1, got {value}")
    return value


def bootstrap_option(cls: type):
    """``--bootstrap N`` (N >= 1, else one error line), filling field ``n_boot`` of ``cls``, its default."""
    return field_option(cls, "n_boot", "--bootstrap", "n_boot", type=int, fill=True, callback=_at_least_one,
                        metavar="N>=1", help="Bootstrap replicates.")  # fmt: skip


def loader_workers_option(help_text: str):
    """``--loader-workers N`` (DataLoader workers, stored as ``workers``) and its hidden old
    spelling ``--workers``."""

    def decorate(f):
        f = old_spelling("--workers", "--loader-workers", "workers", type=click.IntRange(0))(f)
        return click.option("--loader-workers", "workers", default=None, type=click.IntRange(0),
                            help=help_text)(f)

    return decorate


def seeds_option(cls: type, name: str = "seeds"):
    """``--seeds LIST`` (comma-separated integers, read with :func:`parse_seeds`; one run per
    seed), filling field ``name`` of ``cls`` (a run's ``seed``, a grid's ``seeds``), its default."""
    return field_option(cls, name, "--seeds", "seeds", type=click.STRING, fill=True, metavar="LIST",
                        help="Comma-separated seeds, e.g. 0,1,2 (one run per seed).")  # fmt: skip


def out_option(cls: type = SweepConfig):
    """``--out DIR``, the runs folder: field ``out`` of ``cls`` (:class:`SweepConfig`'s for the
    commands whose config has none), its default."""
    return field_option(cls, "out", type=click.Path(file_okay=False), fill=True, help="Runs folder.")


def device_option(cls: type):
    """``--device``, the same in every command: ``auto`` (CUDA when visible, else the CPU) by
    default (field ``device`` of ``cls``); the command resolves it
    with :func:`~spar_bench.probes.hardware.pick_device` (a bad or unusable value: one line)."""
    return field_option(cls, "device", type=click.STRING, fill=True, metavar="auto|cpu|cuda[:N]",
                        help="Where it runs: auto (CUDA when visible, else the CPU), cpu, cuda or "
                             "cuda:N.")  # fmt: skip


def resolved_device(device: str) -> str:
    """``--device`` as a run records it, ``auto`` resolved (``cpu``, ``cuda``): where a run trains
    never names its folder (:meth:`~..runs.spec.RunSpec.variant`), so ``auto`` changes no run id.

    Interned: ``head.pt`` pickles its config, and pickle writes a second reference to one string
    object as a back-reference but an equal, distinct string in full (``"cpu"`` must be the
    literal's object for the same bytes)."""
    import sys

    from ..hardware import pick_device

    return sys.intern(str(pick_device(device)))


def compute_option(cls: type):
    """``--compute``, the same in every command (field ``compute`` of ``cls``, its default): the
    compute precision, resolved with :func:`~spar_bench.probes.hardware.pick_compute`."""
    from ..hardware import COMPUTE_DTYPES

    return field_option(cls, "compute", type=click.Choice(COMPUTE_DTYPES), fill=True,
                        help="Compute precision; auto = bf16 on GPUs (fp16 without bf16) and on CPUs with "
                             "native bf16 (AMX/AVX512-BF16), else fp32; the choice is recorded. "
                             "(Storage precision is --dtype.)")  # fmt: skip


def threads_option(cls: type = SweepConfig):
    """``--threads N``, the same in every command: field ``threads`` of ``cls`` (1; the help says
    why; :class:`SweepConfig`'s for the commands whose config has none)."""
    return field_option(cls, "threads", type=click.IntRange(1), fill=True,
                        help="torch CPU threads per process; 1 everywhere, as a CPU result's last bits "
                             "depend on the thread count (parallel sums add in another order): 1 gives "
                             "the same bytes on every machine, and --jobs processes never oversubscribe "
                             "the cores. More speed up one long CPU run (finetune).")  # fmt: skip


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


def run_options(cls: type):
    """The options every run takes, shared by ``fit`` and ``sweep`` (one per :data:`OPTIONS`);
    ``--bootstrap`` fills ``cls``'s ``n_boot``. ``--device`` and ``--threads`` take
    :class:`SweepConfig`'s defaults: ``fit`` runs one sweep's grid in its process, and its
    ``--device`` (auto) is resolved before it fills a run's ``TrainConfig.device``, whose own
    default (cpu, a device already resolved) is a Python caller's."""

    def decorate(f):
        f = spec_options()(f)
        f = click.option("--data", default=None, type=click.Path(file_okay=False),
                         help="Build dir (default: the cache's dataset_dir).")(f)  # fmt: skip
        f = bootstrap_option(cls)(f)
        f = click.option("--no-controls", is_flag=True, help="Skip the blind baseline (faster).")(f)
        f = click.option("--preset", default=None, metavar="NAME",
                         help="Fill the options not given from a named preset: paper (docs/PROTOCOL.md "
                              "§12); explicit options win, and each run records both.")(f)  # fmt: skip
        return threads_option()(device_option(SweepConfig)(f))

    return decorate


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
