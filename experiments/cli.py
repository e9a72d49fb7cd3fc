"""``spar-bench``: a whole experiment from one file (``spar-bench run EXPERIMENT.yaml``).

``spar-build`` and ``spar-probe`` stay the tools of single steps; ``spar-bench run`` expands an
experiment file into a plan of them (:mod:`.plan`), skips what is finished, redoes what changed
and runs the rest (:mod:`.runner`). A name without ``.yaml`` is a preset shipped with the
package (``demo``, ``paper``, ``recall-vs-computation``).

Each command imports the library in its body: ``spar-bench --help`` loads click and no other
third-party package (docs/DEVELOPING.md, Imports).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from spar_bench import __version__
from spar_bench.clitools import run_main, wait_option
from spar_bench.errors import ConfigError, RunFailed

from . import preset_path


@click.group()
@click.version_option(package_name="spar-bench")
def cli() -> None:
    """Run SPAR-Bench experiments from a file."""


def _overrides(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set {item!r}: expected NAME=VALUE, e.g. --set OUT=/scratch/spar")
        out[name.strip()] = value
    return out


def _experiment_file(text: str) -> Path:
    p = Path(text)
    if p.is_file() or text.endswith((".yaml", ".yml")):
        return p
    return preset_path(text)


@cli.command("run")
@click.argument("experiment")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="Set a variable of the file's vars: (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the plan (done/todo/changed) and its estimated cost; run nothing.")
@click.option("--list", "list_steps", is_flag=True, help="Print every step id and its state; run nothing.")
@click.option("--only", multiple=True, metavar="STEP", help="Run only this step (repeatable; ids from --list).")
@click.option("--partition", default=None, metavar="I/N",
              help="Run partition I of N (0 <= I < N) of the plan's steps, in order (e.g. a SLURM array task).")
@wait_option  # also: how long to wait for a step of another partition this one needs
@click.option("--devices", default=None, metavar="LIST",
              help="Devices to run steps on side by side, e.g. cuda:0,cuda:1 (default: one step at a time, "
                   "each command's own device default).")
@click.option("--executor", type=click.Choice(["local", "slurm"]), default="local", show_default=True,
              help="local: run the steps here; slurm: submit each step not done as one sbatch job (docs/USAGE.md).")
@click.option("--slurm-partition", default=None, metavar="NAME", help="slurm: the partition of every job.")
@click.option("--slurm-account", default=None, metavar="NAME", help="slurm: the account of every job.")
@click.option("--slurm-qos", default=None, metavar="NAME", help="slurm: the QOS of every job.")
@click.option("--slurm-extra", multiple=True, metavar="OPTION",
              help="slurm: one more #SBATCH option for every job, e.g. --slurm-extra=--constraint=a100 (repeatable).")
@click.option("--follow/--no-follow", default=True, show_default=True,
              help="slurm: wait for the jobs, print the table and exit 1 when a step failed (--no-follow: "
                   "submit and return; see spar-bench status OUT).")
def run_command(experiment, sets, dry_run, list_steps, only, partition, devices, executor, follow, **slurm):
    """Run an experiment file: builds, caches, heads, finetuning, transfer, MLLMs, one report."""
    from spar_bench.locks import wait_seconds
    from spar_bench.partitions import parse_partition

    from .config import load_experiment
    from .confine import check_confined
    from .plan import make_plan
    from .plan import partition as part_of
    from .runner import check_inputs, run_steps
    from .values import check_devices, check_values

    here = not (dry_run or list_steps)  # a plan may be printed where its devices are not
    device_list = check_devices(devices, here)
    path = _experiment_file(experiment)
    exp = load_experiment(path, _overrides(sets))
    check_values(exp, here)
    plan = make_plan(exp)
    check_confined(exp.out, plan.steps)  # nothing written outside out: (a symlinked folder inside it)
    part = parse_partition(partition)
    chosen = [plan.step(s) for s in only] if only else plan.steps
    if part is not None:
        ids = {s.id for s in part_of(plan, part[0] + 1, part[1])}
        chosen = [s for s in chosen if s.id in ids]
        if not chosen:  # more partitions than steps (or --only outside this one): said, not silent
            click.echo(f"--partition {partition}: no step in this partition (the plan has {len(plan.steps)} "
                       f"step(s) for {part[1]} partitions); nothing to run", err=True)  # fmt: skip
            return None
    if executor == "slurm" and not list_steps:
        return _run_slurm(plan, chosen, experiment=str(path), sets=_overrides(sets), dry_run=dry_run,
                          follow=follow, opts=slurm)  # fmt: skip
    if dry_run or list_steps:
        _print_plan(plan, chosen, costs=dry_run)
        if dry_run:  # the rows the plan will fill, with the paper's numbers alone
            from .leaderboard import write_reference_leaderboard
            from .plan import PLAN

            csv = write_reference_leaderboard(exp, Path(exp.out) / PLAN / "reference")[1]
            click.echo(f"reference leaderboard (the planned rows, the paper's numbers; no result): {csv}")
        return None
    check_inputs(plan, chosen, wait_seconds())
    _write_plan(plan)
    counts = run_steps(plan, chosen, device_list)
    click.echo(f"{plan.experiment.name}: {counts['ran']} step(s) run, {counts['redone']} redone, "
               f"{counts['skipped']} already done -> {plan.experiment.out}")


def _run_slurm(plan, chosen, experiment: str, sets: dict[str, str], dry_run: bool, follow: bool, opts: dict) -> None:
    """``--executor slurm``: the steps not done submitted as jobs (:mod:`.slurm`); then followed."""
    from spar_bench.locks import output_lock

    from . import slurm
    from .runner import check_inputs, migrate

    o = slurm.SlurmOptions(opts["slurm_partition"], opts["slurm_account"], opts["slurm_qos"], tuple(opts["slurm_extra"]))
    if dry_run:
        slurm.submit(plan, chosen, o, dry_run=True)
        return
    check_inputs(plan, chosen, 0.0)
    out = plan.experiment.out
    _write_plan(plan)
    migrate(plan, chosen)
    slurm.write_invocation(out, experiment, sets)
    with output_lock(slurm.slurm_dir(out) / "jobs.json", what="spar-bench run --executor slurm"):
        sub = slurm.submit(plan, chosen, o)
    click.echo(f"{plan.experiment.name}: {len(sub.new)} job(s) submitted, {len(sub.kept)} already queued or "
               f"running, {len(chosen) - len(sub.jobs)} step(s) done -> {out} (spar-bench status {out})")
    if follow and sub.jobs:
        slurm.follow(out, sub)


@cli.command("step")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("step_id")
@click.option("--hash", "expected", default=None, help="The step's hash when submitted: refuse to run another.")
def step_command(out, step_id, expected):
    """Run one step of the experiment submitted to OUT (the worker of a SLURM job)."""
    from . import slurm
    from .config import load_experiment
    from .plan import make_plan
    from .runner import check_inputs, run_steps

    inv = slurm.read_invocation(out)
    plan = make_plan(load_experiment(inv["file"], inv["sets"]))
    step = plan.step(step_id)
    if expected and plan.hashes[step.id] != expected:
        raise ConfigError(f"step {step_id} changed since it was submitted (the experiment file or its inputs): "
                          f"submit again: spar-bench run {inv['file']} --executor slurm")  # fmt: skip
    check_inputs(plan, [step], 0.0)
    counts = run_steps(plan, [step], progress=False)
    click.echo(f"step {step_id}: {'already done' if counts['skipped'] else 'finished'}")


@cli.command("status")
@click.argument("out", type=click.Path(path_type=Path))
def status_command(out):
    """One table of an experiment's steps: done, running (job, node), queued, failed (its log's last line), todo."""
    from . import slurm

    slurm.print_rows(slurm.step_rows(out))


@cli.command("cancel")
@click.argument("out", type=click.Path(path_type=Path))
def cancel_command(out):
    """Cancel the SLURM jobs of the experiment submitted to OUT (finished steps stay done)."""
    from . import slurm

    record = slurm.submitted(out)
    if not record:
        click.echo(f"{out}: no SLURM job was submitted (no {slurm.slurm_dir(out) / 'jobs.json'}); nothing to cancel")
        return
    jobs = slurm.job_states([r["job"] for r in record.values()])
    live = sorted((j.id for j in jobs.values() if j.state in slurm.LIVE), key=int)
    slurm.cancel_jobs(live)
    click.echo(f"{out}: {len(live)} job(s) cancelled" + (f" ({', '.join(live)})" if live else ""))


def _print_plan(plan, chosen, costs: bool) -> None:
    from .estimate import duration, step_seconds, totals
    from .runner import status

    cpu_total = gpu_total = 0.0
    for s in chosen:
        line = f"{s.id}\t{status(plan, s)}"
        if costs:
            cpu, gpu = step_seconds(plan, s)
            cpu_total, gpu_total = cpu_total + cpu, gpu_total + gpu
            what = ", ".join(f"{v:,.0f} {u}" for u, v in s.cost) or "-"
            line += f"\t{what}\t~{duration(cpu)} on 2 CPU cores, ~{duration(gpu)} on one GPU"
        click.echo(line)
    if costs:
        t = totals(plan, chosen)
        click.echo("total: " + ", ".join(f"{v:,.0f} {k}" for k, v in t.items()))
        click.echo(f"estimated time: ~{duration(cpu_total)} on 2 CPU cores (this machine class), "
                   f"~{duration(gpu_total)} on one GPU (H200 rates); estimates from the benches' rates")


def _write_plan(plan) -> None:
    """``OUT/.plan/plan.json``: the experiment's provenance and every step with its hash."""
    from spar_bench.hashing import sha256_json
    from spar_bench.provenance import RUN_PACKAGES, package_versions

    from .plan import PLAN

    exp = plan.experiment
    steps = [{"id": s.id, "hash": plan.hashes[s.id], "needs": list(s.needs)} for s in plan.steps]
    plan_hash = sha256_json(steps)
    record = {"provenance": {"experiment": exp.name, "file": Path(exp.source).name, "file_sha256": exp.sha256,
                             "plan_sha256": plan_hash, "spar_bench": __version__,
                             "versions": package_versions(RUN_PACKAGES)},
              "steps": steps}  # fmt: skip
    p = exp.out / PLAN / "plan.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"plan.json.{os.getpid()}.tmp")  # partitions write it side by side: never torn
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(p)


