"""Options several ``spar-build`` commands share, in the one vocabulary of the toolkit.

Processes are ``--jobs`` (build, ``phantom``, ``merge``). ``--workers`` is the old spelling,
renamed in 0.2: it still works, hidden from ``--help`` and with a note on stderr, and is
removed in 0.3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from spar_bench.errors import ConfigError

#: The hidden parameter holding the old spelling's value (popped by :func:`pop_jobs`).
OLD_JOBS = "workers_renamed"


def jobs_option(help_text: str, *, checked: bool = True) -> Callable[[Any], Any]:
    """``--jobs N`` (processes, default 1) and its hidden old spelling ``--workers N``.

    ``checked`` makes click refuse N < 1; without it the command checks N itself (the build's
    :class:`~spar_bench.builder.build.BuildConfig` names the bad value). The command reads the
    value with :func:`pop_jobs`.
    """
    kind = click.IntRange(min=1) if checked else int

    def decorate(f):
        f = click.option("--workers", OLD_JOBS, type=kind, default=None, hidden=True,
                         help="Old spelling of --jobs (renamed in 0.2, removed in 0.3).")(f)
        return click.option("--jobs", type=kind, default=None, metavar="N",
                            help=f"{help_text}  [default: 1]")(f)
    return decorate


def pop_jobs(params: dict[str, Any]) -> int:
    """The process count of ``--jobs`` or ``--workers`` (popped from ``params``); 1 when neither.

    ConfigError when both are given with different values; the old spelling prints a note.
    """
    jobs, old = params.pop("jobs", None), params.pop(OLD_JOBS, None)
    if old is None:
        return 1 if jobs is None else jobs
    if jobs is not None and jobs != old:
        raise ConfigError(f"--workers {old} and --jobs {jobs}: --workers is the old spelling of --jobs; "
                          "give --jobs only")
    click.echo("note: --workers is now --jobs (renamed in 0.2; the old spelling is removed in 0.3)",
               err=True)
    return old
