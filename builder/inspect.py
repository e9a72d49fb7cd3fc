"""``spar-build inspect``: read cases as the builder will, and show what it sees.

For each case: orientation found in the file and the transform applied, spacing,
shape, organs present with voxel counts, organs annotated but absent, organs the
source does not annotate, label ids ignored, repairs made, and problems. A case without
an image (a masks-only folder) is inspected from its masks alone (``--images auto``, the
default): the report says there is no image and the PNG draws the masks alone. ``--png DIR`` writes an overlay of
the axial slice showing the most organs, per case, in the display convention (column 0 = patient's right, so the
patient's right is on the image's LEFT edge, marked "R"; "L" on the right edge).
``--volume-size S`` adds the Level 4 cube a build with that size would cut (side in mm, mm
per voxel; docs/PROTOCOL.md §5a).
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from spar_bench.clitools import field_option
from spar_bench.errors import ConfigError, SparError

from .ontology import label_counts
from .options import BUILD
from .schema import N_ORGANS, ORGANS


def volume_line(case, size: int, margin_mm: float) -> str:
    """The Level 4 cube a build with ``--volume-size size`` would cut from ``case``."""
    from .samples.volume import grid_for_case

    grid = grid_for_case(case, size, margin_mm)
    if grid is None:
        return "  level4 cube: none (no labelled voxel)"
    side = grid.mm_per_voxel * size
    return (f"  level4 cube: {side:.1f} mm a side around the labelled organs ({margin_mm:g} mm margin); "
            f"{grid.mm_per_voxel:.2f} mm/voxel at --volume-size {size}")


def describe_case(case, sample=None) -> list[str]:
    """Human-readable lines describing one loaded :class:`~spar_bench.builder.case.Case`;
    with a :class:`~spar_bench.builder.samples.SampleConfig` ``sample``, also the Level 4 cube
    of its ``volume_size`` (:func:`volume_line`)."""
    from .frame import describe_transform

    info = case.provenance.get("orientation", {})
    applied = describe_transform(info) if "transform" in info else "unknown transform"
    counts = np.zeros(N_ORGANS + 1, dtype=np.int64)
    found = label_counts(case.mask)
    counts[: found.size] = found
    present = [f"{o}={int(counts[i + 1])}" for i, o in enumerate(ORGANS) if counts[i + 1]]
    absent = [o for i, o in enumerate(ORGANS) if case.annotated[i] and not counts[i + 1]]
    unannotated = [o for i, o in enumerate(ORGANS) if not case.annotated[i]]
    if case.image is not None:
        image_line = f"  image: {'pseudo-CT (synthesized)' if case.image_synthesized else 'CT'}, HU range " \
                     f"[{int(case.image.min())}, {int(case.image.max())}]"
    else:
        image_line = "  image: none (masks only; a build needs the CT images, or --images synthesize)"
    lines = [
        f"case {case.case_id} (source {case.source}, split {case.split})",
        f"  orientation: found {info.get('axcodes', '?')}; applied {applied} -> [z,row,col] "
        "(row 0 anterior, col 0 = patient's right)",
        f"  spacing (z,row,col) mm: {tuple(round(float(s), 4) for s in case.spacing)}; shape: {case.shape}",
        image_line,
        f"  present ({len(present)}): {', '.join(present) or 'none'}",
        f"  absent (annotated, 0 voxels): {', '.join(absent) or 'none'}",
        f"  not annotated by source: {', '.join(unannotated) or 'none'}",
    ]
    if case.lesion is not None:
        lines.append(f"  lesion voxels: {int(np.count_nonzero(case.lesion))}")
    ignored = case.provenance.get("ignored_label_ids") or {}
    if ignored:
        lines.append("  ignored label ids: " + ", ".join(f"{k} ({v} voxels)" for k, v in ignored.items()))
    mask_info = case.provenance.get("mask_orientation")
    if mask_info:
        lines.append(f"  mask axis order: found {mask_info.get('axcodes', '?')} (another order of the image's grid); "
                     f"applied {describe_transform(mask_info)}")
    repairs = case.provenance.get("repairs") or []
    for r in repairs:
        lines.append(f"  repair: {r}")
    problems = []
    obliq = info.get("obliquity_deg", 0.0) or 0.0
    if obliq > 1.0:
        problems.append(f"oblique volume ({obliq:.1f} deg): snapped to nearest axes, not resampled")
    if case.provenance.get("overlap_voxels"):
        problems.append(f"{case.provenance['overlap_voxels']} voxels claimed by two classes")
    lines.append(f"  problems: {'; '.join(problems) or 'none'}")
    if sample is not None:
        lines.append(volume_line(case, sample.volume_size, sample.fov_margin_mm))
    return lines


def overlay_slice(mask: np.ndarray) -> int:
    """The axial slice showing the most organs (ties: the one nearest the labelled z-middle)."""
    n_z = mask.shape[0]
    per_slice = np.bincount(
        (np.arange(n_z, dtype=np.int64)[:, None] * (N_ORGANS + 1) + mask.reshape(n_z, -1)).ravel(),
        minlength=n_z * (N_ORGANS + 1),
    ).reshape(n_z, N_ORGANS + 1)
    n_organs = (per_slice[:, 1:] > 0).sum(axis=1)
    zs = np.flatnonzero(n_organs)
    if zs.size == 0:
        return n_z // 2
    middle = (zs[0] + zs[-1]) / 2.0
    best = np.flatnonzero(n_organs == n_organs.max())
    return int(best[np.argmin(np.abs(best - middle))])


def write_overlay_png(case, path: Path) -> Path:
    """Axial overlay (see :func:`overlay_slice`) in display convention, "R" on the image's left edge, "L" on its right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    z = overlay_slice(case.mask)
    sz, sr, sc = case.spacing
    fig, ax = plt.subplots(figsize=(6, 6 * (case.shape[1] * sr) / max(case.shape[2] * sc, 1e-6) + 0.4))
    extent = (0, case.shape[2] * sc, case.shape[1] * sr, 0)
    has_image = case.image is not None
    if has_image:
        ax.imshow(np.clip(case.image[z], -160, 240), cmap="gray", extent=extent, interpolation="nearest")
    overlay = np.ma.masked_equal(case.mask[z], 0)
    ax.imshow(overlay, cmap="tab20", vmin=1, vmax=20, alpha=0.45 if has_image else 0.9,
              extent=extent, interpolation="nearest")  # masks alone: opaque on white
    for organ_id in np.unique(case.mask[z]):
        if organ_id == 0:
            continue
        rows, cols = np.nonzero(case.mask[z] == organ_id)
        ax.text(cols.mean() * sc, rows.mean() * sr, ORGANS[organ_id - 1], color="white" if has_image else "black",
                fontsize=6, ha="center", va="center")
    mark = "yellow" if has_image else "darkorange"
    style = {"color": mark, "fontsize": 16, "fontweight": "bold", "va": "center"}
    ax.text(0.01, 0.5, "R", transform=ax.transAxes, ha="left", **style)
    ax.text(0.99, 0.5, "L", transform=ax.transAxes, ha="right", **style)
    ax.text(0.5, 0.99, "A", transform=ax.transAxes, ha="center", color=mark, fontsize=12, va="top")
    alone = "" if has_image else ", masks only: no image"
    ax.set_title(f"{case.source}/{case.case_id} z={z} (patient's right on the left{alone})", fontsize=9)
    ax.set_axis_off()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


