"""The plan on a SLURM cluster: every step not done is one ``sbatch`` job (``--executor slurm``).

Each job runs one worker, ``spar-bench step OUT STEP_ID --hash H``, which runs the step exactly as
the local executor does (:func:`.runner.run_steps`: its lock, its marker, its log line). A job
waits for the jobs of the steps it needs (``--dependency=afterok:`` with
``--kill-on-invalid-dep=yes``: the dependants of a failure never start). SLURM does the
scheduling, the dependencies, the requeue and the accounting; this module writes the scripts,
submits them, and reads ``squeue`` (``sacct`` where accounting is on) back.

Why scripts written here, not ``submitit``: no extra dependency, and a user can read every
script (``--dry-run`` prints them, ``OUT/.plan/slurm/*.sbatch`` keeps them) and submit one by hand.

Files under ``OUT/.plan``: ``slurm/<step>.sbatch`` (the scripts), ``slurm/jobs.json`` (the
submission record: each step's job id and the hash it was submitted with), ``slurm/experiment.json``
(how the worker reloads the plan: the experiment file, the ``--set`` values, the working folder)
and ``logs/<step>.<jobid>.log``. Submitting again is idempotent: a step whose job is queued or
running with the same hash is not submitted again; a failed, cancelled or timed-out step is
submitted again with its dependants (which resume from the step's own resume state).
"""

from __future__ import annotations

import getpass
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from spar_bench.errors import ConfigError, RunFailed

from .estimate import step_seconds
from .plan import PLAN, Plan, Step
from .runner import marker, status

#: job states in which a job may still run (anything else has ended)
LIVE = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                  "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})  # fmt: skip
#: what the estimate's time is multiplied by (it is a mean; a job past its limit is killed)
TIME_MARGIN, MIN_MINUTES = 3.0, 15


@dataclass(frozen=True)
class SlurmOptions:
    """The command line's ``--slurm-*`` options: on every job."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resources:
    cpus: int
    mem: str
    gpus: int
    time: str  # [D-]HH:MM:SS


@dataclass
class Job:
    """One job as SLURM reports it."""

    id: str
    state: str
    reason: str = ""
    node: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE and self.reason != "DependencyNeverSatisfied"


@dataclass
class Submission:
    """What one submission pass did: each step's job (kept or new)."""

    jobs: dict[str, str] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- files under OUT/.plan
def slurm_dir(out: Path) -> Path:
    return out / PLAN / "slurm"


def log_dir(out: Path) -> Path:
    return out / PLAN / "logs"


def safe(step_id: str) -> str:
    return marker(Path("."), step_id).stem


def read_record(out: Path) -> dict[str, dict[str, str]]:
    """The submission record: step id -> ``{"job": id, "hash": h}``; none before the first
    submission, one line when ``jobs.json`` is damaged (its jobs cannot be known, so submitting
    every step again could run each twice)."""
    p = slurm_dir(out) / "jobs.json"
    if not p.exists():
        return {}
    try:
        steps = json.loads(p.read_text(encoding="utf-8"))["steps"]
        if not all(isinstance(r, dict) and str(r["job"]).isdigit() for r in steps.values()):
            raise TypeError("a step without a job id")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{p}: damaged ({type(e).__name__}: {e}); its jobs cannot be read: list yours with "
                          "squeue --me and cancel them with scancel") from None  # fmt: skip
    return {k: {**r, "job": str(r["job"])} for k, r in steps.items()}


def submitted(out: Path) -> dict[str, dict[str, str]]:
    """The submission record, for ``spar-bench cancel``: one line when ``out`` is no experiment's
    folder (mistyped, or never run) or its ``jobs.json`` is damaged (its jobs cannot be known)."""
    if not out.is_dir():
        raise ConfigError(f"{out}: no such folder; give the out: folder of an experiment run with --executor slurm")
    _plan_steps(out)
    return read_record(out)


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def write_invocation(out: Path, experiment: str, sets: dict[str, str]) -> None:
    """How the worker reloads the plan: the experiment file, the ``--set`` values, the folder it ran in."""
    _write_json(slurm_dir(out) / "experiment.json",
                {"file": str(Path(experiment).absolute()), "sets": sets, "cwd": os.getcwd()})  # fmt: skip


def read_invocation(out: Path) -> dict[str, Any]:
    p = slurm_dir(out) / "experiment.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read the submission's experiment record ({e}); submit with "
                          "spar-bench run EXPERIMENT --executor slurm") from None  # fmt: skip