@cli.command("compare")
@click.argument("a")
@click.argument("b")
def compare_command(a: str, b: str) -> None:
    """Two leaderboards side by side: A, B, B - A and whether each mean lies in the other's interval.

    A and B: a leaderboard.json, its report folder or the experiment's OUT."""
    from .leaderboard import compare, read_leaderboard

    click.echo(compare(read_leaderboard(a), read_leaderboard(b)), nl=False)


@cli.command("check")
@click.argument("rerun", type=click.Path(path_type=Path))
@click.option("--against", type=click.Path(path_type=Path), default=None, metavar="JSON",
              help="The reference (default: docs/calibration.json, the calibration table of docs/RESULTS.md).")
def check_command(rerun: Path, against: Path | None) -> None:
    """Compare a calibration rerun's calibration.json with the reference table.

    Untrained cells must be the same, trained cells within the cross-machine tolerance (seeds
    and bootstrap), and every conclusion of the reference must hold; exit 1 if not, 2 when a
    file is unreadable or of other conditions."""

    from . import calibration_check

    if against is None and not calibration_check.REFERENCE.is_file():
        raise ConfigError("no docs/calibration.json beside this installation (an installed wheel has none); "
                          "give the reference with --against JSON")
    if calibration_check.check_command(rerun, against or calibration_check.REFERENCE):
        raise RunFailed(f"{rerun}: the rerun does not reproduce the reference (the lines above)")


def main(argv: list[str] | None = None) -> None:
    run_main(cli, argv)


if __name__ == "__main__":
    main()
