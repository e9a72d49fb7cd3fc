"""``spar-probe encoders``: list the encoders the registry knows (nothing is downloaded)."""

from __future__ import annotations

import json

import click

from ..encoders import registry_rows


@click.command("encoders")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def encoders_command(as_json: bool) -> None:
    """List the encoders: names, family, input size, tokens, dim, pooled vector, weights source.

    Nothing is downloaded; "?" marks what is only known once the encoder is loaded.
    """
    rows = registry_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    cols = ["name", "family", "input", "tokens", "dim", "pooled", "weights"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    click.echo("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        click.echo("  ".join(r[c].ljust(widths[c]) for c in cols).rstrip())
