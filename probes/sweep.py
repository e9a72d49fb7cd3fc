"""``spar-probe sweep``: every probe x head x seed from one feature cache, on all cores.

Runs are independent processes (a ``spawn`` process pool; each worker uses one torch
thread, so ``--jobs 2`` keeps both cores of a small machine busy without
oversubscription). A run whose ``metrics.json`` exists is skipped, so an interrupted
sweep resumes where it stopped. Token heads are scheduled first (they take longest).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import click

from spar_bench.errors import SparError


@dataclass(frozen=True)
class Job:
    features: str
    head: str
    probe: str
    seed: int
    out: str
    layer: int
    data: str | None
    max_epochs: int | None
    n_boot: int
    controls: bool
    batch_size: int = 256
    device: str = "cpu"


def plan(jobs: list[Job]) -> tuple[list[Job], list[Job]]:
    """Split ``jobs`` into (to run, already finished); to-run ordered token heads first."""
    from .fit import METRICS_FILE, open_cache, run_dir
    from .heads import head_input

    if not jobs:
        return [], []
    cache = open_cache(jobs[0].features)
    todo, done = [], []
    for j in jobs:
        (
            done
            if (run_dir(j.out, cache, j.probe, j.head, j.seed) / METRICS_FILE).is_file()
            else todo
        ).append(j)
    todo.sort(key=lambda j: (head_input(j.head) != "tokens", j.head, j.probe, j.seed))
    return todo, done


class JobResult(NamedTuple):
    job: Job
    run_dir: str
    seconds: float
    error: str | None = None
    #: why the probe could not run on this build (no items): reported, not a failure
    unavailable: str | None = None


def run_job(job: Job) -> JobResult:
    """Worker entry: one run with one torch thread."""
    import torch

    from .fit import ProbeUnavailable, run_fit, train_config_from

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        rd = run_fit(
            job.features, job.head, job.probe, job.seed, job.out, job.layer, job.data,
            train_config_from(job.max_epochs, job.batch_size, 1e-3, job.device), None, job.n_boot, job.controls,
            progress=False,
        )  # fmt: skip
    except ProbeUnavailable as e:
        return JobResult(job, "", time.perf_counter() - t0, unavailable=str(e))
    except SparError as e:
        return JobResult(job, "", time.perf_counter() - t0, error=str(e))
    return JobResult(job, str(rd), time.perf_counter() - t0)


def run_sweep(jobs: list[Job], n_jobs: int = 2) -> list[JobResult]:
    """Run the unfinished ``jobs`` with ``n_jobs`` processes (1: in this process)."""
    from tqdm.auto import tqdm

    todo, done = plan(jobs)
    if done:
        click.echo(f"skipping {len(done)} finished run(s)")
    results = []
    bar = tqdm(total=len(todo), desc="sweep", unit="run")
    if n_jobs <= 1 or len(todo) <= 1:
        for j in todo:
            results.append(run_job(j))
            bar.update()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=mp.get_context("spawn")) as ex:
            futures = [ex.submit(run_job, j) for j in todo]
            for f in as_completed(futures):
                results.append(f.result())
                bar.update()
    bar.close()
    return results


@click.command("sweep")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@click.option(
    "--heads", default="mlp,transformer", show_default=True, help="Comma-separated heads."
)
@click.option("--probes", default="all", show_default=True, help="Comma-separated probes or 'all'.")
@click.option("--seeds", default="0,1,2", show_default=True, help="Comma-separated seeds.")
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--jobs", default=2, show_default=True, type=click.IntRange(1), help="Worker processes."
)
@click.option("--layer", default=-1, show_default=True, type=int)
@click.option(
    "--data",
    default=None,
    type=click.Path(file_okay=False),
    help="Build dir (default: the cache's).",
)
@click.option(
    "--max-epochs", default=None, type=int, help="Default: 100 pooled heads, 40 token heads."
)
@click.option("--batch-size", default=256, show_default=True, type=int)
@click.option("--bootstrap", "n_boot", default=1000, show_default=True, type=int)
@click.option("--no-controls", is_flag=True, help="Skip the blind baselines.")
@click.option("--device", default="cpu", show_default=True, help="Where heads train: cpu or cuda[:N].")
def sweep_command(
    features,
    heads,
    probes,
    seeds,
    out,
    jobs,
    layer,
    data,
    max_epochs,
    batch_size,
    n_boot,
    no_controls,
    device,
):
    """Fit every probe x head x seed from one cache (skips finished runs)."""
    from spar_bench.errors import ConfigError

    from .fit import open_cache, parse_probes, parse_seeds, resolve_build, train_config_from
    from .heads import head_input

    head_list = [h.strip() for h in heads.split(",") if h.strip()]
    for h in head_list:
        head_input(h)  # unknown head -> ConfigError with suggestions
    probe_list = parse_probes(probes)  # names first, before any file is read
    resolve_build(open_cache(features), data)  # fail fast on a fingerprint mismatch
    train_config_from(None, batch_size, 1e-3, device)  # fail fast on an unusable --device
    all_jobs = [
        Job(
            str(features),
            h,
            p,
            s,
            str(out),
            layer,
            data,
            max_epochs,
            n_boot,
            not no_controls,
            batch_size,
            device,
        )
        for h in head_list
        for p in probe_list
        for s in parse_seeds(seeds)
    ]
    t0 = time.perf_counter()
    results = run_sweep(all_jobs, jobs)
    failed = [(r.job, r.error) for r in results if r.error]
    n_unavailable = sum(r.unavailable is not None for r in results)
    for r in sorted(results, key=lambda r: (r.job.probe, r.job.head, r.job.seed)):
        j = r.job
        status = (f"FAILED: {r.error}" if r.error
                  else f"not available on this build: {r.unavailable}" if r.unavailable
                  else f"{r.seconds:.1f}s")  # fmt: skip
        click.echo(f"{j.probe:28s} {j.head:12s} seed{j.seed}  {status}")
    click.echo(
        f"sweep: {len(results) - len(failed) - n_unavailable} run(s) done, {n_unavailable} probe run(s)"
        f" not available on this build, in {time.perf_counter() - t0:.1f}s -> {Path(out)}"
    )
    if failed:
        raise ConfigError(
            f"{len(failed)} run(s) failed; first: {failed[0][0].probe}/{failed[0][0].head}: {failed[0][1]}"
        )