@click.command("inspect")
@click.option("--source", "source_name", required=True, help="Source name (see `spar-build sources`).")
@click.option("--root", type=click.Path(path_type=Path), required=True, help="Folder of the source.")
@click.option("--case", "case_ids", multiple=True, help="Only this case id (repeatable).")
@field_option(BUILD, "images", type=click.Choice(["auto", "require", "synthesize"]), fill=True,
              help="auto: read images where they exist, masks alone where not; "
              "synthesize: render a pseudo-CT for masks-only folders.")
@field_option(BUILD, "unknown_labels", type=click.Choice(["fail", "ignore"]), fill=True,
              help="A label id the label map does not know: stop, or ignore it (listed).")
@click.option("--png", "png_dir", type=click.Path(path_type=Path), default=None,
              help="Write a mid-slice overlay PNG per case into this folder.")
@field_option(BUILD, "on_error", type=click.Choice(["fail", "skip"]), fill=True,
              help="fail: stop at the first bad case; skip: report it and continue.")
@field_option(BUILD, "seed", type=int, fill=True, help="Global seed (pseudo-CT rendering).")
@click.option("--volume-size", type=int, default=None, metavar="S",
              help="Also show the Level 4 cube (side in mm, mm per voxel) at this --volume-size.")
def inspect_command(
    source_name: str,
    root: Path,
    case_ids: tuple[str, ...],
    images: str,
    png_dir: Path | None,
    on_error: str,
    seed: int,
    unknown_labels: str,
    volume_size: int | None,
) -> None:
    """Read cases into the canonical frame and print what the builder will see."""

    from .sources import SOURCES

    sample = None
    if volume_size is not None:  # checked where every build checks it
        from .samples import SampleConfig

        sample = SampleConfig(volume_size=volume_size)
    source_cls = SOURCES.get(source_name)
    source = source_cls(root, images=images, seed=seed, unknown_labels=unknown_labels)
    refs = source.find()
    if case_ids:
        known = {r.case_id for r in refs}
        missing = [c for c in case_ids if c not in known]
        if missing:
            raise ConfigError(f"case(s) {', '.join(missing)} not found in {root} ({len(refs)} cases there)")
        refs = [r for r in refs if r.case_id in set(case_ids)]
    failed = 0
    for ref in refs:
        try:
            masks_only = images == "auto" and "image" not in ref.files and hasattr(source, "read_case")
            case = source.read_case(ref, masks_only=True) if masks_only else source.load(ref)
        except SparError as e:
            if on_error == "fail":
                raise
            failed += 1
            click.echo(f"case {ref.case_id}: SKIPPED: {e}")
            continue
        for line in describe_case(case, sample):
            click.echo(line)
        if png_dir is not None:
            out = write_overlay_png(case, Path(png_dir) / f"{source_name}_{case.case_id}.png")
            click.echo(f"  png: {out}")
    click.echo(f"{len(refs) - failed} case(s) read, {failed} skipped")
