"""Options several ``spar-build`` commands share, in the one vocabulary of the toolkit.

Processes are ``--jobs`` (build, ``phantom``, ``merge``). ``--workers`` is the old spelling,
renamed in 0.2: it still works, hidden from ``--help``, and is removed in 0.3; given with
``--jobs`` it is one error line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from spar_bench.clitools import old_spelling

#: the build's settings, the home of the defaults of ``spar-build``'s (and ``inspect``'s) options,
#: named so that a command line imports it only when its help or a default is needed
BUILD = "spar_bench.builder.build:BuildConfig"
#: a build's sample settings, the home of the defaults of its sampling options
SAMPLE = "spar_bench.builder.samples.config:SampleConfig"


def jobs_option(help_text: str, *, checked: bool = True) -> Callable[[Any], Any]:
    """``--jobs N`` (processes, default 1) and its hidden old spelling ``--workers N``
    (:func:`spar_bench.clitools.old_spelling`, as every renamed option of the toolkit).

    ``checked`` makes click refuse N < 1; without it the command checks N itself (the build's
    :class:`~spar_bench.builder.build.BuildConfig` names the bad value). The command reads the
    value with :func:`pop_jobs`.
    """
    kind = click.IntRange(min=1) if checked else int

    def decorate(f):
        f = old_spelling("--workers", "--jobs", "jobs", type=kind, default=None)(f)
        return click.option("--jobs", type=kind, default=None, metavar="N", help=f"{help_text}  [default: 1]")(f)
    return decorate


def pop_jobs(params: dict[str, Any]) -> int:
    """The process count of ``--jobs`` (or its old spelling), popped from ``params``; 1 when not given."""
    jobs = params.pop("jobs", None)
    return 1 if jobs is None else jobs
