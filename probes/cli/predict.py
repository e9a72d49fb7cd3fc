"""``spar-probe predict``: run a predictor that reads a build (a run kind of
:data:`spar_bench.probes.kinds.RUN_KINDS` made ``on_build``: the constant prior, the Level 4
mask oracle, the organ-map computation models, or a plug-in's kind) on every probe x seed, scored with every control, through
:func:`spar_bench.probes.runs.session.run`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from spar_bench.builder.shards import Build
from spar_bench.clitools import wait_option
from spar_bench.errors import ConfigError
from spar_bench.locks import output_lock

from ..kinds import run_kind
from ..runs.session import run_all
from ..runs.spec import PredictorSpec
from .options import (
    bootstrap_option,
    names_all,
    out_option,
    parse_probes,
    parse_seeds,
    probe_option,
    seeds_option,
)


@click.command("predict")
@click.option("--kind", required=True,
              help="Run kind: prior, oracle (Level 4), slice-oracle (Levels 1-3), reader, organmaps (Level 3), "
                   "organmaps3d (Level 4), or a plug-in's.")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="A finished build.")
@probe_option()
@seeds_option(PredictorSpec, "seed")
@out_option()
@click.option("--overwrite", is_flag=True, help="Run a finished run again and replace it (else it is kept).")
@bootstrap_option(PredictorSpec)
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="One of the kind's own options, as an experiment's predictors.NAME.options gives it (e.g. "
                   "organmaps3d's training); the value read as JSON (2, 0.5, true, [1,2]), else as text. "
                   "Repeatable.")  # fmt: skip
@wait_option
def predict_command(kind, data, probes, seeds, out, overwrite, n_boot, options):
    """Score a build-reading predictor (one run per probe x seed) like a probe head."""
    cls = run_kind(kind)
    if getattr(cls, "on_build", None) is None:
        raise ConfigError(f"--kind {kind}: its runs read a feature cache or a model, not a build; use the "
                          "command of that kind (fit, finetune, vqa)")  # fmt: skip
    if not (Path(data) / "manifest.json").is_file():
        raise ConfigError(f"--data {data}: no manifest.json; pass a finished build folder")
    build = Build(data)
    names = parse_probes(probes, build.levels())
    click.get_current_context().with_resource(output_lock(out, what="spar-probe predict"))
    given = kind_options(options)
    grid = [[PredictorSpec(p, kind, s, features=str(data), n_boot=n_boot, options=given) for s in parse_seeds(seeds)]
            for p in names]  # fmt: skip
    for spec, rd in run_all(grid, out, skip_unavailable=names_all(probes), overwrite=overwrite):
        click.echo(f"{spec.probe} seed {spec.seed}: {rd}")


def kind_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``--option KEY=VALUE`` items as a kind's options (a value read as JSON, else as text)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE, e.g. --option epochs=2")
        try:
            out[key.strip()] = json.loads(text)
        except ValueError:
            out[key.strip()] = text
    return out
