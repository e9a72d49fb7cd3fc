"""``spar-probe``: cache encoder features, fit heads, sweep, evaluate and report."""

from __future__ import annotations

import click

from spar_bench.clitools import LazyGroup, run_main

COMMANDS = {
    "encoders": "spar_bench.probes.cli.encoders:encoders_command",
    "cache": "spar_bench.probes.cli.cache:cache_command",
    "fit": "spar_bench.probes.cli.fit:fit_command",
    "sweep": "spar_bench.probes.cli.sweep:sweep_command",
    "eval": "spar_bench.probes.cli.fit:eval_command",
    "finetune": "spar_bench.probes.cli.finetune:finetune_command",
    "report": "spar_bench.probes.cli.report:report_command",
    "vqa": "spar_bench.probes.cli.vqa:vqa_command",
    "predict": "spar_bench.probes.cli.predict:predict_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="spar-bench")
def cli() -> None:
    """Probe a vision encoder with SPAR-Bench."""


def main(argv: list[str] | None = None) -> None:
    run_main(cli, argv)


if __name__ == "__main__":
    main()
