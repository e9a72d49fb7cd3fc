"""``spar-probe sweep``: every probe x head x seed (x grid point) from one feature cache, on all
cores (the scheduling is :mod:`spar_bench.probes.runs.sweep`)."""

from __future__ import annotations

from pathlib import Path

import click

from spar_bench.clitools import field_options, given, wait_option
from spar_bench.locks import output_lock
from spar_bench.partitions import parse_partition

from ..runs.sweep import SweepConfig, sweep
from .options import head_option, pop_run_options, probe_option, run_options, seeds_option


@click.command("sweep")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@head_option(SweepConfig, "heads", param="heads", old=True)
@probe_option(old=True)
@seeds_option(SweepConfig)
@field_options(SweepConfig, "out", "jobs", helps={"out": "Runs folder.", "jobs": "Worker processes."},
               types={"out": click.Path(file_okay=False)})
@click.option("--grid", multiple=True, metavar="KEY=V1,V2",
              help="Sweep a run option over values (repeat for a cartesian product), "
                   "e.g. --grid lr=1e-3,3e-4 --grid wd=0,0.01.")  # fmt: skip
@click.option("--list", "list_ids", is_flag=True,
              help="Print every run id (its folder under --out) and whether it is done; run nothing.")
@click.option("--only", multiple=True, metavar="RUN_ID", help="Run only this run (repeatable; ids from --list).")
@click.option("--partition", default=None, metavar="I/N",
              help="Run only the runs whose id hashes to partition I of N (e.g. a SLURM array task).")
@field_options(SweepConfig, "batch_runs", "grid_prune", helps={
    "batch_runs": "Train the runs that differ only in seed, lr and weight decay as one vmapped batch (auto: on a "
                  "GPU, where it is faster; results agree with single runs in distribution, not bit for bit).",
    "grid_prune": "Successive halving of an lr/wd --grid: each seed's grid points train as one batch, and after "
                  "epoch K only the point with the lowest validation loss so far trains on (the others are "
                  "written as pruned). 0: off. Not with --only/--partition."})  # fmt: skip
@wait_option
@run_options(SweepConfig)
def sweep_command(features, heads, probes, seeds, out, jobs, grid, list_ids, only, partition, batch_runs,
                  grid_prune, data, n_boot, no_controls, device, threads, **kw):  # fmt: skip
    """Fit every probe x head x seed (x grid point) from one cache (skips finished runs)."""
    from spar_bench.presets import explicit_options

    cfg = SweepConfig(features, heads, probes, seeds, grid=tuple(grid), only=tuple(only), partition=partition,
                      **given({"out": out, "jobs": jobs, "batch_runs": batch_runs, "grid_prune": grid_prune}),
                      data=data, n_boot=n_boot, controls=not no_controls, device=device, threads=threads,
                      preset=kw.pop("preset", None), options=pop_run_options(kw))  # fmt: skip
    if not list_ids:  # --list only reads: no lock
        _hold_outputs(cfg.out, tuple(only), parse_partition(partition))
    sweep(cfg, explicit_options(click.get_current_context()), list_ids=list_ids)


def _hold_outputs(out: str, only: tuple[str, ...], part: tuple[int, int] | None) -> None:
    """Lock ``out`` until the command ends: a whole sweep alone; the partitions of one sweep (and
    its ``--only`` runs) side by side (shared), each partition and each named run by one sweep."""
    ctx, what = click.get_current_context(), "spar-probe sweep"
    ctx.with_resource(output_lock(out, what=what, shared=bool(only or part)))
    if part is not None:
        ctx.with_resource(output_lock(f"{out}.partition-{part[0]}-of-{part[1]}", what=what,
                                      name=f"{out} partition {part[0]}/{part[1]}"))  # fmt: skip
    for rid in sorted(set(only)):  # the lock an eval of that run takes too
        ctx.with_resource(output_lock(Path(out) / rid, what=what, name=f"{out} run {rid}"))
