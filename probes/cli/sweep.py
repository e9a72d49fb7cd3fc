"""``spar-probe sweep``: every probe x head x seed (x grid point) from one feature cache, on all
cores (the scheduling is :mod:`spar_bench.probes.runs.sweep`)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from spar_bench.clitools import wait_option
from spar_bench.locks import output_lock

from ..runs.sweep import (
    Job,
    check_grid_prune,
    list_runs,
    make_jobs,
    print_results,
    run_sweep,
    select_jobs,
)
from .options import (
    apply_preset,
    cache_levels,
    head_option,
    parse_heads,
    parse_probes,
    parse_seeds,
    pop_run_options,
    probe_option,
    resolved_device,
    run_options,
    seeds_option,
    with_preset,
)


@click.command("sweep")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@head_option("mlp,transformer", param="heads", old=True)
@probe_option(old=True)
@seeds_option("0,1,2")
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--jobs", default=2, show_default=True, type=click.IntRange(1), help="Worker processes."
)
@click.option("--grid", multiple=True, metavar="KEY=V1,V2",
              help="Sweep a run option over values (repeat for a cartesian product), "
                   "e.g. --grid lr=1e-3,3e-4 --grid wd=0,0.01.")  # fmt: skip
@click.option("--list", "list_ids", is_flag=True,
              help="Print every run id (its folder under --out) and whether it is done; run nothing.")
@click.option("--only", multiple=True, metavar="RUN_ID", help="Run only this run (repeatable; ids from --list).")
@click.option("--partition", default=None, metavar="I/N",
              help="Run only the runs whose id hashes to partition I of N (e.g. a SLURM array task).")
@click.option("--batch-runs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Train the runs that differ only in seed, lr and weight decay as one vmapped batch "
                   "(auto: on a GPU, where it is faster; results agree with single runs in "
                   "distribution, not bit for bit).")
@click.option("--grid-prune", default=0, show_default=True, type=int, metavar="K",
              help="Successive halving of an lr/wd --grid: each seed's grid points train as one batch, "
                   "and after epoch K only the point with the lowest validation loss so far trains on "
                   "(the others are written as pruned). 0: off. Not with --only/--partition.")
@wait_option
@run_options
def sweep_command(features, heads, probes, seeds, out, jobs, grid, list_ids, only, partition, batch_runs,
                  grid_prune, data, n_boot, no_controls, device, threads, **kw):  # fmt: skip
    """Fit every probe x head x seed (x grid point) from one cache (skips finished runs)."""
    from spar_bench.partitions import parse_partition

    from ..runs.inputs import encoder_slug, open_cache, resolve_build
    from ..runs.spec import parse_grid

    kw, preset = apply_preset({"seeds": seeds, "heads": heads, **kw})
    seeds, heads = kw.pop("seeds"), kw.pop("heads")
    options = pop_run_options(kw)
    head_list = parse_heads(heads)
    device = resolved_device(device)  # fail fast on an unusable --device; auto: cpu or cuda
    points = parse_grid(grid)
    all_jobs = make_jobs(str(features), head_list, parse_probes(probes, cache_levels(features)), parse_seeds(seeds), options,
                         points, str(out), threads, data=data, controls=not no_controls,
                         n_boot=n_boot, device=device)  # fmt: skip
    all_jobs = [Job(with_preset(j.run, preset), j.out, j.threads) for j in all_jobs]
    if grid_prune:
        check_grid_prune(grid_prune, all_jobs, points, bool(only or partition))
    cache = open_cache(features)
    resolve_build(cache, data)  # fail fast on a fingerprint mismatch
    slug = encoder_slug(cache)
    if list_ids:
        list_runs(all_jobs, slug, cache, grid_prune)
        return
    chosen = select_jobs(all_jobs, slug, tuple(only), parse_partition(partition))
    _hold_outputs(out, tuple(only), parse_partition(partition))
    t0 = time.perf_counter()
    batched = batch_runs == "on" or (batch_runs == "auto" and str(device).startswith("cuda"))
    print_results(run_sweep(chosen, jobs, batched, grid_prune), time.perf_counter() - t0, out)


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
