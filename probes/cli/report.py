"""``spar-probe report``: tables and plots over a folder of runs (:mod:`spar_bench.probes.runs.report`)."""

from __future__ import annotations

import click

from ..runs.report import write_report


@click.command("report")
@click.argument("runs", type=click.Path(file_okay=False))
@click.option("--out", default="report", show_default=True, type=click.Path(file_okay=False))
def report_command(runs, out):
    """Tables (report.md, report.json) and plots over a folder of runs."""
    path = write_report(runs, out)
    click.echo(f"report: {path}")
