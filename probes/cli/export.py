"""``spar-build export BUILD --format vlmevalkit|lmms-eval --out DIR``: the build's questions,
with every control, for another harness (the library call: :func:`spar_bench.probes.vqa.export.export_build`)."""

from __future__ import annotations

import click

from spar_bench.clitools import field_options, given

from ..vqa.export import FORMATS, export_build
from ..vqa.options import VqaOptions
from .options import probe_option


@click.command("export")
@click.argument("build", type=click.Path(file_okay=False))
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS),
              help="vlmevalkit: a CustomMCQDataset TSV per probe; lmms-eval: a task folder per probe.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="A new (or empty) folder.")
@probe_option("Question probe(s) (size or level3.size; level4.volume) or 'all' (those of the build's levels).",
              cls=VqaOptions)
@field_options(VqaOptions, "splits", helps={"splits": "Splits whose questions are exported."})
@click.option("--no-convention-hint", is_flag=True, help="Drop the display-convention sentence.")
@click.option("--no-circular", is_flag=True, help="Skip the option rotations (CircularEval).")
@click.option("--no-blind", is_flag=True, help="Skip the blind (no image) control.")
@field_options(VqaOptions, "image_size", "volume_as", helps={
    "image_size": "Side of each image, as spar-probe vqa's.",
    "volume_as": "Level 4: 'montage' (auto) or 'views' one image; 'video' frames (lmms-eval only)."})
def export_command(build, fmt, out, probes, splits, no_convention_hint, no_circular, no_blind, image_size, volume_as):
    """Export a build's questions (every control) as VLMEvalKit TSVs or lmms-eval tasks;
    score the answers back with spar-probe vqa --answers FILE."""
    opts = VqaOptions(probes=probes, convention_hint=not no_convention_hint, circular=not no_circular,
                      blind=not no_blind, **given({"splits": splits, "image_size": image_size, "volume_as": volume_as}))
    for probe, meta in export_build(build, out, fmt, opts):
        if meta is None:
            click.echo(f"{probe}: no questions on {opts.splits}; skipped", err=True)
        else:
            click.echo(f"{probe}: -> {meta.parent if fmt == 'lmms-eval' else meta.with_suffix('.tsv')}")
