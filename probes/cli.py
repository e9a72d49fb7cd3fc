"""``spar-probe``: cache encoder features, fit heads, sweep, evaluate and report."""

from __future__ import annotations

import click

from spar_bench.clitools import LazyGroup, run_main

COMMANDS = {
    "encoders": "spar_bench.probes.encoders:encoders_command",
    "cache": "spar_bench.probes.cache:cache_command",
    "fit": "spar_bench.probes.fit:fit_command",
    "sweep": "spar_bench.probes.sweep:sweep_command",
    "eval": "spar_bench.probes.fit:eval_command",
    "finetune": "spar_bench.probes.finetune.run:finetune_command",
    "report": "spar_bench.probes.report:report_command",
    "vqa": "spar_bench.probes.vqa.cli:vqa_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="spar-bench")
def cli() -> None:
    """Probe a vision encoder with SPAR-Bench."""


def main(argv: list[str] | None = None) -> None:
    run_main(cli, argv)


if __name__ == "__main__":
    main()