# --------------------------------------------------------------------------- SLURM's commands
def _slurm(args: list[str], what: str) -> str:
    """Run a SLURM command; one line naming it when it is missing or fails."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError(f"{args[0]}: not found; --executor slurm needs SLURM's commands on PATH "
                          "(a login node of the cluster, or scripts/slurm-local.sh start DIR)") from None  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{args[0]} did not answer in 120 s ({what}); is slurmctld up?") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ConfigError(f"{args[0]} failed ({what}): {last}")
    return done.stdout


def job_states(ids: list[str]) -> dict[str, Job]:
    """The jobs of ``ids`` that SLURM still knows: ``squeue`` (ended jobs too, for a few minutes),
    then ``sacct`` for older ones where accounting is on."""
    if not ids:
        return {}
    text = _slurm(["squeue", "-h", "--states=all", "-u", getpass.getuser(), "-o", "%i|%T|%r|%N"], "job states")
    found: dict[str, Job] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] in ids:
            found[parts[0]] = Job(parts[0], parts[1], parts[2], parts[3])
    missing = [i for i in ids if i not in found]
    if missing:
        found.update(_sacct(missing))
    return found


def _sacct(ids: list[str]) -> dict[str, Job]:
    """Ended jobs from accounting; nothing where accounting is off."""
    try:
        done = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State,NodeList", "-j", ",".join(ids)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in done.stdout.splitlines() if done.returncode == 0 else ():
        parts = line.split("|")
        if len(parts) == 3 and parts[0] in ids:
            out[parts[0]] = Job(parts[0], parts[1].split()[0], "", parts[2])
    return out


def cluster_has_gpus() -> bool:
    """Whether a node of the cluster has GPUs as a generic resource (unknown: assume it has)."""
    try:
        text = _slurm(["sinfo", "-h", "-o", "%G"], "generic resources")
    except ConfigError:
        return True
    return "gpu" in text


def cancel_jobs(ids: list[str]) -> None:
    if ids:
        _slurm(["scancel", *ids], "cancel")


# --------------------------------------------------------------------------- resources and scripts
def _hms(seconds: float) -> str:
    minutes = max(MIN_MINUTES, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    return (f"{days}-" if days else "") + f"{rest // 60:02d}:{rest % 60:02d}:00"


def resources(plan: Plan, step: Step, gpus_here: bool) -> Resources:
    """``step``'s resources: the experiment file's ``resources:`` for its kind (over ``default``),
    else defaults from the plan: CPUs from ``jobs``, a GPU for a step that takes a device (where the
    cluster has GPUs), and the estimate's time with a margin."""

    given = {**plan.experiment.resources.get("default", {}), **plan.experiment.resources.get(step.kind, {})}
    gpus = int(given.get("gpus", 1 if step.device and gpus_here else 0))
    cpus = int(given.get("cpus", max(1, plan.experiment.jobs) if step.kind in ("build", "heads") else 2))
    cpu_s, gpu_s = step_seconds(plan, step)
    seconds = (gpu_s if gpus else cpu_s * 2 / cpus) * TIME_MARGIN
    time_ = given.get("time")
    return Resources(cpus, str(given.get("mem", "16G" if gpus else "4G")), gpus,
                     _hms(seconds) if time_ is None else str(time_))  # fmt: skip


