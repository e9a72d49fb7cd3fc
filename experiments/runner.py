"""Running a plan: what is done, what changed, and each step run exactly once.

A finished step leaves ``OUT/.plan/steps/<step>.json`` (its hash and outputs) and a line in
``OUT/.plan/log.jsonl``. On a rerun a step recorded with its current hash is skipped; one
recorded with another hash is redone, its outputs removed first (the line says so); one
never finished runs (its library calls resume what they had written: a build from ``OUT.tmp``,
a cache, a sweep and finetuning with their own resumption). Interrupted anywhere, a rerun
continues where the run stopped. A marker holding the hash 0.2 gave the same step (steps held
argv then, :mod:`.legacy`) counts as done and is rewritten with today's hash (:func:`migrate`).

One writer per step: a step runs holding ``OUT/.plan/steps/<step>.json.lock``
(:mod:`spar_bench.locks`), so two runs of one experiment (or two partitions given the same
step) never write a step at once: the second is refused in one line, or with ``--wait`` waits
and then skips the step the first finished. The runner locks steps, not OUT: the partitions of
an experiment write one OUT side by side. Each step's command locks its own output (a build
folder, a cache file, a runs folder), files other than the step's: no lock is taken twice.


Each spec of a step is one library call, declared with its kind (:data:`~.steps.STEPS`,
:mod:`.step_kinds`); no step goes through a click command.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click

from spar_bench.errors import ConfigError
from spar_bench.locks import output_lock
from spar_bench.outputs import remove, rerun_as
from spar_bench.procs import check_stop, process_pool

from .confine import check_confined
from .legacy import old_hashes
from .plan import PLAN, Plan, Step
from .steps import STEPS


def marker(out: Path, step_id: str) -> Path:
    return out / PLAN / "steps" / (re.sub(r"[^A-Za-z0-9@._-]+", "_", step_id) + ".json")


def _recorded(plan: Plan, step: Step) -> str | None:
    """The hash ``step``'s marker records (None: not finished)."""
    try:
        return json.loads(marker(plan.experiment.out, step.id).read_text())["hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def legacy_hashes(plan: Plan) -> dict[str, str]:
    """The hashes 0.2 gave the plan's steps (:mod:`.legacy`), computed once."""
    if plan.legacy is None:
        plan.legacy = old_hashes(plan.experiment, plan.steps)
    return plan.legacy


def status(plan: Plan, step: Step) -> str:
    """``done`` (finished with this hash, or with the hash 0.2 gave the same step), ``changed``
    (finished with another) or ``todo``."""
    had = _recorded(plan, step)
    if had is None:
        return "todo"
    return "done" if had in (plan.hashes[step.id], legacy_hashes(plan).get(step.id)) else "changed"


def migrate(plan: Plan, steps: list[Step]) -> None:
    """Markers that record a step's 0.2 hash (steps held argv then) rewritten with today's hash
    (a ``migrate`` line in the log): the step is kept, not redone."""
    out = plan.experiment.out
    for s in steps:
        had = _recorded(plan, s)
        if had is None or had == plan.hashes[s.id] or had != legacy_hashes(plan).get(s.id):
            continue
        m = marker(out, s.id)
        record = {**json.loads(m.read_text()), "hash": plan.hashes[s.id]}
        tmp = m.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        with _signals_held():
            tmp.replace(m)
            _log(out, "migrate", s, hash=plan.hashes[s.id], was=had)


def _log(out: Path, event: str, step: Step, **kw: Any) -> None:
    path = out / PLAN / "log.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"event": event, "step": step.id, **kw}, sort_keys=True) + "\n")


def concrete(value: Any, out: Path) -> Any:
    """``value`` (a record, a list, a path) with ``{out}`` replaced by the experiment's folder."""
    if isinstance(value, dict):
        return {k: concrete(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [concrete(v, out) for v in value]
    return value.replace("{out}", str(out)) if isinstance(value, str) else value


def _remove_outputs(out: Path, step: Step) -> None:
    """A changed step's outputs go before it is redone: only paths inside ``out``."""
    check_confined(out, [step])  # never removes through a symlink or a name that climbs out
    for rel in step.outputs:
        if rel.startswith("{out}/"):
            remove(Path(concrete(rel, out)))


#: how a step stopped by a full disk goes on (its command's own advice names another command)
RERUN = "rerun the same `spar-bench run` command (it resumes the step)"


def execute(step: Step, out: Path, device: str | None) -> None:
    """Run ``step``'s specs, each one library call (in this process); ``device`` where a spec
    takes one and its options name none."""
    check_confined(out, [step], deep=True)  # no symbolic link inside its folders points out of out
    if any(STEPS.get(kind).fresh for kind, _ in step.specs):  # it owns its folder whole: written afresh
        _remove_outputs(out, step)
    for kind, record in step.specs:
        call(kind, concrete(record, out), device if step.device else None)


def call(kind: str, spec: dict[str, Any], device: str | None) -> None:
    """One spec's library call, its kind's (:data:`~.steps.STEPS`); a full disk inside it says how
    the experiment goes on (:data:`RERUN`), not what the library's own command would."""
    with rerun_as(RERUN):
        STEPS.get(kind).call(spec, device)


def check_inputs(plan: Plan, chosen: list[Step], wait_s: float) -> None:
    """Every step a chosen step needs is finished or chosen before it; else wait up to ``wait_s``
    for another partition to finish it, then fail in one line naming the step to run first."""
    order = {s.id: i for i, s in enumerate(chosen)}
    deadline = time.monotonic() + wait_s
    for s in chosen:
        for need in s.needs:
            if need in order and order[need] < order[s.id]:
                continue
            while status(plan, plan.step(need)) != "done":
                if time.monotonic() >= deadline:
                    raise ConfigError(f"step {s.id} needs {need}, which is not finished; run it first: "
                                      f"spar-bench run {plan.experiment.source} --only {need}")  # fmt: skip
                time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))


def run_steps(plan: Plan, chosen: list[Step], devices: tuple[str, ...] = (), progress: bool = True) -> dict[str, int]:
    """Run the steps of ``chosen`` that are not done, in order (one device) or side by side as
    their inputs finish (several devices); returns how many steps were done, run and redone."""
    out = plan.experiment.out
    check_confined(out, chosen)
    migrate(plan, chosen)
    todo = [s for s in chosen if status(plan, s) != "done"]
    counts = {"skipped": len(chosen) - len(todo), "ran": 0, "redone": 0}
    for s in chosen:
        if s not in todo:
            _log(out, "skip", s, hash=plan.hashes[s.id])
    if len(devices) > 1:
        _run_parallel(plan, todo, devices, counts)
    else:
        for i, s in enumerate(todo, 1):
            check_stop()  # a SIGTERM/SIGINT a finalizer swallowed: stop before the next step
            if progress:
                click.echo(f"[{i}/{len(todo)}] {s.id}", err=True)
            _run_one(plan, s, devices[0] if devices else None, counts)
    return counts


def _start(plan: Plan, s: Step, counts: dict[str, int]) -> None:
    out = plan.experiment.out
    if status(plan, s) == "changed":
        click.echo(f"{s.id}: changed since it finished (inputs or options); redoing it", err=True)
        _remove_outputs(out, s)
        counts["redone"] += 1
    else:
        counts["ran"] += 1
    _log(out, "start", s, hash=plan.hashes[s.id])


def _finish(plan: Plan, s: Step, seconds: float) -> None:
    """The step's marker and its ``finish`` line, written as one: a SIGINT/SIGTERM arriving in
    between is held until both are written (a marker without its line would never be logged)."""
    out = plan.experiment.out
    m = marker(out, s.id)
    m.parent.mkdir(parents=True, exist_ok=True)
    tmp = m.with_suffix(".tmp")
    tmp.write_text(json.dumps({"id": s.id, "hash": plan.hashes[s.id], "outputs": list(s.outputs)}, indent=1) + "\n")
    with _signals_held():
        tmp.replace(m)
        _log(out, "finish", s, hash=plan.hashes[s.id], seconds=round(seconds, 1))


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked, then delivered) until the block ends."""
    held = {signal.SIGINT, signal.SIGTERM}
    can = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held) if can else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _claim(plan: Plan, s: Step, counts: dict[str, int]) -> ExitStack | None:
    """The step's lock, held by the returned stack until it closes; None (the lock let go) when
    another run of the experiment finished the step while this one waited for it."""
    out, held = plan.experiment.out, ExitStack()
    held.enter_context(output_lock(marker(out, s.id), what="spar-bench run", name=f"step {s.id} of {out}"))
    if status(plan, s) == "done":
        held.close()
        counts["skipped"] += 1
        _log(out, "skip", s, hash=plan.hashes[s.id])
        return None
    return held


def _run_one(plan: Plan, s: Step, device: str | None, counts: dict[str, int]) -> None:
    held = _claim(plan, s, counts)
    if held is None:
        return
    with held:
        _start(plan, s, counts)
        t0 = time.perf_counter()
        execute(s, plan.experiment.out, device)
        _finish(plan, s, time.perf_counter() - t0)


def _run_parallel(plan: Plan, todo: list[Step], devices: tuple[str, ...], counts: dict[str, int]) -> None:
    """Steps whose inputs are finished run side by side, one per device."""
    pending, running, free = list(todo), {}, list(devices)
    with process_pool(len(devices)) as pool, ExitStack() as every:
        while pending or running:
            check_stop()  # a swallowed SIGTERM/SIGINT (see run_steps): the pool's workers are killed
            for s in [s for s in pending if _ready(plan, s, pending, running)]:
                if not free:
                    break
                pending.remove(s)
                if (held := _claim(plan, s, counts)) is None:
                    continue
                every.push(held)  # held until the step finishes, or the run stops
                dev = free.pop(0)
                _start(plan, s, counts)
                running[pool.submit(_timed, s, plan.experiment.out, dev)] = (s, dev, held)
            done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
            for f in done:
                s, dev, held = running.pop(f)
                _finish(plan, s, f.result())
                held.close()
                free.append(dev)


def _ready(plan: Plan, s: Step, pending: list[Step], running: dict) -> bool:
    busy = {p.id for p in pending} | {r[0].id for r in running.values()}
    return not any(n in busy for n in s.needs)


def _timed(s: Step, out: Path, device: str) -> float:
    t0 = time.perf_counter()
    execute(s, out, device)
    return time.perf_counter() - t0
