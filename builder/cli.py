"""``spar-build``: build SPAR-Bench from CT sources.

``spar-build --source word --out shards/`` builds; subcommands list sources, render
the phantom, inspect cases, verify and publish a build. Subcommands are imported
lazily, so ``--help`` is instant.
"""

from __future__ import annotations

import sys

import click

from .clitools import LazyGroup, run_cli

COMMANDS = {
    "sources": "builder.sources:sources_command",
    "inspect": "builder.inspect:inspect_command",
    "phantom": "builder.phantom.cli:phantom_command",
    "verify": "builder.verify:verify_command",
    "push": "builder.writers.hf:push_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, invoke_without_command=True)
@click.version_option(package_name="spar-bench")
@click.pass_context
def cli(ctx: click.Context, **options) -> None:
    """Build SPAR-Bench shards: spar-build --source SOURCE --out DIR [options]."""
    if ctx.invoked_subcommand is not None:
        return
    from .build import build_from_cli

    build_from_cli(**options)


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_cli(cli, argv))


if __name__ == "__main__":
    main()
