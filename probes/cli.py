"""``spar-probe``: cache encoder features, fit heads, sweep, evaluate and report."""

from __future__ import annotations

import sys

import click

from builder.clitools import LazyGroup, run_cli

COMMANDS = {
    "encoders": "probes.encoders:encoders_command",
    "cache": "probes.cache:cache_command",
    "fit": "probes.fit:fit_command",
    "sweep": "probes.sweep:sweep_command",
    "eval": "probes.fit:eval_command",
    "report": "probes.report:report_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="spar-bench")
def cli() -> None:
    """Probe a vision encoder with SPAR-Bench."""


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_cli(cli, argv))


if __name__ == "__main__":
    main()
