"""The batch runner of ``spar-probe sweep``: every probe x head x seed (x grid point) from one
feature cache, on all cores.

Every job is one :class:`~.spec.RunSpec`, made from the same options as
``spar-probe fit`` (so a sweep reproduces a fit run with the same options byte for
byte), plus ``--grid KEY=V1,V2 ...``: the cartesian product of run options (``lr``,
``weight_decay``/``wd``, ``batch_size``, ``max_epochs``, ``proj_dim``, ``d_model``,
``n_layers``, ``dropout``, ``hidden`` ...; each grid point gets its own run folder). Head
options apply to the heads that have them.

Runs are independent processes (a ``spawn`` process pool; each worker uses ``--threads``
torch threads, 1 by default, so ``--jobs 2`` keeps both cores of a small machine busy
without oversubscription). A run whose ``metrics.json`` exists is skipped, so an
interrupted sweep resumes where it stopped. SIGTERM or Ctrl-C stops the sweep and its
processes at once (:mod:`spar_bench.procs`); the runs they were training have no
``metrics.json`` and are trained again by the rerun. Token heads are scheduled first (they take
longest).

Spreading a sweep over machines (docs/SCALE.md): every run has an id, its folder relative
to ``--out`` (``<encoder>/<probe>/<head>[,variant]/seed<k>``). ``--list`` prints the ids
and whether each is finished; ``--only ID`` runs just those; ``--partition I/N`` runs the
ids whose sha256 falls in partition I of N (:mod:`spar_bench.partitions`), so a scheduler
array of N tasks runs each run exactly once, all into one folder.

``--grid-prune K`` (successive halving): the grid points of each seed that differ only in
lr / weight decay train as one batch (whatever ``--batch-runs`` says); after epoch K only
the point with the lowest validation loss so far trains on, the others stop and are
written as pruned (``train.pruned_at`` in metrics.json). It needs the whole grid in one
sweep, so it refuses ``--only`` and ``--partition``.

``spar-probe --help`` loads this module, so the session, the cache readers and torch are
imported where they are used (docs/DEVELOPING.md, Imports).
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import click

from spar_bench.errors import ConfigError, RunFailed, SparError
from spar_bench.fields import check_fields, limited
from spar_bench.partitions import bucket, parse_partition
from spar_bench.procs import check_stop, completed, process_pool

from ..heads import head_input
from ..names import cache_probes, parse_heads, parse_seeds
from .spec import OPTIONS, RunSpec, check_options_apply, make_run, parse_grid, with_preset


@dataclass(frozen=True)
class Job:
    """One run of a sweep and where it writes."""

    run: RunSpec
    out: str
    threads: int = 1


def plan(jobs: list[Job], grid_prune: int = 0) -> tuple[list[Job], list[Job]]:
    """Split ``jobs`` into (to run, already finished); to-run ordered token heads first.

    A finished run made with other options than its job's is an error (:func:`~.store.finished_run`).
    """
    from .inputs import encoder_slug, open_cache
    from .predictors import finished_run

    if not jobs:
        return [], []
    cache = open_cache(jobs[0].run.features)
    slug = encoder_slug(cache)
    todo, done = [], []
    for j in jobs:
        (done if finished_run(j.run, j.run.run_dir(j.out, slug), cache, grid_prune) else todo).append(j)
    todo.sort(key=schedule_key)
    return todo, done


def schedule_key(j: Job) -> tuple:
    """Token heads first (they take longest), then a fixed order."""

    return head_input(j.run.head) != "tokens", j.run.head, j.run.probe, j.run.variant(), j.run.seed


class JobResult(NamedTuple):
    job: Job
    run_dir: str
    seconds: float
    error: str | None = None
    #: why the probe could not run on this build (no items): reported, not a failure
    unavailable: str | None = None


def run_job(job: Job) -> JobResult:
    """Worker entry: one run with ``job.threads`` torch threads."""
    import torch

    from .inputs import ProbeUnavailable
    from .session import run_fit

    torch.set_num_threads(job.threads)
    t0 = time.perf_counter()
    try:
        rd = run_fit(job.run, job.out, progress=False)
    except ProbeUnavailable as e:
        return JobResult(job, "", time.perf_counter() - t0, unavailable=str(e))
    except SparError as e:
        return JobResult(job, "", time.perf_counter() - t0, error=str(e))
    return JobResult(job, str(rd), time.perf_counter() - t0)


def run_batch(jobs: list[Job], prune_at: int = 0) -> list[JobResult]:
    """Worker entry: jobs of one batch key trained as one batch (:func:`~.session.run_fit_batch`;
    ``prune_at``: successive halving of each seed's grid points after that epoch)."""
    import torch

    from .inputs import ProbeUnavailable
    from .session import run_fit_batch

    if len(jobs) == 1:
        return [run_job(jobs[0])]
    torch.set_num_threads(jobs[0].threads)
    t0 = time.perf_counter()
    try:
        dirs = run_fit_batch([j.run for j in jobs], jobs[0].out, prune_at=prune_at)
    except ProbeUnavailable as e:
        return [JobResult(j, "", time.perf_counter() - t0, unavailable=str(e)) for j in jobs]
    except SparError as e:
        return [JobResult(j, "", time.perf_counter() - t0, error=str(e)) for j in jobs]
    each = (time.perf_counter() - t0) / len(jobs)
    return [JobResult(j, str(rd), each) for j, rd in zip(jobs, dirs, strict=True)]


def batches(jobs: list[Job], batched: bool) -> list[list[Job]]:
    """Units of work: one job each, or (``batched``) the jobs that differ only in seed, lr and
    weight decay together, in first-appearance order."""
    from ..ensemble import batch_key

    if not batched:
        return [[j] for j in jobs]
    units: dict = {}
    for j in jobs:
        units.setdefault((j.out, j.threads, batch_key(j.run)), []).append(j)
    return list(units.values())


def run_sweep(jobs: list[Job], n_jobs: int = 2, batched: bool = False, prune_at: int = 0) -> list[JobResult]:
    """Run the unfinished ``jobs`` with ``n_jobs`` processes (1: in this process); ``batched``
    trains the runs of one batch key together (:mod:`spar_bench.probes.ensemble`).

    ``prune_at`` (``--grid-prune``): every batch key is one batch, pruned after that epoch;
    a batch with any unfinished run is trained again whole (its finished runs are rewritten
    with the same bytes), since pruning depends on all of its runs.
    """
    from tqdm.auto import tqdm

    todo, done = plan(jobs, prune_at)
    if prune_at:
        pending = set(todo)
        units = [u for u in batches(sorted(jobs, key=schedule_key), True) if pending.intersection(u)]
        done = [j for j in done if not any(j in u for u in units)]
    else:
        units = batches(todo, batched)
    if done:
        click.echo(f"skipping {len(done)} finished run(s)")
    results: list[JobResult] = []
    bar = tqdm(total=sum(len(u) for u in units), desc="sweep", unit="run")
    try:
        _run_units(units, n_jobs, prune_at, results, bar)
    finally:
        bar.close()  # before the line of a stop (SIGINT, SIGTERM)
    return results


def _run_units(units: list[list[Job]], n_jobs: int, prune_at: int, results: list[JobResult], bar) -> None:
    """Run ``units`` here (``n_jobs`` 1) or in :func:`spar_bench.procs.process_pool`, whose workers
    die with this process and are killed by a signal or an error (nothing queued runs after)."""

    if n_jobs <= 1 or len(units) <= 1:
        for u in units:
            check_stop()  # a SIGINT/SIGTERM a finalizer swallowed: no further run starts
            results.extend(run_batch(u, prune_at))
            bar.update(len(u))
        return

    with process_pool(n_jobs) as ex:
        futures = [ex.submit(run_batch, u, prune_at) for u in units]
        for f in completed(futures):
            results.extend(f.result())
            bar.update(len(results) - bar.n)


def make_jobs(features: str, heads: list[str], probes: list[str], seeds: list[int], options: dict,
              grid: list[dict], out: str, threads: int = 1, **run_kw) -> list[Job]:  # fmt: skip
    """One job per head x probe x seed x grid point (grid values override ``options``)."""

    for point in grid:
        check_options_apply(heads, {**options, **point})
    jobs = [Job(make_run(features, p, h, s, {**options, **point}, strict=False, **run_kw), out, threads)
            for h in heads for p in probes for point in grid for s in seeds]  # fmt: skip
    return list(dict.fromkeys(jobs))  # a grid point that equals another for some head runs once


def check_grid_prune(k: int, jobs: list[Job], grid: list[dict], split: bool) -> None:
    """``--grid-prune K``: an epoch below every run's max epochs, over an lr / weight decay grid,
    on a sweep run whole (``split``: --only or --partition given)."""

    if k < 1:
        raise ConfigError(f"--grid-prune {k}: give the epoch after which to prune (>= 1), or 0 for off")
    if len({(p.get("lr"), p.get("weight_decay")) for p in grid}) < 2:
        raise ConfigError("--grid-prune: no --grid over lr or wd; pruning chooses among each seed's "
                          "learning-rate / weight-decay grid points")  # fmt: skip
    if split:
        raise ConfigError("--grid-prune trains each seed's grid points together: it cannot be split by "
                          "--only or --partition (run the pruned grid in one sweep)")  # fmt: skip
    for j in jobs:
        n = j.run.train.epochs_for(head_input(j.run.head))
        if k >= n:
            raise ConfigError(f"--grid-prune {k}: must be below the max epochs of every run "
                              f"({j.run.head} runs {n}); nothing would be saved")  # fmt: skip


def run_id(job: Job, slug: str) -> str:
    """A run's id: its folder relative to the sweep's ``--out``."""
    return job.run.run_dir("", slug).as_posix()


def select_jobs(jobs: list[Job], slug: str, only: tuple[str, ...] = (),
                partition: tuple[int, int] | None = None) -> list[Job]:
    """The jobs named by ``only`` (all if empty) that fall in ``partition`` (all if None)."""

    ids = [run_id(j, slug) for j in jobs]
    for name in only:
        if name not in ids:
            close = difflib.get_close_matches(name, ids, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; list the ids with --list"
            raise ConfigError(f"--only {name}: no such run in this sweep{hint}")
    return [j for j, i in zip(jobs, ids, strict=True)
            if (not only or i in only) and (partition is None or bucket(i, partition[1]) == partition[0])]


def list_runs(jobs: list[Job], slug: str, cache, grid_prune: int = 0) -> None:
    """Print ``<run id>\t<done|todo>`` per job."""
    from .predictors import finished_run

    for j in jobs:
        state = "done" if finished_run(j.run, j.run.run_dir(j.out, slug), cache, grid_prune) else "todo"
        click.echo(f"{run_id(j, slug)}\t{state}")


def print_results(results: list[JobResult], seconds: float, out: str) -> None:
    """A line per run and a summary; :class:`~spar_bench.errors.RunFailed` (exit 1) when any failed."""

    failed = [(r.job, r.error) for r in results if r.error]
    n_unavailable = sum(r.unavailable is not None for r in results)
    for r in sorted(results, key=lambda r: (r.job.run.probe, r.job.run.head, r.job.run.variant(),
                                            r.job.run.seed)):  # fmt: skip
        j = r.job.run
        status = (f"FAILED: {r.error}" if r.error
                  else f"not available on this build: {r.unavailable}" if r.unavailable
                  else f"{r.seconds:.1f}s")  # fmt: skip
        name = f"{j.head},{j.variant()}" if j.variant() else j.head
        click.echo(f"{j.probe:28s} {name:12s} seed{j.seed}  {status}")
    click.echo(
        f"sweep: {len(results) - len(failed) - n_unavailable} run(s) done, {n_unavailable} probe run(s)"
        f" not available on this build, in {seconds:.1f}s -> {Path(out)}"
    )
    if failed:
        j = failed[0][0].run
        raise RunFailed(f"{len(failed)} run(s) failed; first: {j.probe}/{j.head}: {failed[0][1]}")


@dataclass(frozen=True)
class SweepConfig:
    """One sweep, as ``spar-probe sweep`` and an experiment's ``heads:`` step give it:
    ``heads``/``probes`` names or comma lists (``all``), ``seeds`` a comma list or ints,
    ``options`` the run options (:data:`~.spec.OPTIONS`; absent: default), ``grid``
    ``KEY=V1,V2`` items, ``only``/``partition`` a part of the runs, ``preset`` a name
    (:mod:`spar_bench.presets`)."""

    features: str
    heads: tuple[str, ...] | str = ("mlp,transformer",)
    probes: tuple[str, ...] | str = ("all",)
    seeds: str | tuple[int, ...] = "0,1,2"
    out: str = "runs"
    jobs: int = limited(2, lo=1)
    grid: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    partition: str | None = None
    batch_runs: str = limited("auto", choices=("auto", "on", "off"))
    grid_prune: int = 0  # checked with the grid (check_grid_prune: the epoch it prunes after)
    data: str | None = None
    n_boot: int = limited(1000, lo=1, flag="--bootstrap")
    controls: bool = True
    device: str = "auto"
    threads: int = limited(1, lo=1)
    preset: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)


def sweep_jobs(cfg: SweepConfig, explicit: Collection[str] = ()) -> list[Job]:
    """Every job of ``cfg``, checked; the preset fills the ``seeds``, ``heads`` and run options
    not in ``explicit`` (the names given, as :func:`spar_bench.presets.apply_probe_preset`)."""
    from ..hardware import pick_device

    params: dict[str, Any] = {"seeds": cfg.seeds, "heads": cfg.heads, **{n: cfg.options.get(n) for n in OPTIONS}}
    preset = None
    if cfg.preset:
        from spar_bench.presets import apply_probe_preset

        params, preset = apply_probe_preset(cfg.preset, params, set(explicit))
    seeds, heads = params.pop("seeds"), params.pop("heads")
    head_list = parse_heads(heads)
    device = str(pick_device(cfg.device))  # fail fast on an unusable --device; auto: cpu or cuda
    points = parse_grid(cfg.grid)
    jobs = make_jobs(str(cfg.features), head_list, cache_probes(cfg.probes, cfg.features),
                     parse_seeds(seeds), params, points, str(cfg.out), cfg.threads, data=cfg.data,
                     controls=cfg.controls, n_boot=cfg.n_boot, device=device)  # fmt: skip
    jobs = [Job(with_preset(j.run, preset), j.out, j.threads) for j in jobs]
    if cfg.grid_prune:
        check_grid_prune(cfg.grid_prune, jobs, points, bool(cfg.only or cfg.partition))
    return jobs


def sweep(cfg: SweepConfig, explicit: Collection[str] = (), list_ids: bool = False) -> None:
    """Run the sweep ``cfg`` (its runs not finished), printing a line per run (``list_ids``:
    print each run's id and state, run nothing)."""

    from .inputs import encoder_slug, open_cache, resolve_build

    jobs = sweep_jobs(cfg, explicit)
    cache = open_cache(cfg.features)
    resolve_build(cache, cfg.data)  # fail fast on a fingerprint mismatch
    slug = encoder_slug(cache)
    if list_ids:
        list_runs(jobs, slug, cache, cfg.grid_prune)
        return
    chosen = select_jobs(jobs, slug, tuple(cfg.only), parse_partition(cfg.partition))
    t0 = time.perf_counter()
    from ..hardware import pick_device

    on_gpu = str(pick_device(cfg.device)).startswith("cuda")
    batched = cfg.batch_runs == "on" or (cfg.batch_runs == "auto" and on_gpu)
    print_results(run_sweep(chosen, cfg.jobs, batched, cfg.grid_prune), time.perf_counter() - t0, cfg.out)
