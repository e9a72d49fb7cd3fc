"""``spar-probe finetune``: train an encoder and a probe head end to end on a build's images
(the run is kind ``finetune``, :class:`spar_bench.probes.finetune.predictor.FinetuneJob`, made by
:func:`spar_bench.probes.runs.session.run`)."""

from __future__ import annotations

import json

import click

from spar_bench.clitools import field_options, given, wait_option
from spar_bench.locks import output_lock

from ..finetune.config import FinetuneConfig, FinetuneSpec, finetune_specs
from ..finetune.encoding import parse_model_args
from ..runs.session import run_all
from .options import (
    bootstrap_option,
    compute_option,
    device_option,
    fmt,
    head_option,
    loader_workers_option,
    names_all,
    out_option,
    probe_option,
    seeds_option,
    spec_options,
    threads_option,
)

#: the training options, each made from its :class:`FinetuneConfig` field (default, help)
TRAINING = ("encoder_lr", "head_lr", "weight_decay", "batch_size", "accum", "max_epochs", "warmup_epochs",
            "patience", "freeze_blocks", "grad_clip", "sinkhorn_iters", "val_fraction", "layer",
            "checkpoint_every")  # fmt: skip


@click.command("finetune")
@click.option("--encoder", required=True, help="Encoder spec, e.g. timm:resnet18 (see `spar-probe encoders`).")
@click.option("--weights", default=None, help="Weights to finetune from (file or folder).")
@field_options(FinetuneSpec, "init", helps={
    "init": "scratch: train the architecture from random weights (recorded as trained from scratch)."})
@click.option("--model-args", default=None, help='JSON for timm.create_model, e.g. \'{"depth": 4}\'.')
@click.option("--revision", default=None, help="Pinned hub revision (hf: encoders).")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="Build folder (manifest.json).")
@head_option(FinetuneSpec)
@probe_option()
@seeds_option(FinetuneSpec, "seed")
@out_option()
@field_options(FinetuneConfig, *TRAINING)
@device_option(FinetuneConfig)
@compute_option(FinetuneConfig)
@loader_workers_option("DataLoader workers (default: 2 on CUDA, 0 on CPU).")
@threads_option()
@bootstrap_option(FinetuneSpec)
@click.option("--no-controls", is_flag=True, help="Skip the blind baseline.")
@click.option("--train-mirrors", is_flag=True, help="Also train on mirrored counterfactual samples.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a finished or interrupted run (train it again).")
@spec_options(("head",))
@wait_option
def finetune_command(encoder, weights, init, model_args, revision, data, head, probes, seeds, out, device, compute,
                     workers, threads, n_boot, no_controls, train_mirrors, resume, overwrite, **kw):
    """Train an encoder and probe heads end to end on a build's images (finetune or from scratch;
    one run per probe x head x seed)."""
    import torch

    torch.set_num_threads(threads)
    cfg = FinetuneConfig(**given({k: kw.pop(k) for k in TRAINING}), device=device, compute=compute, workers=workers)
    head_opts = kw
    grid = finetune_specs(encoder, str(data), probes, head, seeds, weights=weights, **given({"init": init}),
                          model_kwargs=parse_model_args(model_args), revision=revision, cfg=cfg, n_boot=n_boot,
                          controls=not no_controls, train_mirrors=train_mirrors, head_options=head_opts)  # fmt: skip
    click.get_current_context().with_resource(output_lock(out, what="spar-probe finetune"))
    for fs, rd in run_all(grid, out, skip_unavailable=names_all(probes), resume=resume, overwrite=overwrite):
        m = json.loads((rd / "metrics.json").read_text())
        key = m["headline"]
        click.echo(f"{fs.probe} {fs.head} seed{fs.seed}: {key}={fmt(m['test'].get(key))} -> {rd}")
