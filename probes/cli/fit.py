"""``spar-probe fit`` and ``spar-probe eval``: train probe heads on cached features, score them
(the run lifecycle is :mod:`spar_bench.probes.runs`; see :mod:`~spar_bench.probes.runs.session`
for what a run folder holds)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from spar_bench.clitools import wait_option
from spar_bench.locks import output_lock

from ..names import cache_probes
from ..runs.session import EvalTarget, evaluate_on, run_all
from ..runs.spec import RunSpec, make_run
from ..runs.store import METRICS_FILE
from ..tasks import get_probe
from .options import (
    apply_preset,
    bootstrap_option,
    fmt,
    head_option,
    names_all,
    out_option,
    parse_heads,
    parse_seeds,
    pop_run_options,
    probe_option,
    resolved_device,
    run_options,
    seeds_option,
    with_preset,
)


@click.command("fit")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@head_option(RunSpec)
@probe_option()
@seeds_option(RunSpec, "seed")
@out_option()
@click.option("--overwrite", is_flag=True, help="Train a finished run again and replace it (else it is kept).")
@wait_option
@run_options(RunSpec)
def fit_command(features, head, probes, seeds, out, overwrite, data, n_boot, no_controls, device, threads,
                **kw):  # fmt: skip
    """Train probe heads on cached features and score them (one run per probe x head x seed)."""
    import torch

    kw, preset = apply_preset({"seeds": seeds, **kw})
    seeds = kw.pop("seeds")
    options = pop_run_options(kw)
    device = resolved_device(device)
    heads = parse_heads(head)
    runs = [[with_preset(make_run(features, p, h, s, options, data=data, controls=not no_controls,
                                  n_boot=n_boot, device=device), preset)
             for h in heads for s in parse_seeds(seeds)]
            for p in cache_probes(probes, features)]  # fmt: skip
    torch.set_num_threads(threads)
    click.get_current_context().with_resource(output_lock(out, what="spar-probe fit"))  # until the command ends
    for run, rd in run_all(runs, out, skip_unavailable=names_all(probes), overwrite=overwrite):
        m = json.loads((rd / METRICS_FILE).read_text())
        key = m["headline"]
        click.echo(f"{run.probe} {run.head} seed{run.seed}: {key}={fmt(m['test'].get(key))} -> {rd}")


@click.command("eval")
@click.option(
    "--run",
    "run",
    required=True,
    type=click.Path(file_okay=False),
    help="A finished run directory.",
)
@click.option(
    "--features", default=None, type=click.Path(dir_okay=False),
    help="Another feature cache (a finetune run may instead re-encode --data's images).",
)
@click.option(
    "--data",
    default=None,
    type=click.Path(file_okay=False),
    help="Its build (default: cache's dataset_dir).",
)
@bootstrap_option(EvalTarget)
@click.option("--encoder", default=None,
              help="Re-encoding a finetune run of a local model: its path again (hf:DIR, open_clip:local-dir:DIR).")
@click.option("--overwrite", is_flag=True, help="Replace an evaluation of other inputs (else it is refused).")
@wait_option
def eval_command(run, features, data, n_boot, encoder, overwrite):
    """Score a trained head on another cache (transfer), without retraining.

    A ``spar-probe finetune`` run given ``--data`` and no ``--features`` re-encodes that
    build's images with its own trained encoder (a local model's path, which runs do not
    record, is given again with ``--encoder``).
    """
    if Path(run).is_dir():  # it adds its evaluation to the run (the runs' --out lock is not taken: a reader)
        click.get_current_context().with_resource(output_lock(run, what="spar-probe eval"))
    out = evaluate_on(run, EvalTarget(features, data, n_boot, overwrite, encoder))
    m = json.loads(out.read_text())
    key = get_probe(m["probe"]).headline
    if features is None:
        click.echo(f"{m['probe']} {m['head']} on {m['data']} (re-encoded): {key}={fmt(m['test'].get(key))} -> {out}")
        return
    click.echo(
        f"{m['probe']} {m['head']} on {Path(features).name}: {key}={fmt(m['test'].get(key))} -> {out}"
    )
