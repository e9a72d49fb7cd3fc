"""``spar-build``: build SPAR-Bench from CT sources.

``spar-build --source word --out shards/`` builds; subcommands list sources, render
the phantom, inspect cases, verify and publish a build. Subcommands are imported
lazily, so ``--help`` is instant.
"""

from __future__ import annotations

import click

from spar_bench.clitools import LazyGroup, run_main, wait_option

from .options import jobs_option, pop_jobs

COMMANDS = {
    "sources": "spar_bench.builder.sources:sources_command",
    "inspect": "spar_bench.builder.inspect:inspect_command",
    "phantom": "spar_bench.builder.phantom.cli:phantom_command",
    "verify": "spar_bench.builder.verify:verify_command",
    "merge": "spar_bench.builder.merge:merge_command",
    "push": "spar_bench.builder.writers.hf:push_command",
    "export": "spar_bench.probes.cli.export:export_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, invoke_without_command=True)
@click.option("--source", multiple=True, metavar="NAME",
              help="Source to build from (repeat for a transfer build); see `spar-build sources`.")
@click.option("--root", multiple=True, metavar="DIR",
              help="Data folder, one per --source (default $SPAR_DATA_<SOURCE>, else ./data/<source>).")
@click.option("--out", metavar="DIR", help="Output folder (required to build).")
@click.option("--levels", metavar="LIST",
              help="Comma list of level1,level2,level3,level4 (default level1,level2,level3; "
                   "level4, whole CT volumes, is opt-in).")
@click.option("--volume-size", type=int, metavar="S",
              help="Level 4 (needs level4 in --levels): side of the isotropic volume cube in voxels "
                   "(default 128; from 8 to the largest this machine's memory allows).")
@click.option("--window", metavar="LEVEL,WIDTH",
              help="CT window in HU mapped to the uint8 images (default 40,400); 0,2000 keeps "
                   "-1000..1000 HU, air and bone, the range of a CT foundation model such as astra-ct.")
@click.option("--samples-per-case", type=int, help="Level 1/2 mosaics per case.")
@click.option("--l12-min-organs", type=int,
              help="Present organs a Level 1/2 mosaic needs (default 8; fewer: the case gives none).")
@click.option("--seed", type=int, default=0, show_default=True, help="Global seed.")
@jobs_option("Processes (never change the output).", checked=False)
@click.option("--counterfactual", metavar="mirror|mirror+flip",
              help="Add left-right mirrored copies; mirror+flip also adds superior-inferior flipped "
                   "Level 4 volumes.")
@click.option("--images", type=click.Choice(["auto", "require", "synthesize"]), default="auto",
              show_default=True, help="Use real CT, require it, or render pseudo-CT from masks.")
@click.option("--arrangement", type=click.Choice(["rows-by-y", "rank-x", "rank-y"]),
              help="Level 2 target arrangement.")
@click.option("--partition", metavar="I/N", default=None,
              help="Build only partition I of N (cases by hash of their id) into a partition "
                   "folder; combine all N with `spar-build merge`.")
@click.option("--shard-size", type=int, default=2000, show_default=True, help="Rows per shard.")
@click.option("--compression", type=click.Choice(["blosc", "gzip", "lzf", "none"]), default="blosc",
              show_default=True, help="HDF5 image compression; gzip, lzf and none read without hdf5plugin.")
@click.option("--thresholds-from", metavar="PATH",
              help="Take size/distance thresholds from another build (folder or manifest.json).")
@click.option("--fit-thresholds-on", metavar="SPLIT",
              help="Fit thresholds on this split when the build has no train split.")
@click.option("--resume", is_flag=True, help="Finish an interrupted build (reuses OUT.tmp).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT.")
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail", show_default=True,
              help="On a bad case: stop, or skip it and record why in the manifest.")
@click.option("--no-hf", is_flag=True, help="Do not write the Hugging Face folder OUT/hf.")
@click.option("--cases", multiple=True, metavar="[SOURCE=]IDS",
              help="Only these case ids (comma list, or @FILE with one id a line); per source.")
@click.option("--limit", multiple=True, metavar="[SOURCE=]N",
              help="Keep N cases, chosen by a seeded patient-level draw; per source.")
@click.option("--split-ratio", multiple=True, metavar="[SOURCE=]TRAIN,VAL,TEST",
              help="Split a source by patient in this ratio (seeded), e.g. lits=0.7,0.1,0.2.")
@click.option("--split-file", metavar="CSV", help="Splits of listed cases: columns case_id,split[,source].")
@click.option("--unknown-labels", type=click.Choice(["fail", "ignore"]), default="fail", show_default=True,
              help="A label id the label map does not know: stop, or ignore it (recorded per case).")
@click.option("--preset", metavar="NAME",
              help="Fill the options not given from a named preset: paper (docs/PROTOCOL.md §12); "
                   "explicit options win, and the manifest records both.")
@wait_option  # OUT.lock is taken by the build (spar_bench.locks)
@click.version_option(package_name="spar-bench")
@click.pass_context
def cli(ctx: click.Context, **options) -> None:
    """Build SPAR-Bench shards: spar-build --source SOURCE --out DIR [options]."""
    if ctx.invoked_subcommand is not None:
        return
    if not options.get("out") and not options.get("source"):
        click.echo(ctx.get_help())
        return
    from spar_bench.presets import explicit_options

    from .build import build_from_cli

    options["jobs"] = pop_jobs(options)
    build_from_cli(options, explicit_options(ctx))


def main(argv: list[str] | None = None) -> None:
    run_main(cli, argv)


if __name__ == "__main__":
    main()