def script(plan: Plan, step: Step, res: Resources, deps: list[str], opts: SlurmOptions) -> str:
    """The ``sbatch`` script of ``step``: its resources, its dependencies (job ids), one worker."""
    exp, out = plan.experiment, plan.experiment.out
    lines = ["#!/bin/bash", f"# step {step.id} of experiment {exp.name}, written by spar-bench run --executor slurm",
             f"#SBATCH --job-name={exp.name}:{step.id}", f"#SBATCH --output={log_dir(out)}/{safe(step.id)}.%j.log",
             "#SBATCH --open-mode=append", f"#SBATCH --chdir={os.getcwd()}", "#SBATCH --nodes=1",
             "#SBATCH --ntasks=1", f"#SBATCH --cpus-per-task={res.cpus}", f"#SBATCH --mem={res.mem}",
             f"#SBATCH --time={res.time}"]  # fmt: skip
    if res.gpus:
        lines.append(f"#SBATCH --gres=gpu:{res.gpus}")
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines.append("#SBATCH --requeue")  # a requeued job runs the step again: it resumes its own state
    lines += [f"#SBATCH {x}" for x in opts.extra]
    if deps:
        lines += [f"#SBATCH --dependency=afterok:{':'.join(deps)}", "#SBATCH --kill-on-invalid-dep=yes"]
    if step.needs:
        lines.append(f"# needs: {' '.join(step.needs)}")
    worker = [sys.executable, "-m", "spar_bench.experiments.cli", "step", str(out), step.id,
              "--hash", plan.hashes[step.id]]  # fmt: skip
    lines += ["export PYTHONUNBUFFERED=1", "exec " + " ".join(shlex.quote(w) for w in worker), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- submission
def submit(plan: Plan, chosen: list[Step], opts: SlurmOptions, dry_run: bool = False) -> Submission:
    """Every chosen step not done as one job, after the jobs of the steps it needs; a step whose
    job is queued or running with its hash, and none of whose needs is submitted anew, is kept."""

    out = plan.experiment.out
    record = read_record(out)
    ids = [record[s.id]["job"] for s in chosen if s.id in record]
    states = {} if dry_run and not record else job_states(ids)  # before the markers: a job ending in between
    todo = [s for s in chosen if status(plan, s) != "done"]  # has written its marker, and is not submitted again
    gpus_here = cluster_has_gpus()
    sub = Submission()
    for s in todo:
        rec = record.get(s.id)
        job = states.get(rec["job"]) if rec else None
        if job is not None and job.live and rec["hash"] == plan.hashes[s.id] and not set(s.needs) & set(sub.new):
            sub.jobs[s.id] = job.id
            sub.kept.append(s.id)
            continue
        if job is not None and job.live and not dry_run:  # stale: its needs are submitted anew, or it changed
            cancel_jobs([job.id])
        deps = [sub.jobs[n] if not dry_run or n not in sub.new else f"{{{n}}}" for n in s.needs if n in sub.jobs]
        text = script(plan, s, resources(plan, s, gpus_here), deps, opts)
        if dry_run:
            click.echo(f"# ---- {slurm_dir(out) / (safe(s.id) + '.sbatch')}\n{text}")
            sub.jobs[s.id] = s.id
        else:
            sub.jobs[s.id] = _sbatch(out, s, text)
            record[s.id] = {"job": sub.jobs[s.id], "hash": plan.hashes[s.id]}
            _write_json(slurm_dir(out) / "jobs.json", {"experiment": plan.experiment.name, "steps": record})
        sub.new.append(s.id)
    return sub


def _sbatch(out: Path, step: Step, text: str) -> str:
    path = slurm_dir(out) / f"{safe(step.id)}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    log_dir(out).mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return _slurm(["sbatch", "--parsable", str(path)], f"submitting step {step.id}").strip().split(";")[0]


# --------------------------------------------------------------------------- status
def last_line(out: Path, step_id: str, job: str) -> str:
    """The last non-empty line of the step's log for ``job`` ('' when none)."""
    try:
        lines = (log_dir(out) / f"{safe(step_id)}.{job}.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def _plan_steps(out: Path) -> list[dict[str, Any]]:
    p = out / PLAN / "plan.json"
    try:
        return list(json.loads(p.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{p}: no plan here; {out} is not an experiment's folder (spar-bench run writes it)") from None


def step_rows(out: Path) -> list[tuple[str, str, str, str]]:
    """One row per step of the plan last written to ``out``: step, state (done, running, queued,
    failed, changed, todo), job id, and the node, the reason it waits, or the log's last line."""

    steps, record = _plan_steps(out), submitted(out)  # a damaged jobs.json: one line, not "todo"
    jobs = job_states([r["job"] for r in record.values()]) if record else {}
    rows = []
    for s in steps:
        try:
            had = json.loads(marker(out, s["id"]).read_text())["hash"]
        except (OSError, ValueError, KeyError, TypeError):
            had = None
        rec = record.get(s["id"], {})
        job = jobs.get(rec.get("job", ""))
        if had == s["hash"]:
            rows.append((s["id"], "done", rec.get("job", ""), ""))
        elif job is not None and job.live:
            running = job.state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD")
            rows.append((s["id"], "running" if running else "queued", job.id, job.node if running else job.reason))
        elif rec:
            state = job.state.lower() if job is not None else "failed"
            rows.append((s["id"], state if state in ("cancelled", "timeout") else "failed", rec["job"],
                         last_line(out, s["id"], rec["job"])))  # fmt: skip
        else:
            rows.append((s["id"], "changed" if had else "todo", "", ""))
    return rows


def print_rows(rows: list[tuple[str, str, str, str]]) -> None:
    width = max([len(r[0]) for r in rows] + [4])
    click.echo(f"{'step':<{width}}  {'state':<9}  {'job':<8}  node / reason / last log line")
    for r in rows:
        click.echo(f"{r[0]:<{width}}  {r[1]:<9}  {r[2]:<8}  {r[3]}".rstrip())


def follow(out: Path, sub: Submission, poll_s: float = 2.0) -> None:
    """Wait until every submitted job has ended; the table; :class:`RunFailed` naming the steps
    that did not finish (each with its log's last line)."""
    ids = list(sub.jobs.values())
    while any(j.live for j in job_states(ids).values()):
        time.sleep(poll_s)
    rows = [r for r in step_rows(out) if r[0] in sub.jobs]
    print_rows(rows)
    bad = [r for r in rows if r[1] != "done"]
    if bad:
        first = bad[0]
        raise RunFailed(f"{len(bad)} step(s) did not finish: {first[0]} {first[1]} (job {first[2]}): "
                        f"{first[3] or 'no log line'}; see {log_dir(out)}, fix it and run the same command again")  # fmt: skip
