"""``spar-build phantom``: write a procedural phantom dataset in the WORD layout."""

from __future__ import annotations

import click

from spar_bench.clitools import declared_type, field_option, given, wait_option

from ..options import jobs_option, pop_jobs
from .generate import INTENSITIES, LAYOUTS, SIZES, PhantomOptions, write_phantom_dataset


@click.command("phantom")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Output folder (WORD layout).",
)
@click.option(
    "--n", "n", default=150, show_default=True, type=click.IntRange(min=1), help="Number of cases."
)
@field_option(PhantomOptions, "layout", type=click.Choice(LAYOUTS),
              help="canonical anatomy, mirrored (situs inversus) or random organ positions.")
@field_option(PhantomOptions, "seed", help="Global seed; each case derives its own.")
@click.option(
    "--no-lesions", is_flag=True, help="Draw no liver lesions (the lesion channel stays empty)."
)
@field_option(PhantomOptions, "size", type=click.Choice(tuple(SIZES)),
              help="small: 160x160 x 40-60 slices; medium: 256x256 x 80-120; large: 512x512 x 160-240.")
@click.option(
    "--in-plane",
    type=declared_type(PhantomOptions, "in_plane"),
    default=None,
    help="In-plane voxels (N x N), overriding --size's; a smaller grid renders and builds faster.",
)
@click.option(
    "--slices",
    "n_slices",
    type=declared_type(PhantomOptions, "n_slices"),
    default=None,
    help="Slices per case, overriding --size's range.",
)
@field_option(PhantomOptions, "intensities", type=click.Choice(INTENSITIES),
              help="ct: CT-like organ means (left/right pairs look the same); distinct: every organ its "
                   "own mean HU, 17 HU apart, so organs can be told apart by intensity in any layout.")
@click.option("--overwrite", is_flag=True, help="Replace an existing phantom dataset in --out.")
@jobs_option("Processes rendering cases; the dataset's bytes do not depend on it.")
@wait_option
def phantom_command(
    out_dir: str, n: int, layout: str | None, seed: int | None, no_lesions: bool, size: str | None,
    in_plane: int | None, n_slices: int | None, intensities: str | None, overwrite: bool, **jobs: int | None,
) -> None:
    """Write N phantom cases (imagesTr/labelsTr, imagesVal/labelsVal, imagesTs/labelsTs).

    Read them back with ``spar-build --source phantom --root DIR``. Labels use
    manifests/labels/phantom.json (WORD ids, 17 = liver lesion); DIR/phantom.json
    records the seed, layout and every case's parameters.
    """
    from spar_bench.locks import output_lock

    options = PhantomOptions(lesions=not no_lesions, in_plane=in_plane, n_slices=n_slices,
                             **given({"layout": layout, "seed": seed, "size": size, "intensities": intensities}))
    with output_lock(out_dir, what="spar-build phantom"):
        record = write_phantom_dataset(out_dir, n, options, overwrite=overwrite, workers=pop_jobs(jobs))
    splits = ", ".join(f"{k} {v}" for k, v in record["splits"].items())
    n_les = sum(1 for c in record["cases"].values() if c["lesion_voxels"] > 0)
    shapes = [c["shape"] for c in record["cases"].values()]
    click.echo(
        f"wrote {record['n']} {options.layout} phantom cases to {out_dir} ({splits}); "
        f"{n_les} with liver lesions; {shapes[0][1]}x{shapes[0][2]} in-plane, "
        f"{min(s[0] for s in shapes)}-{max(s[0] for s in shapes)} slices; seed {options.seed}; {options.intensities} intensities"
    )
